"""Tests of the harness's own parts that a run's faults rely on: the proxy really delays,
holds and cuts, against a real redis-server; the supervisor really stops what it started.

    python3 -m unittest discover -s faults -p 'test_*.py'
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import tempfile
import time
import unittest
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import resp  # noqa: E402
from harness.processes import Proxies, RedisServer, Supervisor  # noqa: E402

if shutil.which("redis-server") is None:
    raise RuntimeError("the harness tests need redis-server: apt-get install -y redis-server")


class ProxyAgainstRedis(unittest.TestCase):
    def setUp(self):
        self.dir = Path(tempfile.mkdtemp(prefix="faults-test-"))
        self.sup = Supervisor(self.dir)
        self.redis = RedisServer(self.sup, "redis")
        asyncio.run(self.redis.start())
        self.proxies = Proxies(self.sup)
        self.port = self.proxies.add("p", self.redis.port)

    def tearDown(self):
        self.sup.stop_all()
        shutil.rmtree(self.dir, ignore_errors=True)

    def round_trip(self, conn) -> float:
        start = time.monotonic()
        self.assertEqual(conn("PING"), "PONG")
        return time.monotonic() - start

    def test_latency_delays_each_way(self):
        with resp.Redis(self.port) as conn:
            self.assertLess(self.round_trip(conn), 0.1)
            self.proxies.send(cmd="latency", name="p", ms=100)
            self.assertGreaterEqual(self.round_trip(conn), 0.2)
            self.proxies.send(cmd="latency", name="p", ms=0)
            self.assertLess(self.round_trip(conn), 0.1)

    def test_a_partition_holds_what_was_sent_and_delivers_it_when_it_heals(self):
        raw = socket.create_connection(("127.0.0.1", self.port))
        raw.sendall(b"PING\r\n")
        self.assertEqual(raw.recv(100), b"+PONG\r\n")
        self.proxies.send(cmd="partition", name="p", on=True)
        raw.sendall(b"INCR partitioned\r\n")
        raw.settimeout(0.5)
        with self.assertRaises(TimeoutError):
            raw.recv(100)
        # Nothing reached Redis, and a new connection gets nowhere either.
        self.assertIsNone(self.redis("GET", "partitioned"))
        late = socket.create_connection(("127.0.0.1", self.port))
        late.sendall(b"PING\r\n")
        late.settimeout(0.3)
        with self.assertRaises(TimeoutError):
            late.recv(100)
        self.proxies.send(cmd="partition", name="p", on=False)
        raw.settimeout(5)
        late.settimeout(5)
        self.assertEqual(raw.recv(100), b":1\r\n")
        self.assertEqual(late.recv(100), b"+PONG\r\n")
        raw.close()
        late.close()

    def test_cut_closes_every_connection(self):
        conn = resp.Redis(self.port)
        self.round_trip(conn)
        self.assertGreaterEqual(self.proxies.send(cmd="cut", name="p")["closed"], 2)
        with self.assertRaises((OSError, resp.RedisError)):
            conn("PING")
        conn.close()
        with resp.Redis(self.port) as again:
            self.round_trip(again)

    def test_a_connection_to_a_stopped_redis_is_closed(self):
        self.redis.kill()
        with resp.Redis(self.port) as conn:
            with self.assertRaises((OSError, resp.RedisError)):
                conn("PING")


class SupervisorStopsEverything(unittest.TestCase):
    def test_paused_and_running_children_are_stopped(self):
        d = Path(tempfile.mkdtemp(prefix="faults-test-"))
        sup = Supervisor(d)
        try:
            running = sup.spawn("sleep-a", ["sleep", "60"])
            paused = sup.spawn("sleep-b", ["sleep", "60"])
            os.kill(paused.pid, 19)  # SIGSTOP
        finally:
            sup.stop_all()
            shutil.rmtree(d, ignore_errors=True)
        self.assertIsNotNone(running.poll())
        self.assertIsNotNone(paused.poll())


if __name__ == "__main__":
    unittest.main()
