#!/usr/bin/env python3
"""Where Redis spends its CPU on a lock cycle: the crate's batch script against a hand-written lock.

    python3 scripts/lua_cost.py [--batch B] [--cycles N] [--runs R]

Starts a `redis-server` of its own on a free loopback port (stopped at the end), and measures
Redis's CPU (`used_cpu_user + used_cpu_sys` of `INFO cpu`) per lock cycle, an acquire and a
release of a fresh key, for each variant below, B cycles' operations per round trip (B `EVALSHA`s
pipelined for the hand-written lock; one `EVALSHA` of B operations for the batch scripts, as group
commit sends them under load). Only Redis's CPU is counted, not this client's. The variants run
alternately, R times each; each line is the median and range.

- `hand-written`: `SET key token NX PX ttl`, then a compare-and-delete script (`GET`, `DEL`).
- `batch script`: the crate's `ops` script as `RedisStore` sends it, with hand-off: an acquire is
  `SET NX PX`, `LLEN` of the key's queue and the fencing token (`TIME`, `GET` and `SET` of the
  counter, once per call); a release `GET`, `LLEN`, `DEL`.
- `without queue checks`: the batch script with its two `LLEN`s left out (not a safe script: it
  shows what the hand-off queue's checks cost).
- `without fencing`: the batch script whose acquires hand out no fencing token (not safe
  either: what the fencing counter costs).
- `the batch script as a function`: the same script loaded with `FUNCTION LOAD` and called with
  `FCALL` (Redis 7+), where the crate sends `EVALSHA`.
- `the hand-written work, batched`: the batch script's reader and arguments, with an acquire that
  only runs `SET NX PX` and a release that only runs `GET` and `DEL`: the same Redis work as the
  hand-written lock, in the batch script's form (what the form costs: its keys and arguments, the
  reader's loop, `pcall` per operation).

The script is assembled from `src/store/redis/scripts/*.lua` in the order `scripts.rs`'s
`OPS_PARTS` lists them. Only 127.0.0.1 is contacted.
"""

import argparse
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "src" / "store" / "redis" / "scripts"
sys.path.insert(0, str(ROOT / "faults"))
from harness.resp import Redis, RedisError  # noqa: E402  (the fault harness's client: standard library only)


def batch_script() -> str:
    """The `ops` script, as `scripts.rs` assembles it."""
    source = (ROOT / "src" / "store" / "redis" / "scripts.rs").read_text()
    parts = re.search(r"const OPS_PARTS: \[&str; \d+\] = \[(.*?)\];", source, re.S)
    if not parts:
        sys.exit("error: OPS_PARTS not found in scripts.rs")
    files = re.findall(r'include_str!\("scripts/([^"]+)"\)', parts.group(1))
    return "".join((SCRIPTS / name).read_text() for name in files)


def replaced(source: str, old: str, new: str) -> str:
    if old not in source:
        sys.exit(f"error: the batch script no longer has {old!r}: update lua_cost.py")
    return source.replace(old, new)


ACQUIRE = "local function acquire(lock, fence_key, queue, token, ttl, retention, claim, stamp, channel, rescan)\n"
RELEASE = "local function release(lock, fence_key, queue, token, claim, retention)\n"


def variants() -> dict:
    ops = batch_script()
    no_queue = replaced(ops, "if took and (not queue or redis.call('LLEN', queue) == 0) then",
                        "if took then")
    no_queue = replaced(no_queue, "if held and (not queue or redis.call('LLEN', queue) == 0) then",
                        "if held then")
    no_fence = replaced(ops, "local function new_fence(fence_key, retention)\n",
                        "local function new_fence(fence_key, retention)\n  do return 1 end\n")
    bare = replaced(ops, ACQUIRE, ACQUIRE + "  do if redis.call('SET', lock, token, 'NX', 'PX', ttl) "
                    "then return 1, 0 end return 0, 0 end\n")
    bare = replaced(bare, RELEASE, RELEASE + "  do if redis.call('GET', lock) == token then "
                    "redis.call('DEL', lock) return 1 end return 0 end\n")
    function = ("#!lua name=tower_lock_cost\nredis.register_function('ops', function(KEYS, ARGV)\n"
                + ops + "\nend)\n")
    return {
        "hand-written": None,
        "batch script": ops,
        "the batch script as a function": function,
        "without queue checks": no_queue,
        "without fencing": no_fence,
        "the hand-written work, batched": bare,
    }


def cpu(redis: Redis) -> float:
    """`used_cpu_user + used_cpu_sys` of the server, in seconds."""
    info = redis("INFO", "cpu")
    return sum(float(v) for v in re.findall(r"used_cpu_(?:user|sys):([\d.]+)", info))


def cycles(redis: Redis, script, batch: int, n: int, run: int) -> float:
    """Redis CPU µs per cycle over `n` cycles of fresh keys."""
    tag = f"{run:04d}{id(script) % 10000:04d}"
    lock = lambda i: f"tower-lock:{{{tag}{i:07d}}}5:audit:{i:064x}"
    queue = lambda i: f"tower-lock:{{{tag}{i:07d}}}queue:5:audit:{i:064x}"
    fence = "tower-lock:fence"
    token = lambda i: f"{i * 7919 + 13:032x}"
    header = ["1", "1000", "86400000"]  # hand-off on, claim window, fence retention
    if script is None:
        release = redis("SCRIPT", "LOAD", "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                        "return redis.call('DEL', KEYS[1]) else return 0 end")
    elif script.startswith("#!lua"):
        redis("FUNCTION", "LOAD", "REPLACE", script)
    else:
        sha = redis("SCRIPT", "LOAD", script)
    call = ("FCALL", "ops") if script is not None and script.startswith("#!lua") else None
    before = cpu(redis)
    for start in range(0, n, batch):
        keys = range(start, start + batch)
        if script is None:
            replies = redis.pipeline([("SET", lock(i), token(i), "NX", "PX", 30000) for i in keys])
            assert all(r == "OK" for r in replies), replies[:2]
            replies = redis.pipeline([("EVALSHA", release, 1, lock(i), token(i)) for i in keys])
            assert all(r == 1 for r in replies), replies[:2]
            continue
        for kind, args in (("a", lambda i: [token(i), "30000", "0123456789abcdef", "tl:ch", "0"]),
                           ("r", lambda i: [token(i)])):
            names, argv = [], list(header)
            for i in keys:
                names += [lock(i), fence, queue(i)]
                argv += [kind] + args(i)
            out = redis(*(call or ("EVALSHA", sha)), len(names), *names, *argv)
            assert out[0::2] == [1] * batch, out[:4]
    return (cpu(redis) - before) / n * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=3)
    opts = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                redis = Redis(port)
                redis("PING")
                break
            except (OSError, RedisError):
                time.sleep(0.05)
        else:
            sys.exit("error: redis-server did not start")
        version = re.search(r"redis_version:(\S+)", redis("INFO", "server")).group(1)
        found = {name: [] for name in variants()}
        for run in range(opts.runs):
            for name, script in variants().items():
                found[name].append(cycles(redis, script, opts.batch, opts.cycles, run))
        print(f"Redis {version}, {opts.batch} cycles per round trip, {opts.cycles} cycles, "
              f"{opts.runs} runs: Redis CPU µs per cycle (acquire + release), median (range)")
        hand = statistics.median(found["hand-written"])
        for name, values in found.items():
            median = statistics.median(values)
            print(f"  {name:32} {median:6.2f} ({min(values):.2f}-{max(values):.2f})"
                  f"  {median / hand:.2f}x")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
