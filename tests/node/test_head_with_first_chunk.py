"""A provider head that arrives with the first body bytes leaves the node with them.

``ProviderResponse.body_ready()`` looks only at what h11 already buffered; the
relay then passes ``body_follows=True`` so the executor holds the head frame
and the first body frame flushes both in one write (SSE included).  Nothing
ever waits for bytes that are not here yet.
"""

from __future__ import annotations

from typing import Any

import trio

from iopd.http.client import EarlyStart, ProviderHTTPClient, ProviderProtocolError
from iopd.node.adapters.base import Adapter, TunnelOutput
from iopd.node.adapters.openai import OpenAIAdapter
from iopd.node.executor import NodeExecutor
from iopd.node.registry import AdapterRegistry
from tests.support.streams import read_head
from wire.messages import ProviderSpec, ProviderTunnelFrame, ProviderTunnelRequest, RunEvent

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve_two_writes(
    first: bytes, rest: bytes, release: trio.Event, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer each request with ``first`` at once and ``rest`` once ``release`` is set."""

    async def handle(stream: trio.SocketStream) -> None:
        if b"\r\n\r\n" not in await read_head(stream):
            return
        await stream.send_all(first)
        await release.wait()
        await stream.send_all(rest)
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_body_ready_when_the_first_chunk_came_with_the_head() -> None:
    release = trio.Event()
    first = SSE_HEAD + _chunk(b"data: 1\n\n")
    rest = _chunk(b"data: 2\n\n") + b"0\r\n\r\n"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_two_writes, first, rest, release)
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            async with client.stream("POST", "/v1/chat/completions", body=b"{}") as resp:
                assert resp.body_ready()
                assert resp.body_ready()  # asking twice changes nothing
                pieces = resp.aiter_bytes()
                # The first piece is there although the rest is not sent yet.
                assert await pieces.__anext__() == b"data: 1\n\n"
                release.set()
                assert [p async for p in pieces] == [b"data: 2\n\n"]
            assert client.idle_connections == 1  # read to the end: pooled
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_body_not_ready_when_the_head_came_alone() -> None:
    release = trio.Event()
    rest = _chunk(b"data: 1\n\n") + b"0\r\n\r\n"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_two_writes, SSE_HEAD, rest, release)
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            async with client.stream("POST", "/v1/chat/completions", body=b"{}") as resp:
                assert not resp.body_ready()
                release.set()
                assert [p async for p in resp.aiter_bytes()] == [b"data: 1\n\n"]
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_body_ready_on_a_broken_first_chunk_leaves_the_error_to_the_reader() -> None:
    release = trio.Event()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                _serve_two_writes, SSE_HEAD + b"zz\r\nnot a chunk\r\n", b"", release
            )
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            error: Exception | None = None
            got: list[bytes] = []
            async with client.stream("POST", "/v1/chat/completions", body=b"{}") as resp:
                assert not resp.body_ready()
                try:
                    async for piece in resp.aiter_bytes():
                        got.append(piece)
                except ProviderProtocolError as exc:
                    error = exc
            assert got == []
            assert error is not None and "invalid HTTP" in str(error)
            assert client.idle_connections == 0  # not pooled
            await client.aclose()
            nursery.cancel_scope.cancel()


class _RecordingOutput(TunnelOutput):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    async def head(
        self, status: int, headers: list[tuple[str, str]], *, body_follows: bool = False
    ) -> None:
        self.calls.append(("head", body_follows))

    async def body(self, data: bytes) -> None:
        self.calls.append(("body", data))


async def test_relay_tells_the_output_when_the_body_follows_the_head() -> None:
    release = trio.Event()
    first = SSE_HEAD + _chunk(b"data: 1\n\n")
    rest = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_serve_two_writes, first, rest, release)
            release.set()
            spec = ProviderSpec(id="p", type="openai", base_url=f"http://127.0.0.1:{port}")
            adapter = OpenAIAdapter(spec)
            out = _RecordingOutput()
            req = ProviderTunnelRequest(
                stream_id=1, provider_id="p", method="POST", path="/v1/chat/completions"
            )
            await adapter.tunnel(req, out)
            assert out.calls[0] == ("head", True)
            assert b"".join(d for kind, d in out.calls[1:] if kind == "body") == (
                b"data: 1\n\ndata: [DONE]\n\n"
            )
            await adapter.aclose()
            nursery.cancel_scope.cancel()


class _RecordingSender:
    """A StreamSender with ``send_held``; records (kind, held) per message."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    async def send(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append((msg.kind, False))

    async def send_held(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        await trio.lowlevel.checkpoint()
        self.calls.append((msg.kind, True))


class _SSEAdapter(Adapter):
    def __init__(self, spec: ProviderSpec, body_follows: bool) -> None:
        super().__init__(spec)
        self.body_follows = body_follows

    async def run(self, req: Any, out: Any) -> None:  # pragma: no cover - unused
        raise NotImplementedError

    async def tunnel(
        self, req: ProviderTunnelRequest, out: TunnelOutput, early: EarlyStart | None = None
    ) -> None:
        await out.head(200, [("content-type", "text/event-stream")], body_follows=self.body_follows)
        await out.body(b"data: 1\n\n")
        await out.body(b"data: 2\n\n")


async def _sse_calls(body_follows: bool) -> list[tuple[str, bool]]:
    executor = NodeExecutor()
    spec = ProviderSpec(id="p", type="openai", base_url="http://127.0.0.1:1")
    executor.registry = AdapterRegistry({"p": _SSEAdapter(spec, body_follows)})
    sender = _RecordingSender()
    req = ProviderTunnelRequest(stream_id=3, provider_id="p", method="POST", path="/v1/x")
    with trio.fail_after(5):
        await executor.serve_stream(req, sender)
    return sender.calls


async def test_sse_head_is_held_for_a_first_chunk_already_in_hand() -> None:
    assert await _sse_calls(True) == [
        ("head", True),
        ("body", False),  # flushes the head with it; later chunks are not held
        ("body", False),
        ("end", False),
    ]


async def test_sse_head_alone_is_sent_at_once() -> None:
    assert await _sse_calls(False) == [
        ("head", False),
        ("body", False),
        ("body", False),
        ("end", False),
    ]
