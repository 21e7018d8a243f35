"""iopd.transport.fastsend: the direct socket write and its fallbacks."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from iopd.transport import fastsend


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_small_write_goes_straight_to_the_socket() -> None:
    with trio.fail_after(5):
        a, b = await _pair()
        assert fastsend.write_now(a, b"hello") == 5
        assert await b.receive_some(100) == b"hello"
        await a.aclose()
        await b.aclose()


async def test_a_full_socket_takes_part_and_send_all_finishes_through_trio() -> None:
    with trio.fail_after(10):
        a, b = await _pair()
        a.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        data = bytes(range(256)) * 4096  # 1 MiB: far more than the buffers hold
        written = fastsend.write_now(a, data)
        assert 0 < written < len(data)  # the kernel took a part only
        assert fastsend.write_now(a, b"more") == 0  # and now nothing
        got = bytearray()

        async def read_all() -> None:
            while len(got) < written + 3:
                got.extend(await b.receive_some(65536))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await a.send_all(b"end")  # the rest goes through trio, which waits
        assert bytes(got) == data[:written] + b"end"
        await a.aclose()
        await b.aclose()


async def test_other_streams_are_left_to_trio() -> None:
    with trio.fail_after(5):
        send, receive = trio.testing.memory_stream_pair()
        assert fastsend.write_now(send, b"x") == 0
        await send.send_all(b"xyz")
        assert await receive.receive_some(10) == b"xyz"  # write_now wrote nothing


async def test_a_broken_connection_is_trios_broken_resource_error() -> None:
    with trio.fail_after(5):
        a, b = await _pair()
        await b.aclose()
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(100):  # the first write may still land in the buffer
                fastsend.write_now(a, b"x" * 65536)
        await a.aclose()


async def test_a_closed_socket_is_left_to_trio() -> None:
    with trio.fail_after(5):
        a, b = await _pair()
        await a.aclose()
        assert fastsend.write_now(a, b"x") == 0  # no fd: nothing attempted
        await b.aclose()


async def test_receive_waits_for_the_bytes_then_reads_once() -> None:
    with trio.fail_after(5):
        a, b = await _pair()
        async with trio.open_nursery() as nursery:

            async def write_later() -> None:
                await trio.sleep(0.01)
                await a.send_all(b"hello")

            nursery.start_soon(write_later)
            assert await fastsend.receive_some(b, 100) == b"hello"
        await a.send_all(b"abcdef")
        assert await fastsend.receive_some(b, 4) == b"abcd"  # at most max_bytes
        assert await fastsend.receive_some(b, 4) == b"ef"
        await a.aclose()
        assert await fastsend.receive_some(b, 4) == b""  # EOF
        await b.aclose()


async def test_receive_is_a_cancel_point() -> None:
    with trio.fail_after(5):
        a, b = await _pair()
        with trio.move_on_after(0.01) as scope:
            await fastsend.receive_some(b, 100)
        assert scope.cancelled_caught
        await a.aclose()
        await b.aclose()


async def test_receive_on_a_closed_socket_or_other_stream() -> None:
    with trio.fail_after(5):
        a, b = await _pair()
        await b.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await fastsend.receive_some(b, 100)
        await a.aclose()
        send, receive = trio.testing.memory_stream_pair()
        await send.send_all(b"xyz")
        assert await fastsend.receive_some(receive, 10) == b"xyz"  # left to trio
