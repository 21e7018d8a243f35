"""A provider that is down: the caller's 502 names no backend address, the node's log does.

The node's HTTP client reports a refused connect as trio does ("all attempts
to connect to 127.0.0.1:PORT failed"); that text is the operator's, in the
node's ``event=provider_error`` line, while the caller gets "the provider
could not be reached" on every path: the passthrough relay (``openai``) and
the normalized chat (``ollama``).  The edge keeps to that message for a node
that still sends its own text for these codes.
"""

from __future__ import annotations

import logging

import pytest
import trio

from iopd.edge.openai.run_errors import provider_error
from iopd.node.adapters.base import AdapterError, CollectedTunnelOutput
from iopd.node.adapters.openai import OpenAIAdapter
from tests.support.gateway import (
    http_request,
    node_token,
    running_gateway,
    token_hash,
    wait_provider_health,
)
from tests.support.mock_providers import (
    MockHTTPServer,
    MockOllamaServer,
    MockOpenAIServer,
    closed_port_url,
)
from tests.support.node_parts import tunnel_req
from wire.messages import ProviderSpec

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def one_provider_yaml(provider_type: str, base_url: str) -> str:
    return f"""
edge: {{id: e, node_listen: "127.0.0.1:0", admin_listen: "127.0.0.1:0"}}
openai: {{listen: "127.0.0.1:0"}}
provider_pool: {{retry_attempts: 0}}
models:
  - id: m
    providers: {{down-1: m}}
nodes:
  - id: node-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - {{id: down-1, type: {provider_type}, base_url: "{base_url}", models: [m], health_interval: 3600}}
"""


async def refusing(port: int) -> None:
    """Wait until nothing accepts on ``port`` (callers bound it)."""
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        await stream.aclose()
        await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("provider_type", "mock_class"),
    [("openai", MockOpenAIServer), ("ollama", MockOllamaServer)],
    ids=["passthrough", "normalized"],
)
async def test_a_provider_that_went_down_is_a_502_without_its_address(
    provider_type: str, mock_class: type[MockHTTPServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Healthy at the probe, gone at the request: the edge dispatches and the connect fails."""
    caplog.set_level(logging.INFO)
    mock = mock_class()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            provider = trio.CancelScope()

            async def serve_mock(task_status: trio.TaskStatus[None]) -> None:
                with provider:
                    await mock.serve(task_status=task_status)

            await nursery.start(serve_mock)
            port = str(mock.port)
            async with running_gateway(one_provider_yaml(provider_type, mock.base_url)) as gw:
                await wait_provider_health(gw, "healthy")
                provider.cancel()  # the provider goes down: its port refuses connections
                await refusing(mock.port)
                resp = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
    assert resp.status == 502, resp.body
    error = resp.json()["error"]
    assert error["message"] == "the provider could not be reached"
    text = resp.body.decode() + "".join(f"{k}: {v}" for k, v in resp.headers)
    assert "127.0.0.1" not in text and port not in text
    logged = [r.getMessage() for r in caplog.records if "event=provider_error" in r.getMessage()]
    assert any(f"127.0.0.1:{port}" in line for line in logged), logged


def test_the_edge_never_passes_on_a_nodes_text_for_a_provider_never_reached() -> None:
    old_node = "provider unreachable: cannot connect: all attempts to connect to 10.1.2.3:8000 failed"
    for code in ("provider_unreachable", "provider_reset"):
        error = provider_error(code, old_node)
        assert error.status == 502 and "10.1.2.3" not in error.message
    assert provider_error("provider_error", "provider returned 500").message == (
        "provider returned 500"
    )


async def test_the_adapter_keeps_the_address_out_of_the_callers_message() -> None:
    base_url = closed_port_url()
    adapter = OpenAIAdapter(ProviderSpec(id="x", type="openai", base_url=base_url))
    with trio.fail_after(5), pytest.raises(AdapterError) as info:
        await adapter.tunnel(tunnel_req("/v1/chat/completions", {}), CollectedTunnelOutput())
    await adapter.aclose()
    assert info.value.code == "provider_unreachable"
    assert info.value.message == "the provider could not be reached"
    assert base_url.removeprefix("http://") in info.value.detail  # for the node's log
