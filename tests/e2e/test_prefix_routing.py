"""End to end: cache-aware routing through a real edge and node to providers that
keep a bounded prompt cache (``tests/support/prefix_cache.py``).

Six agent-like sessions (three shared system prompts, each turn adding a
tool output) against three providers of one slot each, each caching two
prompts: with ``routing: prefix`` a session's turns meet its cache, with
``least_load`` they scatter.  Then nothing is left held: leases, waiters,
the waiters' homes, and the index within its bound.
"""

from __future__ import annotations

import random

import trio

from tests.support.configs import http_provider, node_entry
from tests.support.gateway import Gateway, http_request, running_gateway, wait_until
from tests.support.mock_providers import MockOpenAIServer
from tests.support.prefix_cache import PrefixCache, cached_fraction

SESSIONS, TURNS = 6, 5


def _yaml(urls: list[str], policy: str) -> str:
    providers = "".join(
        http_provider(f"p{i}", "openai", url, models="[served]", capacity=1)
        for i, url in enumerate(urls)
    )
    # A slow prefill as the rule sees it: a session waits for its own provider
    # rather than prefill elsewhere, whatever this machine's load makes of the timing.
    pool = (
        "provider_pool:\n  routing: {block_bytes: 256, index_blocks: 64, "
        "prefill_tokens_per_second: 1}\n"
    )
    names = ", ".join(f"p{i}: served" for i in range(len(urls)))
    return f"""
edge:
  id: edge-routing
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
{pool}
models:
  - id: m
    routing: {policy}
    providers: {{{names}}}
nodes:
{node_entry("node-a", providers)}
"""


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefgh ") for _ in range(n))


async def _turn(gw: Gateway, messages: list[dict[str, str]], t: int, rng: random.Random) -> None:
    messages.append({"role": "user", "content": f"turn {t}: " + _text(rng, 600)})
    body = {"model": "m", "messages": messages}
    resp = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
    assert resp.status == 200, resp.body
    messages.append({"role": "assistant", "content": "ok"})


async def _session(gw: Gateway, messages: list[dict[str, str]], rng: random.Random) -> None:
    for t in range(1, TURNS):
        await _turn(gw, messages, t, rng)


async def _run(policy: str) -> float:
    caches = [PrefixCache(slots=2) for _ in range(3)]
    mocks = [MockOpenAIServer() for _ in caches]
    for mock, cache in zip(mocks, caches, strict=True):
        mock.models = ["served"]
        mock.handler = cache
    async with trio.open_nursery() as nursery:
        for mock in mocks:
            await nursery.start(mock.serve)
        async with running_gateway(_yaml([m.base_url for m in mocks], policy)) as gw:
            rng = random.Random(3)
            systems = [_text(rng, 3000) for _ in range(3)]
            histories = [[{"role": "system", "content": systems[s % 3]}] for s in range(SESSIONS)]
            rngs = [random.Random(s) for s in range(SESSIONS)]
            for s in range(SESSIONS):  # first turns one by one: their placement is the rule's
                await _turn(gw, histories[s], 0, rngs[s])
            async with trio.open_nursery() as sessions:  # the later turns all at once
                for s in range(SESSIONS):
                    sessions.start_soon(_session, gw, histories[s], rngs[s])
            pool = gw.runtime.pool
            await wait_until(lambda: all(in_flight == 0 for in_flight in _in_flight(gw)))
            router = pool.scheduler.router
            assert pool.queue_depth == 0 and router.homed == {}
            assert not pool.scheduler.active_grants
            for pid in ("p0", "p1", "p2"):
                assert router.index.blocks(pid) <= 64
            if policy == "prefix":
                assert router.decisions.get(("m", "prefix"), 0) >= SESSIONS * (TURNS - 2)
            else:  # counted, never indexed
                assert router.decisions == {("m", "load"): SESSIONS * TURNS}
                assert router.index.total_blocks == 0
        nursery.cancel_scope.cancel()
    assert sum(c.requests for c in caches) == SESSIONS * TURNS
    return cached_fraction(caches)


def _in_flight(gw: Gateway) -> list[int]:
    return [load.in_flight for load in gw.runtime.pool.provider_loads().values()]


async def test_prefix_routing_keeps_each_sessions_turns_on_its_cache() -> None:
    with trio.fail_after(60):
        prefix = await _run("prefix")
        least_load = await _run("least_load")
    print(f"cached fraction: prefix {prefix:.3f}, least_load {least_load:.3f}")
    assert prefix >= 0.78  # the workload's most: every turn but the first cached, and the
    assert prefix > least_load  # second session of each system prompt's first turn
