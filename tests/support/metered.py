"""The metering tests' gateway: one edge with principals, its config, the metrics' label sets.

``gateway_yaml`` is the edge the metrics tests run (group ``echo`` on node-a, the
mock providers' groups, a scripted ``FakeNode``'s groups); ``req``/``tokens``/
``reasoning`` spell the label sets a scrape is compared against.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.metrics import LabelSet, Scrape, changes, scrape
from tests.support.wire_peers import FakeNode

EDGE_ID = "edge-m"
PRINCIPAL_TOKEN = "sk-canary-principal-7f3a91"
LEGACY_TOKEN = "sk-canary-legacy-c0ffee42"
NO_ALIAS_TOKEN = "sk-canary-noalias-1b2c3d"
ALICE = {"principal_ref": "user-1", "principal_alias": "alice", "token_ref": "app-1"}
BOB = {"principal_ref": "user-2", "principal_alias": "user-2", "token_ref": "app-2"}  # no alias
UNMAPPED = {"principal_ref": "unmapped", "principal_alias": "unmapped", "token_ref": "unmapped"}


def req(
    who: dict[str, str],
    *,
    group: str,
    status: str = "ok",
    endpoint: str = "chat_completions",
    mode: str = "normalized",
    **extra: str,
) -> LabelSet:
    """The full label set of an ``iop_openai_requests_total`` series (+ ``extra``)."""
    return frozenset(
        {
            "edge_id": EDGE_ID,
            **who,
            "model_group": group,
            "endpoint": endpoint,
            "response_mode": mode,
            "status": status,
            **extra,
        }.items()
    )


def tokens(base: LabelSet, source: str, **counts: int) -> dict[LabelSet, float]:
    """Expected ``iop_openai_usage_tokens_total`` deltas: token_type=count under ``base``."""
    return {
        base | {("usage_source", source), ("token_type", t)}: float(n) for t, n in counts.items()
    }


def reasoning(who: dict[str, str], group: str, endpoint: str = "chat_completions") -> LabelSet:
    return frozenset(
        {
            "edge_id": EDGE_ID,
            "principal_ref": who["principal_ref"],
            "token_ref": who["token_ref"],
            "model_group": group,
            "endpoint": endpoint,
        }.items()
    )


def assert_no_reasoning(before: Scrape, after: Scrape) -> None:
    for name in (
        "iop_openai_reasoning_observed_total",
        "iop_openai_reasoning_chars_total",
        "iop_openai_reasoning_estimated_tokens_total",
    ):
        assert changes(before, after, name) == {}, name


async def wait_requests(gw: Gateway, before: Scrape, n: int) -> Scrape:
    """Scrape until ``n`` more requests were recorded (a handler may finish after the reply)."""
    while True:
        now = await scrape(gw)
        got = now.get("iop_openai_requests_total") - before.get("iop_openai_requests_total")
        if got >= n:
            assert got == n
            return now
        await trio.sleep(0.01)


# ------------------------------------------------------------------ configs


def auth_block() -> str:
    return f"""  bearer_token: {LEGACY_TOKEN}
  principal_tokens:
    - {{token_ref: app-1, token_hash_sha256: {token_hash(PRINCIPAL_TOKEN)}, principal_ref: user-1, alias: alice}}
    - {{token_ref: app-2, token_hash_sha256: {token_hash(NO_ALIAS_TOKEN)}, principal_ref: user-2}}
"""


def gateway_yaml(
    *,
    auth: bool = False,
    delay_ms: int = 0,
    capacity: int = 4,
    pool: str = "",
    openai_base: str | None = None,
    ollama_base: str | None = None,
    openai_extra: str = "",
    fake_node: bool = False,
) -> str:
    """Group ``echo`` (echo-1 on node-a); ``gpt`` (openai provider) and ``llama``
    (ollama provider) when their mock URLs are given; ``fake`` on node-f (a
    FakeNode: one passthrough provider ``fake-pt`` and one normalized ``fake-echo``)."""
    models = ["  - id: echo\n    providers: {echo-1: echo}"]
    providers = [
        f"""      - id: echo-1
        type: echo
        models: [echo]
        capacity: {capacity}
        delay_ms: {delay_ms}"""
    ]
    if openai_base:
        models.append("  - id: gpt\n    providers: {vllm-a: served-gpt}")
        providers.append(
            f"""      - id: vllm-a
        type: openai
        base_url: {openai_base}
        models: [served-gpt]
        capacity: 4
        health_interval: 60"""
        )
    if ollama_base:
        models.append("  - id: llama\n    providers: {ollama-b: 'mock:latest'}")
        providers.append(
            f"""      - id: ollama-b
        type: ollama
        base_url: {ollama_base}
        models: ['mock:latest']
        capacity: 4
        health_interval: 60"""
        )
    fake = ""
    if fake_node:
        models.append("  - id: fake-pt\n    providers: {fake-pt: served-fake}")
        models.append("  - id: fake\n    providers: {fake-echo: fake}")
        fake = f"""  - id: node-f
    token_hash_sha256: {token_hash(node_token("node-f"))}
    providers:
      - id: fake-pt
        type: openai
        base_url: http://127.0.0.1:9
        models: [served-fake]
        capacity: 4
      - id: fake-echo
        type: echo
        models: [fake]
        capacity: 4
"""
    provider_lines = "\n".join(providers)
    model_lines = "\n".join(models)
    return f"""
edge:
  id: {EDGE_ID}
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  heartbeat_interval: 60
  heartbeat_timeout: 180
openai:
  listen: 127.0.0.1:0
{auth_block() if auth else ""}{openai_extra}
{pool}
models:
{model_lines}
nodes:
  - id: node-a
    alias: box-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
{provider_lines}
{fake}
"""


async def chat(
    gw: Gateway,
    body: dict[str, Any],
    *,
    token: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    path: str = "/v1/chat/completions",
) -> RawResponse:
    hdrs = list(headers)
    if token is not None:
        hdrs.append(("authorization", f"Bearer {token}"))
    return await http_request(gw.host_port, "POST", path, body=body, headers=hdrs)


@asynccontextmanager
async def gateway_with_fake_node(
    responder: Any = None,
) -> AsyncIterator[tuple[Gateway, FakeNode]]:
    """A gateway whose node-f is a ``FakeNode`` (groups ``fake-pt`` and ``fake``)."""
    async with running_gateway(gateway_yaml(fake_node=True), nodes=["node-a"]) as gw:
        host, port = gw.handle.wire
        async with FakeNode.connect(
            host, port, node_id="node-f", token=node_token("node-f"), responder=responder
        ) as node:
            await wait_until(lambda: gw.runtime.hub.session("node-f") is not None)
            yield gw, node
