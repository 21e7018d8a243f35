"""Queued requests cannot hold unbounded memory: ``provider_pool.max_queued_bytes``.

A real edge and node on loopback, one ``echo`` provider with one slot that the
test holds itself (``pool.lease``), so every HTTP request can only wait.  The
queue bound is small in bytes and roomy in count, so what refuses a request is
the bytes its body would add.  Each test checks that the bytes held by the
queue go back to 0 however the waiters leave: admitted, cancelled by a caller
that hangs up, timed out, or failed because their node went away.

The real clock, not ``autojump_clock``: with real sockets the mock clock
jumps to the next deadline whenever every task waits on I/O, so a waiter's
queue timeout could fire in the middle of a test that only means to look at
the queue (that made the refresh test fail now and then under load).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
from pathlib import Path
from typing import Any

import trio
import trio.testing

from tests.support.configs import echo_provider, edge_yaml, node
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    metric,
    running_gateway,
    wait_until,
)

CHAT = "/v1/chat/completions"
MAX_QUEUED_BYTES = 2_000


def queue_yaml(
    *, queue_timeout: float = 60, max_queued_bytes: int = MAX_QUEUED_BYTES, max_queue: int = 8
) -> str:
    return edge_yaml(
        edge_id="edge-hostile-queue",
        provider_pool={
            "max_queue": max_queue,
            "queue_timeout": queue_timeout,
            "max_queued_bytes": max_queued_bytes,
        },
        nodes=[node(providers=[echo_provider(capacity=1)])],
    )


def body_of(size: int) -> bytes:
    """A chat request body of exactly ``size`` bytes (as ``http_request`` sends it)."""
    doc: dict[str, Any] = {"model": "echo", "messages": [{"role": "user", "content": ""}]}
    pad = size - len(json.dumps(doc).encode())
    assert pad >= 0
    doc["messages"][0]["content"] = "x" * pad
    body = json.dumps(doc).encode()
    assert len(body) == size
    return body


def rss_mib() -> float:
    """This process's resident memory after giving freed heap back (Linux; 0 elsewhere)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def raw_post(host_port: tuple[str, int], body: bytes, statuses: list[int]) -> None:
    """POST ``body`` without copying it (h11 would build one more copy per request)."""
    host, port = host_port
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(head)
        await stream.send_all(body)
        first = await stream.receive_some(64)
        statuses.append(int(first[9:12]))


async def chat(gw: Gateway, body: bytes, out: list[RawResponse] | None = None) -> RawResponse:
    resp = await http_request(gw.host_port, "POST", CHAT, body=body)
    if out is not None:
        out.append(resp)
    return resp


async def status_queue(gw: Gateway) -> dict[str, Any]:
    doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
    queue: dict[str, Any] = doc["queue"]
    return queue


async def test_bytes_bound_refuses_with_429_and_cancels_give_the_bytes_back() -> None:
    with trio.fail_after(300):
        async with running_gateway(queue_yaml()) as gw:
            pool = gw.runtime.pool
            big = body_of(900)
            async with pool.lease("echo"), trio.open_nursery() as callers:
                callers.start_soon(chat, gw, big)
                callers.start_soon(chat, gw, big)
                await wait_until(lambda: pool.queue_depth == 2)
                assert pool.queued_bytes == 1_800
                assert metric(gw, "iop_queue_bytes") == 1_800
                queue = await status_queue(gw)
                assert queue["queued_bytes"] == 1_800
                assert queue["max_queued_bytes"] == MAX_QUEUED_BYTES

                # Two waiters of 8 allowed, but a third 900-byte body does not fit.
                refused = await chat(gw, big)
                assert refused.status == 429, refused.body
                err = refused.json()["error"]
                assert (err["type"], err["code"]) == ("rate_limit_error", "queue_full")
                assert metric(gw, "iop_openai_requests_total", status="queue_full") == 1
                assert metric(gw, "iop_dispatch_wait_seconds_count", outcome="queue_full") == 1
                assert pool.queue_depth == 2 and pool.queued_bytes == 1_800

                # A small body still fits under the bound: it is bytes, not count.
                callers.start_soon(chat, gw, body_of(200))
                await wait_until(lambda: pool.queue_depth == 3)
                assert pool.queued_bytes == 2_000

                # The callers hang up while queued: the edge sees it, bytes go back.
                callers.cancel_scope.cancel()
            await wait_until(lambda: pool.queue_depth == 0)
            assert pool.queued_bytes == 0
            assert metric(gw, "iop_queue_bytes") == 0
            assert (await status_queue(gw))["queued_bytes"] == 0

            # A request that gets the free slot at once is never refused by the bound.
            huge = await chat(gw, body_of(MAX_QUEUED_BYTES * 4))
            assert huge.status == 200, huge.body


async def test_timeouts_and_admission_give_the_bytes_back() -> None:
    with trio.fail_after(300):
        async with running_gateway(queue_yaml(queue_timeout=1)) as gw:
            pool = gw.runtime.pool
            timed_out: list[RawResponse] = []
            async with trio.open_nursery() as callers:
                async with pool.lease("echo"):
                    for _ in range(2):
                        callers.start_soon(chat, gw, body_of(900), timed_out)
                    await wait_until(lambda: pool.queue_depth == 2)
                    assert pool.queued_bytes == 1_800
                    await wait_until(lambda: len(timed_out) == 2)
                    assert [r.status for r in timed_out] == [503, 503]
                    assert pool.queued_bytes == 0
                    # Queue again; this time the waiter is admitted when the slot frees.
                    admitted: list[RawResponse] = []
                    callers.start_soon(chat, gw, body_of(900), admitted)
                    await wait_until(lambda: pool.queue_depth == 1)
                    assert pool.queued_bytes == 900
            assert admitted[0].status == 200, admitted[0].body
            assert pool.queue_depth == 0 and pool.queued_bytes == 0


async def test_node_loss_fails_the_waiters_and_gives_the_bytes_back() -> None:
    with trio.fail_after(300):
        async with running_gateway(queue_yaml()) as gw:
            pool = gw.runtime.pool
            failed: list[RawResponse] = []
            async with trio.open_nursery() as callers:
                async with pool.lease("echo"):
                    for _ in range(2):
                        callers.start_soon(chat, gw, body_of(900), failed)
                    await wait_until(lambda: pool.queue_depth == 2)
                    gw.kill_node("node-a")
                    await wait_until(lambda: len(failed) == 2)
                    assert pool.queued_bytes == 0 and pool.queue_depth == 0
            assert [r.status for r in failed] == [502, 502]
            assert {r.json()["error"]["code"] for r in failed} == {"node_dispatch_error"}


async def test_max_queued_bytes_is_live_on_refresh_and_evicts_nobody(tmp_path: Path) -> None:
    """Lowering the bound by ``/refresh`` keeps the waiters queued and refuses the next one."""
    path = tmp_path / "edge.yaml"
    path.write_text(queue_yaml())
    with trio.fail_after(300):
        async with running_gateway(path.read_text(), config_path=str(path)) as gw:
            pool = gw.runtime.pool
            async with pool.lease("echo"), trio.open_nursery() as callers:
                callers.start_soon(chat, gw, body_of(900))
                await wait_until(lambda: pool.queue_depth == 1)
                path.write_text(queue_yaml(max_queued_bytes=500))
                report = await gw.runtime.refresh("apply")
                assert report["applied"] is True and report["restart_required"] == [], report
                queue = await status_queue(gw)
                assert queue["max_queued_bytes"] == 500
                assert queue["depth"] == 1 and queue["queued_bytes"] == 900
                refused = await chat(gw, body_of(100))
                assert refused.status == 429, refused.body
                callers.cancel_scope.cancel()
            await wait_until(lambda: pool.queue_depth == 0)
            assert pool.queued_bytes == 0


async def test_responses_requests_count_their_body_while_queued() -> None:
    with trio.fail_after(300):
        async with running_gateway(queue_yaml()) as gw:
            pool = gw.runtime.pool
            body = json.dumps({"model": "echo", "input": "y" * 700}).encode()
            async with pool.lease("echo"), trio.open_nursery() as callers:
                call = functools.partial(http_request, body=body)
                callers.start_soon(call, gw.host_port, "POST", "/v1/responses")
                await wait_until(lambda: pool.queue_depth == 1)
                assert pool.queued_bytes == len(body)
                callers.cancel_scope.cancel()
            await wait_until(lambda: pool.queue_depth == 0)
            assert pool.queued_bytes == 0


async def test_eight_mib_bodies_queue_only_up_to_the_bound() -> None:
    """Six 8 MB bodies for one busy slot with ``max_queued_bytes`` 24 MiB: 3 wait, 3 get 429.

    Real clock (8 MB transfers over loopback); prints the memory the queued
    requests hold (``pytest -s``), asserts only the counts.
    """
    limit = 24 * 1024 * 1024
    yaml_text = queue_yaml(max_queued_bytes=limit, max_queue=64)
    with trio.fail_after(120):
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            body = body_of(8_000_000)
            statuses: list[int] = []
            before = rss_mib()
            async with pool.lease("echo"), trio.open_nursery() as callers:
                for _ in range(6):
                    callers.start_soon(raw_post, gw.host_port, body, statuses)
                await wait_until(lambda: pool.queue_depth + len(statuses) == 6)
                assert pool.queue_depth == 3 and statuses == [429, 429, 429]
                assert pool.queued_bytes == 24_000_000
                held = rss_mib()
                print(
                    f"MEASURED queued_bodies=3x8MB queued_bytes={pool.queued_bytes} "
                    f"refused=3 rss_before_mib={before:.0f} rss_queued_mib={held:.0f}"
                )
                callers.cancel_scope.cancel()
            await wait_until(lambda: pool.queue_depth == 0)
            assert pool.queued_bytes == 0
