"""Schedules: which faults, how often, how long, and the load they fall on."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class Phase:
    # "redis": one lock Redis, each instance through its own proxy; "sentinel": a master, a
    # replica and three sentinels, the instances with LOCK_STORE=sentinel (no proxy: the
    # sentinels name the master's own address).
    store: str
    # Faults in order; each is followed by `gap_s` of load without faults.
    steps: list[str]
    # Load before the first fault.
    warmup_s: float = 2.0
    # Repeat the steps until this much time has passed (0: once).
    repeat_for_s: float = 0.0
    # Stop early, once the data's journal shows a pause's bait wrote after a newer holder had
    # (a control's schedule: one such stale write is what it is there to show).
    until_stale_write: bool = False


@dataclass
class Schedule:
    name: str
    phases: list[Phase]
    ttl_ms: int = 1000
    wait_ms: int = 1000
    clients: int = 24
    instances: int = 3
    skus: int = 12
    stock: int = 10_000_000
    # Most purchases are quick; some work long enough to be held up mid-purchase by a fault.
    long_fraction: float = 0.1
    long_work_ms: tuple[int, int] = (20, 200)
    short_work_ms: tuple[int, int] = (0, 5)
    # A pause lasts over twice the TTL, and catches a long purchase (the "bait") holding its
    # SKU, stock read, write not yet made.
    pause_s: float = 2.5
    bait_work_ms: int = 400
    bait_lead_s: float = 0.2
    # A killed instance or Redis stays down this long before it is started again.
    down_s: float = 0.5
    partition_s: float = 2.5
    slow_s: float = 2.5
    # Each way, so a round trip is twice this: 300 ms, under half the TTL, so leases survive.
    latency_ms: int = 150
    # Load without faults after each fault heals: longer than the checker's recovery window
    # (TTL + its slack, 3 s here), so that each recovery is judged on its own.
    gap_s: float = 3.5
    sentinel_down_after_ms: int = 1000

    def pauses(self, name: str, at_most: int) -> "Schedule":
        """Pauses only, until a bait writes stale (or `at_most` of them), with shorter
        gaps (recovery is not what a control is for): the fencing-off control's schedule."""
        phase = Phase("redis", ["pause"] * at_most, until_stale_write=True)
        return replace(self, name=name, phases=[phase], gap_s=1.5)

    def without_faults(self, name: str, seconds: float) -> "Schedule":
        return replace(self, name=name, phases=[Phase("redis", [], warmup_s=seconds)])


REDIS_FAULTS = ["pause", "kill", "redis-restart", "partition", "slow-network", "cut",
                "pubsub-kill"]


SHORT = Schedule(
    name="short",
    phases=[
        Phase("redis", list(REDIS_FAULTS)),
        Phase("sentinel", ["sentinel-failover"]),
    ],
)

LONG = Schedule(
    name="long",
    clients=32,
    phases=[
        Phase("redis", list(REDIS_FAULTS), repeat_for_s=22 * 60),
        Phase("sentinel", ["sentinel-failover"], repeat_for_s=8 * 60),
    ],
)

SCHEDULES = {"short": SHORT, "long": LONG}
