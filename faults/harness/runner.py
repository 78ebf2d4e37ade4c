"""One run: start the services, put load on them, apply the schedule's faults, then record the
data's journal and final stocks. Everything it starts is stopped when it ends, however it
ends."""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import signal
import time
from pathlib import Path

from . import resp
from .faults import FAULTS, NEEDS_LOCK_REDIS
from .history import History
from .load import STORE_TIMEOUT_MS, Load, Settings, request
from .processes import MASTER_NAME, Instance, Proxies, RedisServer, Sentinels, Supervisor
from .schedule import Phase, Schedule

JOURNAL_KEY = "faults:journal"


class Environment:
    """The processes of one phase."""

    def __init__(self, store: str):
        self.store = store
        self.instances: dict[str, Instance] = {}
        self.lock: RedisServer | None = None
        self.proxies: Proxies | None = None
        self.sentinels: Sentinels | None = None


class Run:
    def __init__(self, label: str, schedule: Schedule, binary: str, workdir: Path, seed: int,
                 fencing: str = "on", lock: str = "on", log=print):
        self.label = label
        self.schedule = schedule
        self.binary = binary
        self.workdir = workdir
        self.seed = seed
        self.fencing_setting = fencing
        self.lock_setting = lock
        self.log = log
        self.rng = random.Random(seed)
        self.skus = [f"sku{i}" for i in range(schedule.skus)]
        self.failovers = 0
        self.journal = False
        self.stock_url: str | None = None
        self.lock_redis: RedisServer | None = None
        self.bait_ids: set[str] = set()
        self.journal_seen = 0
        self.newest_token: dict[str, int] = {}

    # -- helpers the faults use ---------------------------------------------------------------

    def note(self, text: str) -> None:
        self.history.write({"type": "note", "t": self.history.now(), "text": text})

    # -- the run ------------------------------------------------------------------------------

    async def execute(self) -> Path:
        """Runs it; on Ctrl-C or SIGTERM, stops everything it started and raises
        `asyncio.CancelledError`."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor(self.workdir)
        self.history = History(self.workdir / "history.jsonl")
        self.load = None
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, me.cancel)
        try:
            await self._execute()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if self.load is not None:
                for task in self.load.tasks:
                    task.cancel()
                await asyncio.gather(*self.load.tasks, return_exceptions=True)
            self.sup.stop_all()
            self.history.close()
        return self.history.path

    async def _execute(self) -> None:
        s = self.schedule
        self.data = RedisServer(self.sup, "data-redis")
        await self.data.start()
        self.history.write({
            "type": "run", "label": self.label, "schedule": s.name, "seed": self.seed,
            "ttl_ms": s.ttl_ms, "wait_ms": s.wait_ms, "store_timeout_ms": STORE_TIMEOUT_MS,
            "lock": self.lock_setting, "fencing": self.fencing_setting, "skus": self.skus,
            "clients": s.clients, "started": datetime.datetime.now().isoformat(timespec="seconds"),
        })
        settings = Settings(s.clients, s.wait_ms, s.long_fraction, s.long_work_ms,
                            s.short_work_ms)
        self.load = Load(self.history, settings, self.skus, self.rng, self.label)
        for number, phase in enumerate(s.phases):
            self.env = await self.start_phase(phase)
            if number == 0:
                await self.set_stock()
            self.load.instances = {n: i.port for n, i in self.env.instances.items()}
            self.history.write({"type": "phase", "store": phase.store, "t": self.history.now(),
                                "instances": sorted(self.env.instances)})
            if number == 0:
                self.load.start()
            else:
                self.load.resume()
            self.log(f"[{self.label}] phase {phase.store}: {len(phase.steps)} fault(s)"
                     + (f", repeated for {phase.repeat_for_s:.0f} s" if phase.repeat_for_s else ""))
            await asyncio.sleep(phase.warmup_s)
            await self.apply(phase)
            await self.load.hold()
            if number == len(s.phases) - 1:
                await self.read_final()
            self.stop_phase()
        await self.load.stop()
        self.history.write({"type": "end", "t": self.history.now()})
        self.log(f"[{self.label}] {sum(self.load.counts.values())} requests: "
                 + ", ".join(f"{k}: {v}" for k, v in sorted(self.load.counts.items(), key=str)))

    async def apply(self, phase: Phase) -> None:
        started = time.monotonic()
        rounds = 0
        while phase.steps:
            for kind in phase.steps:
                if kind == "redis-restart" and not self.journal:
                    self.note("redis-restart skipped: the stock lives on the lock Redis (the "
                              "service ignores STOCK_URL), and a restart would erase it")
                    continue
                if kind in NEEDS_LOCK_REDIS and self.env.lock is None:
                    raise ValueError(f"{kind} needs the redis phase, not {phase.store}")
                if kind == "sentinel-failover" and self.env.sentinels is None:
                    raise ValueError("sentinel-failover needs the sentinel phase")
                await FAULTS[kind](self)
                await asyncio.sleep(self.schedule.gap_s)
                if phase.until_stale_write and self.stale_bait_write():
                    self.note("stopped: a pause's bait wrote after a newer holder had")
                    return
            rounds += 1
            elapsed = time.monotonic() - started
            if not phase.repeat_for_s or elapsed >= phase.repeat_for_s:
                break
            if rounds % 5 == 0:
                self.log(f"[{self.label}] {elapsed:.0f} s, {sum(self.load.counts.values())} "
                         "requests")

    def stale_bait_write(self) -> bool:
        """Whether the journal shows a pause's bait writing its SKU after a write with a newer
        token (a holder that came after it, while it was frozen): the stale write a
        fencing-off control is there to show. Without a journal: never. (When to stop is all
        this decides; the checker judges the history on its own.)"""
        if not self.journal:
            return False
        entries = self.data("LRANGE", JOURNAL_KEY, self.journal_seen, -1)
        self.journal_seen += len(entries)
        for raw in entries:
            entry = json.loads(raw)
            token = entry.get("token")
            newest = self.newest_token.get(entry["sku"])
            if (entry.get("request") in self.bait_ids and token is not None
                    and newest is not None and token < newest):
                return True
            if token is not None:
                self.newest_token[entry["sku"]] = max(token, newest or 0)
        return False

    def base_env(self) -> dict:
        s = self.schedule
        return {
            "STOCK_URL": f"redis://127.0.0.1:{self.data.port}/",
            "WRITE_JOURNAL": JOURNAL_KEY,
            "FENCING": self.fencing_setting,
            "LOCK": self.lock_setting,
            "LOCK_TTL_MS": str(s.ttl_ms),
            "LOCK_WAIT_MS": str(s.wait_ms),
            "RUST_LOG": "warn",
        }

    async def start_phase(self, phase: Phase) -> Environment:
        env = Environment(phase.store)
        n = self.schedule.instances
        if phase.store == "redis":
            if self.lock_redis is None:
                self.lock_redis = RedisServer(self.sup, "lock-redis")
                await self.lock_redis.start()
            env.lock = self.lock_redis
            env.proxies = Proxies(self.sup)
            for k in range(1, n + 1):
                name = f"r{k}"
                port = env.proxies.add(name, env.lock.port)
                env.instances[name] = Instance(self.sup, self.binary, name, {
                    **self.base_env(), "LOCK_STORE": "redis",
                    "REDIS_URL": f"redis://127.0.0.1:{port}/"})
        elif phase.store == "sentinel":
            env.sentinels = Sentinels(self.sup, self.schedule.sentinel_down_after_ms)
            await env.sentinels.start()
            data_url = self.stock_url or f"redis://127.0.0.1:{self.data.port}/"
            for k in range(1, n + 1):
                name = f"s{k}"
                env.instances[name] = Instance(self.sup, self.binary, name, {
                    **self.base_env(), "LOCK_STORE": "sentinel",
                    "SENTINEL_URLS": env.sentinels.urls(), "SENTINEL_MASTER": MASTER_NAME,
                    # The data's Redis: with LOCK_STORE=sentinel, REDIS_URL holds the data only.
                    "REDIS_URL": data_url})
        else:
            raise ValueError(f"unknown store {phase.store!r}")
        for instance in env.instances.values():
            await instance.start()
        return env

    def stop_phase(self) -> None:
        for instance in self.env.instances.values():
            instance.kill()
        if self.env.proxies is not None:
            self.sup.stop(self.env.proxies.proc)

    async def set_stock(self) -> None:
        first = next(iter(self.env.instances.values()))
        for sku in self.skus:
            status, body = await request(first.port, "PUT", f"/items/{sku}",
                                         {"stock": self.schedule.stock},
                                         {"x-request-id": f"reset-{sku}"})
            if status != 200:
                raise RuntimeError(f"PUT /items/{sku} answered {status}: {body}")
            self.history.write({"type": "stock", "sku": sku, "stock": self.schedule.stock,
                                "t": self.history.now()})
        self.journal = self.data("LLEN", JOURNAL_KEY) > 0
        if self.journal:
            self.stock_url = f"redis://127.0.0.1:{self.data.port}/"
        else:
            # The service as it was before fenced writes: the stock on REDIS_URL (here the
            # lock Redis), no journal. Later phases keep the stock there.
            if self.env.lock is not None:
                self.stock_url = f"redis://127.0.0.1:{self.env.lock.port}/"
            self.log(f"[{self.label}] the service keeps no write journal (WRITE_JOURNAL): only "
                     "the final stocks can be checked")
        self.history.write({"type": "service", "journal": self.journal, "t": self.history.now()})

    async def read_final(self) -> None:
        first = next(iter(self.env.instances.values()))
        for sku in self.skus:
            # A read takes a shared lease on the SKU: it waits for a holder's lease (a killed
            # instance's runs out at its TTL), and is sent again if it gives up (409).
            deadline = time.monotonic() + 30
            while True:
                status, body = await request(first.port, "GET", f"/items/{sku}")
                if status != 409 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            if status != 200:
                raise RuntimeError(f"GET /items/{sku} answered {status}: {body}")
            self.history.write({"type": "final", "sku": sku, "stock": body["stock"]})
        if not self.journal:
            self.history.write({"type": "journal_end", "available": False})
            return
        total = self.data("LLEN", JOURNAL_KEY)
        index = 0
        with resp.Redis(self.data.port, timeout=30) as r:
            while index < total:
                for raw in r("LRANGE", JOURNAL_KEY, index, index + 9999):
                    try:
                        entry = json.loads(raw)
                    except ValueError as e:
                        raise RuntimeError(f"journal entry {index} is not JSON: {raw!r}") from e
                    self.history.write({"type": "journal", "index": index, "entry": entry})
                    index += 1
        self.history.write({"type": "journal_end", "available": True, "entries": total})
