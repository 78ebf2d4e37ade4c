#!/usr/bin/env python3
"""The fault-injection run: the inventory example under a schedule of faults, its history
judged by the independent checker (`check.py`), with two negative controls that must fail.

    python3 faults/run.py --schedule short      # about 1.2 minutes; part of scripts/test.sh
    python3 faults/run.py --schedule long       # about 35 minutes; figures for RELIABILITY.md

Three runs, each on processes of its own:

- main:        the schedule, fencing on: the checker must pass it.
- fencing-off: FENCING=off, the schedule's pauses (`--controls same`: the whole schedule):
               the checker must fail it with lost updates or tokens out of order.
- lock-off:    LOCK=off, no faults: the checker must fail it with lost updates or overlaps.

Exit status 0 when all three came out as they must. Histories, logs and the checker's
verdicts are kept under --out (by default target/faults/<schedule>-<time>/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from harness.runner import Run  # noqa: E402
from harness.schedule import SCHEDULES  # noqa: E402

# The fencing-off control pauses an instance holding a SKU until one of those pauses ends in a
# stale write the data accepted (the journal shows the paused holder's write after a newer
# holder's), at most this many times. A paused
# holder that resumes writes before it notices its lost lease in about a third of the pauses
# (the example as it was before fenced writes: `docs/RELIABILITY.md`); without a journal to
# stop on, all of them run.
CONTROL_PAUSES = 12

# What each control's failure must show, to count as the failure it is there to show.
CONTROLS = {
    "fencing-off": {"lost-update", "token-order"},
    "lock-off": {"lost-update", "overlap"},
}


def build(profile: str) -> str:
    """The inventory example, with Sentinel; built once per run. `release` by default; `dev`
    builds it as the suite's tests do (`--workspace --tests --all-features`: after the tests, at no cost)."""
    args = (["--release", "--features", "sentinel"] if profile == "release"
            else ["--workspace", "--tests", "--all-features"])
    print(f"building the inventory example ({' '.join(args)})", flush=True)
    out = subprocess.run(
        ["cargo", "build", "--example", "inventory", *args,
         "--message-format=json-render-diagnostics"],
        cwd=ROOT, stdout=subprocess.PIPE, check=True,
    ).stdout.decode()
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("target", {}).get("name") == "inventory" and msg.get("executable"):
            return msg["executable"]
    raise SystemExit("cargo did not report the inventory executable")


def check(history: Path, summary: Path) -> dict:
    """The checker, as a separate process that reads only the history."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "check.py"), str(history), "--figures", "--summary",
         str(summary), "--max-printed", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    (summary.parent / "check.txt").write_text(proc.stdout)
    print(proc.stdout, end="", flush=True)
    if proc.returncode == 2 or not summary.exists():
        raise SystemExit(f"the checker could not read {history}")
    return json.loads(summary.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="short",
                        help="short: about 1.2 minutes; long: 30 minutes of faults")
    parser.add_argument("--binary", help="the inventory example's binary (default: build it)")
    parser.add_argument("--profile", choices=["release", "dev"], default="release",
                        help="how to build it (dev: as the tests build it, no extra build)")
    parser.add_argument("--out", type=Path, help="where histories and logs go")
    parser.add_argument("--seed", type=int, default=None,
                        help="repeat a run's choices of targets, SKUs and work")
    parser.add_argument("--only", action="append", choices=["main", *CONTROLS],
                        help="run only these (repeatable)")
    parser.add_argument("--controls", choices=["pauses", "same"], default="pauses",
                        help="the fencing-off control's schedule: the schedule's pauses "
                             "(default) or the whole schedule")
    args = parser.parse_args()

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server (or run "
                         "scripts/test.sh, which installs it)")
    binary = args.binary or build(args.profile)
    schedule = SCHEDULES[args.schedule]
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "target" / "faults" / f"{schedule.name}-{stamp}"
    runs = {
        "main": dict(schedule=schedule),
        "fencing-off": dict(
            schedule=schedule if args.controls == "same"
            else schedule.pauses(f"{schedule.name}, pauses", CONTROL_PAUSES),
            fencing="off",
        ),
        "lock-off": dict(schedule=schedule.without_faults(f"{schedule.name}, no faults", 4.0),
                         lock="off"),
    }
    selected = args.only or list(runs)
    print(f"fault run: schedule {schedule.name}, seed {seed}, output in {out}", flush=True)

    outcomes = {}
    for label in selected:
        spec = runs[label]
        run = Run(label, spec["schedule"], binary, out / label, seed,
                  fencing=spec.get("fencing", "on"), lock=spec.get("lock", "on"),
                  log=lambda text: print(text, flush=True))
        print(f"--- {label}: schedule {spec['schedule'].name}, FENCING="
              f"{spec.get('fencing', 'on')}, LOCK={spec.get('lock', 'on')}", flush=True)
        history = asyncio.run(run.execute())
        summary = check(history, out / label / "summary.json")
        if label == "main":
            ok = summary["passed"]
            why = "passed" if ok else f"failed: {summary['violations']}"
        else:
            caught = CONTROLS[label].intersection(summary["violations"])
            ok = not summary["passed"] and bool(caught)
            why = (f"failed as it must ({', '.join(sorted(caught))})" if ok
                   else f"did not fail with {' or '.join(sorted(CONTROLS[label]))}: "
                        f"{summary['violations'] or 'no violations'}")
        outcomes[label] = (ok, why, summary)

    print("=== fault run", schedule.name)
    for label, (ok, why, summary) in outcomes.items():
        print(f"{'ok ' if ok else 'NOT OK'} {label}: {why}")
        if label == "main" and not ok and not summary.get("journal"):
            print("       (the example keeps no write journal and does not fence its writes: "
                  "until it does, the main run fails as the fencing-off control does)")
    print(f"histories, logs and verdicts: {out}")
    return 0 if all(ok for ok, _, _ in outcomes.values()) else 1


if __name__ == "__main__":
    # SIGTERM as Ctrl-C; during a run, both cancel it (`Run.execute`), which stops every
    # process it started before this ends.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.exit(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every process the run started was stopped", file=sys.stderr)
        sys.exit(130)
