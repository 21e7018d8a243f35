"""Provider health, end to end: the node's probes reach the edge's /status and its dispatch."""

from __future__ import annotations

import openai
import pytest
import trio

from tests.support.configs import served_edge_yaml
from tests.support.gateway import (
    http_request,
    in_thread,
    running_gateway,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer


async def _health(gw) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
    p = doc["providers"][0]
    return p["health"], p["last_error"]


async def test_unhealthy_provider_leaves_dispatch_and_comes_back() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            await n.start(mock.serve)
            yaml_text = served_edge_yaml(mock.base_url, edge_id="edge-health")
            async with running_gateway(yaml_text) as gw:
                client = gw.sdk()
                msgs = [{"role": "user", "content": "hi"}]
                health: list[tuple[str, str]] = []

                async def poll(want: str) -> None:
                    while True:
                        health[:] = [await _health(gw)]
                        if health[0][0] == want:
                            return
                        await trio.sleep(0.02)

                await poll("healthy")
                await in_thread(lambda: client.chat.completions.create(model="m", messages=msgs))

                mock.healthy = False
                await poll("unhealthy")
                assert health[0][1], "an unhealthy provider reports its last error"
                with pytest.raises(openai.APIStatusError) as info:
                    await in_thread(
                        lambda: client.chat.completions.create(model="m", messages=msgs)
                    )
                assert info.value.status_code == 502
                assert info.value.code == "node_dispatch_error"

                mock.healthy = True
                await poll("healthy")
                resp = await in_thread(
                    lambda: client.chat.completions.create(model="m", messages=msgs)
                )
                assert resp.choices[0].message.content
                await wait_until(
                    lambda: gw.runtime.pool.provider_loads()["vllm-a"].in_flight == 0
                )
            n.cancel_scope.cancel()


async def test_a_provider_serving_other_names_is_unhealthy_and_says_which() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            mock.listed = ["Qwen/Qwen3-8B"]  # the config says it serves "served"
            await n.start(mock.serve)
            yaml_text = served_edge_yaml(mock.base_url, edge_id="edge-health")
            async with running_gateway(yaml_text) as gw:
                await wait_until_health(gw, "unhealthy")
                health, last_error = await _health(gw)
                assert last_error == (
                    "model 'served' not served: /v1/models lists 'Qwen/Qwen3-8B'; "
                    "fix nodes[].providers[].models or the server's model name"
                )
                r = await http_request(
                    gw.host_port,
                    "POST",
                    "/v1/chat/completions",
                    body={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                )
                assert r.status == 502
                assert "vllm-a unhealthy" in r.json()["error"]["message"]
                mock.listed.append("served")
                await wait_until_health(gw, "healthy")
            n.cancel_scope.cancel()


async def wait_until_health(gw, want: str) -> None:  # type: ignore[no-untyped-def]
    state = gw.runtime.health
    await wait_until(lambda: "vllm-a" in state and state["vllm-a"].health == want)
