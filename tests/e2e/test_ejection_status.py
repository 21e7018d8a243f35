"""``/status`` and the health gauge show passive ejection.

A real edge and node (tests/support/gateway.py) front a healthy mock provider; the
test ejects it through the pool's attempt API (what the request path will
call) and reads ``/status`` and ``/metrics``: ``health: ejected`` with
``ejected_until`` in Unix time and the gauge at -2; a node that goes away
shows ``disconnected`` over ``ejected`` (precedence), and a trial request
that succeeds shows the probe's health again.
"""

from __future__ import annotations

import time

import trio

from iopd.edge.pool.retry_rules import FailureReason
from tests.support.configs import served_edge_yaml
from tests.support.gateway import (
    Gateway,
    first_provider_status,
    provider_health_gauge,
    running_gateway,
    wait_provider_health,
)
from tests.support.mock_providers import MockOpenAIServer


async def _fail_once(gw: Gateway) -> None:
    pool = gw.runtime.pool
    async with pool.lease("m") as lease:
        pool.attempt_failed(lease, FailureReason.STATUS_5XX)


async def test_status_shows_ejected_with_its_end_and_disconnected_first() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            await n.start(mock.serve)
            yaml_text = served_edge_yaml(
                mock.base_url,
                edge_id="edge-eject",
                provider_pool={"eject_after_failures": 2, "eject_seconds": 30},
            )
            async with running_gateway(yaml_text) as gw:
                healthy = await wait_provider_health(gw, "healthy")
                assert healthy["ejected_until"] is None
                await _fail_once(gw)
                assert (await first_provider_status(gw))["health"] == "healthy"  # 1 of 2 failures
                before = time.time()
                await _fail_once(gw)
                ejected = await first_provider_status(gw)
                assert ejected["health"] == "ejected"
                assert before + 29 <= ejected["ejected_until"] <= time.time() + 31
                assert await provider_health_gauge(gw) == -2
                # A healthy probe does not end an ejection caused by 5xx answers.
                await trio.sleep(0.2)
                assert (await first_provider_status(gw))["health"] == "ejected"

                gw.kill_node("node-a")
                gone = await wait_provider_health(gw, "disconnected")
                assert gone["ejected_until"] is None
                await gw.start_node("node-a")
                await wait_provider_health(gw, "ejected")

                # The last resort is the ejected provider itself: its trial succeeds.
                pool = gw.runtime.pool
                async with pool.lease("m") as lease:
                    pool.attempt_succeeded(lease)
                back = await first_provider_status(gw)
                assert (back["health"], back["ejected_until"]) == ("healthy", None)
                assert await provider_health_gauge(gw) == 2
            n.cancel_scope.cancel()
