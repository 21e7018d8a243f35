"""``/status`` and the health gauge show passive ejection (issue #16).

A real edge and node (tests/gateway.py) front a healthy mock provider; the
test ejects it through the pool's attempt API (what the request path will
call) and reads ``/status`` and ``/metrics``: ``health: ejected`` with
``ejected_until`` in Unix time and the gauge at -2; a node that goes away
shows ``disconnected`` over ``ejected`` (precedence), and a trial request
that succeeds shows the probe's health again.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from iopd.edge.pool.retry_rules import FailureReason
from tests.gateway import Gateway, http_request, node_token, running_gateway, token_hash
from tests.mock_providers import MockOpenAIServer

YAML = """
edge:
  id: edge-eject
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
provider_pool:
  eject_after_failures: 2
  eject_seconds: 30
models:
  - id: m
    providers: {{vllm-a: served}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - id: vllm-a
        type: openai
        base_url: {base}
        models: [served]
        health_interval: 0.05
"""


async def _provider(gw: Gateway) -> dict[str, Any]:
    doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
    provider: dict[str, Any] = doc["providers"][0]
    return provider


async def _wait_health(gw: Gateway, want: str) -> dict[str, Any]:
    while (p := await _provider(gw))["health"] != want:  # noqa: ASYNC110 - polling the edge
        await trio.sleep(0.02)
    return p


async def _gauge(gw: Gateway) -> float:
    text = (await http_request(gw.handle.admin, "GET", "/metrics")).body.decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("iop_provider_health{"))
    return float(line.rsplit(" ", 1)[1])


async def _fail_once(gw: Gateway) -> None:
    pool = gw.runtime.pool
    async with pool.lease("m") as lease:
        pool.attempt_failed(lease, FailureReason.STATUS_5XX)


async def test_status_shows_ejected_with_its_end_and_disconnected_first() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            await n.start(mock.serve)
            yaml_text = YAML.format(hash=token_hash(node_token("node-a")), base=mock.base_url)
            async with running_gateway(yaml_text) as gw:
                healthy = await _wait_health(gw, "healthy")
                assert healthy["ejected_until"] is None
                await _fail_once(gw)
                assert (await _provider(gw))["health"] == "healthy"  # 1 of 2 failures
                before = time.time()
                await _fail_once(gw)
                ejected = await _provider(gw)
                assert ejected["health"] == "ejected"
                assert before + 29 <= ejected["ejected_until"] <= time.time() + 31
                assert await _gauge(gw) == -2
                # A healthy probe does not end an ejection caused by 5xx answers.
                await trio.sleep(0.2)
                assert (await _provider(gw))["health"] == "ejected"

                gw.kill_node("node-a")
                gone = await _wait_health(gw, "disconnected")
                assert gone["ejected_until"] is None
                await gw.start_node("node-a")
                await _wait_health(gw, "ejected")

                # The last resort is the ejected provider itself: its trial succeeds.
                pool = gw.runtime.pool
                async with pool.lease("m") as lease:
                    pool.attempt_succeeded(lease)
                back = await _provider(gw)
                assert (back["health"], back["ejected_until"]) == ("healthy", None)
                assert await _gauge(gw) == 2
            n.cancel_scope.cancel()
