"""Frames sent "soon" leave at the end of the scheduler round, in one write.

``WireChannel.send_soon`` (the node's streamed chunks) commits a frame at
once and leaves its write to ``iopd.transport.round_end``: every frame the
round's tasks sent goes out in one ``write(2)`` just before trio polls for
I/O.  These tests pin that nothing is held past the round, that order is
commit order whatever mixes of ``send``/``queue``/``send_soon`` happen, and
that a socket that does not take a batch whole holds the senders back and
loses nothing.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

import iopd.transport.channel as channel_mod
from iopd.node.executor import NodeExecutor
from iopd.node.registry import AdapterRegistry
from iopd.node.stream_out import LinkSender
from iopd.transport.channel import ChannelClosed, WireChannel
from iopd.transport.round_end import call_at_round_end
from tests.support.node_parts import _ReplyAdapter
from tests.support.wire_peers import challenge_and_prove
from wire.connection import Connection, Role
from wire.messages import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    Message,
    ProviderSpec,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
)

# ------------------------------------------------------------------ round end


async def test_callbacks_run_once_after_the_rounds_tasks_in_order() -> None:
    seen: list[str] = []

    async def task(name: str) -> None:
        seen.append(name)
        call_at_round_end(lambda: seen.append(f"end {name}"))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(task, "a")
            nursery.start_soon(task, "b")
        await trio.lowlevel.checkpoint()  # another round: nothing runs twice
    # trio may run the batch in either order; the callbacks follow in theirs
    first, second = seen[:2]
    assert sorted(seen[:2]) == ["a", "b"]
    assert seen[2:] == [f"end {first}", f"end {second}"]


async def test_a_callback_runs_before_the_loop_sleeps() -> None:
    # The task blocks for an hour right after registering: the callback must
    # not wait for that (it runs before the poll, whatever its timeout).
    ran = trio.Event()

    def note() -> None:
        ran.set()  # (wakes nothing: no task waits on it yet)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def blocker() -> None:
                call_at_round_end(note)
                await trio.sleep(3600)

            nursery.start_soon(blocker)
            await trio.sleep(0.01)
            assert ran.is_set()
            nursery.cancel_scope.cancel()


async def test_a_failing_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[int] = []

    def boom() -> None:
        raise RuntimeError("boom")

    with trio.fail_after(5):
        call_at_round_end(lambda: seen.append(1))
        call_at_round_end(boom)
        call_at_round_end(lambda: seen.append(2))
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        call_at_round_end(lambda: seen.append(3))  # the instrument is still there
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
    assert seen == [1, 2, 3]
    assert any("round-end callback failed" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ channel


def _text(t: str, stream_id: int = 1) -> RunEvent:
    return RunEvent(stream_id=stream_id, kind="text", text=t)


class _Writes:
    """Counts ``write_now`` calls on the node's socket (the wire's writes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = channel_mod.write_now

        def counting(stream: Any, data: bytes | memoryview) -> int:
            self.count += 1
            return real(stream, data)

        monkeypatch.setattr(channel_mod, "write_now", counting)


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> _Writes:
    return _Writes(monkeypatch)


@asynccontextmanager
async def _serving_pair(
    window: int = 1000, sndbuf: int | None = None
) -> AsyncIterator[tuple[WireChannel, WireChannel]]:
    """(edge, node) over a real socket pair; streams 1 and 2 open; the node serving."""
    a, b = trio.socket.socketpair()
    if sndbuf is not None:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    edge = WireChannel(trio.SocketStream(a), Connection(Role.EDGE))
    node = WireChannel(trio.SocketStream(b), Connection(Role.NODE))
    await node.send(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t"))
    assert isinstance(await edge.receive_message(), Hello)
    await challenge_and_prove(edge, node)
    await edge.send(HelloAck(edge_id="e"))
    for stream_id in (1, 2):  # a frame is sent soon only while another stream is open
        await edge.send(
            RunRequest(
                stream_id=stream_id, provider_id="p", adapter="echo", target="m", window=window
            )
        )
    assert isinstance(await node.receive_message(), HelloAck)
    assert isinstance(await node.receive_message(), RunRequest)
    assert isinstance(await node.receive_message(), RunRequest)

    async def serve_node() -> None:
        try:
            await node.serve(lambda m: None, heartbeat_interval=600, heartbeat_timeout=1200)
        except ChannelClosed:
            pass

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_node)
            await trio.testing.wait_all_tasks_blocked()  # serve runs: send_soon may defer
            yield edge, node
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await edge.aclose()
            await node.aclose()


async def _receive(edge: WireChannel, n: int) -> list[Message]:
    return [await edge.receive_message() for _ in range(n)]


async def test_frames_of_many_tasks_in_one_round_leave_in_one_write(writes: _Writes) -> None:
    with trio.fail_after(5):
        async with _serving_pair() as (edge, node):
            order: list[str] = []

            async def send_one(text: str) -> None:
                order.append(text)  # no checkpoint between this and the commit
                await node.send_soon(_text(text))

            before = writes.count
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(send_one, str(i))
            assert writes.count == before + 1
            got = await _receive(edge, 50)
    assert [m.text for m in got] == order  # type: ignore[union-attr]
    assert sorted(order, key=int) == [str(i) for i in range(50)]


async def test_a_lone_frame_is_written_as_soon_as_its_task_blocks(writes: _Writes) -> None:
    with trio.fail_after(5):
        async with _serving_pair() as (edge, node):
            before = writes.count
            await node.send_soon(_text("only"))
            assert writes.count == before  # committed, not written yet
            msg = await edge.receive_message()  # this task blocks: the round ends
            assert writes.count == before + 1
    assert isinstance(msg, RunEvent) and msg.text == "only"


async def test_sends_queues_and_soon_sends_keep_their_commit_order(writes: _Writes) -> None:
    with trio.fail_after(5):
        async with _serving_pair() as (edge, node):
            before = writes.count
            await node.send_soon(_text("a"))
            node.queue(_text("b"))
            await node.send(_text("c"))  # writes a, b, c at once
            assert writes.count == before + 1
            await node.send_soon(_text("d"))
            got = await _receive(edge, 4)
            assert writes.count == before + 2  # d alone, at the end of its round
    assert [m.text for m in got] == ["a", "b", "c", "d"]  # type: ignore[union-attr]


async def test_the_only_open_stream_is_written_at_once(writes: _Writes) -> None:
    with trio.fail_after(5):
        async with _serving_pair() as (edge, node):
            await node.send(RunEvent(stream_id=2, kind="complete", finish_reason="stop"))
            before = writes.count
            await node.send_soon(_text("alone"))
            assert writes.count == before + 1  # nothing could join it: no wait
            msg = await edge.receive_message()
            assert isinstance(msg, RunEvent) and msg.kind == "complete"
            msg = await edge.receive_message()
    assert isinstance(msg, RunEvent) and msg.text == "alone"


async def test_a_cancelled_soon_send_still_delivers_its_frame() -> None:
    with trio.fail_after(5):
        async with _serving_pair() as (edge, node):
            with trio.CancelScope() as scope:
                scope.cancel()
                await node.send_soon(_text("kept"))
            assert scope.cancelled_caught
            msg = await edge.receive_message()
    assert isinstance(msg, RunEvent) and msg.text == "kept"


async def test_a_batch_the_socket_does_not_take_holds_the_senders_and_loses_nothing() -> None:
    # Small socket buffers and an edge that does not read: a round's batch is
    # taken in part, the rest goes first once the edge reads, and later
    # senders wait instead of piling frames up.
    piece = "x" * 3000
    sent: list[int] = []
    with trio.fail_after(10):
        async with _serving_pair(window=10_000, sndbuf=4096) as (edge, node):

            async def sender(k: int) -> None:
                for i in range(20):
                    await node.send_soon(_text(f"{k}:{i}:{piece}"))
                    sent.append(k)
                    await trio.lowlevel.checkpoint()  # a relay's task yields between chunks

            async with trio.open_nursery() as nursery:
                for k in range(10):
                    nursery.start_soon(sender, k)
                await trio.testing.wait_all_tasks_blocked()
                stalled, sent_then = node._stalled, len(sent)
                got = await _receive(edge, 200)  # (read first: a failure must not hang)
    assert stalled, "the socket took every round's batch whole: the test proves nothing"
    assert sent_then < 200  # the senders were held back
    assert len(sent) == 200
    by_sender: dict[str, list[int]] = {}
    for m in got:
        assert isinstance(m, RunEvent) and m.text is not None
        k, i, body = m.text.split(":")
        assert body == piece
        by_sender.setdefault(k, []).append(int(i))
    assert by_sender == {str(k): list(range(20)) for k in range(10)}


async def test_the_outbox_writer_waits_while_another_task_writes_a_stalled_batch() -> None:
    # The round's batch is taken in part, so the outbox writer is woken; the
    # sender's next frame makes the sender the writer of the rest first.  The
    # outbox writer must then leave it to that writer, not loop on "stalled"
    # without a checkpoint (which froze the node at N = 600 in a benchmark).
    with trio.fail_after(5):
        async with _serving_pair(window=10_000, sndbuf=4096) as (edge, node):
            stalled: list[bool] = []

            async def sender() -> None:
                for i in range(10):
                    await node.send_soon(_text(f"a{i}:" + "x" * 4000))
                await trio.lowlevel.checkpoint()  # the round ends: the batch goes in part
                stalled.append(node._stalled)
                await node.send_soon(_text("b:" + "y" * 4000))  # the writer, until the edge reads

            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender)
                await trio.testing.wait_all_tasks_blocked()
                got = await _receive(edge, 11)
    assert stalled == [True]
    assert [m.text.split(":")[0] for m in got] == [f"a{i}" for i in range(10)] + ["b"]  # type: ignore[union-attr]


async def test_a_task_sending_much_in_one_step_writes_without_waiting_for_the_round(
    writes: _Writes,
) -> None:
    with trio.fail_after(5):
        async with _serving_pair(window=10_000) as (edge, node):
            before = writes.count
            for i in range(100):  # 100 KB, no yield between
                await node.send_soon(_text(f"{i}:" + "z" * 1000))
            assert writes.count == before + 1  # at 64 KB, without ending the step
            got = await _receive(edge, 100)
            assert writes.count == before + 2  # the rest, at the round's end
    assert [m.text.split(":")[0] for m in got] == [str(i) for i in range(100)]  # type: ignore[union-attr]


async def test_a_peer_gone_under_a_round_write_closes_the_channel() -> None:
    with trio.fail_after(5):
        async with _serving_pair() as (edge, node):
            edge.stream.socket.close()  # type: ignore[attr-defined]
            for _ in range(200):  # until the kernel reports the reset
                try:
                    await node.send_soon(_text("y" * 1000))
                except ChannelClosed:
                    break
                await trio.lowlevel.checkpoint()
            else:  # pragma: no cover - a broken test
                raise AssertionError("the channel never noticed the closed peer")
    assert node.closed


async def test_without_a_plain_socket_or_before_serve_the_frame_is_written_at_once() -> None:
    a, b = trio.testing.memory_stream_pair()
    edge = WireChannel(a, Connection(Role.EDGE))
    node = WireChannel(b, Connection(Role.NODE))
    with trio.fail_after(5):
        await node.send_soon(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t"))
        assert isinstance(await edge.receive_message(), Hello)
        assert not node._round_end_due


# ------------------------------------------------------------------ node


async def test_the_node_sends_a_streamed_reply_soon_and_its_terminal_at_once() -> None:
    calls: list[tuple[str, str]] = []

    class Sender:
        async def send(self, msg: RunEvent | ProviderTunnelFrame) -> None:
            await trio.lowlevel.checkpoint()
            calls.append((msg.kind, "send"))

        async def send_soon(self, msg: RunEvent | ProviderTunnelFrame) -> None:
            await trio.lowlevel.checkpoint()
            calls.append((msg.kind, "soon"))

        async def send_held(self, msg: RunEvent | ProviderTunnelFrame) -> None:
            await trio.lowlevel.checkpoint()
            calls.append((msg.kind, "held"))

    executor = NodeExecutor()
    spec = ProviderSpec(id="p", type="openai", base_url="http://127.0.0.1:1")
    pieces = [b"data: {}\n\n", b"data: [DONE]\n\n"]
    executor.registry = AdapterRegistry({"p": _ReplyAdapter(spec, "text/event-stream", pieces)})
    req = ProviderTunnelRequest(stream_id=3, provider_id="p", method="POST", path="/v1/x")
    with trio.fail_after(5):
        await executor.serve_stream(req, Sender())
    assert calls[:3] == [("head", "soon"), ("body", "soon"), ("body", "soon")]
    assert calls[-1][1] == "send"  # the terminal


async def test_the_link_sender_sends_the_terminal_and_creditless_frames_at_once(
    writes: _Writes,
) -> None:
    with trio.fail_after(5):
        async with _serving_pair(window=1) as (edge, node):
            sender = LinkSender(node, 1)
            before = writes.count
            await sender.send_soon(_text("a"))  # uses the one credit, soon
            assert writes.count == before
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.send_soon, _text("b"))  # no credit: waits
                first = await edge.receive_message()
                assert isinstance(first, RunEvent) and first.text == "a"
                nursery.cancel_scope.cancel()
            await sender.send_soon(RunEvent(stream_id=1, kind="complete", finish_reason="stop"))
            assert writes.count == before + 2  # the terminal: written at once
            last = await edge.receive_message()
    assert isinstance(last, RunEvent) and last.kind == "complete"
