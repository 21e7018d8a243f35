"""``/v1/responses`` on a passthrough provider that speaks only Chat Completions
(``openai_responses: false``), through the official ``openai`` SDK: the edge
translates the request to ``/v1/chat/completions`` and the answer back into
the ``response`` object and its event stream (``responses.stream``'s
accumulator checks the event order and item identities)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
import trio

from tests.support.configs import edge_yaml, model, node
from tests.support.gateway import (
    Gateway,
    http_request,
    in_thread,
    metric,
    running_gateway,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"type": "custom", "name": "apply_patch", "description": "a patch"},
    {"type": "web_search"},
]


@asynccontextmanager
async def chat_only_gateway() -> AsyncIterator[tuple[Gateway, MockOpenAIServer]]:
    async with trio.open_nursery() as nursery:
        upstream = MockOpenAIServer()
        upstream.responses_api = False  # a 404 if the edge relayed /v1/responses
        await nursery.start(upstream.serve)
        spec = {
            "id": "chat-1",
            "type": "openai",
            "base_url": upstream.base_url,
            "models": ["served"],
            "openai_responses": False,
            "health_interval": 30,
        }
        yaml_text = edge_yaml(
            models=[model("coder", {"chat-1": "served"})], nodes=[node(providers=[spec])]
        )
        async with running_gateway(yaml_text) as gw:
            yield gw, upstream
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("stream", [False, True])
async def test_text_answer_translated(stream: bool) -> None:
    with trio.fail_after(30):
        async with chat_only_gateway() as (gw, upstream):
            client = gw.sdk()

            def ask() -> Any:
                kwargs: Any = {"model": "coder", "input": "hi", "instructions": "be brief"}
                if not stream:
                    return client.responses.create(**kwargs)
                with client.responses.stream(**kwargs) as s:
                    kinds = [event.type for event in s]
                    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                    return s.get_final_response()

            resp = await in_thread(ask)
            assert resp.output_text == upstream.reply_text
            assert resp.status == "completed" and resp.model == "coder"
            assert resp.usage is not None
            assert (resp.usage.input_tokens, resp.usage.output_tokens) == (11, 7)
            sent = upstream.requests[-1]
            assert sent.path == "/v1/chat/completions"
            body = sent.json()
            assert body["model"] == "served"
            assert body["messages"] == [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
            ]
            assert body.get("stream_options") == ({"include_usage": True} if stream else None)
            await wait_until(
                lambda: (
                    metric(gw, "iop_openai_requests_total", endpoint="responses", status="ok") >= 1
                )
            )
            for kind, n in (("input", 11), ("output", 7)):
                assert (
                    metric(
                        gw,
                        "iop_openai_usage_tokens_total",
                        endpoint="responses",
                        status="ok",
                        token_type=kind,
                    )
                    == n
                )


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_translated(stream: bool) -> None:
    """Two calls (split across deltas when streamed): a function call and a
    custom tool's call; the built-in tool is dropped and named."""
    with trio.fail_after(30):
        async with chat_only_gateway() as (gw, upstream):
            upstream.reply_text = ""
            upstream.tool_calls = [
                {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'},
            ]
            client = gw.sdk()

            def ask() -> Any:
                kwargs: Any = {"model": "coder", "input": "weather?", "tools": TOOLS}
                if not stream:
                    return client.responses.with_raw_response.create(**kwargs)
                with client.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
                    events = list(raw.parse())
                    return raw, events[-1].response

            if stream:
                raw, resp = await in_thread(ask)
            else:
                raw = await in_thread(ask)
                resp = raw.parse()
            assert raw.headers["x-iopd-dropped-tools"] == "web_search"
            kinds = [(item.type, item.call_id) for item in resp.output]
            assert kinds == [("function_call", "call_0"), ("custom_tool_call", "call_1")]
            assert resp.output[0].name == "get_weather"
            assert resp.output[0].arguments == '{"city": "Oslo"}'
            assert resp.output[1].name == "apply_patch"
            assert resp.output[1].input == "*** Begin Patch"
            body = upstream.requests[-1].json()
            names = [t["function"]["name"] for t in body["tools"]]
            assert names == ["get_weather", "apply_patch"]
            assert body["tools"][1]["function"]["parameters"]["required"] == ["input"]


async def test_retry_crosses_to_a_chat_only_provider() -> None:
    """A 503 from a provider that serves Responses is retried on the group's
    chat-only one, which gets the translation (the path is each attempt's)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            native = await nursery.start(MockOpenAIServer().serve)
            chat = MockOpenAIServer()
            chat.responses_api = False
            await nursery.start(chat.serve)
            providers = [
                {"id": "r-1", "type": "openai", "base_url": native.base_url, "priority": 0},
                {
                    "id": "c-1",
                    "type": "openai",
                    "base_url": chat.base_url,
                    "priority": 1,
                    "openai_responses": False,
                },
            ]
            for p in providers:
                p.update(models=["s"], health_interval=30)
            yaml_text = edge_yaml(
                models=[model("pair", {"r-1": "s", "c-1": "s"})],
                nodes=[node(providers=providers)],
            )
            async with running_gateway(yaml_text) as gw:
                await _all_healthy(gw)  # so the first attempt goes by priority: r-1
                client = gw.sdk()
                native.mode = "status503"
                resp = await in_thread(lambda: client.responses.create(model="pair", input="hi"))
                assert resp.output_text == chat.reply_text
                assert [r.path for r in native.requests if r.method == "POST"] == ["/v1/responses"]
                assert [r.path for r in chat.requests if r.method == "POST"] == [
                    "/v1/chat/completions"
                ]
            nursery.cancel_scope.cancel()


async def _all_healthy(gw: Gateway) -> None:
    while True:
        doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
        if all(p["health"] == "healthy" for p in doc["providers"]):
            return
        await trio.sleep(0.02)


async def test_what_chat_cannot_carry_is_a_400_naming_the_field() -> None:
    with trio.fail_after(30):
        async with chat_only_gateway() as (gw, upstream):
            client = gw.sdk()
            with pytest.raises(openai.BadRequestError) as caught:
                await in_thread(
                    lambda: client.responses.create(
                        model="coder", input="x", previous_response_id="resp_earlier"
                    )
                )
            assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
            assert [r for r in upstream.requests if r.method == "POST"] == []
