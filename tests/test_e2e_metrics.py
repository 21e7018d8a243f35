"""End to end: usage metering and gateway metrics as an operator scrapes them (SPEC §5).

Every test runs a real edge (tests/gateway.py) with a real node, a mock model
server (tests/mock_providers.py) or a scripted ``FakeNode`` (tests/wire_peers.py),
sends requests over real sockets, then parses the admin ``/metrics`` with
``prometheus_client``'s own parser and checks the *exact* change of every
series between two scrapes: the numbers must be what the provider reported,
each counted once, under the right labels -- and no other series may move.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from iopd.tokens import estimate_input_tokens
from tests.gateway import (
    Gateway,
    RawResponse,
    http_request,
    in_thread,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.mock_providers import MockOllamaServer, MockOpenAIServer
from tests.wire_peers import FakeNode
from wire.messages import (
    Cancel,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)

EDGE_ID = "edge-m"
PRINCIPAL_TOKEN = "sk-canary-principal-7f3a91"
LEGACY_TOKEN = "sk-canary-legacy-c0ffee42"
ALICE = {"principal_ref": "user-1", "principal_alias": "alice", "token_ref": "app-1"}
UNMAPPED = {"principal_ref": "unmapped", "principal_alias": "unmapped", "token_ref": "unmapped"}

LabelSet = frozenset[tuple[str, str]]


# ------------------------------------------------------------------ scraping


class Scrape:
    """One parsed ``/metrics`` body: sample name + label set -> value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, LabelSet], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def get(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the series whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def series(self, name: str) -> dict[LabelSet, float]:
        return {ls: v for (n, ls), v in self.samples.items() if n == name}


async def scrape(gw: Gateway) -> Scrape:
    r = await http_request(gw.handle.admin, "GET", "/metrics")
    assert r.status == 200
    return Scrape(r.body.decode())


def changes(before: Scrape, after: Scrape, name: str) -> dict[LabelSet, float]:
    """Every series of ``name`` that moved between two scrapes, with its delta."""
    old = before.series(name)
    moved = {}
    for ls, v in after.series(name).items():
        d = v - old.get(ls, 0.0)
        if d:
            moved[ls] = d
    return moved


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


def sse_events(body: bytes) -> list[Any]:
    """The JSON documents of an SSE body (``[DONE]`` left out)."""
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# ------------------------------------------------------------------ echo (run_event)


async def test_echo_non_stream_and_stream_run_event_usage_per_principal() -> None:
    """Input = the §2.4 estimate over every text part the node receives; output = chunks."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first part, "},
                {"type": "text", "text": "hello  there world"},
            ],
        },
    ]
    # 14 + 12 + 18 = 44 code points -> 11 input tokens; the echo answers the last user
    # message's text parts joined, "first part, hello  there world": 5 chunks.
    chars = len("You are terse.") + len("first part, ") + len("hello  there world")
    assert estimate_input_tokens(messages) == math.ceil(chars / 4) == 11
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(auth=True)) as gw:
            before = await scrape(gw)
            r = await chat(gw, {"model": "echo", "messages": messages}, token=PRINCIPAL_TOKEN)
            assert r.status == 200
            doc = r.json()
            assert doc["choices"][0]["message"]["content"] == "first part, hello  there world"
            usage = doc["usage"]
            r = await chat(
                gw,
                {
                    "model": "echo",
                    "messages": [{"role": "user", "content": "one two three four"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                token=LEGACY_TOKEN,
            )
            assert r.status == 200
            stream_usage = [e["usage"] for e in sse_events(r.body) if e.get("usage")]
            after = await wait_requests(gw, before, 2)

    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (11, 5)
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in stream_usage] == [(5, 4)]
    alice = req(ALICE, group="echo")
    legacy = req(UNMAPPED, group="echo")
    assert changes(before, after, "iop_openai_requests_total") == {alice: 1, legacy: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(alice, "run_event", input=11, output=5),
        **tokens(legacy, "run_event", input=5, output=4),  # ceil(18/4), 4 chunks
    }
    assert_no_reasoning(before, after)
    hist = changes(before, after, "iop_request_duration_seconds_count")
    assert hist == {
        frozenset(
            {"edge_id": EDGE_ID, "endpoint": "chat_completions", "response_mode": "normalized"}.items()
        ): 2
    }


async def test_open_caller_and_responses_endpoint_are_unmapped() -> None:
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml()) as gw:
            before = await scrape(gw)
            r = await chat(gw, {"model": "echo", "messages": [{"role": "user", "content": "a b"}]})
            assert r.status == 200
            r = await chat(gw, {"model": "echo", "input": "x y z"}, path="/v1/responses")
            assert r.status == 200
            after = await wait_requests(gw, before, 2)
    chat_l = req(UNMAPPED, group="echo")
    resp_l = req(UNMAPPED, group="echo", endpoint="responses")
    assert changes(before, after, "iop_openai_requests_total") == {chat_l: 1, resp_l: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(chat_l, "run_event", input=1, output=2),
        **tokens(resp_l, "run_event", input=2, output=3),
    }
