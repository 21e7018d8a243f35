"""Costly tool calls and JSON bodies, replayed against a real edge and node.

Each case sends what froze or bloated the edge before (a tool-call schema or
argument whose validation never ended, a quadratic tag scan, a JSON body of
millions of tiny values) while another connection asks ``GET /v1/models``.
The hostile caller gets an answer (the plain-text fallback, or a 400), and
the other caller is served.  Before the fixes these tests did not fail: they
hung, because the loop itself was stuck (the ``fail_after`` guards could not
fire either; pytest's timeout ended them).  Speed is measured by
``scripts/measure_hostile_compute.py``, not asserted here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.support.configs import echo_provider, edge_yaml, node
from tests.support.gateway import RawResponse, http_request, running_gateway

EDGE_YAML = edge_yaml(edge_id="edge-hostile", nodes=[node(providers=[echo_provider(category=None)])])


def _tools(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


async def _while_models_answers(
    gw: Any, path: str, body: bytes | dict[str, Any]
) -> tuple[RawResponse, RawResponse]:
    """POST ``body`` and, on another connection meanwhile, GET /v1/models."""
    results: dict[str, RawResponse] = {}

    async def hostile() -> None:
        results["hostile"] = await http_request(gw.host_port, "POST", path, body=body)

    async def models() -> None:
        results["models"] = await http_request(gw.host_port, "GET", "/v1/models")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hostile)
        nursery.start_soon(models)
    return results["hostile"], results["models"]


TOOL_CASES = [
    pytest.param(
        _tools({"type": "object", "allOf": [{"$ref": "#"}, {"$ref": "#"}, {"$ref": "#"}]}),
        '<tool_call>{"name":"f","arguments":{}}</tool_call>',
        id="self-referring-allOf",
    ),
    pytest.param(
        _tools({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}),
        '<tool_call>{"name":"f","arguments":{"a":"' + "a" * 40 + '!"}}</tool_call>',
        id="backtracking-pattern",
    ),
    pytest.param(_tools({}), "<tool_call>" * 50_000, id="unclosed-tags"),
    pytest.param(
        _tools({}), "<tool_call>```" + "\n " * 5_000 + "x```</tool_call>", id="fence-whitespace"
    ),
]


@pytest.mark.parametrize(("tools", "text"), TOOL_CASES)
async def test_hostile_tool_call_gets_the_text_back_and_others_are_served(
    tools: list[dict[str, Any]], text: str
) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": text}], "tools": tools}
    with trio.fail_after(60):
        async with running_gateway(EDGE_YAML) as gw:
            reply, models = await _while_models_answers(gw, "/v1/chat/completions", body)
            assert reply.status == 200, reply.body[:300]
            message = reply.json()["choices"][0]["message"]
            assert message.get("tool_calls") is None
            assert message["content"] == text  # the plain-text fallback
            assert models.status == 200 and models.json()["data"][0]["id"] == "echo"


async def test_hostile_tool_call_while_streaming_falls_back_too() -> None:
    tools, text = TOOL_CASES[0].values
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": text}],
        "tools": tools,
        "stream": True,
    }
    with trio.fail_after(60):
        async with running_gateway(EDGE_YAML) as gw:
            reply, models = await _while_models_answers(gw, "/v1/chat/completions", body)
            assert reply.status == 200
            events = [
                json.loads(line[len("data: ") :])
                for line in reply.body.decode().splitlines()
                if line.startswith("data: {")
            ]
            content = "".join(
                e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
            )
            assert content == text
            assert models.status == 200


def _chat_with_extra(extra: bytes) -> bytes:
    return b'{"model":"echo","messages":[{"role":"user","content":"hi"}],"x":' + extra + b"}"


async def test_json_of_millions_of_tiny_values_is_refused_and_others_are_served() -> None:
    # 4 MiB of [] decoded to ~86 MiB of lists (and held that while queued).
    body = _chat_with_extra(b"[" + b"[]," * (4 * 1024 * 1024 // 3) + b"[]]")
    with trio.fail_after(60):
        async with running_gateway(EDGE_YAML) as gw:
            reply, models = await _while_models_answers(gw, "/v1/chat/completions", body)
            assert reply.status == 400
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "too costly to decode" in error["message"]
            assert models.status == 200


async def test_dense_token_ids_still_pass() -> None:
    ids = b",".join(str(10_000 + i % 90_000).encode() for i in range(600_000))  # ~3.4 MiB
    with trio.fail_after(60):
        async with running_gateway(EDGE_YAML) as gw:
            reply = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body=_chat_with_extra(b"[" + ids + b"]"),
            )
            assert reply.status == 200, reply.body[:300]
            assert reply.json()["choices"][0]["message"]["content"] == "hi"
