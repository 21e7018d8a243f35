"""Frames and response pieces that follow each other at once leave in one write.

The hot path of a non-streamed passthrough reply is head, body, usage, end:
the node holds the first frames back (``WireChannel.queue`` via the link's
``send_held``) so they leave with the terminal in one write, and the edge's
relay holds the HTTP head and body (``Responder`` ``hold=True``) while the
next frame is already buffered.  These tests pin the write counts and,
above all, that nothing held is ever lost or stuck.
"""

from __future__ import annotations

from typing import Any

import h11
import trio
import trio.testing

from iopd.http.server import Request, Responder
from iopd.node.executor import NodeExecutor
from iopd.node.registry import AdapterRegistry
from iopd.node.stream_out import MAX_HELD_BODY_BYTES, LinkSender
from iopd.transport.channel import WireChannel
from tests.support.http_server import connect, get, running
from tests.support.node_parts import _ReplyAdapter
from tests.support.streams import CountingStream, read_head
from tests.support.wire_peers import handshaken_channels
from wire.messages import (
    ProviderSpec,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)

# ------------------------------------------------------------------ channel


async def _pair(window: int = 100) -> tuple[WireChannel, WireChannel, CountingStream]:
    """(edge, node, node's counting stream); stream 1 open with ``window``."""
    a, b = trio.testing.memory_stream_pair()
    counting = CountingStream(b)
    edge, node = await handshaken_channels(a, counting)
    await edge.send(
        RunRequest(stream_id=1, provider_id="p", adapter="echo", target="m", window=window)
    )
    assert isinstance(await node.receive_message(), RunRequest)
    return edge, node, counting


def _text(t: str) -> RunEvent:
    return RunEvent(stream_id=1, kind="text", text=t)


async def test_queued_frames_leave_with_the_next_send_in_one_write() -> None:
    with trio.fail_after(5):
        edge, node, counting = await _pair()
        before = counting.writes
        node.queue(_text("a"))
        node.queue(_text("b"))
        assert counting.writes == before  # nothing written yet
        await node.send(RunEvent(stream_id=1, kind="complete", finish_reason="stop"))
        assert counting.writes == before + 1
        got = [await edge.receive_message() for _ in range(3)]
        assert [m.kind for m in got] == ["text", "text", "complete"]  # type: ignore[union-attr]
        assert [getattr(m, "text", None) for m in got[:2]] == ["a", "b"]


async def test_flush_writes_queued_frames_and_is_a_no_op_when_empty() -> None:
    with trio.fail_after(5):
        edge, node, counting = await _pair()
        before = counting.writes
        await node.flush()
        assert counting.writes == before
        node.queue(_text("x"))
        await node.flush()
        assert counting.writes == before + 1
        msg = await edge.receive_message()
        assert isinstance(msg, RunEvent) and msg.text == "x"


async def test_held_frames_are_flushed_before_waiting_for_credit() -> None:
    # Window 2: both held frames use the credit up; the next send must push
    # them out before it waits, or the edge could never return the credit.
    with trio.fail_after(5):
        edge, node, _ = await _pair(window=2)
        sender = LinkSender(node, 1)
        await sender.send_held(_text("1"))
        await sender.send_held(_text("2"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.send, _text("3"))
            first = await edge.receive_message()
            second = await edge.receive_message()
            assert [getattr(first, "text", None), getattr(second, "text", None)] == ["1", "2"]
            nursery.cancel_scope.cancel()  # "3" waits for credit: that is right


# ------------------------------------------------------------------ executor


class _RecordingSender:
    """A StreamSender with ``send_held``; records (kind, held) per message."""

    def __init__(self, max_frame_bytes: int = 0) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.msgs: list[RunEvent | ProviderTunnelFrame] = []
        if max_frame_bytes:
            self.max_frame_bytes = max_frame_bytes

    async def send(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append((msg.kind, False))
        self.msgs.append(msg)

    async def send_held(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append((msg.kind, True))
        self.msgs.append(msg)


async def _tunnel_sender(
    content_type: str, pieces: list[bytes], *, fail: bool = False, max_frame_bytes: int = 0
) -> _RecordingSender:
    executor = NodeExecutor()
    spec = ProviderSpec(id="p", type="openai", base_url="http://127.0.0.1:1")
    adapter = _ReplyAdapter(spec, content_type, pieces, fail)
    executor.registry = AdapterRegistry({"p": adapter})
    sender = _RecordingSender(max_frame_bytes)
    req = ProviderTunnelRequest(stream_id=3, provider_id="p", method="POST", path="/v1/x")
    with trio.fail_after(5):
        await executor.serve_stream(req, sender)
    return sender


async def _tunnel_calls(content_type: str, pieces: list[bytes]) -> list[tuple[str, bool]]:
    return (await _tunnel_sender(content_type, pieces)).calls


async def test_whole_json_reply_leaves_as_one_whole_frame() -> None:
    sender = await _tunnel_sender("application/json", [b'{"a":', b"1}"])
    assert sender.calls == [("whole", False)]
    (whole,) = sender.msgs
    assert isinstance(whole, ProviderTunnelFrame)
    assert (whole.status, whole.headers, whole.data) == (
        200,
        [("content-type", "application/json")],
        b'{"a":1}',
    )
    assert whole.body_usage == Usage(input_tokens=3, output_tokens=2)
    assert whole.reasoning_chars == 4


async def test_a_failure_after_a_kept_head_sends_the_head_and_body_first() -> None:
    sender = await _tunnel_sender("application/json", [b'{"a":', b"1}"], fail=True)
    assert [kind for kind, _ in sender.calls] == ["head", "body", "usage", "error"]
    assert [m.data for m in sender.msgs if m.kind == "body"] == [b'{"a":1}']


async def test_a_body_in_many_pieces_is_kept_in_one_buffer() -> None:
    sender = await _tunnel_sender("application/json", [b"x"] * 5000)
    assert sender.calls == [("whole", False)]
    assert sender.msgs[0].data == b"x" * 5000 and isinstance(sender.msgs[0].data, bytes)


async def test_a_whole_reply_is_kept_within_a_quarter_of_the_frame_cap() -> None:
    fits = await _tunnel_sender("application/json", [b"x" * 1000], max_frame_bytes=4096)
    assert fits.calls == [("whole", False)]
    big = await _tunnel_sender("application/json", [b"x" * 1000, b"y" * 100], max_frame_bytes=4096)
    assert [kind for kind, _ in big.calls] == ["head", "body", "body", "usage", "end"]
    assert [m.data for m in big.msgs if m.kind == "body"] == [b"x" * 1000, b"y" * 100]


async def test_sse_reply_is_written_piece_by_piece() -> None:
    calls = await _tunnel_calls("text/event-stream", [b"data: 1\n\n", b"data: 2\n\n"])
    assert calls == [
        ("head", False),
        ("body", False),
        ("body", False),
        ("usage", True),
        ("end", False),
    ]


async def test_a_large_whole_body_is_not_held_past_the_cap() -> None:
    piece = b"x" * (MAX_HELD_BODY_BYTES // 2 + 1)
    calls = await _tunnel_calls("application/json", [piece, piece, piece])
    assert calls[:4] == [("head", True), ("body", True), ("body", False), ("body", True)]


# ------------------------------------------------------------------ HTTP responder


class _FakeServer:
    server_header = "iopd"
    closing = False


class _FakeConnection:
    """What ``Responder`` uses of a server connection; records each send."""

    def __init__(self) -> None:
        self.server = _FakeServer()
        self.h11 = h11.Connection(h11.SERVER)
        self.h11.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert isinstance(self.h11.next_event(), h11.Request)
        self.sends: list[bytes] = []

    async def send_bytes(self, data: bytes, scope: trio.CancelScope | None) -> None:
        await trio.lowlevel.checkpoint()
        self.sends.append(data)

    unsent = False

    def send_now(self, data: bytes) -> bool:
        self.sends.append(data)
        return True


async def test_held_head_and_body_leave_with_the_end_in_one_send() -> None:
    conn = _FakeConnection()
    responder = Responder(conn, False, trio.CancelScope())  # type: ignore[arg-type]
    await responder.start(200, [("content-type", "application/json")], hold=True)
    await responder.write(b'{"ok":true}', hold=True)
    assert conn.sends == []
    await responder.end()
    assert len(conn.sends) == 1
    wire = conn.sends[0]
    assert wire.startswith(b"HTTP/1.1 200 ") and wire.endswith(b"0\r\n\r\n")
    assert b'{"ok":true}' in wire


async def test_unheld_write_flushes_what_was_held_first() -> None:
    conn = _FakeConnection()
    responder = Responder(conn, False, trio.CancelScope())  # type: ignore[arg-type]
    await responder.start(200, [], hold=True)
    await responder.write(b"one")
    assert len(conn.sends) == 1 and conn.sends[0].startswith(b"HTTP/1.1 200 ")
    await responder.write(b"two")
    assert len(conn.sends) == 2 and b"two" in conn.sends[1]


async def test_handler_failing_after_a_held_write_still_sends_it_then_cuts() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [], hold=True)
        await responder.write(b"partial", hold=True)
        raise RuntimeError("boom")

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            data = await client.read_to_eof()
            assert data.startswith(b"HTTP/1.1 200 ")
            assert b"partial" in data
            assert not data.endswith(b"0\r\n\r\n")  # cut: no terminating chunk


# ------------------------------------------------------------------ provider client


async def _serve_raw(reply: bytes, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Answer every request on a connection with ``reply``, sent in one write."""

    async def handle(stream: trio.SocketStream) -> None:
        if b"\r\n\r\n" not in await read_head(stream):
            return
        await stream.send_all(reply)
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def test_chunks_that_arrived_together_are_one_piece() -> None:
    from iopd.http.client import ProviderHTTPClient

    events = [b"data: %d\n\n" % i for i in range(5)]
    reply = SSE_HEAD + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_raw, reply)
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            async with client.stream("POST", "/v1/chat/completions", body=b"{}") as resp:
                pieces = [p async for p in resp.aiter_bytes()]
            assert b"".join(pieces) == b"".join(events)
            assert len(pieces) == 1
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_bytes_before_a_broken_chunk_are_yielded_then_the_error() -> None:
    from iopd.http.client import ProviderHTTPClient, ProviderProtocolError

    reply = SSE_HEAD + _chunk(b"data: ok\n\n") + b"zz\r\nnot a chunk\r\n"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_raw, reply)
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            got: list[bytes] = []
            error: Exception | None = None
            async with client.stream("POST", "/v1/chat/completions", body=b"{}") as resp:
                try:
                    async for piece in resp.aiter_bytes():
                        got.append(piece)
                except ProviderProtocolError as exc:
                    error = exc
            assert got == [b"data: ok\n\n"]
            assert error is not None
            await client.aclose()
            nursery.cancel_scope.cancel()
