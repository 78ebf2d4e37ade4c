"""The faults: each applies itself once to the running services, recording its start and end
in the history, and returns once it has healed."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from . import resp
from .processes import MASTER_NAME, wait_for

if TYPE_CHECKING:
    from .runner import Run

STORE_WIDE = "lock-store"


async def pause(run: "Run") -> None:
    """SIGSTOP an instance past the TTL while it holds a lease mid-purchase, then SIGCONT: the
    classic stale write. The other clients leave the instance alone until it has answered what
    they sent it; then a long purchase (the "bait") is sent to it, so that it holds a SKU, its
    stock read and its write not yet made, when it freezes; the clients come back once the
    bait is answered. (An instance busy with other requests when it resumes notices its lost
    leases before it writes more often, and the point is to see what happens when it does
    not.)"""
    target = run.rng.choice(sorted(run.env.instances))
    duration = run.schedule.pause_s
    run.load.spared.add(target)
    await wait_for(f"{target} never finished its requests", lambda: not run.load.busy[target],
                   30, 0.01)
    sku = run.rng.choice(run.skus)
    bait_id = run.load.next_id("bait")
    run.bait_ids.add(bait_id)
    pool = {}
    bait = asyncio.create_task(
        run.load.purchase(pool, target, sku, run.schedule.bait_work_ms, bait_id, bait=True)
    )
    await asyncio.sleep(run.schedule.bait_lead_s)
    instance = run.env.instances[target]
    fid = run.history.fault_start("pause", target, duration_ms=int(duration * 1000))
    instance.pause()
    try:
        await asyncio.sleep(duration)
    finally:
        instance.resume()
    run.history.fault_end(fid, "pause")
    await bait
    for conn in pool.values():
        conn.close()
    run.load.spared.discard(target)


async def kill(run: "Run") -> None:
    """SIGKILL an instance and start it again (same port, same settings)."""
    target = run.rng.choice(sorted(run.env.instances))
    instance = run.env.instances[target]
    fid = run.history.fault_start("kill", target, down_ms=int(run.schedule.down_s * 1000))
    instance.kill()
    await asyncio.sleep(run.schedule.down_s)
    await instance.start()
    run.history.fault_end(fid, "kill")


async def redis_restart(run: "Run") -> None:
    """SIGKILL the lock Redis and start it again, empty (no persistence): every lease, queue
    and fencing counter is gone."""
    lock = run.env.lock
    fid = run.history.fault_start("redis-restart", STORE_WIDE,
                                  down_ms=int(run.schedule.down_s * 1000))
    lock.kill()
    await asyncio.sleep(run.schedule.down_s)
    await lock.start()
    run.history.fault_end(fid, "redis-restart")


async def partition(run: "Run") -> None:
    """Nothing passes between one instance and the lock Redis for a while (its connections
    stay open; what was sent is delivered when the partition heals, as TCP would)."""
    target = run.rng.choice(sorted(run.env.instances))
    duration = run.schedule.partition_s
    fid = run.history.fault_start("partition", target, duration_ms=int(duration * 1000))
    run.env.proxies.send(cmd="partition", name=target, on=True)
    try:
        await asyncio.sleep(duration)
    finally:
        run.env.proxies.send(cmd="partition", name=target, on=False)
    run.history.fault_end(fid, "partition")


async def slow_network(run: "Run") -> None:
    """Every instance's link to the lock Redis delayed, each way."""
    latency = run.schedule.latency_ms
    duration = run.schedule.slow_s
    fid = run.history.fault_start("slow-network", STORE_WIDE, latency_ms=latency,
                                  duration_ms=int(duration * 1000))
    for name in run.env.instances:
        run.env.proxies.send(cmd="latency", name=name, ms=latency)
    try:
        await asyncio.sleep(duration)
    finally:
        for name in run.env.instances:
            run.env.proxies.send(cmd="latency", name=name, ms=0)
    run.history.fault_end(fid, "slow-network")


async def cut(run: "Run") -> None:
    """Every connection between one instance and the lock Redis closed at once."""
    target = run.rng.choice(sorted(run.env.instances))
    fid = run.history.fault_start("cut", target)
    closed = run.env.proxies.send(cmd="cut", name=target)["closed"]
    run.history.fault_end(fid, "cut")
    run.note(f"cut {closed} connection ends of {target}")


async def pubsub_kill(run: "Run") -> None:
    """`CLIENT KILL TYPE pubsub` on the lock Redis: every hand-off subscription dropped."""
    fid = run.history.fault_start("pubsub-kill", STORE_WIDE)
    killed = run.env.lock("CLIENT", "KILL", "TYPE", "pubsub")
    run.history.fault_end(fid, "pubsub-kill")
    run.note(f"pubsub-kill closed {killed} subscription(s)")


async def sentinel_failover(run: "Run") -> None:
    """The master Sentinel names changes: by `SENTINEL FAILOVER`, or by killing the master
    (the sentinels fail over after down-after-milliseconds; the old master comes back empty).
    The two alternate. The fault lasts until the old master is a replica of the new one."""
    sentinels = run.env.sentinels
    old = sentinels.master()
    new = next(s for s in sentinels.servers if s is not old)
    await wait_for("the replica never caught up before a failover",
                   lambda: sentinels.replica_in_sync(new), 30, 0.1)
    await wait_for("the sentinels never agreed (and saw a healthy replica) before a failover",
                   sentinels.ready, 30, 0.1)
    killed = run.failovers % 2 == 1
    run.failovers += 1
    fid = run.history.fault_start("sentinel-failover", STORE_WIDE,
                                  how="master killed" if killed else "SENTINEL FAILOVER",
                                  old=old.port, new=new.port)
    if killed:
        old.kill()
    else:
        deadline = time.monotonic() + 10
        while True:
            try:
                resp.command(sentinels.sentinel_ports[0], "SENTINEL", "FAILOVER", MASTER_NAME)
                break
            except resp.RedisError as e:  # INPROG, NOGOODSLAVE: not ready yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SENTINEL FAILOVER refused: {e}") from e
                await asyncio.sleep(0.2)
    await wait_for("the sentinels never named the new master",
                   lambda: sentinels.named_master() == {new.port}, 30, 0.05)
    if killed:
        # Started again with the settings it was first started with: the first master comes
        # back as a master (empty: a restart without persistence), the way a supervisor
        # restarts a crashed server, until Sentinel demotes it; the first replica comes back
        # a replica of the other server, which is the master again by then.
        await old.start()
    # Healed once there is one master again: until the old one is demoted, a store that has
    # not followed yet can still take leases on it.
    await wait_for("the old master never became a replica", lambda: sentinels.is_replica(old),
                   60, 0.05)
    run.history.fault_end(fid, "sentinel-failover")


FAULTS = {
    "pause": pause,
    "kill": kill,
    "redis-restart": redis_restart,
    "partition": partition,
    "slow-network": slow_network,
    "cut": cut,
    "pubsub-kill": pubsub_kill,
    "sentinel-failover": sentinel_failover,
}

# Faults that need the lock Redis the harness starts (not the Sentinel setup).
NEEDS_LOCK_REDIS = {"redis-restart", "partition", "slow-network", "cut", "pubsub-kill"}
