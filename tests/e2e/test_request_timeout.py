"""Edge review: defects found by reading the edge against its documented contract,
each pinned by a test."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
from pathlib import Path

import h11
import pytest
import trio

from iopd.config.load import load_edge_config
from iopd.edge.daemon import EdgeHandle, run_edge
from iopd.edge.openai.app import OpenAIApp
from tests.support.configs import echo_provider, echo_yaml, edge_yaml, node
from tests.support.gateway import http_request, node_token, running_gateway, token_hash, wait_until
from tests.support.mock_providers import MockOpenAIServer
from tests.support.wire_peers import FakeNode
from wire.messages import NodeConfig


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


def _signal_edge_yaml(capacity: int) -> str:
    return edge_yaml(edge_id="edge-sig", nodes=[node(providers=[echo_provider(capacity=capacity)])])


async def test_sigterm_during_a_sighup_refresh_drains_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM starts the drain at once, even while a SIGHUP refresh is still
    waiting for a silent node's config ack (up to NODE_PUSH_TIMEOUT).

    The signal loop used to await the refresh inline, so every later signal
    (the drain, and the "second signal exits at once") waited behind it.
    """
    path = tmp_path / "edge.yaml"
    path.write_text(_signal_edge_yaml(2))
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handle: EdgeHandle = await nursery.start(
                functools.partial(run_edge, load_edge_config(path), str(path), handle_signals=True)
            )
            rt = handle.runtime
            server = handle.openai_server
            assert server is not None
            host, port = handle.wire
            async with FakeNode.connect(
                host, port, node_id="node-a", token=node_token("node-a")
            ) as fake:
                await wait_until(lambda: rt.hub.connected_since("node-a") is not None)
                fake._ack_config = False  # from now on, config pushes go unanswered
                path.write_text(_signal_edge_yaml(3))  # a live change for node-a
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_until(
                    lambda: any(
                        isinstance(m, NodeConfig) and m.version == 2 for m in fake.received
                    )
                )
                assert rt._refresh_lock.locked()  # the push waits for an ack
                os.kill(os.getpid(), signal.SIGTERM)
                await wait_until(lambda: server.closing)
        events = [
            r.getMessage().split()[0]
            for r in caplog.records
            if r.getMessage().startswith(("event=drain_started", "event=node_config_push"))
        ]
        # The drain began while the push still waited; the push ended with the node.
        assert events == ["event=drain_started", "event=node_config_push"], events


PASSTHROUGH_ONLY = f"""
edge:
  id: edge-pt
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
provider_pool: {{max_queue: 0}}
models:
  - id: direct
    providers: {{vllm-a: served-a}}
    generation: {{limits: {{max_tokens: 100}}}}
nodes:
  - id: node-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - {{id: vllm-a, type: openai, base_url: "http://127.0.0.1:9", models: [served-a]}}
"""


async def test_passthrough_limit_is_a_400_before_dispatch() -> None:
    """On passthrough a request over a generation limit gets 400.  For a
    group whose providers all relay raw, that answer does not depend on which
    provider is picked, so it must not wait for (or be masked by) dispatch: it
    used to be checked only after a lease, so with the node down (or the queue
    full) the caller got a retryable 502/429/503 for a request that can never
    succeed."""
    with trio.fail_after(30):
        async with running_gateway(PASSTHROUGH_ONLY, nodes=[]) as gw:
            cases = [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1000}, "max_tokens"),
                ("/v1/responses", {"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
            ]
            for path, body, param in cases:
                r = await http_request(gw.host_port, "POST", path, body={"model": "direct", **body})
                assert r.status == 400, (path, r.status, r.body)
                err = r.json()["error"]
                assert err["code"] == "invalid_request_error" and err["param"] == param
            # Within the limit the same request is dispatched (and fails: no node).
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body={"model": "direct", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 10},
            )
            assert r.status == 502 and r.json()["error"]["code"] == "node_dispatch_error"


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
            yaml = PASSTHROUGH_ONLY.replace("http://127.0.0.1:9", mock.base_url).replace(
                "  listen: 127.0.0.1:0\n", "  listen: 127.0.0.1:0\n  request_timeout: 1\n"
            )
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


async def test_a_request_that_starts_after_the_drain_cut_is_cut_too() -> None:
    """After drain_timeout the rest is cancelled with a terminal error.
    A request whose body was still arriving at the cut starts its handler after
    ``cut_all()``; it used to run uncut until the node sessions were closed
    under it (502 node_dispatch_error after the whole grace), not 503."""
    yaml = echo_yaml(delay_ms=200).replace(
        "  heartbeat_timeout: 3\n", "  heartbeat_timeout: 3\n  drain_timeout: 0.2\n"
    )
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            app = gw.handle.openai_server.handler if gw.handle.openai_server else None
            assert isinstance(app, OpenAIApp)
            text = " ".join(f"w{i}" for i in range(100))  # 20 s of echo
            body = json.dumps(
                {"model": "echo", "messages": [{"role": "user", "content": text}]}
            ).encode()
            conn = h11.Connection(h11.CLIENT)
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                head = h11.Request(
                    method="POST",
                    target="/v1/chat/completions",
                    headers=[("host", "x"), ("content-length", str(len(body)))],
                )
                await stream.send_all(conn.send(head) + conn.send(h11.Data(data=body[:10])))
                await wait_until(lambda: gw.handle.openai_server.in_flight == 1)  # type: ignore[union-attr]
                gw.handle.drain()
                await wait_until(lambda: app._cut)
                await stream.send_all(
                    conn.send(h11.Data(data=body[10:])) + conn.send(h11.EndOfMessage())
                )
                status = 0
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                    elif isinstance(ev, h11.Response):
                        status = ev.status_code
                        break
                assert status == 503
