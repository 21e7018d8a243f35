"""Small trio stream helpers for tests that watch or feed raw bytes, and a provider stream
without usage."""

from __future__ import annotations

import json

import trio

from tests.support.mock_providers import MockReply


class CountingStream(trio.abc.Stream):
    """Wraps a stream, counting ``send_all`` calls (one per write the caller made)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def read_head(stream: trio.abc.ReceiveStream) -> bytes:
    """Read until the end of an HTTP head or EOF; all that was read (a raw provider's request)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return data


#: A passthrough stream of ~3,000 tokens' worth of text (by the one estimate), no usage.
NO_USAGE_PIECE = "abcd" * 10  # 10 tokens
NO_USAGE_PIECES = 300


def no_usage_stream(delay: float = 0.0) -> MockReply:
    """An OpenAI-compatible SSE reply of ``NO_USAGE_PIECES`` chunks and no usage."""
    chunks = [
        b"data: "
        + json.dumps(
            {
                "id": "chatcmpl-mock",
                "object": "chat.completion.chunk",
                "model": "mock-model",
                "choices": [{"index": 0, "delta": {"content": NO_USAGE_PIECE}, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
        for _ in range(NO_USAGE_PIECES)
    ]
    chunks.append(b"data: [DONE]\n\n")
    return MockReply(
        headers=[("content-type", "text/event-stream")], chunks=chunks, chunk_delay=delay
    )
