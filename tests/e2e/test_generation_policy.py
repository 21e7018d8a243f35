"""A model group's generation policy end to end: normalized providers get the defaults and the
caps; passthrough adds nothing and refuses a request over a limit with 400 before dispatch."""

from __future__ import annotations

import trio

from tests.support.configs import (
    gateway_yaml,
    http_provider,
    node_entry,
    ollama_only_yaml,
    passthrough_yaml,
)
from tests.support.gateway import http_request, running_gateway
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer
from tests.support.replies import assert_error, chat_body

CHAT = "/v1/chat/completions"


async def test_generation_policy_normalized_fills_defaults_and_caps(
    ollama_mock: MockOllamaServer,
) -> None:
    """Normalized (ollama): the node's request to the provider shows the policy applied."""
    mock = ollama_mock
    with trio.fail_after(30):
        yaml_text = ollama_only_yaml(
            mock.base_url,
            "gen",
            group="    generation: {defaults: {temperature: 0.25, top_p: 0.5},"
            " limits: {max_tokens: 100}}\n",
        )
        async with running_gateway(yaml_text) as gw:
            r = await http_request(
                gw.host_port,
                "POST",
                CHAT,
                body=chat_body("gen", "hi", max_tokens=5000, top_p=0.9),
            )
            assert r.status == 200, r.body
            sent = [q for q in mock.requests if q.path == "/api/chat"][-1].json()
            assert sent["model"] == "mock:latest"
            # default filled, caller's own value kept, limit capped
            assert sent["options"]["temperature"] == 0.25
            assert sent["options"]["top_p"] == 0.9
            assert sent["options"]["num_predict"] == 100
            # A request under the limit keeps its value; no limit adds a field.
            r = await http_request(
                gw.host_port, "POST", CHAT, body=chat_body("gen", "hi", max_tokens=7)
            )
            assert r.status == 200
            sent = [q for q in mock.requests if q.path == "/api/chat"][-1].json()
            assert sent["options"]["num_predict"] == 7
            r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("gen", "hi"))
            sent = [q for q in mock.requests if q.path == "/api/chat"][-1].json()
            assert "num_predict" not in sent["options"]
            # A limited field that is not a number: 400 naming it.
            r = await http_request(
                gw.host_port, "POST", CHAT, body=chat_body("gen", "hi", max_tokens="many")
            )
            assert r.status == 400
            assert r.json()["error"]["param"] == "max_tokens"


async def test_generation_policy_passthrough_adds_nothing_and_refuses_over_limit(
    openai_mock: MockOpenAIServer,
) -> None:
    mock = openai_mock
    with trio.fail_after(30):
        yaml_text = gateway_yaml(
            models=(
                "  - id: gen\n    providers: {oa-1: mock-model}\n"
                "    generation: {defaults: {temperature: 0.25},"
                " limits: {max_tokens: 100, max_completion_tokens: 80}}\n"
            ),
            nodes=node_entry(
                "node-a", http_provider("oa-1", "openai", mock.base_url, models="[mock-model]")
            ),
        )
        async with running_gateway(yaml_text) as gw:
            r = await http_request(
                gw.host_port, "POST", CHAT, body=chat_body("gen", "hi", max_tokens=50)
            )
            assert r.status == 200, r.body
            sent = mock.requests[-1].json()
            assert "temperature" not in sent
            assert sent["max_tokens"] == 50
            before = len(mock.requests)
            for field, value in (("max_tokens", 101), ("max_completion_tokens", 81)):
                body = chat_body("gen", "hi", **{field: value})
                r = await http_request(gw.host_port, "POST", CHAT, body=body)
                assert_error(r, 400, "invalid_request_error", param=field)
            # /v1/responses spells it max_output_tokens; the error names that field.
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/responses",
                body={"model": "gen", "input": "x", "max_output_tokens": 81},
            )
            assert_error(r, 400, "invalid_request_error", param="max_output_tokens")
            assert len(mock.requests) == before  # refused before reaching the provider


async def test_passthrough_limit_is_a_400_before_dispatch() -> None:
    """On passthrough a request over a generation limit gets 400.  For a
    group whose providers all relay raw, that answer does not depend on which
    provider is picked, so it must not wait for (or be masked by) dispatch: it
    used to be checked only after a lease, so with the node down (or the queue
    full) the caller got a retryable 502/429/503 for a request that can never
    succeed."""
    with trio.fail_after(30):
        async with running_gateway(passthrough_yaml(), nodes=[]) as gw:
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
