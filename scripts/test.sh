#!/usr/bin/env bash
# Runs the whole test suite. On a fresh Debian machine (as root) it first installs
# redis-server (Debian's build speaks TLS), openssl (the TLS tests make their certificates
# with it) and python3 (the fault-injection run); the tests then start their own servers on
# free loopback ports and stop them.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh --test redis`).
set -euo pipefail
cd "$(dirname "$0")/.."
# A one-off build gains nothing from incremental caches, which would double the disk it needs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "not found: ${missing[*]}; installing from Debian's packages" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: installing them needs root (or install them yourself: apt-get install -y ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "using $(redis-server --version)" >&2
echo "using $(openssl version)" >&2
echo "using $(python3 --version)" >&2

# The gates a change must pass before its tests count (skipped when arguments pick tests):
# formatting, clippy with and without features, rustdoc, and the package as crates.io would
# receive it (built from the packaged files alone).
if [ "$#" -eq 0 ]; then
  if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
  fi
  cargo fmt --all --check
  cargo clippy --workspace --all-targets --quiet -- -D warnings
  cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings
  RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features --quiet
  cargo package --allow-dirty --quiet
fi

# The crate without its default features still builds (tower-only users), and with TLS alone.
cargo check --no-default-features --quiet
cargo check --no-default-features --features tls --quiet
# The whole suite: the crate's tests and the test kit's own (its MONITOR and wrk parsers), in one
# build so that the dependencies both share are compiled once.
if [ "$#" -eq 0 ]; then
  cargo test --workspace --all-features
else
  cargo test --all-features "$@"
fi

# The fault-injection run (faults/README.md): the history checker's own tests, then the short
# schedule (at most 3 minutes once the example is built; it builds it in release mode first),
# whose main run the checker must pass and whose two negative controls it must fail.
if [ "$#" -eq 0 ]; then
  python3 -m unittest discover -s faults -p 'test_*.py'
  python3 faults/run.py --schedule short
fi
