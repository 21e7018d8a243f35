"""The ollama adapter: normalized /api/chat runs and the raw /api/* relay."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from iopd.node.adapters.base import AdapterError, CollectedRunOutput, CollectedTunnelOutput
from iopd.node.adapters.ollama import OllamaAdapter, to_ollama_messages
from iopd.node.usage_extract import NdjsonUsageScanner
from tests.support.mock_providers import MockOllamaServer, MockReply
from tests.support.node_parts import adapter_req
from wire.messages import ProviderSpec, ProviderTunnelRequest, RunRequest, Usage


def adapter_for(ollama_mock: MockOllamaServer) -> OllamaAdapter:
    return OllamaAdapter(ProviderSpec(id="ol", type="ollama", base_url=ollama_mock.base_url))


def run_req(**kw: Any) -> RunRequest:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be nice"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    return adapter_req("ol", "ollama", "qwen3:32b", messages, **kw)


async def test_run_maps_text_thinking_usage_and_options(ollama_mock: MockOllamaServer) -> None:
    ollama_mock.reasoning_text = "hmm ok"
    out = CollectedRunOutput()
    with trio.fail_after(5):
        await adapter_for(ollama_mock).run(
            run_req(
                params={
                    "temperature": 0.1,
                    "top_p": 0.9,
                    "max_tokens": 64,
                    "stop": ["x"],
                    "seed": 7,
                    "user": "u",
                }
            ),
            out,
        )
    sent = ollama_mock.requests[0].json()
    assert ollama_mock.requests[0].path == "/api/chat"
    assert sent["model"] == "qwen3:32b" and sent["stream"] is True
    assert sent["options"] == {
        "temperature": 0.1,
        "top_p": 0.9,
        "num_predict": 64,
        "stop": ["x"],
        "seed": 7,
    }
    assert sent["messages"] == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hi there"},
    ]
    assert out.joined_text == "Hello from ollama"
    assert out.joined_reasoning == "hmm ok"
    assert out.usage == Usage(input_tokens=13, output_tokens=5)
    assert out.finish_reason == "stop"


async def test_run_tool_calls_become_openai_shape(ollama_mock: MockOllamaServer) -> None:
    ollama_mock.reply_text = ""
    ollama_mock.tool_calls = [{"name": "lookup", "arguments": {"q": "trio", "n": 2}}]
    out = CollectedRunOutput()
    with trio.fail_after(5):
        await adapter_for(ollama_mock).run(
            run_req(tools=[{"type": "function", "function": {"name": "lookup"}}]), out
        )
    (call,) = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"q": "trio", "n": 2}
    assert out.finish_reason == "tool_calls"
    assert ollama_mock.requests[0].json()["tools"][0]["function"]["name"] == "lookup"


def test_history_tool_calls_are_converted_for_ollama() -> None:
    messages: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert to_ollama_messages(messages) == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "42"},
    ]


async def test_run_errors(ollama_mock: MockOllamaServer) -> None:
    adapter = adapter_for(ollama_mock)
    with trio.fail_after(5):
        ollama_mock.mode = "error500"
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(), CollectedRunOutput())
        assert info.value.code == "provider_error"
        ollama_mock.mode = "ok"
        ollama_mock.handler = lambda req: MockReply(chunks=[b'{"error": "model not found"}\n'])
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(), CollectedRunOutput())
        assert "model not found" in info.value.message
        ollama_mock.handler = lambda req: MockReply(chunks=[b"garbage\n"])
        with pytest.raises(AdapterError):
            await adapter.run(run_req(), CollectedRunOutput())
        ollama_mock.handler = None
        ollama_mock.mode, ollama_mock.retry_after = "status429", "7"
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(), CollectedRunOutput())
        assert (info.value.code, info.value.retry_after) == ("provider_saturated", "7")


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("stream", [True, False])
async def test_tunnel_relays_raw_and_extracts_usage(
    ollama_mock: MockOllamaServer, path: str, stream: bool
) -> None:
    body = {"model": "qwen3:32b", "stream": stream, "prompt": "hi", "messages": []}
    req = ProviderTunnelRequest(
        stream_id=1, provider_id="ol", method="POST", path=path, body=json.dumps(body).encode()
    )
    out = CollectedTunnelOutput()
    with trio.fail_after(5):
        await adapter_for(ollama_mock).tunnel(req, out)
    reply = ollama_mock._generate(body, chat=path == "/api/chat")
    assert out.status == 200
    assert out.data == (reply.body if reply.chunks is None else b"".join(reply.chunks))
    assert out.usage == Usage(input_tokens=13, output_tokens=5)


def test_ndjson_scanner_counts_thinking() -> None:
    scanner = NdjsonUsageScanner()
    scanner.feed(
        b'{"message":{"thinking":"abc"},"done":false}\n{"done":true,"prompt_eval_count":1,'
    )
    scanner.feed(b'"eval_count":2}')
    scanner.finish()
    assert scanner.usage == Usage(input_tokens=1, output_tokens=2)
    assert scanner.reasoning_chars == 3


async def test_probe_uses_api_tags(ollama_mock: MockOllamaServer) -> None:
    adapter = adapter_for(ollama_mock)
    with trio.fail_after(5):
        assert await adapter.probe() == ("healthy", "")
        assert ollama_mock.requests[-1].path == "/api/tags"
        ollama_mock.healthy = False
        assert (await adapter.probe())[0] == "unhealthy"


async def test_probe_reports_a_model_ollama_has_not_pulled(ollama_mock: MockOllamaServer) -> None:
    ollama_mock.listed = ["llama3:latest"]
    spec = ProviderSpec(
        id="ol", type="ollama", base_url=ollama_mock.base_url, models=["llama3", "qwen3:32b"]
    )
    adapter = OllamaAdapter(spec)
    with trio.fail_after(5):
        health, error = await adapter.probe()
        assert health == "unhealthy"
        assert error.startswith("model 'qwen3:32b' not served: /api/tags lists 'llama3:latest'")
        ollama_mock.listed.append("qwen3:32b")
        assert await adapter.probe() == ("healthy", "")
    await adapter.aclose()


@pytest.mark.parametrize(
    ("params", "options", "think"),
    [
        (
            {"top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1},
            {"top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1},
            None,
        ),
        ({"reasoning_effort": "high"}, None, "high"),
        ({"reasoning_effort": "minimal"}, None, "low"),
        ({"reasoning_effort": "none"}, None, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, None, False),
        # reasoning_effort wins over the template switch; other kwargs have no place
        (
            {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False, "x": 1}},
            None,
            "low",
        ),
        ({"chat_template_kwargs": {"x": 1}}, None, None),
    ],
)
def test_chat_body_maps_sampling_extras_and_think(
    params: dict[str, Any], options: dict[str, Any] | None, think: Any
) -> None:
    adapter = OllamaAdapter(ProviderSpec(id="ol", type="ollama", base_url="http://127.0.0.1:9"))
    body = adapter.chat_body(run_req(params=params))
    assert body.get("options") == options
    assert body.get("think", None) == think
    assert ("think" in body) is (think is not None)
    assert "chat_template_kwargs" not in body


def test_embeddings_translation_both_ways() -> None:
    import base64
    import struct

    from iopd.node.adapters.ollama import ollama_embed_body, openai_embeddings

    body = {"model": "nomic", "input": ["a", "b"], "dimensions": 3, "user": "u"}
    assert ollama_embed_body(body) == {"model": "nomic", "input": ["a", "b"], "dimensions": 3}
    for bad in ({"input": [[1, 2]]}, {"input": []}, {"input": "x", "dimensions": 0}, []):
        with pytest.raises(AdapterError) as info:
            ollama_embed_body(bad)
        assert info.value.code == "bad_request"
    answer = {"embeddings": [[0.5, -1.0], [2.0, 0.25]], "prompt_eval_count": 4}
    doc, tokens = openai_embeddings(answer, "nomic", "float")
    assert tokens == 4 and doc["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [d["embedding"] for d in doc["data"]] == [[0.5, -1.0], [2.0, 0.25]]
    packed, _ = openai_embeddings(answer, "nomic", "base64")
    first = base64.b64decode(packed["data"][0]["embedding"])
    assert struct.unpack("<2f", first) == (0.5, -1.0)
    with pytest.raises(AdapterError):
        openai_embeddings({"error": "x"}, "nomic", "float")


async def test_a_large_embeddings_answer_goes_out_in_pieces(ollama_mock: MockOllamaServer) -> None:
    from iopd.node.adapters.ollama import EMBED_CHUNK_BYTES

    vector = [0.123456789] * 20000
    ollama_mock.handler = lambda req: MockReply(
        body=json.dumps({"embeddings": [vector, vector], "prompt_eval_count": 2}).encode()
    )
    adapter = adapter_for(ollama_mock)
    out = CollectedTunnelOutput()
    body = json.dumps({"model": "nomic", "input": ["a", "b"], "encoding_format": "float"})
    req = ProviderTunnelRequest(
        stream_id=1, provider_id="ol", method="POST", path="/v1/embeddings", body=body.encode()
    )
    with trio.fail_after(10):
        await adapter.tunnel(req, out)
    await adapter.aclose()
    assert out.status == 200 and len(out.chunks) > 1
    assert all(len(c) <= EMBED_CHUNK_BYTES for c in out.chunks)
    doc = json.loads(out.data)
    assert len(doc["data"]) == 2 and len(doc["data"][1]["embedding"]) == 20000
    assert out.usage == Usage(input_tokens=2)
    assert [r.path for r in ollama_mock.requests] == ["/api/embed"]
