"""A provider that accepts and never answers: 504 ``provider_timeout`` after
``first_byte_timeout``, naming the model group, and nothing left held."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.support.configs import served_edge_yaml
from tests.support.gateway import http_request, running_gateway, wait_until
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer, MockReply


def hang_chats(req: Any) -> MockReply | None:
    """Answer the probe, hang on everything else (the server accepted the request)."""
    return None if req.method == "GET" else MockReply(hang_before_head=True)


@pytest.mark.parametrize(
    ("server", "ptype", "stream"),
    [
        (MockOpenAIServer, "openai", False),
        (MockOpenAIServer, "openai", True),
        (MockOllamaServer, "ollama", True),
    ],
    ids=["passthrough", "passthrough-stream", "normalized-stream"],
)
async def test_a_hung_provider_ends_in_504_naming_the_group(
    server: type[MockOpenAIServer | MockOllamaServer], ptype: str, stream: bool
) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = server()
            mock.handler = hang_chats
            await n.start(mock.serve)
            provider = {"type": ptype, "first_byte_timeout": 0.5, "read_timeout": 300}
            yaml_text = served_edge_yaml(mock.base_url, edge_id="edge-fbt", provider=provider)
            async with running_gateway(yaml_text) as gw:
                await wait_until(lambda: "vllm-a" in gw.runtime.health)
                body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
                r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
                assert r.status == 504, r.body
                error = r.json()["error"]
                assert error["code"] == "provider_timeout"
                assert error["message"] == (
                    "model group 'm': the provider sent no response within 0.5s (first_byte_timeout)"
                )
                await mock.wait_client_close(1)  # the node closed the upstream connection
                await wait_until(lambda: gw.runtime.pool.provider_loads()["vllm-a"].in_flight == 0)
            n.cancel_scope.cancel()
