"""``NodeStream.direct``: replies the hub's reader writes out for a parked consumer.

The passthrough relay hands its stream a ``DirectWriter`` so a relayed
response (a streamed chunk, or a whole non-streaming reply) is written to
the caller from the edge's wire reader instead of waking the handler.  These
tests drive a ``NodeStream`` by hand (no sockets): what the writer takes is
consumed (credit returned) and written at the end of the reader's batch,
what it declines reaches the consumer in order, a part left unwritten is
settled before the consumer sees anything else, and nothing is offered
while the consumer is busy or once it was cancelled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio
import trio.testing

from iopd.edge.nodes.node_session import NodeStream
from wire.messages import Credit, Message, ProviderTunnelFrame


class _Writer:
    """Holds body frames; ``flush_now`` writes them (or, when ``partial``,
    leaves part pending for the consumer's ``settle``)."""

    def __init__(self, *, partial: bool = False) -> None:
        self.held: list[bytes] = []
        self.written: list[list[bytes]] = []  # one list per flush
        self.partial = partial
        self.pending = False
        self.settled = 0

    def write_now(self, msg: ProviderTunnelFrame) -> bool:
        if msg.kind != "body":
            return False
        self.held.append(msg.data)
        return True

    def flush_now(self) -> None:
        if self.held:
            self.written.append(self.held)
            self.held = []
            self.pending = self.partial

    async def settle(self) -> None:
        await trio.lowlevel.checkpoint()
        self.pending = False
        self.settled += 1


def _body(data: bytes) -> ProviderTunnelFrame:
    return ProviderTunnelFrame(stream_id=1, kind="body", data=data)


def _stream(
    writer: _Writer, post: Callable[[Message], None] = lambda _m: None
) -> NodeStream[ProviderTunnelFrame]:
    """Stream 1 of node ``n`` (8 frames of credit), ``writer`` its direct writer."""
    stream: NodeStream[ProviderTunnelFrame] = NodeStream("n", 1, 8, post)
    stream.direct = writer
    return stream


async def _consume(stream: NodeStream[ProviderTunnelFrame], got: list[ProviderTunnelFrame]) -> None:
    async for msg in stream:
        got.append(msg)


@asynccontextmanager
async def _parked_consumer(
    stream: NodeStream[ProviderTunnelFrame],
) -> AsyncIterator[tuple[trio.Nursery, list[ProviderTunnelFrame]]]:
    """A consumer task parked on ``stream``; yields its nursery and what it has received."""
    got: list[ProviderTunnelFrame] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_consume, stream, got)
            await trio.testing.wait_all_tasks_blocked()
            yield nursery, got


async def test_replies_for_a_parked_consumer_are_written_by_the_reader_once_per_batch() -> None:
    posted: list[Message] = []
    writer = _Writer()
    stream = _stream(writer, posted.append)
    async with _parked_consumer(stream) as (_nursery, got):
        offered = [stream.deliver(_body(b"%d" % i)) for i in range(3)]
        assert offered == [True, False, False]  # flush once, at the end of the batch
        assert writer.written == []  # held until then
        stream.flush_direct()
        stream.deliver(_body(b"3"))
        stream.flush_direct()
        assert writer.written == [[b"0", b"1", b"2"], [b"3"]]
        assert stream.buffered() == 0 and got == []  # the consumer never woke
        assert posted == [Credit(stream_id=1, frames=2), Credit(stream_id=1, frames=2)]
        stream.deliver(ProviderTunnelFrame(stream_id=1, kind="usage"))
        stream.deliver(_body(b"4"))  # the consumer is woken, not parked: buffered
        stream.deliver(ProviderTunnelFrame(stream_id=1, kind="end"))
        stream.flush_direct()
    assert [m.kind for m in got] == ["usage", "body", "end"]
    assert got[1].data == b"4" and writer.written == [[b"0", b"1", b"2"], [b"3"]]


async def test_a_part_left_unwritten_is_settled_before_the_next_reply() -> None:
    writer = _Writer(partial=True)
    stream = _stream(writer)
    async with _parked_consumer(stream) as (_nursery, got):
        stream.deliver(_body(b"a"))
        stream.flush_direct()  # written in part: the consumer is woken to settle
        stream.deliver(_body(b"b"))  # not offered while a part is pending
        assert writer.written == [[b"a"]] and stream.buffered() == 1
        await trio.testing.wait_all_tasks_blocked()
        assert writer.settled == 1 and [m.data for m in got] == [b"b"]
        stream.deliver(ProviderTunnelFrame(stream_id=1, kind="end"))
    assert [m.kind for m in got] == ["body", "end"]


async def test_a_cancelled_consumer_is_offered_nothing() -> None:
    """A request past its deadline (its scope cancelled while it waits) gets
    no write from the reader, even before its task runs again."""
    writer = _Writer()
    stream = _stream(writer)
    async with _parked_consumer(stream) as (nursery, _got):
        nursery.cancel_scope.cancel()
        assert stream.deliver(_body(b"late")) is False
        stream.flush_direct()
    assert writer.held == [] and writer.written == [] and stream.buffered() == 1


async def test_an_abandoned_stream_drops_its_writer() -> None:
    stream = _stream(_Writer())
    stream.abandon()
    assert stream.direct is None
