"""Two correctness gaps found in review, each pinned by an end-to-end test.

1. ``openai.request_timeout`` running out while a request is still *queued*
   (no provider lease yet) is a queue timeout — 503 ``queue_timeout`` with
   ``Retry-After``, counted as one — not the provider's 504.  A request that
   holds a lease when its time is up keeps the 504 ``provider_timeout``.
2. Once the edge drains, ``GET /healthz`` answers 503 ``shutting_down`` (and
   the connection closes), so a load balancer takes the instance out.

Everything runs a real edge (``tests/gateway.py``) over loopback.
"""

from __future__ import annotations

import h11
import trio
import trio.testing

from tests.gateway import (
    Gateway,
    RawResponse,
    http_request,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)

REQUEST_TIMEOUT = 5


def edge_yaml() -> str:
    """One echo provider with one slot; a request may wait far longer than it may run."""
    return f"""
edge:
  id: edge-open
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  drain_timeout: 30
openai:
  listen: 127.0.0.1:0
  request_timeout: {REQUEST_TIMEOUT}
provider_pool: {{max_queue: 8, queue_timeout: 60}}
models:
  - id: echo
    providers: {{echo-1: echo}}
nodes:
  - id: node-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - id: echo-1
        type: echo
        category: api
        models: [echo]
        capacity: 1
        delay_ms: 1000
"""


def metric(gw: Gateway, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in gw.runtime.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


async def chat(gw: Gateway, content: str) -> RawResponse:
    body = {"model": "echo", "messages": [{"role": "user", "content": content}]}
    return await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)


# --------------------------------------------- 1. request_timeout while queued


async def test_request_timeout_while_queued_is_a_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with running_gateway(edge_yaml()) as gw:
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


# ------------------------------------------------------ 2. /healthz when draining


async def _read_response(stream: trio.SocketStream, conn: h11.Connection) -> RawResponse:
    """The next whole response on a client connection (body read to its end)."""
    status, headers, body = 0, [], b""
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(ev, h11.Response):
            status = ev.status_code
            headers = [(k.decode(), v.decode()) for k, v in ev.headers]
        elif isinstance(ev, h11.Data):
            body += bytes(ev.data)
        elif isinstance(ev, h11.EndOfMessage):
            return RawResponse(status, headers, body)
        else:
            raise AssertionError(f"unexpected {ev!r}")


async def test_healthz_answers_503_and_closes_once_the_edge_drains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with running_gateway(edge_yaml()) as gw:
            server = gw.handle.openai_server
            assert server is not None
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                probe = h11.Request(method="GET", target="/healthz", headers=[("host", "edge")])
                await stream.send_all(conn.send(probe) + conn.send(h11.EndOfMessage()))
                first = await _read_response(stream, conn)
                assert first.status == 200 and first.header("connection") != "close"

                # A second probe on the same keep-alive connection is under way
                # (its head half sent) when the drain begins.
                conn.start_next_cycle()
                head = conn.send(probe) + conn.send(h11.EndOfMessage())
                await stream.send_all(head[:10])
                await wait_until(lambda: server.in_flight == 1)
                gw.handle.drain()
                await wait_until(lambda: server.closing)
                await stream.send_all(head[10:])

                second = await _read_response(stream, conn)
                assert second.status == 503, second.body
                err = second.json()["error"]
                assert (err["type"], err["code"]) == ("server_error", "shutting_down")
                assert second.header("connection") == "close"
                assert await stream.receive_some(1024) == b""  # and the edge hung up
