"""A small blocking Redis client (RESP2), for the harness's own commands: readiness, the
journal, `CLIENT KILL`, Sentinel's questions. Never used on the service's path."""

from __future__ import annotations

import socket


class RedisError(Exception):
    """An error reply (`-ERR ...`), or a server that did not answer."""


class Redis:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.file = self.sock.makefile("rb")

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Redis":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, *args):
        self.sock.sendall(_encode(args))
        return self._read()

    def pipeline(self, commands):
        """Several commands in one write; their replies, in order (an error reply raises)."""
        self.sock.sendall(b"".join(_encode(args) for args in commands))
        return [self._read() for _ in commands]

    def _read(self):
        line = self.file.readline()
        if not line:
            raise RedisError("the connection closed")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.file.read(n + 2)[:-2]
            return data.decode("utf-8", "replace")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise RedisError(f"unexpected reply {line!r}")


def _encode(args) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def command(port: int, *args, timeout: float = 5.0):
    """One command on a connection of its own."""
    with Redis(port, timeout=timeout) as r:
        return r(*args)


def ping(port: int, timeout: float = 0.5) -> bool:
    try:
        return command(port, "PING", timeout=timeout) == "PONG"
    except (OSError, RedisError):
        return False
