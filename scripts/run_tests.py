#!/usr/bin/env python3
"""Builds the workspace's test binaries once and runs them three at a time.

    python3 scripts/run_tests.py [cargo test options, before any `--`]

`cargo test` runs its test binaries one after another, and most of this suite's time is spent
waiting (on leases running out, servers starting, handshakes), not computing: the binaries are
run side by side instead, `TOWER_LOCK_TEST_JOBS` at a time (default 3: on 2 cores, 188 s at
2, 131 s at 3, 114 s at 4, where tests that batch under time still failed now and then), the
longest first, each binary's output printed whole when it ends, the doc tests (`cargo test
--doc`) among them. Each
binary runs as cargo would run it: from its package's directory, with `CARGO` set. The
`integration` binary (`tests/integration.rs`) runs once per module, each module's tests by
name (`--exact`), so that each file of `tests/` still runs in a process of its own, with the
crate's runtime thread to itself, as when every file was its own binary. Some run a second time
on Valkey 9 (`AGAIN_ON_VALKEY`). It exits 1 when any run fails, after all have run, naming
them.
"""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The runs that take longest (binaries, or modules of a binary run per module), started first
# so that the others fill in around them.
LONGEST_FIRST = ["protocol_model", "tls", "faults", "cluster", "sentinel", "credentials", "orders"]
# Runs whose tests mostly wait (on servers, proxies, leases and timers: well under a core of CPU
# for their wall time; `run_tests.py` prints both) run 4 of their tests at a time rather than
# libtest's one per core.
MORE_THREADS = {"faults", "cluster", "sentinel", "orders", "redlock", "redis", "valkey",
                "runtimes", "handoff", "coalesce"}
# Binaries whose tests run once per module (the first part of a test's name), each in a process
# of its own.
PER_MODULE = {"integration"}
# Options that pick targets: with any of them, no doc tests.
TARGET_OPTIONS = {"--lib", "--bin", "--bins", "--test", "--tests", "--example", "--examples",
                  "--bench", "--benches", "--all-targets", "--doc"}
# Run again with `TOWER_LOCK_TEST_SERVER=valkey` (and these test filters): hand-off, group
# commit, idempotency records and the crate-private store capabilities (key sets, records, the
# hand-off queue) on Valkey 9. The behaviour suite and the native commands run on it in
# tests/valkey.rs, the protocol model's check against a real server in tests/protocol_model.rs.
AGAIN_ON_VALKEY = {
    "handoff": [],
    "group_commit": [],
    "idempotency": [],
    "tower_lock": ["store::tests::redis", "store::tests::cluster"],
}


def build(args):
    command = ["cargo", "test", "--no-run", "--message-format=json-render-diagnostics", *args]
    built = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if built.returncode != 0:
        sys.exit(f"error: `{' '.join(command)}` failed (exit {built.returncode})")
    out = built.stdout
    binaries = []
    for line in out.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message.get("executable") \
                and message["profile"]["test"]:
            binaries.append((message["target"]["name"], message["target"]["src_path"],
                             message["executable"], Path(message["manifest_path"]).parent))
    return binaries


def modules(binary):
    """`binary` as one run per module: (name, source, executable, directory, filters) each,
    the module's tests named exactly (a module's name as a filter would also match any test
    whose name merely contains it)."""
    _, src, executable, directory = binary
    listed = subprocess.run([executable, "--list", "--format", "terse"], cwd=directory,
                            stdout=subprocess.PIPE, text=True)
    if listed.returncode != 0:
        sys.exit(f"error: `{executable} --list` failed (exit {listed.returncode})")
    tests = {}
    for line in listed.stdout.splitlines():
        if line.endswith(": test"):
            test = line[: -len(": test")]
            tests.setdefault(test.split("::")[0], []).append(test)
    return [(module, str(Path(src).parent / f"{module}.rs"), executable, directory,
             ["--exact", *names]) for module, names in tests.items()]


def run(job):
    (name, src, executable, directory, filters), extra, server = job
    started = time.monotonic()
    env = dict(os.environ, CARGO=os.environ.get("CARGO", "cargo"))
    if server:
        env["TOWER_LOCK_TEST_SERVER"] = server
    command = [executable, *filters, *extra]
    if name in MORE_THREADS:
        command += ["--test-threads", "4"]
    if executable is None:
        # The doc tests: `cargo test --doc` with the build's arguments (`filters`).
        command = [env["CARGO"], "test", "--doc", *filters]
    process = subprocess.Popen(command, cwd=directory, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    output = process.stdout.read()
    process.stdout.close()
    # Reaped here rather than by `wait`, for the CPU time it and the children it waited for
    # (its servers) used.
    _, status, usage = os.wait4(process.pid, 0)
    code = process.returncode = os.waitstatus_to_exitcode(status)
    took = (time.monotonic() - started, usage.ru_utime + usage.ru_stime)
    label = src if executable is None else os.path.relpath(src, ROOT)
    return label + (f" on {server}" if server else ""), code, output, took


def main():
    args = sys.argv[1:]
    # With options that pick targets, some binaries are not built, and no doc tests run.
    picked = any(arg.split("=")[0] in TARGET_OPTIONS for arg in args)
    binaries = []
    for binary in build(args):
        binaries += modules(binary) if binary[0] in PER_MODULE else [(*binary, [])]
    # A renamed binary or module must not lose its place or its rerun silently.
    stale = (set(LONGEST_FIRST) | set(AGAIN_ON_VALKEY) | MORE_THREADS) - {b[0] for b in binaries}
    if stale and not picked:
        sys.exit("error: LONGEST_FIRST, AGAIN_ON_VALKEY or MORE_THREADS names no binary or "
                 f"module: {stale}")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    binaries.sort(key=lambda b: (rank.get(b[0], len(rank)), b[1]))
    runs = [(b, [], None) for b in binaries]
    runs += [(b, AGAIN_ON_VALKEY[b[0]], "valkey") for b in binaries if b[0] in AGAIN_ON_VALKEY]
    # The doc tests among them, last (`cargo test --doc` refuses options that pick targets).
    if not picked:
        runs.append((("doc", "doc tests", None, ROOT, args), [], None))
    workers = int(os.environ.get("TOWER_LOCK_TEST_JOBS", "3"))
    print(f"running {len(runs)} test binaries and modules, {workers} at a time", flush=True)
    failed = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for label, code, output, took in pool.map(run, runs):
            print(f"\n     Running {label} ({took[0]:.1f} s, CPU {took[1]:.1f} s)", flush=True)
            sys.stdout.write(output)
            sys.stdout.flush()
            if code < 0:
                try:
                    cause = signal.Signals(-code).name
                except ValueError:
                    cause = f"signal {-code}"
                failed.append(f"{label}: killed by {cause}")
            elif code != 0:
                failed.append(f"{label}: exit {code}")
    if failed:
        print("\nerror: test binaries failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
