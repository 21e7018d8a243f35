"""Bodies before authentication and stalled readers, replayed on a real edge + node.

Bodies: whole bodies were read before authentication; 401 and 404 were
decided after up to ``max_body_bytes`` had arrived, and ``Expect:
100-continue`` got ``100 Continue`` without a token.  Now route, method and
caller are decided from the head (no body byte waited for), ``100 Continue``
only follows an admitted head, and ``openai.max_inflight_body_bytes`` bounds
what all connections may be sending at once (503 ``overloaded``).

Stalled readers: callers that never read pinned provider slots until
``request_timeout``.  Now a write that makes no progress for
``openai.send_timeout`` cuts the connection: the node gets ``Cancel`` and the
pool slot is freed.
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import pytest
import trio

from tests.support.configs import echo_provider, edge_yaml, node, principal_token
from tests.support.gateway import (
    Gateway,
    http_request,
    running_gateway,
    wait_until,
)

TOKEN = "iop_hostile_caller_token_0001"
MAX_BODY = 8 * 1024 * 1024


def hostile_yaml(*, capacity: int = 4, **openai: Any) -> str:
    return edge_yaml(
        edge_id="edge-hostile",
        openai={"principal_tokens": [principal_token(TOKEN)], **openai},
        nodes=[node(providers=[echo_provider(capacity=capacity)])],
    )


def head(method: str, path: str, length: int, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_reply(stream: trio.SocketStream) -> bytes:
    """Everything until the edge closes the connection."""
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass
    return data


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def overloaded_count(metrics: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("iop_openai_requests_total{") and 'status="overloaded"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize(
    ("request_head", "status", "code"),
    [
        (head("POST", "/v1/chat/completions", MAX_BODY - 1), 401, "invalid_api_key"),
        (
            head("POST", "/v1/chat/completions", MAX_BODY - 1, "Authorization: Bearer wrong"),
            401,
            "invalid_api_key",
        ),
        (
            head("POST", "/v1/nope", MAX_BODY - 1, f"Authorization: Bearer {TOKEN}"),
            404,
            "not_found",
        ),
        (
            head("PUT", "/v1/chat/completions", MAX_BODY - 1, f"Authorization: Bearer {TOKEN}"),
            405,
            "method_not_allowed",
        ),
    ],
)
async def test_a_refused_head_is_answered_without_its_body(
    request_head: bytes, status: int, code: str
) -> None:
    """The head announces 8 MiB - 1 and no body byte ever comes: the answer
    arrives anyway (it used to wait for the body, up to ``body_timeout``)."""
    with trio.fail_after(20):
        async with running_gateway(hostile_yaml()) as gw:
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                await stream.send_all(request_head)
                reply = await read_reply(stream)
            assert status_of(reply) == status
            headers, _, body = reply.partition(b"\r\n\r\n")
            assert b"connection: close" in headers.lower()
            assert b"x-request-id: req-" in headers.lower()
            assert json.loads(body)["error"]["code"] == code
            server = gw.handle.openai_server
            assert server is not None and server.inflight_body_bytes == 0


async def test_100_continue_only_when_authenticated() -> None:
    body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}).encode()
    expect = "Expect: 100-continue"
    with trio.fail_after(20):
        async with running_gateway(hostile_yaml()) as gw:
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                await stream.send_all(head("POST", "/v1/chat/completions", len(body), expect))
                reply = await read_reply(stream)
            assert reply.startswith(b"HTTP/1.1 401 ")
            assert b"100 Continue" not in reply

            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                auth = f"Authorization: Bearer {TOKEN}"
                await stream.send_all(
                    head(
                        "POST", "/v1/chat/completions", len(body), auth, expect, "Connection: close"
                    )
                )
                interim = await stream.receive_some(65536)
                assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
                await stream.send_all(body)
                reply = interim + await read_reply(stream)
            final = reply.split(b"\r\n\r\n", 1)[1]
            assert final.startswith(b"HTTP/1.1 200 ")
            assert b'"content":"hi"' in reply


async def test_bodies_past_max_inflight_body_bytes_get_503_overloaded() -> None:
    """One caller holds the whole budget with a body still arriving: the next
    body is refused from its head, with ``Retry-After``, and counted with its
    endpoint as ``overloaded``; the budget is back to 0 once the first is in."""
    budget = 1024 * 1024
    body = json.dumps(
        {"model": "echo", "messages": [{"role": "user", "content": "x" * (budget - 200)}]}
    ).encode()
    auth = f"Authorization: Bearer {TOKEN}"
    with trio.fail_after(30):
        async with running_gateway(hostile_yaml(max_body_bytes=budget, max_inflight_body_bytes=budget)) as gw:
            server = gw.handle.openai_server
            assert server is not None
            before = overloaded_count(
                (await http_request(gw.handle.admin, "GET", "/metrics")).body.decode()
            )
            first = await trio.open_tcp_stream(*gw.host_port)
            async with first:
                await first.send_all(
                    head("POST", "/v1/chat/completions", len(body), auth, "Connection: close")
                    + body[:1000]
                )
                await wait_until(lambda: server.inflight_body_bytes == len(body))
                second = await trio.open_tcp_stream(*gw.host_port)
                async with second:
                    await second.send_all(head("POST", "/v1/chat/completions", len(body), auth))
                    reply = await read_reply(second)
                assert status_of(reply) == 503
                headers, _, error = reply.partition(b"\r\n\r\n")
                assert b"retry-after: 1" in headers.lower()
                envelope = json.loads(error)["error"]
                assert (envelope["code"], envelope["type"]) == ("overloaded", "server_error")
                # A request without a body is not affected.
                models = await http_request(
                    gw.host_port,
                    "GET",
                    "/v1/models",
                    headers=[("authorization", f"Bearer {TOKEN}")],
                )
                assert models.status == 200
                await first.send_all(body[1000:])
                assert status_of(await read_reply(first)) == 200
            assert server.inflight_body_bytes == 0
            after = overloaded_count(
                (await http_request(gw.handle.admin, "GET", "/metrics")).body.decode()
            )
            assert after - before == 1


async def _stalled_caller(gw: Gateway, body: bytes) -> trio.SocketStream:
    """A streaming request on a socket with a tiny receive window that never reads."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(gw.host_port)
    stream = trio.SocketStream(sock)
    await stream.send_all(
        head("POST", "/v1/chat/completions", len(body), f"Authorization: Bearer {TOKEN}") + body
    )
    return stream


async def test_a_caller_that_never_reads_frees_its_provider_slot() -> None:
    """All the provider's slots held by callers that stopped reading: each is cut
    after ``send_timeout`` (not ``request_timeout``, 600 s), the node's streams
    end (Cancel), and the next caller is served while they stay connected."""
    capacity = 4  # as in the finding: 4 callers held all 4 slots
    # 2 s, not less: all four must be holding their slots at once before the
    # first is cut, and sending four 6 MB requests takes a while on a busy machine.
    yaml = hostile_yaml(capacity=capacity, send_timeout=2)
    # ~6 MB of output per request: more than the socket buffers absorb.
    words = " ".join("a" * 60_000 for _ in range(100))
    body = json.dumps(
        {"model": "echo", "stream": True, "messages": [{"role": "user", "content": words}]}
    ).encode()
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            pool = gw.runtime.pool
            executor = gw.node_handles["node-a"].executor
            stalled = [await _stalled_caller(gw, body) for _ in range(capacity)]
            try:
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == capacity)
                held = trio.current_time()
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 0)
                freed = trio.current_time() - held
                await wait_until(lambda: executor.active_streams == 0)
                print(f"MEASURED stalled readers: {capacity} slots freed {freed:.2f} s after all were held")
                reply = await http_request(
                    gw.host_port,
                    "POST",
                    "/v1/chat/completions",
                    body={"model": "echo", "messages": [{"role": "user", "content": "next"}]},
                    headers=[("authorization", f"Bearer {TOKEN}")],
                )
                assert (
                    reply.status == 200
                    and reply.json()["choices"][0]["message"]["content"] == "next"
                )
            finally:
                for stream in stalled:
                    await stream.aclose()


async def test_models_keep_answering_while_unauthenticated_heads_announce_big_bodies() -> None:
    """Many connections announcing 8 MiB - 1 without a token cost the edge no
    buffered body: each is refused from its head, and ``/v1/models`` answers."""
    with trio.fail_after(30):
        async with running_gateway(hostile_yaml()) as gw:
            streams = []
            for _ in range(50):
                stream = await trio.open_tcp_stream(*gw.host_port)
                await stream.send_all(head("POST", "/v1/chat/completions", MAX_BODY - 1))
                streams.append(stream)
            try:
                for stream in streams:
                    assert status_of(await read_reply(stream)) == 401
                reply = await http_request(
                    gw.host_port,
                    "GET",
                    "/v1/models",
                    headers=[("authorization", f"Bearer {TOKEN}")],
                )
                assert reply.status == 200
                assert re.search(rb'"id":\s*"echo"', reply.body)
                server = gw.handle.openai_server
                assert server is not None and server.inflight_body_bytes == 0
            finally:
                for stream in streams:
                    await stream.aclose()
