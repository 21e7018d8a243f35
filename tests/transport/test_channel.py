"""WireChannel: heartbeats and pongs, a silent peer, EOF and protocol errors, a cancelled
sender, concurrent senders coalesced in call order."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iopd.transport import ChannelClosed, WireChannel
from tests.support.streams import CountingStream
from tests.support.wire_peers import challenge_and_prove, handshaken_channels, wait_until
from wire.connection import Connection, Role
from wire.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    Pong,
    RunEvent,
    RunRequest,
)

# ------------------------------------------------------------------ channel


async def _open_pair() -> tuple[WireChannel, WireChannel]:
    """Two channels (edge, node) over memory streams, handshake done."""
    return await handshaken_channels(*trio.testing.memory_stream_pair())


async def test_channel_answers_heartbeat_with_pong_and_dispatches_the_rest() -> None:
    edge, node = await _open_pair()
    seen: list[Message] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_quietly, node, seen.append, 100.0, 1000.0)
            await edge.send(Heartbeat(seq=41))
            assert await edge.receive_message() == Pong(seq=41)
            await edge.send(RunRequest(stream_id=1, provider_id="p", adapter="echo", target="m"))
            await wait_until(lambda: len(seen) == 1)
            assert isinstance(seen[0], RunRequest)  # heartbeats are not dispatched
            nursery.cancel_scope.cancel()


async def _serve_quietly(
    chan: WireChannel, dispatch: object, interval: float, timeout: float
) -> None:
    try:
        await chan.serve(dispatch, heartbeat_interval=interval, heartbeat_timeout=timeout)  # type: ignore[arg-type]
    except ChannelClosed:
        pass


async def test_channel_sends_heartbeats_and_times_out_silent_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, node = await _open_pair()
    with trio.fail_after(100):
        start = trio.current_time()
        with pytest.raises(ChannelClosed) as info:
            await node.serve(lambda m: None, heartbeat_interval=2.0, heartbeat_timeout=7.0)
        assert info.value.kind == "heartbeat"
        assert trio.current_time() - start == pytest.approx(7.0)
        # it did send heartbeats meanwhile (3 of them: at 2, 4, 6 s)
        msgs = edge.conn.receive_data(await edge.stream.receive_some(65536))
        assert [m for m in msgs if isinstance(m, Heartbeat)] == [
            Heartbeat(seq=1),
            Heartbeat(seq=2),
            Heartbeat(seq=3),
        ]
    assert node.closed


async def test_channel_peer_eof_and_protocol_error() -> None:
    with trio.fail_after(5):
        edge, node = await _open_pair()
        await edge.aclose()
        with pytest.raises(ChannelClosed) as info:
            await node.serve(lambda m: None, heartbeat_interval=10, heartbeat_timeout=30)
        assert info.value.kind in ("eof", "broken")
        with pytest.raises(ChannelClosed):
            await node.send(Heartbeat())

        edge, node = await _open_pair()
        await edge.stream.send_all(b"\x00\x00\x00\x00")  # zero-length frame
        with pytest.raises(ChannelClosed) as info:
            await node.serve(lambda m: None, heartbeat_interval=10, heartbeat_timeout=30)
        assert info.value.kind == "protocol"
        assert "zero-length" in info.value.reason
        assert isinstance(info.value, trio.BrokenResourceError)


async def test_cancelled_sender_never_leaves_half_a_frame() -> None:
    a, b = trio.testing.lockstep_stream_pair()  # every send waits for the reader
    edge = WireChannel(a, Connection(Role.EDGE))
    node = WireChannel(b, Connection(Role.NODE))
    hello = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t" * 1000)
    done: list[str] = []

    async def sender(scope: trio.CancelScope) -> None:
        with scope:
            await node.send(hello)
            done.append("sent")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(sender, scope)
            await trio.testing.wait_all_tasks_blocked()  # blocked inside send_all
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert done == []  # the cancel did not abort the write half-way
            assert await edge.receive_message() == hello  # the whole frame arrives
            await wait_until(lambda: done == ["sent"])


async def test_concurrent_senders_are_coalesced_in_call_order() -> None:
    a, b = trio.testing.memory_stream_pair()  # send_all yields: senders pile up
    counting = CountingStream(b)
    edge = WireChannel(a, Connection(Role.EDGE))
    node = WireChannel(counting, Connection(Role.NODE))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await node.send(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t"))
            assert isinstance(await edge.receive_message(), Hello)
            await challenge_and_prove(edge, node)
            await edge.send(HelloAck(edge_id="e"))
            await edge.send(
                RunRequest(stream_id=1, provider_id="p", adapter="echo", target="m", window=100)
            )
            assert isinstance(await node.receive_message(), HelloAck)
            assert isinstance(await node.receive_message(), RunRequest)
            writes_before = counting.writes
            call_order: list[str] = []

            async def send_one(text: str) -> None:
                call_order.append(text)  # no checkpoint between this and send()
                await node.send(RunEvent(stream_id=1, kind="text", text=text))

            for i in range(50):
                nursery.start_soon(send_one, str(i))
            got = [await edge.receive_message() for _ in range(50)]
    # frames arrive whole, each once, in the order the senders called send()
    assert [m.text for m in got] == call_order  # type: ignore[union-attr]
    assert sorted(call_order, key=int) == [str(i) for i in range(50)]
    assert counting.writes - writes_before < 50  # and were batched into fewer writes
