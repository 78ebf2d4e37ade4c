#!/usr/bin/env python3
"""TCP proxies on 127.0.0.1 that the harness controls: one process, any number of proxies.

Run as its own process (so that forwarding bytes never waits for the harness's load
generator), it reads commands from stdin, one JSON object a line, and answers each on stdout
with one JSON line, `{"ok": true, ...}` or `{"ok": false, "error": "..."}`:

- `{"cmd": "add", "name": N, "upstream": PORT}`: a new proxy to 127.0.0.1:PORT; answers its
  `port`.
- `{"cmd": "latency", "name": N, "ms": MS}`: every chunk, each way, is delivered MS ms after it
  was read (in order); 0 turns it off.
- `{"cmd": "partition", "name": N, "on": true|false}`: while on, nothing is delivered either
  way and new connections are accepted but not connected upstream; what was read is held and
  delivered when the partition heals, as TCP would retransmit it (connections are not cut).
- `{"cmd": "cut", "name": N}`: every open connection of the proxy is closed at once, both sides.
- `{"cmd": "stats"}`: connections accepted and bytes forwarded, per proxy.

A connection whose upstream refuses (Redis down) is closed at once. Stdin closing ends the
process.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys


class Link:
    """One direction of one connection: what was read, waiting to be delivered."""

    def __init__(self, proxy: "Proxy", writer: asyncio.StreamWriter):
        self.proxy = proxy
        self.writer = writer
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = asyncio.Event()

    def push(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.queue.append((loop.time() + self.proxy.latency, data))
        self.ready.set()

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.ready.clear()
                await self.ready.wait()
            due, data = self.queue[0]
            await self.proxy.open.wait()
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                continue  # the partition may have started meanwhile
            self.queue.popleft()
            if data == b"":
                self.writer.write_eof() if self.writer.can_write_eof() else self.writer.close()
                return
            self.writer.write(data)
            self.proxy.bytes += len(data)
            await self.writer.drain()


class Proxy:
    def __init__(self, name: str, upstream: int):
        self.name = name
        self.upstream = upstream
        self.latency = 0.0
        self.open = asyncio.Event()
        self.open.set()
        self.connections: set[asyncio.Task] = set()
        self.writers: set[asyncio.StreamWriter] = set()
        self.accepted = 0
        self.bytes = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        self.accepted += 1
        task = asyncio.current_task()
        self.connections.add(task)
        self.writers.add(client_w)
        upstream_w = None
        try:
            # A partition holds new connections too: the client's SYN was answered (by the
            # kernel), nothing more.
            await self.open.wait()
            try:
                upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream)
            except OSError:
                return
            self.writers.add(upstream_w)
            to_upstream, to_client = Link(self, upstream_w), Link(self, client_w)
            pumps = [
                asyncio.create_task(self.pump(client_r, to_upstream)),
                asyncio.create_task(self.pump(upstream_r, to_client)),
                asyncio.create_task(to_upstream.deliver()),
                asyncio.create_task(to_client.deliver()),
            ]
            try:
                # Either side closing ends the connection, once what it sent is delivered.
                done, _ = await asyncio.wait(pumps[2:], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            finally:
                for t in pumps:
                    t.cancel()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (client_w, upstream_w):
                if w is not None:
                    self.writers.discard(w)
                    w.close()
            self.connections.discard(task)

    async def pump(self, reader: asyncio.StreamReader, link: Link) -> None:
        try:
            while True:
                data = await reader.read(65536)
                link.push(data)
                if not data:
                    return
        except OSError:
            link.push(b"")

    def cut(self) -> int:
        n = 0
        for w in list(self.writers):
            transport = w.transport
            if transport is not None:
                transport.abort()
                n += 1
        return n


class Control:
    def __init__(self):
        self.proxies: dict[str, Proxy] = {}

    async def handle(self, command: dict) -> dict:
        cmd = command["cmd"]
        if cmd == "add":
            proxy = Proxy(command["name"], int(command["upstream"]))
            self.proxies[proxy.name] = proxy
            return {"port": await proxy.start()}
        if cmd == "stats":
            return {
                "proxies": {
                    n: {"accepted": p.accepted, "bytes": p.bytes, "open": len(p.connections)}
                    for n, p in self.proxies.items()
                }
            }
        proxy = self.proxies[command["name"]]
        if cmd == "latency":
            proxy.latency = float(command["ms"]) / 1000
            return {}
        if cmd == "partition":
            if command["on"]:
                proxy.open.clear()
            else:
                proxy.open.set()
            return {}
        if cmd == "cut":
            return {"closed": proxy.cut()}
        raise ValueError(f"unknown command {cmd!r}")


async def main() -> None:
    control = Control()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            return
        try:
            answer = {"ok": True, **await control.handle(json.loads(line))}
        except Exception as e:  # every failure is the caller's to see
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
