"""``openai.request_timeout`` is the whole request, wherever the request is when its time is
up: a stream whose caller stopped reading, a raw relay whose provider hangs after its head and a
whole answer still being written are cut (quietly: a request line, no ERROR traceback); a
request still queued gets the queue's 503 ``queue_timeout``, one still running the provider's
504 ``provider_timeout``."""

from __future__ import annotations

import json
import logging
import socket

import h11
import pytest
import trio
import trio.testing

from tests.support.configs import echo_yaml, one_slot_yaml, passthrough_yaml
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    metric,
    running_gateway,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer

REQUEST_TIMEOUT = 5


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


async def test_a_cut_relay_is_logged_as_a_request_not_as_a_handler_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A raw relay that has to be cut mid-body (here: request_timeout while the
    provider hangs after its head) is an expected outcome: the connection is cut
    and the request line says why.  It used to be raised through the HTTP server
    as an unknown exception, logged at ERROR with a traceback (event=handler_failed)."""
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            mock.mode = "hang_after_head"
            await n.start(mock.serve)
            yaml = passthrough_yaml(mock.base_url, openai_extra="  request_timeout: 1")
            async with running_gateway(yaml) as gw:
                body = {"model": "direct", "stream": True,
                        "messages": [{"role": "user", "content": "hi"}]}
                with pytest.raises(h11.RemoteProtocolError):  # cut: the body never completes
                    await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
                await wait_until(lambda: gw.runtime.pool.provider_loads()["vllm-a"].in_flight == 0)
            n.cancel_scope.cancel()
    errors_logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors_logged == [], [r.getMessage() for r in errors_logged]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=request ")]
    assert len(lines) == 1 and "status=provider_error" in lines[0], lines


async def test_request_timeout_during_a_whole_response_write_cuts_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A non-streamed answer whose write outlives request_timeout (the caller
    stopped reading) is cut; it used to try to append an SSE error event to the
    finished response, which raised RuntimeError -> an ERROR traceback."""
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        yaml = echo_yaml(openai_extra="  request_timeout: 1\n  long_context_threshold_tokens: 10000000")
        async with running_gateway(yaml) as gw:
            words = " ".join("a" * 60_000 for _ in range(100))
            body = json.dumps(
                {"model": "echo", "messages": [{"role": "user", "content": words}]}
            ).encode()
            server = gw.handle.openai_server
            assert server is not None
            stream = await _stalled_stream_client(gw.host_port, body)
            try:
                await wait_until(lambda: server.in_flight == 1)
                with trio.fail_after(10):
                    await wait_until(lambda: server.in_flight == 0)
            finally:
                await stream.aclose()
    errors_logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors_logged == []


async def chat(gw: Gateway, content: str) -> RawResponse:
    body = {"model": "echo", "messages": [{"role": "user", "content": content}]}
    return await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)


async def test_request_timeout_while_queued_is_a_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with running_gateway(one_slot_yaml(REQUEST_TIMEOUT)) as gw:
            # The test holds the only slot, so the request can only wait.
            async with gw.runtime.pool.lease("echo"):
                queued = await chat(gw, "hello")
            assert queued.status == 503, queued.body
            err = queued.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "queue_timeout")
            # It waited its whole request_timeout (< queue_timeout): that is the hint.
            assert queued.header("retry-after") == str(REQUEST_TIMEOUT)
            assert metric(gw, "iop_openai_requests_total", status="queue_timeout") == 1
            assert metric(gw, "iop_openai_requests_total", status="provider_error") == 0
            assert metric(gw, "iop_dispatch_wait_seconds_count", outcome="queue_timeout") == 1
            assert metric(gw, "iop_queue_waiters_timed_out_total") == 1
            assert gw.runtime.pool.queue_depth == 0

            # With a lease, running out of time is still the provider's 504:
            # 20 chunks at 1 s each cannot finish within 5 s.
            running = await chat(gw, "w " * 20)
            assert running.status == 504, running.body
            assert running.json()["error"]["code"] == "provider_timeout"
            assert metric(gw, "iop_openai_requests_total", status="provider_error") == 1
            assert metric(gw, "iop_openai_requests_total", status="queue_timeout") == 1
            await wait_until(lambda: gw.runtime.pool.provider_loads()["echo-1"].in_flight == 0)
