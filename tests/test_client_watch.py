"""The server's ``ClientWatch``: one task calls the watched sockets' ``on_ready``
while they are watched, and never after."""

from __future__ import annotations

import socket

import pytest
import trio

from iopd.http.client_watch import ClientWatch


async def test_on_ready_runs_while_watched_and_never_after() -> None:
    watch = ClientWatch()
    a, b = socket.socketpair()
    a.setblocking(False)
    seen: list[bytes] = []
    arrived = trio.Event()

    def on_ready() -> None:
        seen.append(a.recv(100))
        arrived.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            watch.watch(a.fileno(), on_ready)
            assert watch.watched == 1
            b.send(b"one")
            await arrived.wait()
            assert seen == [b"one"]
            watch.unwatch(a.fileno())
            watch.unwatch(a.fileno())  # idempotent
            assert watch.watched == 0
            b.send(b"two")
            await trio.sleep(0.05)
            assert seen == [b"one"]  # not watched: left in the socket
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
            c.setblocking(False)
            arrived = trio.Event()

            def on_ready() -> None:
                calls.append(c.recv(10).decode())
                arrived.set()

            watch.watch(c.fileno(), on_ready)
            d.send(b"new")
            await arrived.wait()
            assert calls == ["new"]
            watch.unwatch(c.fileno())
            nursery.cancel_scope.cancel()
    c.close()
    d.close()


async def test_a_failing_on_ready_is_logged_and_unwatched_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    watch = ClientWatch()
    a, b = socket.socketpair()
    good_a, good_b = socket.socketpair()
    good_a.setblocking(False)
    got: list[bytes] = []
    broke, arrived = trio.Event(), trio.Event()

    def broken() -> None:
        broke.set()
        raise RuntimeError("a bug")

    def good() -> None:
        got.append(good_a.recv(10))
        arrived.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            watch.watch(a.fileno(), broken)
            watch.watch(good_a.fileno(), good)
            b.send(b"x")
            await broke.wait()  # (its unwatch ran in the same step)
            assert watch.watched == 1  # the broken one is off the set
            good_b.send(b"ok")
            await arrived.wait()
            assert got == [b"ok"]
            assert "event=client_watch_failed" in caplog.text
            nursery.cancel_scope.cancel()
    for s in (a, b, good_a, good_b):
        s.close()
