"""Per-principal limits shared by several edges through a real redis-server.

Each edge is a whole edge with its own embedded echo node, as several
machines behind one load balancer would be; they share one principal and
one ``redis-server`` started by the test on a free loopback port.  Requests
alternate between the edges, and every limit must hold exactly as one edge
would hold it.  Windows run on the server's clock, so these tests use the
real clock (the minute never turns within a test: each takes seconds).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from iopd.edge.principals.shared_limits import SharedLimits
from iopd.edge.principals.store import LimitsStore
from scripts.edge_process import running_edge
from tests.support.gateway import (
    Gateway,
    admin_host_port,
    get_json,
    http_request,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer, closed_port_url
from tests.support.redis_server import RedisServer, running_redis
from tests.support.streams import NO_USAGE_PIECES, no_usage_stream

TEAM_A = "sk-shared-limits-team-a-0001"
CHAT = "/v1/chat/completions"


@pytest.fixture
def redis(tmp_path: Path) -> Any:
    with running_redis(tmp_path) as server:
        yield server


def edge_head(edge_id: str) -> str:
    """An edge's own section and its OpenAI listener with team-a's token (more
    tokens may follow)."""
    return f"""
edge:
  id: {edge_id}
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
  principal_tokens:
    - {{token_ref: a-1, token_hash_sha256: {token_hash(TEAM_A)}, principal_ref: team-a}}
"""


def edge_yaml(
    edge_id: str,
    url: str,
    limits: str,
    *,
    delay_ms: int = 0,
    mode: str = "local",
    ttl: float = 1.5,
    retry_via: tuple[str, str] | None = None,
) -> str:
    """An edge with its embedded echo node.  ``retry_via``: (a base URL nothing
    answers on, a mock provider's) serve the model instead, the dead one tried
    first (lower priority), so every request is retried."""
    dead = ""
    group = "{echo-1: echo}"
    if retry_via is not None:
        dead = (
            f"      - {{id: dead-1, type: openai, base_url: {retry_via[0]}/v1, models: [echo]}}\n"
            f"      - {{id: good-1, type: openai, base_url: {retry_via[1]}/v1, models: [echo],"
            " priority: 1}\n"
        )
        group = "{dead-1: echo, good-1: echo}"
    return (
        edge_head(edge_id)
        + f"""models:
  - id: echo
    providers: {group}
nodes:
  - id: here
    embedded: true
    providers:
{dead}      - {{id: echo-1, type: echo, models: [echo], capacity: 8, delay_ms: {delay_ms}, priority: 1}}
limits:
  backend: redis
  redis_url: {url}
  on_backend_error: {mode}
  backend_timeout: 0.2
  lease_ttl: {ttl}
  principals:
    - {{principal_ref: team-a, {limits}}}
"""
    )


@contextlib.asynccontextmanager
async def edges(redis: RedisServer, n: int, limits: str, **kw: Any) -> AsyncIterator[list[Gateway]]:
    async with contextlib.AsyncExitStack() as stack:
        gws = [
            await stack.enter_async_context(
                running_gateway(edge_yaml(f"edge-{i}", redis.url, limits, **kw), nodes=[])
            )
            for i in range(n)
        ]
        for gw in gws:
            await wait_until(lambda gw=gw: gw.runtime.hub.connected_since("here") is not None)
        yield gws


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": "one two"}], **extra}


async def post(gw: Gateway, **extra: Any) -> Any:
    return await http_request(
        gw.host_port,
        "POST",
        CHAT,
        body=chat(**extra),
        headers=[("authorization", f"Bearer {TEAM_A}")],
    )


def shared(gw: Gateway) -> SharedLimits:
    backend = gw.runtime.limits
    assert isinstance(backend, SharedLimits)
    return backend


async def metrics_text(gw: Gateway) -> str:
    return (await http_request(admin_host_port(gw), "GET", "/metrics")).body.decode()


async def store_view(redis: RedisServer) -> Any:
    store = LimitsStore(redis.url, timeout=1.0)
    async with store.client:
        keys = store.keys("team-a")
        requests = await store.client.zcard(keys[0])
        tokens = int(await store.client.hget(keys[3], "tok") or 0)
        return requests, tokens, await store.slots_held("team-a")


# ------------------------------------------------------------------ exact across edges


async def test_requests_per_minute_hold_exactly_across_three_edges(redis: RedisServer) -> None:
    with trio.fail_after(60):
        async with edges(redis, 3, "requests_per_minute: 7") as gws:
            statuses = [(await post(gws[i % 3])).status for i in range(12)]
            assert statuses == [200] * 7 + [429] * 5
            # Every edge says the same about the shared window.
            last = await post(gws[1])
            assert last.header("x-ratelimit-remaining-requests") == "0"
            assert last.header("retry-after") is not None
            assert (await store_view(redis))[0] == 7


async def test_requests_per_minute_hold_under_concurrency(redis: RedisServer) -> None:
    """Twenty callers at once on two edges: exactly the limit gets in."""
    with trio.fail_after(60):
        async with edges(redis, 2, "requests_per_minute: 9") as gws:
            statuses: list[int] = []

            async def one(i: int) -> None:
                statuses.append((await post(gws[i % 2])).status)

            async with trio.open_nursery() as n:
                for i in range(20):
                    n.start_soon(one, i)
            assert sorted(statuses) == [200] * 9 + [429] * 11


async def test_tokens_per_minute_hold_exactly_and_settle_with_usage(redis: RedisServer) -> None:
    with trio.fail_after(60):
        async with edges(redis, 2, "tokens_per_minute: 1000", delay_ms=400) as gws:
            # One request alone: reserved input + 300, settled with its (small) usage.
            assert (await post(gws[0], max_tokens=300)).status == 200
            requests, settled, _ = await store_view(redis)
            assert requests == 1 and 0 < settled < 100
            # Six at once on two edges, each holding its reservation while it runs:
            # exactly as many as fit in what is left of the 1000 get in.
            reservation = 300 + settled  # the echo's usage is its input, as estimated
            fits = (1000 - settled) // reservation
            statuses: list[int] = []

            async def one(i: int) -> None:
                statuses.append((await post(gws[i % 2], max_tokens=300)).status)

            async with trio.open_nursery() as n:
                for i in range(6):
                    n.start_soon(one, i)
            assert sorted(statuses) == [200] * fits + [429] * (6 - fits)
            requests, tokens, _ = await store_view(redis)
            assert requests == 1 + fits and tokens == settled * (1 + fits)


async def test_without_max_tokens_requests_are_cut_to_the_room_left(redis: RedisServer) -> None:
    """TPM 4096: after a small request, every request without max_tokens is
    admitted (cut to what the shared window has left), not refused."""
    with trio.fail_after(60):
        async with edges(redis, 2, "tokens_per_minute: 4096") as gws:
            assert (await post(gws[0], max_tokens=3)).status == 200
            _, first, _ = await store_view(redis)
            assert 0 < first < 100
            for i in range(4):
                assert (await post(gws[i % 2])).status == 200
            requests, tokens, slots = await store_view(redis)
            # Each settled with its usage: the window holds the usage alone.
            assert requests == 5 and tokens == 5 * first and slots == 0
            # An explicit max_tokens larger than the room left still waits.
            assert (await post(gws[0], max_tokens=4096 - 5 * first)).status == 429


async def test_max_concurrent_holds_across_edges_and_waiters_get_freed_slots(
    redis: RedisServer,
) -> None:
    with trio.fail_after(60):
        async with edges(redis, 3, "max_concurrent: 2", delay_ms=150) as gws:
            peak = 0
            done = trio.Event()

            async def watch() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, (await store_view(redis))[2])
                    running = sum(
                        r for gw in gws for r, _q in gw.runtime.pool.principal_loads().values()
                    )
                    assert running <= 2, running
                    await trio.sleep(0.01)

            statuses: list[int] = []

            async def one(i: int) -> None:
                statuses.append((await post(gws[i % 3])).status)

            async with trio.open_nursery() as n:
                n.start_soon(watch)
                async with trio.open_nursery() as callers:
                    for i in range(9):
                        callers.start_soon(one, i)
                done.set()
            assert statuses == [200] * 9  # every waiter got a slot freed on some edge
            assert peak == 2
            assert (await store_view(redis))[2] == 0


TEAM_B = "sk-shared-limits-team-b-0002"


def two_providers_yaml(edge_id: str, url: str) -> str:
    """Model ``slow`` on ``x-1`` (one slot, 2 s a reply), ``echo`` on ``y-1``;
    team-a may run one request at once on every edge together, team-b has no limits."""
    return (
        edge_head(edge_id)
        + f"""    - {{token_ref: b-1, token_hash_sha256: {token_hash(TEAM_B)}, principal_ref: team-b}}
models:
  - id: slow
    providers: {{x-1: slow}}
  - id: echo
    providers: {{y-1: echo}}
nodes:
  - id: here
    embedded: true
    providers:
      - {{id: x-1, type: echo, models: [slow], capacity: 1, delay_ms: 2000}}
      - {{id: y-1, type: echo, models: [echo], capacity: 8}}
limits:
  backend: redis
  redis_url: {url}
  backend_timeout: 0.2
  lease_ttl: 1.5
  principals:
    - {{principal_ref: team-a, max_concurrent: 1}}
"""
    )


async def test_a_request_waiting_for_a_provider_holds_no_shared_slot(
    redis: RedisServer,
) -> None:
    """As with ``memory``, ``max_concurrent`` counts running requests only: team-a's
    request queued behind team-b's on the full ``x-1`` leaves team-a's one slot to
    its next request, on another edge, which runs at once (while team-b's runs)."""
    with trio.fail_after(60):
        async with contextlib.AsyncExitStack() as stack:
            gws = [
                await stack.enter_async_context(
                    running_gateway(two_providers_yaml(f"edge-{i}", redis.url), nodes=[])
                )
                for i in range(2)
            ]
            for gw in gws:
                await wait_until(lambda gw=gw: gw.runtime.hub.connected_since("here") is not None)
            pool = gws[0].runtime.pool
            statuses: dict[str, int] = {}

            async def send(name: str, gw: Gateway, token: str, model: str) -> None:
                resp = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body={**chat(), "model": model},
                    headers=[("authorization", f"Bearer {token}")],
                )
                statuses[name] = resp.status

            async with trio.open_nursery() as n:
                n.start_soon(send, "b-on-x", gws[0], TEAM_B, "slow")
                await wait_until(lambda: sum(f for f, _q in pool.principal_loads().values()) == 1)
                n.start_soon(send, "a-waits-for-x", gws[0], TEAM_A, "slow")
                await wait_until(lambda: pool.queue_depth == 1)
                await send("a-on-y", gws[1], TEAM_A, "echo")
                # It ran while team-a's first request was still waiting for x-1.
                assert statuses == {"a-on-y": 200}
                assert pool.queue_depth == 1
            assert statuses == {"a-on-y": 200, "b-on-x": 200, "a-waits-for-x": 200}
            assert (await store_view(redis))[2] == 0


async def test_an_edge_killed_holding_slots_frees_them_within_the_ttl(
    redis: RedisServer,
) -> None:
    """SIGKILL an edge process while it runs two slow requests: their leases expire."""
    with trio.fail_after(60):
        text = edge_yaml("doomed", redis.url, "max_concurrent: 2", delay_ms=5000, ttl=1.5)
        async with running_edge(text) as proc:
            host_port = ("127.0.0.1", proc.openai_port)

            async def slow() -> None:
                with contextlib.suppress(OSError, h11.RemoteProtocolError):  # the edge dies
                    await http_request(
                        host_port,
                        "POST",
                        CHAT,
                        body=chat(),
                        headers=[("authorization", f"Bearer {TEAM_A}")],
                    )

            async with trio.open_nursery() as n:
                n.start_soon(slow)
                n.start_soon(slow)
                await wait_until_async(lambda: _slots(redis), 2)
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = trio.current_time()
                await wait_until_async(lambda: _slots(redis), 0)
                # Within the TTL (1.5 s); the bound here is loose, for a loaded machine.
                assert trio.current_time() - killed_at <= 3 * 1.5
                n.cancel_scope.cancel()
        async with edges(redis, 1, "max_concurrent: 2") as (gw,):
            assert (await post(gw)).status == 200


async def _slots(redis: RedisServer) -> int:
    return int((await store_view(redis))[2])


async def wait_until_async(probe: Any, want: int) -> None:
    while await probe() != want:  # noqa: ASYNC110 - polling the store, owned by other processes
        await trio.sleep(0.02)


async def test_retries_count_once_in_the_store(redis: RedisServer) -> None:
    """Every request first fails on a provider nobody answers, then is retried on
    the echo: it counts once (one request, one settled token entry)."""
    with trio.fail_after(60):
        limits = "requests_per_minute: 100, tokens_per_minute: 100000"
        async with (
            trio.open_nursery() as nursery,
            edges(redis, 2, limits, retry_via=(closed_port_url(), await _mock(nursery))) as gws,
        ):
            for i in range(4):
                # Its health probe failed: make it a candidate as if it had just gone down.
                gws[i % 2].runtime.pool.set_provider_health("dead-1", "healthy")
                resp = await post(gws[i % 2])
                assert resp.status == 200, resp.body
            retried = [
                line
                for gw in gws
                for line in (await metrics_text(gw)).splitlines()
                if line.startswith("iop_request_retries_total{")
            ]
            assert retried and sum(float(x.rsplit(" ", 1)[1]) for x in retried) >= 4
            requests, tokens, slots = await store_view(redis)
            assert requests == 4 and slots == 0
            assert 0 < tokens < 4 * 100  # settled with the usage, each once
            nursery.cancel_scope.cancel()


async def _mock(nursery: trio.Nursery) -> str:
    server = await nursery.start(MockOpenAIServer().serve)
    return str(server.base_url)


# ------------------------------------------------------------------ the store goes away


async def test_outage_local_mode_limits_per_edge_then_recovers(redis: RedisServer) -> None:
    """Each edge in the outage counts by itself, on its own counts: what it admitted
    through the store counts there too.  At recovery each writes back what it admitted
    by itself, so the (restarted, empty) store goes on from there."""
    with trio.fail_after(60):
        async with edges(redis, 2, "requests_per_minute: 4", mode="local") as gws:
            assert [(await post(gws[0])).status for _ in range(3)] == [200] * 3
            assert [(await post(gws[1])).status for _ in range(2)] == [200, 429]
            redis.kill()
            # edge-0 has 3 of its own, edge-1 has 1: 1 and 3 more.
            for gw, more in zip(gws, (1, 3), strict=True):
                assert [(await post(gw)).status for _ in range(4)] == [200] * more + [429] * (
                    4 - more
                )
                status = await get_json(admin_host_port(gw), "/status")
                assert status["limits_backend"]["state"] == "outage"
                assert status["limits_backend"]["errors_total"] >= 1
                assert "iop_limits_backend_errors_total" in await metrics_text(gw)
            redis.start()
            for gw in gws:
                await wait_until(lambda gw=gw: shared(gw).backend_row()["state"] == "ok")
            # The store lost what it had with its restart, and got back the 4 the edges
            # admitted by themselves: the window is full.
            assert (await store_view(redis))[0] == 4
            assert [(await post(gws[i % 2])).status for i in range(2)] == [429] * 2


async def test_outage_reject_mode_answers_503_limits_unavailable(redis: RedisServer) -> None:
    with trio.fail_after(60):
        async with edges(redis, 1, "requests_per_minute: 100", mode="reject") as (gw,):
            assert (await post(gw)).status == 200
            redis.kill()
            resp = await post(gw)
            assert resp.status == 503
            error = resp.json()["error"]
            assert (error["code"], error["type"]) == ("limits_unavailable", "server_error")
            assert resp.header("retry-after") == "1"
            assert 'status="limits_unavailable"' in await metrics_text(gw)
            redis.start()
            await wait_until(lambda: shared(gw).backend_row()["state"] == "ok")
            assert (await post(gw)).status == 200


async def test_outage_allow_mode_admits_without_limits(redis: RedisServer) -> None:
    with trio.fail_after(60):
        async with edges(redis, 1, "requests_per_minute: 1", mode="allow") as (gw,):
            assert (await post(gw)).status == 200
            assert (await post(gw)).status == 429
            redis.kill()
            assert [(await post(gw)).status for _ in range(5)] == [200] * 5
            redis.start()
            await wait_until(lambda: shared(gw).backend_row()["state"] == "ok")
            assert [(await post(gw)).status for _ in range(2)] == [200, 429]


async def test_an_edge_frozen_while_its_store_calls_wait_has_no_outage(redis: RedisServer) -> None:
    """Two edge processes, RPM 20, ``local``: one is stopped (SIGSTOP) for 0.5 s,
    over its ``backend_timeout`` of 0.2, again and again while callers send to
    both.  The store answers in time; the replies wait in the frozen edge's
    socket, and reading them late is its own lag, not an outage: exactly 20."""
    with trio.fail_after(90):
        yaml = [edge_yaml(f"edge-{i}", redis.url, "requests_per_minute: 20") for i in range(2)]
        async with running_edge(yaml[0]) as frozen, running_edge(yaml[1]) as other:
            ports = [("127.0.0.1", frozen.openai_port), ("127.0.0.1", other.openai_port)]
            for port in ports:  # both serve (their embedded nodes are up) before the test
                while (await _post_to(port)).status != 200:  # noqa: ASYNC110 - another process
                    await trio.sleep(0.05)
            statuses: list[int] = []
            done = trio.Event()

            async def freeze() -> None:
                while not done.is_set():
                    os.kill(frozen.pid, signal.SIGSTOP)
                    await trio.sleep(0.5)
                    os.kill(frozen.pid, signal.SIGCONT)
                    await trio.sleep(0.1)

            async def caller(port: tuple[str, int]) -> None:
                for _ in range(12):
                    statuses.append((await _post_to(port)).status)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(freeze)
                async with trio.open_nursery() as callers:
                    for port in ports + ports:
                        callers.start_soon(caller, port)
                done.set()
            assert statuses.count(200) == 20 - 2, statuses  # two went to the warm-up
            assert statuses.count(429) == len(statuses) - 18
            for proc in (frozen, other):
                status = await get_json(("127.0.0.1", proc.admin_port), "/status")
                assert status["limits_backend"]["errors_total"] == 0
            assert (await store_view(redis))[0] == 20


async def _post_to(host_port: tuple[str, int]) -> Any:
    return await http_request(
        host_port, "POST", CHAT, body=chat(), headers=[("authorization", f"Bearer {TEAM_A}")]
    )


async def test_a_stream_without_usage_settles_what_it_relayed_in_the_store(
    redis: RedisServer,
) -> None:
    """TPM 2000, no max_tokens, ~3,000 tokens streamed without usage: the shared
    window records them all (the reservation was cut to 2000), as debt."""
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.handler = lambda req: no_usage_stream() if req.method == "POST" else None
            yaml = (
                edge_head("edge-0")
                + f"""models:
  - id: echo
    providers: {{oa-1: mock-model}}
nodes:
  - id: here
    embedded: true
    providers:
      - {{id: oa-1, type: openai, base_url: {mock.base_url}/v1, models: [mock-model]}}
limits:
  backend: redis
  redis_url: {redis.url}
  principals:
    - {{principal_ref: team-a, tokens_per_minute: 2000}}
"""
            )
            async with running_gateway(yaml, nodes=[]) as gw:
                await wait_until(lambda: gw.runtime.hub.connected_since("here") is not None)
                resp = await post(gw, stream=True)
                assert resp.status == 200 and resp.body.count(b'"content"') == NO_USAGE_PIECES
                requests, tokens, slots = await store_view(redis)
                # The input estimate of "one two" (2) plus the output relayed.
                assert (requests, tokens, slots) == (1, 2 + NO_USAGE_PIECES * 10, 0)
                assert (await post(gw, stream=True)).status == 429  # in debt
            n.cancel_scope.cancel()
