#!/usr/bin/env bash
# Reproduces docs/BENCHMARKS.md (the project's benchmark, benches/lock_bench/): about 25 minutes on
# 2 cores, plus the first build. On a fresh Debian machine (as root) it first installs `wrk`,
# `redis-server`, and `valgrind` and `strace` (the counts per request, scenario h); the benchmark
# starts its own redis-server on a free loopback port and stops it.
# Settings go through the environment: BENCH_RUNS (default 3), BENCH_QUICK=1 (a short smoke run),
# BENCH_FULL (default 1 here: the memory flatness run sends the 1M requests the flatness target asks of the
# report; BENCH_FULL=0 for 100k), BENCH_ONLY=abcdefghijk, BENCH_NOTE="...".
# The counts alone (deterministic, whatever the machine's load): BENCH_ONLY=h scripts/bench.sh
# Leases with counts alone (about 2 minutes each at BENCH_RUNS=3): BENCH_ONLY=permits (a key with
# N permits against a hand-written sorted-set semaphore), BENCH_ONLY=shared (90 % readers on
# shared leases against the exclusive lease); BENCH_ONLY=permits,shared for both.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
command -v strace >/dev/null 2>&1 || missing+=(strace)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing ${missing[*]} from Debian's packages" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: installing ${missing[*]} needs root (or: apt-get install -y ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

export BENCH_COMMAND="scripts/bench.sh"
export BENCH_FULL="${BENCH_FULL:-1}"
exec cargo bench -p tower-lock-suite --bench lock_bench
