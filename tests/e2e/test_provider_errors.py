"""Provider errors end to end: a normalized provider's error and timeout, a passthrough
provider's error relayed as it is."""

from __future__ import annotations

import trio

from tests.support.configs import (
    ollama_only_yaml,
    remote_yaml,
)
from tests.support.gateway import http_request, running_gateway, wait_until
from tests.support.mock_providers import (
    MockOllamaServer,
    MockOpenAIServer,
    MockReply,
    RecordedRequest,
)
from tests.support.replies import assert_error, chat_body

CHAT = "/v1/chat/completions"


async def test_normalized_provider_error_and_timeout(ollama_mock: MockOllamaServer) -> None:
    mock = ollama_mock
    with trio.fail_after(30):
        yaml_text = ollama_only_yaml(
            mock.base_url,
            "ol",
            # One probe only, before the mock fails on purpose: a
            # probe in "error500" or "hang" mode marks it unhealthy.
            extra="        read_timeout: 0.3\n        health_interval: 3600\n",
        )
        async with running_gateway(yaml_text) as gw:
            await wait_until(
                lambda: getattr(gw.runtime.health.get("ol-1"), "health", "") == "healthy"
            )
            mock.mode = "error500"
            r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("ol", "hi"))
            assert_error(r, 502, "provider_error")
            assert r.json()["error"]["type"] == "server_error"
            mock.mode = "hang"
            r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("ol", "hi"))
            assert_error(r, 504, "provider_timeout")
            mock.mode = "ok"
            r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("ol", "hi"))
            assert r.status == 200
            await wait_until(lambda: gw.runtime.pool.provider_loads()["ol-1"].in_flight == 0)


async def test_passthrough_provider_error_relayed_as_is(openai_mock: MockOpenAIServer) -> None:
    mock = openai_mock
    with trio.fail_after(30):
        body_bytes = b'{"error": {"message": "upstream exploded", "type": "weird", "code": 7}}'

        def handler(req: RecordedRequest) -> MockReply | None:
            if req.method == "POST":
                return MockReply(
                    status=500,
                    headers=[("content-type", "application/json"), ("x-upstream", "yes")],
                    body=body_bytes,
                )
            return None

        mock.handler = handler
        yaml_text = remote_yaml(mock.base_url)
        async with running_gateway(yaml_text) as gw:
            for path, body in (
                (CHAT, chat_body("remote", "hi")),
                ("/v1/responses", {"model": "remote", "input": "hi", "stream": True}),
            ):
                r = await http_request(gw.host_port, "POST", path, body=body)
                assert r.status == 500
                assert r.body == body_bytes
                assert r.header("x-upstream") == "yes"
            pool = gw.runtime.pool
            await wait_until(lambda: pool.provider_loads()["oa-1"].in_flight == 0)
