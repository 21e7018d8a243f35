"""A real ``redis-server`` (or ``valkey-server``) on a free loopback port, for the shared-limits tests.

Started in a temporary directory with nothing persisted (``--save ''
--appendonly no``).  When neither binary is installed the test is skipped
with the reason, unless ``CI`` is set: then it fails (``.ci/run`` installs
the Debian package).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["RedisServer", "redis_server_binary", "running_redis"]


def redis_server_binary() -> str:
    """The server binary, or skip (fail under CI) when none is installed."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    reason = "redis-server (or valkey-server) is not installed: apt-get install redis-server"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server process; :meth:`kill` and :meth:`start` again keep its port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = redis_server_binary()
        self.workdir = workdir
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-run, as in an outage."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def command(self, *args: str) -> bytes:
        """One command over a raw socket (the tests' own look at the store)."""
        out = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(out.encode())
            return s.recv(65536)


@contextmanager
def running_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
