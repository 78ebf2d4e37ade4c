#!/usr/bin/env bash
# The gates that `scripts/test.sh` runs beside the test binaries (whose time is mostly waiting):
#   bash scripts/gates.sh            rustdoc, the public API's listing, the docs' references, the
#                                    package as crates.io would receive it, and the builds below
#   bash scripts/gates.sh features   only the builds without the default features
# Formatting and clippy on the workspace run before the tests' build, in scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-all}" = all ]; then
  RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features --quiet
  # And with the default features, as most users build it (no links to `bb8`-only items).
  RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -p tower-lock --quiet
  # The public API as checked in (docs/public-api.txt): a change to the surface shows in review.
  python3 scripts/public_api.py
  # Every file, heading and crate symbol the docs (and the protocol model's comments) cite
  # exists, and none cites a line number or an issue.
  python3 scripts/check_docs.py
  # The package as crates.io would receive it, built from the packaged files alone.
  cargo package --allow-dirty --quiet
fi

# The crate without its default features still builds (tower-only users), and with TLS alone,
# without a warning; and its doc examples compile and pass without axum (each gated on what it
# uses).
cargo clippy -p tower-lock --lib --no-default-features --quiet -- -D warnings
cargo clippy -p tower-lock --lib --no-default-features --features tls --quiet -- -D warnings
cargo test -p tower-lock --doc --no-default-features --quiet
