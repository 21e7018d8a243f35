"""End to end: the Ollama side of the edge.

A real edge and node in front of ``MockOllamaServer``: ``/api/chat`` and
``/api/generate`` are relayed raw with ``model`` rewritten to the served name,
``/api/tags`` is answered by the edge from its catalog, a group without an
ollama provider gets a clear 400, and the normalized ``/v1/chat/completions``
path restores Ollama's ``thinking`` and native ``tool_calls`` into the
OpenAI shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from tests.support.configs import OLLAMA_SERVED, ollama_yaml
from tests.support.gateway import (
    Gateway,
    http_request,
    in_thread,
    running_gateway,
)
from tests.support.mock_providers import MockOllamaServer
from tests.support.replies import function_tool


@asynccontextmanager
async def ollama_gateway(
    mock: MockOllamaServer | None = None, *, generation: str = ""
) -> AsyncIterator[tuple[Gateway, MockOllamaServer]]:
    mock = mock or MockOllamaServer()
    async with trio.open_nursery() as n:
        await n.start(mock.serve)
        async with running_gateway(ollama_yaml(mock.base_url, generation=generation)) as gw:
            yield gw, mock
        n.cancel_scope.cancel()


def posts(mock: MockOllamaServer, path: str) -> list[dict[str, object]]:
    return [r.json() for r in mock.requests if r.method == "POST" and r.path == path]


async def test_api_chat_and_generate_relayed_raw_with_model_rewritten() -> None:
    with trio.fail_after(30):
        async with ollama_gateway() as (gw, mock):
            for path, extra in (
                ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
                ("/api/generate", {"prompt": "hi"}),
            ):
                for stream in (True, False):
                    body = {"model": "llama", "stream": stream, "keep_alive": "5m", **extra}
                    r = await http_request(gw.host_port, "POST", path, body=body)
                    assert r.status == 200, r.body
                    sent = posts(mock, path)[-1]
                    assert sent == {**body, "model": OLLAMA_SERVED}  # unknown fields kept
                    # The provider's bytes, unchanged: the same request straight to the mock.
                    direct = await http_request(
                        ("127.0.0.1", mock.port), "POST", path, body={**body, "model": OLLAMA_SERVED}
                    )
                    assert r.body == direct.body
                    ctype = r.header("content-type")
                    if stream:
                        assert ctype == "application/x-ndjson"
                        assert r.header("x-accel-buffering") == "no"
                        lines = [json.loads(line) for line in r.body.splitlines()]
                        assert lines[-1]["done"] is True
                        assert all(line["model"] == OLLAMA_SERVED for line in lines)
                    else:
                        assert ctype == "application/json"
                        assert r.json()["done"] is True


async def test_api_tags_from_the_catalog_not_the_provider() -> None:
    with trio.fail_after(30):
        async with ollama_gateway() as (gw, mock):
            before = len(mock.requests)
            r = await http_request(gw.host_port, "GET", "/api/tags")
            assert r.status == 200
            names = [m["name"] for m in r.json()["models"]]
            assert names == ["llama", "both"]  # groups with an ollama provider, in order
            assert all(m["model"] == m["name"] for m in r.json()["models"])
            # Answered by the edge: no /api/tags call beyond the health probes.
            assert all(q.path == "/api/tags" and q.method == "GET" for q in mock.requests[before:])
            r = await http_request(gw.host_port, "POST", "/api/tags")
            assert r.status == 405  # in Ollama's error shape: {"error": "<message>"}
            assert r.json() == {"error": "POST is not allowed on /api/tags"}


async def test_api_on_a_group_without_ollama_is_a_clear_400() -> None:
    with trio.fail_after(30):
        async with ollama_gateway() as (gw, mock):
            for path in ("/api/chat", "/api/generate"):
                r = await http_request(
                    gw.host_port, "POST", path, body={"model": "echo-only", "prompt": "x"}
                )
                assert r.status == 400  # errors on /api/* take Ollama's shape
                err = r.json()["error"]
                assert f"model 'echo-only' has no ollama provider for {path}" == err
            r = await http_request(gw.host_port, "POST", "/api/chat", body={"model": "nope"})
            assert r.status == 404 and "'nope' does not exist" in r.json()["error"]
            r = await http_request(gw.host_port, "POST", "/api/chat", body={"messages": []})
            assert r.status == 400 and r.json() == {"error": "'model' is required"}
            r = await http_request(gw.host_port, "POST", "/api/pull", body={"model": "llama"})
            assert r.status == 404 and r.json() == {"error": "no route for POST /api/pull"}
            # A mixed group relays /api/* only to its ollama provider.
            for _ in range(3):
                r = await http_request(
                    gw.host_port, "POST", "/api/generate", body={"model": "both", "prompt": "x"}
                )
                assert r.status == 200
            assert len(posts(mock, "/api/generate")) == 3


async def test_api_relay_enforces_generation_limits_without_adding_defaults() -> None:
    generation = "    generation: {defaults: {temperature: 0.1}, limits: {max_tokens: 64}}"
    with trio.fail_after(30):
        async with ollama_gateway(generation=generation) as (gw, mock):
            body = {
                "model": "llama",
                "prompt": "x",
                "stream": False,
                "options": {"num_predict": 64},
            }
            r = await http_request(gw.host_port, "POST", "/api/generate", body=body)
            assert r.status == 200
            assert posts(mock, "/api/generate")[-1]["options"] == {"num_predict": 64}
            body["options"] = {"num_predict": 65}
            r = await http_request(gw.host_port, "POST", "/api/generate", body=body)
            assert r.status == 400
            assert "options.num_predict" in r.json()["error"]
            assert len(posts(mock, "/api/generate")) == 1


async def test_normalized_chat_restores_thinking_and_native_tool_calls() -> None:
    mock = MockOllamaServer()
    mock.reasoning_text = "let me think about it"
    mock.reply_text = "The weather is fine."
    mock.tool_calls = [{"name": "get_weather", "arguments": {"city": "Seoul", "days": 2}}]
    weather = {"city": {"type": "string"}, "days": {"type": "integer"}}
    tools = [function_tool("get_weather", weather)]
    messages = [{"role": "user", "content": "weather in Seoul?"}]
    with trio.fail_after(30):
        async with ollama_gateway(mock) as (gw, _):
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body={"model": "llama", "messages": messages, "tools": tools},
            )
            assert r.status == 200, r.body
            sent = posts(mock, "/api/chat")[-1]
            assert sent["model"] == OLLAMA_SERVED
            assert sent["tools"]  # native tools: passed to the provider, no text protocol
            assert "tool_call>" not in json.dumps(sent["messages"])
            choice = r.json()["choices"][0]
            msg = choice["message"]
            assert msg["reasoning_content"] == mock.reasoning_text
            assert choice["finish_reason"] == "tool_calls"
            (call,) = msg["tool_calls"]
            assert call["type"] == "function" and call["id"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Seoul", "days": 2}
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == mock.prompt_eval_count
            assert usage["completion_tokens"] == mock.eval_count

            # The same through the SDK, streaming.
            client = gw.sdk()

            def stream() -> tuple[str, str, list[object]]:
                text, reasoning = "", ""
                calls: list[object] = []
                for chunk in client.chat.completions.create(
                    model="llama", messages=messages, tools=tools, stream=True
                ):
                    if not chunk.choices:
                        continue
                    delta = chunk.choices[0].delta
                    text += delta.content or ""
                    reasoning += getattr(delta, "reasoning_content", None) or ""
                    calls += delta.tool_calls or []
                return text, reasoning, calls

            text, reasoning, calls = await in_thread(stream)
            assert text == mock.reply_text
            assert reasoning == mock.reasoning_text
            assert len(calls) == 1
            fn = calls[0].function  # type: ignore[attr-defined]
            assert fn.name == "get_weather"
            assert json.loads(fn.arguments) == {"city": "Seoul", "days": 2}
