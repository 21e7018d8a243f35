"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from iopd import sdnotify


@pytest.fixture
def systemd_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket (what systemd listens on) and its path."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5.0)  # a guard: a missing datagram fails the test, never hangs it
    try:
        yield sock, path
    finally:
        sock.close()


def _received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_unset_socket_is_a_noop_returning_false() -> None:
    assert sdnotify.notify("READY=1", env={}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False


def test_no_states_sends_nothing(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, path = systemd_socket
    assert sdnotify.notify(env={"NOTIFY_SOCKET": path}) is False
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


def test_ready_with_status_in_one_datagram(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, path = systemd_socket
    assert sdnotify.notify(*sdnotify.ready("serving"), env={"NOTIFY_SOCKET": path}) is True
    assert _received(sock) == ["READY=1", "STATUS=serving"]


def test_reads_os_environ_by_default(
    systemd_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = systemd_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.notify("STOPPING=1") is True
    assert _received(sock) == ["STOPPING=1"]
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sdnotify.notify("STOPPING=1") is False


def test_reloading_carries_monotonic_usec(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, path = systemd_socket
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.notify(*sdnotify.reloading(), env={"NOTIFY_SOCKET": path})
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = _received(sock)
    assert lines[0] == "RELOADING=1"
    assert lines[1].startswith("MONOTONIC_USEC=")
    assert before <= int(lines[1].removeprefix("MONOTONIC_USEC=")) <= after
    assert lines[2] == "STATUS=reloading config"


def test_stopping_states() -> None:
    assert sdnotify.stopping() == ("STOPPING=1", "STATUS=draining")
    assert sdnotify.stopping("bye") == ("STOPPING=1", "STATUS=bye")


def test_newline_in_a_value_cannot_forge_another_assignment(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, path = systemd_socket
    assert sdnotify.notify(sdnotify.status("bad\nREADY=1"), env={"NOTIFY_SOCKET": path})
    assert _received(sock) == ["STATUS=bad READY=1"]


@pytest.mark.skipif(
    not hasattr(socket, "AF_UNIX") or os.uname().sysname != "Linux",
    reason="abstract AF_UNIX sockets are Linux-only",
)
def test_abstract_socket_address() -> None:
    name = f"iopd-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5.0)
    try:
        assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "@" + name}) is True
        assert _received(sock) == ["READY=1"]
    finally:
        sock.close()


def test_failures_never_raise(tmp_path: Path) -> None:
    # Nobody listens on this path: the send fails, notify returns False.
    missing = str(tmp_path / "nobody.sock")
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": missing}) is False
    # A path too long for sockaddr_un.
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "/" + "x" * 200}) is False
    # Unsupported forms (relative path, vsock) are ignored.
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "relative.sock"}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "vsock:2:1234"}) is False
