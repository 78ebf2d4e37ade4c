"""The clients: concurrent purchases on a few SKUs, each with a deadline and a unique
`x-request-id`, over keep-alive HTTP/1.1 connections, every one recorded in the history."""

from __future__ import annotations

import asyncio
import collections
import json
import random

from .history import History

# redis-rs's and the layer's bound on one store call (`LockConfig::store_timeout`, 1 s by
# default): an acquire that gets nothing back in time, and the release after the handler, each
# cost at most this.
STORE_TIMEOUT_MS = 1000
# How long a client waits for an answer beyond the request's deadline before it gives up and
# records "no answer" (a paused instance answers late, by the length of its pause).
CLIENT_GRACE_S = 10.0


class Settings:
    def __init__(self, clients: int, wait_ms: int, long_fraction: float,
                 long_work_ms: tuple[int, int], short_work_ms: tuple[int, int]):
        self.clients = clients
        self.wait_ms = wait_ms
        self.long_fraction = long_fraction
        self.long_work_ms = long_work_ms
        self.short_work_ms = short_work_ms

    def deadline_ms(self, work_ms: int) -> int:
        """What the service promises: the wait for the lock, one store call that may time
        out, the handler's work, and the release."""
        return self.wait_ms + work_ms + 2 * STORE_TIMEOUT_MS


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class Refused(Exception):
    pass


async def exchange(conn: Connection, method: str, path: str, headers: dict,
                   body: bytes = b"") -> tuple[int, bytes]:
    head = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", f"content-length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    conn.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    await conn.writer.drain()
    raw = await conn.reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
    if "content-length" in fields:
        data = await conn.reader.readexactly(int(fields["content-length"]))
    elif fields.get("transfer-encoding", "").lower() == "chunked":
        data = b""
        while True:
            size = int((await conn.reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            chunk = await conn.reader.readexactly(size + 2)
            if size == 0:
                break
            data += chunk[:-2]
    else:
        data = b""
    if fields.get("connection", "").lower() == "close":
        conn.close()
    return status, data


class Load:
    def __init__(self, history: History, settings: Settings, skus: list[str], rng: random.Random,
                 label: str):
        self.history = history
        self.settings = settings
        self.skus = skus
        self.rng = rng
        self.label = label
        self.instances: dict[str, int] = {}
        # Instances the clients leave alone for a while (a pause's target, holding its bait).
        self.spared: set[str] = set()
        self.go = asyncio.Event()
        self.stopping = False
        self.in_flight = 0
        self.busy: collections.Counter = collections.Counter()  # requests in flight, per instance
        self.idle = asyncio.Event()
        self.idle.set()
        self.sequence = 0
        self.counts: collections.Counter = collections.Counter()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.go.set()
        self.tasks = [asyncio.create_task(self.client(n)) for n in range(self.settings.clients)]

    async def hold(self) -> None:
        """Sends nothing new, and returns once every request in flight is answered."""
        self.go.clear()
        while self.in_flight:
            self.idle.clear()
            await self.idle.wait()

    def resume(self) -> None:
        self.go.set()

    async def stop(self) -> None:
        self.stopping = True
        await self.hold()
        self.go.set()
        await asyncio.gather(*self.tasks)

    def next_id(self, client: int | str) -> str:
        self.sequence += 1
        return f"{self.label}-{client}-{self.sequence}"

    def work_ms(self) -> int:
        lo, hi = (
            self.settings.long_work_ms
            if self.rng.random() < self.settings.long_fraction
            else self.settings.short_work_ms
        )
        return self.rng.randint(lo, hi)

    async def client(self, n: int) -> None:
        pool: dict[int, Connection] = {}
        while True:
            await self.go.wait()
            if self.stopping:
                break
            instance = self.rng.choice(sorted(set(self.instances) - self.spared))
            sku = self.rng.choice(self.skus)
            record = await self.purchase(pool, instance, sku, self.work_ms(), self.next_id(n))
            if record["error"] is not None:
                await asyncio.sleep(0.05)  # a refused or dropped connection: no busy loop
        for conn in pool.values():
            conn.close()

    async def purchase(self, pool: dict[int, Connection], instance: str, sku: str, work_ms: int,
                       rid: str, **extra) -> dict:
        port = self.instances[instance]
        deadline_ms = self.settings.deadline_ms(work_ms)
        record = {"type": "request", "id": rid, "op": "purchase", "sku": sku,
                  "instance": instance, "work_ms": work_ms, "deadline_ms": deadline_ms,
                  "invoke": None, "complete": None, "status": None, "token": None,
                  "stock": None, "problem": None, "error": None, **extra}
        self.in_flight += 1
        self.busy[instance] += 1
        record["invoke"] = self.history.now()
        try:
            conn = pool.get(port)
            if conn is None or not conn.usable():
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError as e:
                    raise Refused() from e
                conn = pool[port] = Connection(reader, writer)
            try:
                status, body = await asyncio.wait_for(
                    exchange(conn, "POST", f"/items/{sku}/purchase?work_ms={work_ms}",
                             {"x-request-id": rid}),
                    deadline_ms / 1000 + CLIENT_GRACE_S,
                )
            except BaseException:
                pool.pop(port, None)
                conn.close()
                raise
            record["complete"] = self.history.now()
            record["status"] = status
            try:
                answer = json.loads(body)
            except ValueError:
                answer = {}
            if status == 200:
                record["token"] = answer.get("fencing_token")
                record["stock"] = answer.get("stock")
            elif isinstance(answer, dict) and isinstance(answer.get("type"), str):
                record["problem"] = answer["type"].rsplit("#", 1)[-1].rsplit("/", 1)[-1]
        except Refused:
            record["complete"] = self.history.now()
            record["error"] = "refused"
        except asyncio.TimeoutError:
            record["error"] = "timeout"
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            record["complete"] = self.history.now()
            record["error"] = f"closed ({type(e).__name__})"
        finally:
            self.in_flight -= 1
            self.busy[instance] -= 1
            if not self.in_flight:
                self.idle.set()
        self.counts[record["status"] or record["error"].split(" ")[0]] += 1
        self.history.write(record)
        return record


async def request(port: int, method: str, path: str, body: dict | None = None,
                  headers: dict | None = None, timeout: float = 10) -> tuple[int, dict]:
    """One request on a connection of its own (set-up, final reads)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = Connection(reader, writer)
    try:
        data = b"" if body is None else json.dumps(body).encode()
        h = {"content-type": "application/json"} if body is not None else {}
        h.update(headers or {})
        status, raw = await asyncio.wait_for(exchange(conn, method, path, h, data), timeout)
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()
