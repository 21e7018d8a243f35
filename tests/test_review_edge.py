"""Edge review: defects found by reading the edge against SPEC, each pinned by a test."""

from __future__ import annotations

import json
import socket

import trio

from tests.gateway import running_gateway, wait_until
from tests.test_e2e_openai import echo_yaml


async def _stalled_stream_client(host_port: tuple[str, int], body: bytes) -> trio.SocketStream:
    """Send a streaming request on a socket with a tiny receive window and never read."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(host_port)
    stream = trio.SocketStream(sock)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + body)
    return stream


async def test_request_timeout_bounds_a_stream_whose_client_stopped_reading() -> None:
    """request_timeout is the whole request: a caller that stops reading an SSE
    stream (but keeps the connection open) must not pin the request forever.

    The timeout used to cancel the blocked write and then try to write the
    error event *outside* any deadline, which blocked again, for good.
    """
    with trio.fail_after(30):
        yaml = echo_yaml(openai_extra="  request_timeout: 1\n  long_context_threshold_tokens: 10000000")
        async with running_gateway(yaml) as gw:
            # ~6 MB of output: more than the edge's socket buffers can absorb.
            words = " ".join("a" * 60_000 for _ in range(100))
            body = json.dumps(
                {"model": "echo", "stream": True, "messages": [{"role": "user", "content": words}]}
            ).encode()
            server = gw.handle.openai_server
            assert server is not None
            stream = await _stalled_stream_client(gw.host_port, body)
            try:
                await wait_until(lambda: server.in_flight == 1)
                # The request ends (within its 1 s limit plus a short grace) although
                # the caller never reads: the connection is given up on.
                with trio.fail_after(10):
                    await wait_until(lambda: server.in_flight == 0)
                pool = gw.runtime.pool
                assert pool.provider_loads()["echo-1"].in_flight == 0
            finally:
                await stream.aclose()
