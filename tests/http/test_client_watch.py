"""The server's ``ClientWatch``: one task calls the watched sockets' ``on_ready``
while they are watched, and never after."""

from __future__ import annotations

import socket

import pytest
import trio

from iopd.http.client_watch import ClientWatch


class _Reads:
    """An ``on_ready`` that reads its socket: what it read, and a wait for the next read."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.got: list[bytes] = []
        self._arrived = trio.Event()

    def __call__(self) -> None:
        self.got.append(self.sock.recv(100))
        self._arrived.set()

    async def next(self) -> bytes:
        await self._arrived.wait()
        self._arrived = trio.Event()
        return self.got[-1]


async def test_on_ready_runs_while_watched_and_never_after() -> None:
    watch = ClientWatch()
    a, b = socket.socketpair()
    reads = _Reads(a)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            watch.watch(a.fileno(), reads)
            assert watch.watched == 1
            b.send(b"one")
            assert await reads.next() == b"one"
            watch.unwatch(a.fileno())
            watch.unwatch(a.fileno())  # idempotent
            assert watch.watched == 0
            b.send(b"two")
            await trio.sleep(0.05)
            assert reads.got == [b"one"]  # not watched: left in the socket
            assert a.recv(100) == b"two"
            nursery.cancel_scope.cancel()
    a.close()
    b.close()


async def test_a_closed_socket_is_unwatched_quietly_and_its_number_reusable() -> None:
    watch = ClientWatch()
    calls: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            a, b = socket.socketpair()
            fd = a.fileno()
            watch.watch(fd, lambda: calls.append("old"))
            a.close()  # closed while watched (a bug elsewhere): the kernel drops it
            b.close()
            watch.unwatch(fd)
            assert watch.watched == 0
            c, d = socket.socketpair()  # (often given the closed socket's number)
            reads = _Reads(c)
            watch.watch(c.fileno(), reads)
            d.send(b"new")
            assert await reads.next() == b"new"
            assert calls == []
            watch.unwatch(c.fileno())
            nursery.cancel_scope.cancel()
    c.close()
    d.close()


async def test_a_failing_on_ready_is_logged_and_unwatched_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = ClientWatch()
    a, b = socket.socketpair()
    good_a, good_b = socket.socketpair()
    reads = _Reads(good_a)
    broke = trio.Event()

    def broken() -> None:
        broke.set()
        raise RuntimeError("a bug")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            watch.watch(a.fileno(), broken)
            watch.watch(good_a.fileno(), reads)
            b.send(b"x")
            await broke.wait()  # (its unwatch ran in the same step)
            assert watch.watched == 1  # the broken one is off the set
            good_b.send(b"ok")
            assert await reads.next() == b"ok"
            assert "event=client_watch_failed" in caplog.text
            nursery.cancel_scope.cancel()
    for s in (a, b, good_a, good_b):
        s.close()
