"""The processes a run starts: redis-server (alone, as a replica, as a sentinel), the inventory
example's instances and the proxy process. Every one of them is registered with a
`Supervisor`, which stops them all at the end of the run, on failure and on Ctrl-C; each
also dies with the harness if the harness itself is killed (`PR_SET_PDEATHSIG`)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from . import resp

MASTER_NAME = "mymaster"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: SIGKILL this child when the harness dies, however it dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)


class Supervisor:
    """Starts processes in sessions of their own (so the terminal's Ctrl-C reaches only the
    harness) and stops every one it started."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.children: list[subprocess.Popen] = []

    def spawn(self, name: str, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=kw.pop("stdin", subprocess.DEVNULL),
                stdout=kw.pop("stdout", log),
                stderr=log,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                **kw,
            )
        except FileNotFoundError as e:
            raise SystemExit(
                f"cannot run {argv[0]} ({e}): the fault run needs redis-server (apt-get install "
                "-y redis-server) and python3; scripts/test.sh installs them"
            ) from e
        finally:
            log.close()
        self.children.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a paused process cannot die until resumed
                proc.kill()
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self) -> None:
        for proc in reversed(self.children):
            self.stop(proc)
        self.children.clear()

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


async def wait_for(what: str, check, within: float, interval: float = 0.02) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {within} s")
        await asyncio.sleep(interval)


class RedisServer:
    """A redis-server on 127.0.0.1 without persistence: a restart comes back empty."""

    def __init__(self, sup: Supervisor, name: str, args: tuple[str, ...] = ()):
        self.sup, self.name, self.args = sup, name, args
        self.port = free_port()
        self.dir = sup.workdir / name
        self.dir.mkdir(exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        self.proc = self.sup.spawn(
            self.name,
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), *self.args],
        )

    async def start(self) -> None:
        self.spawn()
        await wait_for(f"{self.name} (redis-server on port {self.port}) did not answer PING",
                       self.alive, 10)

    def alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited: {self.sup.log_tail(self.name)}")
        return resp.ping(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.sup.stop(self.proc)
            self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def __call__(self, *args):
        return resp.command(self.port, *args)


class Sentinels:
    """A master, its replica and three sentinels (quorum 2)."""

    def __init__(self, sup: Supervisor, down_after_ms: int):
        self.sup = sup
        self.down_after_ms = down_after_ms
        # The first master and its replica; which is which changes with each failover.
        self.servers: list[RedisServer] = []
        self.sentinel_ports: list[int] = []

    async def start(self) -> None:
        master = RedisServer(self.sup, "sentinel-master")
        await master.start()
        replica = RedisServer(self.sup, "sentinel-replica",
                              args=("--replicaof", "127.0.0.1", str(master.port)))
        await replica.start()
        self.servers = [master, replica]
        for i in range(3):
            port = free_port()
            d = self.sup.workdir / f"sentinel-{i}"
            d.mkdir(exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {d}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} 2000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self.sup.spawn(f"sentinel-{i}", ["redis-server", str(conf), "--sentinel"])
            self.sentinel_ports.append(port)
        await wait_for("the sentinels never saw the replica and each other", self.ready, 30, 0.1)

    def urls(self) -> str:
        return ",".join(f"redis://127.0.0.1:{p}/" for p in self.sentinel_ports)

    def master_info(self, port: int) -> dict:
        flat = resp.command(port, "SENTINEL", "MASTER", MASTER_NAME, timeout=1)
        return dict(zip(flat[::2], flat[1::2]))

    def ready(self) -> bool:
        try:
            return all(
                (info := self.master_info(p)).get("num-other-sentinels") == "2"
                and info.get("num-slaves") == "1"
                and "s_down" not in info.get("flags", "")
                for p in self.sentinel_ports
            )
        except (OSError, resp.RedisError):
            return False

    def named_master(self) -> set[int]:
        ports = set()
        for p in self.sentinel_ports:
            try:
                addr = resp.command(p, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME,
                                    timeout=1)
                ports.add(int(addr[1]))
            except (OSError, resp.RedisError, TypeError):
                ports.add(-1)
        return ports

    def master(self) -> RedisServer:
        ports = self.named_master()
        (port,) = ports
        return next(s for s in self.servers if s.port == port)

    def is_replica(self, server: RedisServer) -> bool:
        try:
            return server("ROLE")[0] == "slave"
        except (OSError, resp.RedisError, IndexError, TypeError):
            return False

    def replica_in_sync(self, replica: RedisServer) -> bool:
        try:
            info = replica("INFO", "replication")
        except (OSError, resp.RedisError):
            return False
        return "role:slave" in info and "master_link_status:up" in info


class Instance:
    """One process of the inventory example."""

    def __init__(self, sup: Supervisor, binary: str, name: str, env: dict):
        self.sup, self.binary, self.name = sup, binary, name
        self.port = free_port()
        self.env = {**os.environ, **env, "HOST": "127.0.0.1", "PORT": str(self.port),
                    "INSTANCE": name}
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        self.proc = self.sup.spawn(self.name, [self.binary], env=self.env)
        await wait_for(f"instance {self.name} did not listen on port {self.port}", self.listening,
                       15)

    def listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"instance {self.name} exited with {self.proc.returncode}:\n"
                f"{self.sup.log_tail(self.name)}"
            )
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        self.sup.stop(self.proc)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


class Proxies:
    """The proxy process (`proxy.py`), driven over its stdin and stdout."""

    def __init__(self, sup: Supervisor):
        script = Path(__file__).with_name("proxy.py")
        self.proc = sup.spawn("proxy", ["python3", str(script)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
        self.names: list[str] = []

    def send(self, **command) -> dict:
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the proxy process ended")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise RuntimeError(f"proxy {command}: {answer['error']}")
        return answer

    def add(self, name: str, upstream: int) -> int:
        self.names.append(name)
        return self.send(cmd="add", name=name, upstream=upstream)["port"]
