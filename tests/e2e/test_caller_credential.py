"""Only a provider's own trouble marks it for everyone, end to end.

A real edge and node, two passthrough providers of one group on one mock
upstream (one origin, so a caller's key could be retried to the other), and
two principals: ``mallory`` and ``alice``.  The mock answers a request that
carries a caller's own provider key (``X-Provider-Authorization``) with 429
``Retry-After: 3600`` or 500, and a ``poison`` body with 500 whoever sends
it.  The callers get those answers relayed; a request without its own key
keeps being served by the preferred provider at once: nothing the keys got
saturated or ejected it.
Failures from two principals still eject.  Real sockets, so the real clock
under ``fail_after`` guards.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import trio

from iopd.config.catalog import build_catalog
from iopd.edge.runtime.pool_config import pool_snapshot
from tests.support.gateway import (
    Gateway,
    edge_config,
    http_request,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer, MockReply, RecordedRequest

OWN_KEY = "Bearer own-provider-key-of-"  # + the principal

EDGE_YAML = """
edge:
  id: edge-callerkey
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
  principal_tokens:
    - {{token_ref: t-alice, principal_ref: alice, token_hash_sha256: {alice}}}
    - {{token_ref: t-mallory, principal_ref: mallory, token_hash_sha256: {mallory}}}
provider_pool:
  retry_attempts: 2
  eject_after_failures: 3
  eject_seconds: 30
models:
  - id: m
    providers: {{p1: served-p1, p2: served-p2}}
nodes:
  - id: node-a
    token_hash_sha256: {node}
    providers:
      - id: p1
        type: openai
        base_url: {url}
        models: [served-p1]
        priority: 0
        capacity: 4
        health_interval: 3600
      - id: p2
        type: openai
        base_url: {url}
        models: [served-p2]
        priority: 1
        capacity: 4
        health_interval: 3600
"""


def _yaml(url: str) -> str:
    return EDGE_YAML.format(
        alice=token_hash("alice-token"),
        mallory=token_hash("mallory-token"),
        node=token_hash(node_token("node-a")),
        url=url,
    )


def _error(status: int, retry_after: str | None = None) -> MockReply:
    headers = [("content-type", "application/json")]
    if retry_after is not None:
        headers.append(("retry-after", retry_after))
    return MockReply(status=status, headers=headers, body=b'{"error":{"message":"no"}}')


def _answer_own_key_with(mock: MockOpenAIServer, reply: MockReply) -> None:
    """``reply`` to completions that carry a caller's own key, 500 to a poison body;
    others are served."""

    def handler(req: RecordedRequest) -> MockReply | None:
        if not req.path.endswith("/chat/completions"):
            return None  # the health probe passes
        if (req.header("authorization") or "").startswith(OWN_KEY):
            return reply
        if json.loads(req.body).get("poison"):
            return _error(500)
        return None

    mock.handler = handler


def _served(mock: MockOpenAIServer) -> list[str]:
    """The served model of every completion the mock got, in order."""
    return [r.json()["model"] for r in mock.requests if r.path.endswith("/chat/completions")]


async def _chat(
    gw: Gateway, who: str, *, own_key: bool = False, poison: bool = False
) -> Any:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if poison:
        body["poison"] = True
    headers = [("authorization", f"Bearer {who}-token")]
    if own_key:
        headers.append(("x-provider-authorization", OWN_KEY + who))
    return await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body, headers=headers)


async def _probes_reported(gw: Gateway) -> None:
    """A late first health report would re-examine the providers under the test."""
    await wait_until(
        lambda: all(
            p["health"] not in ("unknown", "disconnected") for p in gw.runtime.status()["providers"]
        )
    )


def _assert_nothing_held(gw: Gateway) -> None:
    pool = gw.runtime.pool
    loads = pool.provider_loads()
    assert all(load.in_flight == 0 and load.long_in_flight == 0 for load in loads.values())
    assert pool.queue_depth == 0 and pool.queued_bytes == 0
    assert not pool.scheduler.active_grants
    assert pool.principal_loads() == {}


def _assert_untouched(gw: Gateway) -> None:
    """Neither provider is saturated, ejected, or out of the choice."""
    outliers = gw.runtime.pool.scheduler.outliers
    now = trio.current_time()
    for pid in ("p1", "p2"):
        assert outliers.saturated_until(pid, now) is None, pid
        assert not outliers.is_ejected(pid), pid
        assert outliers.is_choosable(pid, now), pid


async def _scenario(test: Any) -> None:
    async with trio.open_nursery() as nursery:
        mock = await nursery.start(MockOpenAIServer().serve)
        with trio.fail_after(30):
            async with running_gateway(_yaml(mock.base_url)) as gw:
                await _probes_reported(gw)
                await test(gw, mock)
                _assert_nothing_held(gw)
        nursery.cancel_scope.cancel()


async def test_a_429_on_the_callers_own_key_is_relayed_and_saturates_nobody() -> None:
    async def run(gw: Gateway, mock: MockOpenAIServer) -> None:
        _answer_own_key_with(mock, _error(429, retry_after="3600"))
        for _ in range(2):
            resp = await _chat(gw, "mallory", own_key=True)
            assert resp.status == 429, resp.body
            assert resp.header("retry-after") == "3600"  # the provider's answer, as it was
            assert resp.header("x-iopd-upstream-status") == "429"
        # Not retried: every provider of that origin shares the key's limit.
        assert _served(mock) == ["served-p1", "served-p1"]
        _assert_untouched(gw)
        resp = await _chat(gw, "alice")
        assert resp.status == 200, resp.body
        assert _served(mock)[-1] == "served-p1"  # the preferred provider, at once
        metrics, _ = gw.runtime.metrics.exposition()
        assert b'provider="p1",reason="status_429"} 2.0' in metrics  # still counted as seen

    await _scenario(run)


async def test_500s_on_the_callers_own_key_eject_nobody() -> None:
    async def run(gw: Gateway, mock: MockOpenAIServer) -> None:
        _answer_own_key_with(mock, _error(500))
        for who in ["mallory", "alice"] * 3:  # two principals, twice eject_after_failures
            resp = await _chat(gw, who, own_key=True)
            assert resp.status == 500, resp.body
        assert set(_served(mock)) == {"served-p1"}
        _assert_untouched(gw)
        assert (await _chat(gw, "alice")).status == 200
        assert _served(mock)[-1] == "served-p1"
        assert gw.runtime.status()["providers"][0]["health"] != "ejected"

    await _scenario(run)


async def test_one_principal_alone_cannot_eject_two_can() -> None:
    async def run(gw: Gateway, mock: MockOpenAIServer) -> None:
        _answer_own_key_with(mock, _error(500))
        for _ in range(6):  # a request the provider fails, from mallory alone (no own key)
            assert (await _chat(gw, "mallory", poison=True)).status == 500
        assert set(_served(mock)) == {"served-p1"}  # a 500 is not retried
        _assert_untouched(gw)
        assert (await _chat(gw, "alice")).status == 200  # served by p1; the streak restarts
        assert _served(mock)[-1] == "served-p1"
        # Two principals' failures in one streak: the provider's own trouble.
        assert (await _chat(gw, "mallory", poison=True)).status == 500
        assert (await _chat(gw, "mallory", poison=True)).status == 500
        assert not gw.runtime.pool.scheduler.outliers.is_ejected("p1")
        assert (await _chat(gw, "alice", poison=True)).status == 500
        assert gw.runtime.pool.scheduler.outliers.is_ejected("p1")
        assert (await _chat(gw, "alice")).status == 200
        assert _served(mock)[-1] == "served-p2"

    await _scenario(run)


def test_two_principals_are_needed_only_where_callers_can_be_told_apart() -> None:
    cfg = edge_config(_yaml("http://127.0.0.1:9"))
    alice, mallory = cfg.openai.principal_tokens
    alice_again = msgspec.structs.replace(mallory, principal_ref="alice")

    def needed(tokens: list[Any], bearer: str | None = None) -> int:
        openai = msgspec.structs.replace(
            cfg.openai, principal_tokens=tokens, bearer_token=bearer
        )
        variant = msgspec.structs.replace(cfg, openai=openai)
        return pool_snapshot(variant, build_catalog(variant)).ejection.principals

    assert needed([alice, mallory]) == 2
    assert needed([alice], bearer="legacy") == 2  # alice, and everyone with the bearer token
    assert needed([]) == 1  # open: every caller is the same one
    assert needed([], bearer="legacy") == 1
    assert needed([alice]) == 1
    assert needed([alice, alice_again]) == 1  # two tokens of one principal
