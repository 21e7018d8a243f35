"""The openai adapter: passthrough relay, usage extraction, normalized run, probes."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
import trio.testing

from iopd.node.adapters.base import AdapterError, CollectedRunOutput, CollectedTunnelOutput
from iopd.node.adapters.http_relay import end_to_end
from iopd.node.adapters.openai import OpenAIAdapter
from iopd.node.executor import NodeExecutor
from iopd.node.usage_extract import (
    MAX_PARSED_BYTES,
    JsonUsageScanner,
    SseUsageScanner,
    scanner_for,
    usage_from_openai,
)
from tests.support.mock_providers import MockOpenAIServer, MockReply
from tests.support.node_parts import adapter_req, tunnel_req
from wire.messages import NodeConfig, ProviderSpec, RunRequest, Usage

CANARY = "sk-canary-4f1d2a9e"


def adapter_for(openai_mock: MockOpenAIServer, **kw: Any) -> OpenAIAdapter:
    return OpenAIAdapter(ProviderSpec(id="vllm", type="openai", base_url=openai_mock.base_url, **kw))


def expected_body(reply: MockReply) -> bytes:
    return reply.body if reply.chunks is None else b"".join(reply.chunks)


# ------------------------------------------------------------------ usage_extract (pure)


def test_usage_from_chat_and_responses_shapes() -> None:
    assert usage_from_openai(
        {
            "prompt_tokens": 10,
            "completion_tokens": 20,
            "completion_tokens_details": {"reasoning_tokens": 5},
            "prompt_tokens_details": {"cached_tokens": 2},
        }
    ) == Usage(input_tokens=10, output_tokens=20, reasoning_tokens=5, cached_input_tokens=2)
    assert usage_from_openai(
        {
            "input_tokens": 1,
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 3},
            "input_tokens_details": {"cached_tokens": 4},
        }
    ) == Usage(input_tokens=1, output_tokens=2, reasoning_tokens=3, cached_input_tokens=4)
    assert usage_from_openai({"total_tokens": 3}) is None
    assert usage_from_openai(None) is None


def test_sse_scanner_handles_byte_at_a_time_feeding() -> None:
    body = (
        b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\r\n\r\n'
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
        b"data: [DONE]\n\n"
    )
    scanner = SseUsageScanner()
    for i in range(len(body)):
        scanner.feed(body[i : i + 1])
    scanner.finish()
    assert scanner.usage == Usage(input_tokens=3, output_tokens=4)
    assert scanner.reasoning_chars == 3


def test_overlong_sse_line_is_bounded_and_usage_found_in_tail() -> None:
    scanner = SseUsageScanner()
    big = b"x" * (MAX_PARSED_BYTES + 10)
    scanner.feed(b'data: {"type":"response.completed","response":{"output":"')
    for i in range(0, len(big), 1 << 20):
        scanner.feed(big[i : i + (1 << 20)])
        assert len(scanner._buf) <= MAX_PARSED_BYTES + (1 << 20)
    scanner.feed(
        b'","usage":{"input_tokens":7,"output_tokens":8,"output_tokens_details":{"reasoning_tokens":1}}}}\n\n'
    )
    scanner.finish()
    assert scanner.usage == Usage(input_tokens=7, output_tokens=8, reasoning_tokens=1)


def test_json_scanner_and_scanner_choice() -> None:
    scanner = scanner_for("application/json; charset=utf-8")
    assert isinstance(scanner, JsonUsageScanner)
    scanner.feed(b'{"usage": {"prompt_tokens": 1, ')
    scanner.feed(b'"completion_tokens": 2}}')
    scanner.finish()
    assert scanner.usage == Usage(input_tokens=1, output_tokens=2)
    garbage = scanner_for("application/json")
    garbage.feed(b"not json")
    garbage.finish()
    assert garbage.usage is None
    assert isinstance(scanner_for("text/event-stream"), SseUsageScanner)


def test_end_to_end_drops_hop_by_hop_headers() -> None:
    headers = [
        ("Connection", "keep-alive, X-Hop"),
        ("Keep-Alive", "5"),
        ("Transfer-Encoding", "chunked"),
        ("TE", "trailers"),
        ("Trailer", "x"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "secret"),
        ("X-Hop", "1"),
        ("Content-Length", "10"),
        ("X-Request-Id", "abc"),
        ("Content-Type", "application/json"),
    ]
    assert end_to_end(headers, request=False) == [
        ("X-Request-Id", "abc"),
        ("Content-Type", "application/json"),
    ]


# ------------------------------------------------------------------ passthrough


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_passthrough_is_byte_exact_with_usage(
    openai_mock: MockOpenAIServer, stream: bool
) -> None:
    openai_mock.reasoning_text = "let me think"
    openai_mock.usage = {
        "prompt_tokens": 12,
        "completion_tokens": 9,
        "completion_tokens_details": {"reasoning_tokens": 4},
        "prompt_tokens_details": {"cached_tokens": 6},
    }
    adapter = adapter_for(openai_mock)
    body = {"model": "m", "messages": [], "stream": stream, "codex_field": [1, 2]}
    out = CollectedTunnelOutput()
    with trio.fail_after(5):
        await adapter.tunnel(tunnel_req("/v1/chat/completions", body), out)
    assert out.status == 200
    assert out.data == expected_body(openai_mock._chat(body))
    assert b"x_unknown_field" in out.data
    assert json.loads(openai_mock.requests[0].body)["codex_field"] == [1, 2]
    assert not any(k == "content-length" for k, _ in out.headers)
    assert out.usage == Usage(
        input_tokens=12, output_tokens=9, reasoning_tokens=4, cached_input_tokens=6
    )
    assert out.reasoning_chars == len("let me think")
    if stream:
        assert len(out.chunks) > 1  # relayed as it arrived, not re-buffered


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_passthrough_usage(openai_mock: MockOpenAIServer, stream: bool) -> None:
    adapter = adapter_for(openai_mock)
    body = {"model": "m", "input": "hi", "stream": stream}
    out = CollectedTunnelOutput()
    with trio.fail_after(5):
        await adapter.tunnel(tunnel_req("/v1/responses", body), out)
    assert out.data == expected_body(openai_mock._responses(body))
    assert out.usage == Usage(
        input_tokens=11, output_tokens=7, reasoning_tokens=3, cached_input_tokens=2
    )


async def test_passthrough_request_headers_and_api_key(openai_mock: MockOpenAIServer) -> None:
    adapter = adapter_for(openai_mock, api_key=CANARY)
    headers = [
        ("content-type", "application/json"),
        ("connection", "keep-alive"),
        ("keep-alive", "timeout=5"),
        ("te", "trailers"),
        ("accept-encoding", "gzip"),
        ("proxy-authorization", "Basic x"),
        ("x-trace", "t-1"),
    ]
    with trio.fail_after(5):
        await adapter.tunnel(
            tunnel_req("/v1/chat/completions", {"model": "m"}, headers), CollectedTunnelOutput()
        )
        forwarded = [
            ("content-type", "application/json"),
            ("authorization", "Bearer caller-provider-key"),
        ]
        await adapter.tunnel(
            tunnel_req("/v1/chat/completions", {"model": "m"}, forwarded), CollectedTunnelOutput()
        )
    first, second = openai_mock.requests
    names = {k for k, _ in first.headers}
    assert {"keep-alive", "te", "accept-encoding", "proxy-authorization"}.isdisjoint(names)
    assert first.header("x-trace") == "t-1"
    assert first.header("authorization") == f"Bearer {CANARY}"
    assert [v for k, v in second.headers if k == "authorization"] == ["Bearer caller-provider-key"]
    assert openai_mock.connections_opened == 1  # keep-alive across tunnels


async def test_passthrough_relays_provider_500(openai_mock: MockOpenAIServer) -> None:
    openai_mock.mode = "error500"
    out = CollectedTunnelOutput()
    with trio.fail_after(5):
        await adapter_for(openai_mock).tunnel(tunnel_req("/v1/chat/completions", {"model": "m"}), out)
    assert out.status == 500
    assert json.loads(out.data)["error"]["message"] == "boom"


async def test_passthrough_unreachable_and_garbage(openai_mock: MockOpenAIServer) -> None:
    dead = OpenAIAdapter(ProviderSpec(id="x", type="openai", base_url="http://127.0.0.1:1"))
    with trio.fail_after(5):
        with pytest.raises(AdapterError) as info:
            await dead.tunnel(tunnel_req("/v1/chat/completions", {}), CollectedTunnelOutput())
        assert info.value.code == "provider_unreachable"  # never reached: the edge may retry
        openai_mock.mode = "garbage"
        with pytest.raises(AdapterError) as info:
            await adapter_for(openai_mock).tunnel(
                tunnel_req("/v1/chat/completions", {}), CollectedTunnelOutput()
            )
        assert info.value.code == "provider_error"


async def test_passthrough_hang_is_provider_timeout(
    openai_mock: MockOpenAIServer, autojump_clock: trio.testing.MockClock
) -> None:
    openai_mock.mode = "hang"
    with trio.fail_after(100):
        with pytest.raises(AdapterError) as info:
            await adapter_for(openai_mock, read_timeout=30).tunnel(
                tunnel_req("/v1/chat/completions", {}), CollectedTunnelOutput()
            )
    assert info.value.code == "provider_timeout"


async def test_cancel_through_executor_closes_upstream_connection(openai_mock: MockOpenAIServer) -> None:
    from tests.support.node_parts import ListSender

    openai_mock.chunk_delay = 0.05
    openai_mock.reply_text = " ".join(["word"] * 200)
    executor = NodeExecutor()
    await executor.on_config(
        NodeConfig(
            stream_id=0,
            version=1,
            providers=[ProviderSpec(id="vllm", type="openai", base_url=openai_mock.base_url)],
        )
    )
    sender = ListSender()
    req = tunnel_req("/v1/chat/completions", {"model": "m", "stream": True})
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.serve_stream, req, sender)
            while sender.kinds.count("body") < 2:
                await sender.sent.wait()
            assert openai_mock.client_closes == 0
            executor.cancel(req.stream_id, "caller went away")
        await openai_mock.wait_client_close(1)
    assert sender.kinds[0] == "head"
    assert sender.kinds[-1] == "error" and sender.msgs[-1].code == "cancelled"


# ------------------------------------------------------------------ normalized run


def run_req(**kw: Any) -> RunRequest:
    return adapter_req("vllm", "openai", "served-model", [{"role": "user", "content": "hi"}], **kw)


async def test_normalized_run_text_reasoning_tools_usage(openai_mock: MockOpenAIServer) -> None:
    openai_mock.reasoning_text = "thinking hard"
    openai_mock.tool_calls = [{"name": "get_weather", "arguments": '{"city": "Seoul"}'}]
    out = CollectedRunOutput()
    with trio.fail_after(5):
        await adapter_for(openai_mock).run(
            run_req(params={"temperature": 0.2, "model": "ignored"}, tools=[{"type": "function"}]),
            out,
        )
    sent = openai_mock.requests[0].json()
    assert sent["model"] == "served-model" and sent["stream"] is True
    assert sent["temperature"] == 0.2 and sent["tools"] == [{"type": "function"}]
    assert out.joined_text == openai_mock.reply_text
    assert out.joined_reasoning == "thinking hard"
    assert out.tool_calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Seoul"}'},
        }
    ]
    assert out.finish_reason == "tool_calls"
    assert out.usage == Usage(input_tokens=11, output_tokens=7)


async def test_normalized_run_errors(openai_mock: MockOpenAIServer) -> None:
    adapter = adapter_for(openai_mock)
    with trio.fail_after(5):
        openai_mock.mode = "error500"
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(), CollectedRunOutput())
        assert info.value.code == "provider_error" and "500" in info.value.message
        openai_mock.mode = "ok"
        openai_mock.handler = lambda req: MockReply(
            headers=[("content-type", "text/event-stream")], chunks=[b"data: {not json\n\n"]
        )
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(), CollectedRunOutput())
        assert info.value.code == "provider_error"
        openai_mock.handler = lambda req: MockReply(
            headers=[("content-type", "text/event-stream")],
            chunks=[b'data: {"choices":[{"delta":{"content":"cut"}}]}\n\n'],
        )
        out = CollectedRunOutput()
        with pytest.raises(AdapterError):
            await adapter.run(run_req(), out)
        assert out.joined_text == "cut"


async def test_probe_flips_and_canary_key_never_logged(
    openai_mock: MockOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    adapter = adapter_for(openai_mock, api_key=CANARY)
    with trio.fail_after(5):
        assert await adapter.probe() == ("healthy", "")
        assert openai_mock.requests[-1].path == "/v1/models"
        assert openai_mock.requests[-1].header("authorization") == f"Bearer {CANARY}"
        openai_mock.healthy = False
        health, error = await adapter.probe()
        assert health == "unhealthy" and "503" in error
        openai_mock.mode = "garbage"
        health, error = await adapter.probe()
        assert health == "unhealthy" and CANARY not in error
        openai_mock.mode = "error500"
        with pytest.raises(AdapterError) as info:
            await adapter.run(run_req(), CollectedRunOutput())
        assert CANARY not in info.value.message
    assert CANARY not in caplog.text
    await adapter.aclose()


async def test_probe_reports_a_served_name_the_provider_does_not_list(
    openai_mock: MockOpenAIServer,
) -> None:
    openai_mock.listed = ["other-model"]
    adapter = adapter_for(openai_mock, models=["served"])
    with trio.fail_after(5):
        assert await adapter.probe() == (
            "unhealthy",
            "model 'served' not served: /v1/models lists 'other-model'; "
            "fix nodes[].providers[].models or the server's model name",
        )
        openai_mock.listed = ["other-model", "served"]
        assert await adapter.probe() == ("healthy", "")
    await adapter.aclose()


async def test_probe_checks_no_names_in_a_list_past_its_cap(openai_mock: MockOpenAIServer) -> None:
    from iopd.node.served_models import MAX_LIST_BYTES

    openai_mock.listed = [f"model-{i:08d}" for i in range(MAX_LIST_BYTES // 30)]
    adapter = adapter_for(openai_mock, models=["served"])
    with trio.fail_after(5):
        assert await adapter.probe() == ("healthy", "")
    await adapter.aclose()
