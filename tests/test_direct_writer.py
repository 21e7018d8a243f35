"""``NodeStream.direct``: replies the hub's reader writes out for a parked consumer.

The passthrough relay hands its stream a ``DirectWriter`` so a streamed
body frame is written to the caller from the edge's wire reader instead of
waking the handler.  These tests drive a ``NodeStream`` by hand (no sockets):
what the writer takes is consumed (credit returned), what it declines reaches
the consumer in order, a part left unwritten is settled before the consumer
sees anything else, and nothing is offered while the consumer is busy.
"""

from __future__ import annotations

import trio
import trio.testing

from iopd.edge.node_session import NodeStream
from wire.messages import Credit, Message, ProviderTunnelFrame


class _Writer:
    """Takes body frames (all of them, or leaves part pending when ``partial``)."""

    def __init__(self, *, partial: bool = False) -> None:
        self.written: list[bytes] = []
        self.partial = partial
        self.pending = False
        self.settled = 0

    def write_now(self, msg: ProviderTunnelFrame) -> bool:
        if msg.kind != "body":
            return False
        self.written.append(msg.data)
        self.pending = self.partial
        return True

    async def settle(self) -> None:
        await trio.lowlevel.checkpoint()
        self.pending = False
        self.settled += 1


def _body(data: bytes) -> ProviderTunnelFrame:
    return ProviderTunnelFrame(stream_id=1, kind="body", data=data)


async def _consume(stream: NodeStream[ProviderTunnelFrame], got: list[ProviderTunnelFrame]) -> None:
    async for msg in stream:
        got.append(msg)


async def test_body_frames_for_a_parked_consumer_are_written_by_the_reader() -> None:
    posted: list[Message] = []
    stream: NodeStream[ProviderTunnelFrame] = NodeStream("n", 1, 8, posted.append)
    writer = _Writer()
    stream.direct = writer
    got: list[ProviderTunnelFrame] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_consume, stream, got)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(4):
                stream.deliver(_body(b"%d" % i))
            assert writer.written == [b"0", b"1", b"2", b"3"]
            assert stream.buffered() == 0 and got == []  # the consumer never woke
            assert posted == [Credit(stream_id=1, frames=2), Credit(stream_id=1, frames=2)]
            stream.deliver(ProviderTunnelFrame(stream_id=1, kind="usage"))
            stream.deliver(_body(b"4"))  # the consumer is woken, not parked: buffered
            stream.deliver(ProviderTunnelFrame(stream_id=1, kind="end"))
    assert [m.kind for m in got] == ["usage", "body", "end"]
    assert got[1].data == b"4" and writer.written == [b"0", b"1", b"2", b"3"]


async def test_a_part_left_unwritten_is_settled_before_the_next_reply() -> None:
    stream: NodeStream[ProviderTunnelFrame] = NodeStream("n", 1, 8, lambda _m: None)
    writer = _Writer(partial=True)
    stream.direct = writer
    got: list[ProviderTunnelFrame] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_consume, stream, got)
            await trio.testing.wait_all_tasks_blocked()
            stream.deliver(_body(b"a"))  # written in part: the consumer is woken to settle
            stream.deliver(_body(b"b"))  # not offered while a part is pending
            assert writer.written == [b"a"] and stream.buffered() == 1
            await trio.testing.wait_all_tasks_blocked()
            assert writer.settled == 1 and [m.data for m in got] == [b"b"]
            stream.deliver(ProviderTunnelFrame(stream_id=1, kind="end"))
    assert [m.kind for m in got] == ["body", "end"]


async def test_an_abandoned_stream_drops_its_writer() -> None:
    stream: NodeStream[ProviderTunnelFrame] = NodeStream("n", 1, 8, lambda _m: None)
    stream.direct = _Writer()
    stream.abandon()
    assert stream.direct is None
