"""Anthropic's Messages API through the official ``anthropic`` SDK, on every path.

One edge, four model groups, one per path a Messages request can take:

* ``native``: an ``openai`` provider declared ``anthropic_messages: true``
  (``MockMessagesServer``): relayed as sent, ``model`` rewritten;
* ``chat``: an OpenAI-only provider (``MockOpenAIServer``): translated to
  Chat Completions and back;
* ``llama``: an ``ollama`` provider (``MockOllamaServer``): the normalized path;
* ``echo``: the echo provider (the ``<tool_call>`` text protocol for tools).

Each is driven with ``messages.create``, ``messages.stream`` (the SDK's
accumulated final message checks the event sequence), a tool-use round trip,
``count_tokens`` and the SDK's typed errors.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.configs import echo_provider, edge_yaml, model, node, principal_token
from tests.support.gateway import Gateway, http_request, in_thread, running_gateway, wait_until
from tests.support.mock_providers import (
    MockMessagesServer,
    MockOllamaServer,
    MockOpenAIServer,
    MockReply,
    RecordedRequest,
)

TOKEN = "sk-messages-test-token"
PATHS = ["native", "chat", "llama", "echo"]

WEATHER_TOOL: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
#: The sampling fields (sent as extra fields: recent SDKs no longer name them).
SAMPLING: Any = {"temperature": 0.5, "top_p": 0.9, "top_k": 7}
ECHO_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@dataclass
class Setup:
    gw: Gateway
    native: MockMessagesServer
    chat: MockOpenAIServer
    ollama: MockOllamaServer

    def client(self, api_key: str = TOKEN) -> anthropic.Anthropic:
        root = self.gw.base_url.removesuffix("/v1")
        return anthropic.Anthropic(base_url=root, api_key=api_key, max_retries=0, timeout=30)


def _config(native: str, chat: str, ollama: str, **sections: Any) -> str:
    providers = [
        {
            "id": "msg-1",
            "type": "openai",
            "base_url": native,
            "models": ["served-native"],
            "anthropic_messages": True,
            "health_interval": 30,
        },
        {"id": "chat-1", "type": "openai", "base_url": chat, "models": ["served-chat"]},
        {"id": "ol-1", "type": "ollama", "base_url": ollama, "models": ["mock:latest"]},
        echo_provider(),
    ]
    for p in providers[:3]:
        p.update(capacity=4, health_interval=30)
    openai = {"principal_tokens": [principal_token(TOKEN)], **sections.pop("openai", {})}
    return edge_yaml(
        openai=openai,
        models=[
            model("native", {"msg-1": "served-native"}),
            model("chat", {"chat-1": "served-chat"}),
            model("llama", {"ol-1": "mock:latest"}),
            model("echo", {"echo-1": "echo"}),
        ],
        nodes=[node(providers=providers)],
        **sections,
    )


@asynccontextmanager
async def messages_gateway(**sections: Any) -> AsyncIterator[Setup]:
    async with trio.open_nursery() as nursery:
        native = await nursery.start(MockMessagesServer().serve)
        chat = await nursery.start(MockOpenAIServer().serve)
        ollama = await nursery.start(MockOllamaServer().serve)
        yaml_text = _config(native.base_url, chat.base_url, ollama.base_url, **sections)
        async with running_gateway(yaml_text) as gw:
            yield Setup(gw, native, chat, ollama)
        nursery.cancel_scope.cancel()


def _expected_text(setup: Setup, path: str, sent: str) -> str:
    return {
        "native": setup.native.reply_text,
        "chat": setup.chat.reply_text,
        "llama": setup.ollama.reply_text,
        "echo": sent,
    }[path]


@pytest.mark.parametrize("path", PATHS)
async def test_create_and_stream(path: str) -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            client = setup.client()
            sent = "say hello please"
            msg = await in_thread(
                lambda: client.messages.create(
                    model=path,
                    max_tokens=64,
                    system=[{"type": "text", "text": "be brief"}],
                    messages=[{"role": "user", "content": sent}],
                )
            )
            want = _expected_text(setup, path, sent)
            assert msg.type == "message" and msg.role == "assistant"
            # Translated: the caller's model; relayed: the provider's bytes, its served name.
            assert msg.model == ("served-native" if path == "native" else path)
            assert [b.type for b in msg.content] == ["text"]
            assert msg.content[0].text == want  # type: ignore[union-attr]
            assert msg.stop_reason == "end_turn"
            assert msg.usage.output_tokens > 0

            def streamed() -> tuple[list[str], list[str], Any]:
                with client.messages.stream(
                    model=path, max_tokens=64, messages=[{"role": "user", "content": sent}]
                ) as stream:
                    kinds = [event.type for event in stream]
                    return kinds, [], stream.get_final_message()

            kinds, _, final = await in_thread(streamed)
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert "message_delta" in kinds and "content_block_stop" in kinds
            assert [b.type for b in final.content] == ["text"]
            assert final.content[0].text == want
            assert final.stop_reason == "end_turn"
            assert final.usage.output_tokens > 0


def _arm_tool(setup: Setup, path: str) -> str:
    """Make the path's upstream answer one get_weather call; the user text to send."""
    if path == "native":
        setup.native.tool_uses = [
            {"id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
        ]
    elif path == "chat":
        setup.chat.tool_calls = [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    elif path == "llama":
        setup.ollama.tool_calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    return ECHO_CALL if path == "echo" else "weather in Oslo?"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_round_trip(path: str, stream: bool) -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            client = setup.client()
            text = _arm_tool(setup, path)
            first: list[Any] = [{"role": "user", "content": text}]

            def ask(messages: list[Any]) -> Any:
                kwargs: Any = {"model": path, "max_tokens": 64, "tools": [WEATHER_TOOL]}
                if not stream:
                    return client.messages.create(messages=messages, **kwargs)
                with client.messages.stream(messages=messages, **kwargs) as s:
                    return s.get_final_message()

            msg = await in_thread(lambda: ask(first))
            uses = [b for b in msg.content if b.type == "tool_use"]
            assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Oslo"})]
            assert msg.stop_reason == "tool_use"
            result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}
            follow = [
                *first,
                {"role": "assistant", "content": [u.model_dump() for u in uses]},
                {"role": "user", "content": [result]},
            ]
            await in_thread(lambda: ask(follow))
            if path == "native":  # relayed as sent
                sent = setup.native.requests[-1].json()
                assert sent["model"] == "served-native"
                assert sent["messages"][-1]["content"][0]["type"] == "tool_result"
            elif path == "chat":  # translated to chat: the result is a tool message
                sent = setup.chat.requests[-1].json()
                assert sent["model"] == "served-chat"
                tool_msgs = [m for m in sent["messages"] if m["role"] == "tool"]
                assert tool_msgs == [
                    {"role": "tool", "tool_call_id": uses[0].id, "content": "sunny, 21 C"}
                ]
                assistant = [m for m in sent["messages"] if m["role"] == "assistant"][-1]
                call = assistant["tool_calls"][0]
                assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
                assert sent["tools"][0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]
            elif path == "llama":
                sent = setup.ollama.requests[-1].json()
                assert any(m["role"] == "tool" for m in sent["messages"])


async def test_parallel_tool_calls_streamed_through_chat() -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            setup.chat.reply_text = ""
            setup.chat.tool_calls = [
                {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                {"name": "get_weather", "arguments": '{"city": "Bergen", "unit": "celsius"}'},
            ]
            client = setup.client()

            def streamed() -> Any:
                with client.messages.stream(
                    model="chat",
                    max_tokens=64,
                    tools=[WEATHER_TOOL],
                    messages=[{"role": "user", "content": "two cities"}],
                ) as s:
                    return s.get_final_message()

            final = await in_thread(streamed)
            uses = [b for b in final.content if b.type == "tool_use"]
            assert [u.input["city"] for u in uses] == ["Oslo", "Bergen"]  # type: ignore[index]
            assert len({u.id for u in uses}) == 2
            assert final.stop_reason == "tool_use"


async def test_usage_with_cache_reads() -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            setup.chat.usage = {
                "prompt_tokens": 30,
                "completion_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 12},
            }
            client = setup.client()
            msg = await in_thread(
                lambda: client.messages.create(
                    model="chat", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                )
            )
            assert msg.usage.input_tokens == 18
            assert msg.usage.cache_read_input_tokens == 12
            assert msg.usage.output_tokens == 7
            native = await in_thread(
                lambda: client.messages.create(
                    model="native", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                )
            )
            assert native.usage.cache_read_input_tokens == setup.native.cache_read


async def test_native_gets_anthropic_headers_and_sampling_fields() -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            client = setup.client()
            await in_thread(
                lambda: client.messages.create(
                    model="native",
                    max_tokens=64,
                    stop_sequences=["END"],
                    metadata={"user_id": "u-1"},
                    messages=[{"role": "user", "content": "hi"}],
                    extra_headers={"anthropic-beta": "tools-2024-04-04"},
                    extra_body=SAMPLING,
                )
            )
            req = setup.native.requests[-1]
            assert req.path == "/v1/messages"
            assert (
                req.header("anthropic-version")
                == anthropic.Anthropic(api_key="k").default_headers["anthropic-version"]
            )
            assert req.header("anthropic-beta") == "tools-2024-04-04"
            names = [k for k, _ in req.headers]  # each once, not once per allow-list
            assert names.count("anthropic-version") == names.count("anthropic-beta") == 1
            assert req.header("x-api-key") is None  # the edge's token stays at the edge
            assert req.json()["top_k"] == 7
            await in_thread(
                lambda: client.messages.create(
                    model="chat",
                    max_tokens=64,
                    extra_body=SAMPLING,
                    stop_sequences=["END"],
                    metadata={"user_id": "u-1"},
                    tool_choice={"type": "any"},
                    tools=[WEATHER_TOOL],
                    messages=[{"role": "user", "content": "hi"}],
                )
            )
            sent = setup.chat.requests[-1].json()
            assert sent["max_tokens"] == 64 and sent["temperature"] == 0.5
            assert sent["top_p"] == 0.9 and sent["top_k"] == 7
            assert sent["stop"] == ["END"] and sent["user"] == "u-1"
            assert sent["tool_choice"] == "required"


@pytest.mark.parametrize("path", PATHS)
async def test_count_tokens(path: str) -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            client = setup.client()
            counted = await in_thread(
                lambda: client.messages.count_tokens(
                    model=path,
                    system="count me",
                    messages=[{"role": "user", "content": "one two three four five six seven"}],
                )
            )
            if path == "native":
                assert counted.input_tokens == 42  # the provider's own count
                assert setup.native.requests[-1].path == "/v1/messages/count_tokens"
            else:  # the edge's estimate: ceil(code points / 4) over the texts
                assert counted.input_tokens == 2 + 9


async def test_errors_are_anthropic_typed() -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            hello: Any = [{"role": "user", "content": "hi"}]
            bad = setup.client(api_key="sk-wrong")
            with pytest.raises(anthropic.AuthenticationError) as auth:
                await in_thread(
                    lambda: bad.messages.create(model="echo", max_tokens=8, messages=hello)
                )
            assert auth.value.body == {
                "type": "error",
                "error": {"type": "authentication_error", "message": "Invalid API key"},
            }
            client = setup.client()
            with pytest.raises(anthropic.NotFoundError) as missing:
                await in_thread(
                    lambda: client.messages.create(model="nope", max_tokens=8, messages=hello)
                )
            assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
            with pytest.raises(anthropic.BadRequestError) as bad_request:
                await in_thread(
                    lambda: client.messages.create(
                        model="echo", max_tokens=8, messages=[{"role": "robot", "content": "x"}]
                    )
                )
            assert bad_request.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            setup.chat.mode = "error500"  # a provider's error, translated
            with pytest.raises(anthropic.APIStatusError) as upstream:
                await in_thread(
                    lambda: client.messages.create(model="chat", max_tokens=8, messages=hello)
                )
            assert upstream.value.status_code >= 500
            assert upstream.value.body["type"] == "error"  # type: ignore[index]


async def test_head_refusals_in_anthropic_shape() -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            hp = setup.gw.host_port
            auth = [("x-api-key", TOKEN)]
            cases = [
                ("GET", "/v1/messages", auth, 405, "invalid_request_error"),
                ("POST", "/v1/messages/nope", auth, 404, "not_found_error"),
                ("POST", "/v1/messages", [], 401, "authentication_error"),
            ]
            for method, target, headers, status, kind in cases:
                resp = await http_request(hp, method, target, headers=headers, body=b"{}")
                assert resp.status == status, (method, target)
                assert resp.json()["type"] == "error"
                assert resp.json()["error"]["type"] == kind
            bearer = [("authorization", f"Bearer {TOKEN}")]
            body = json.dumps(
                {"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": "b"}]}
            ).encode()
            resp = await http_request(hp, "POST", "/v1/messages", headers=bearer, body=body)
            assert resp.status == 200 and resp.json()["content"][0]["text"] == "b"
            resp = await http_request(hp, "POST", "/v1/messages", headers=auth, body=b"{")
            assert resp.status == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def _samples(gw: Gateway) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(gw.runtime.metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(samples: dict[Any, float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.mark.parametrize(
    ("path", "tokens_in", "tokens_out"), [("native", 17 + 4, 9), ("chat", 11, 7), ("llama", 13, 5)]
)
async def test_streams_metered_as_messages_with_usage(
    path: str, tokens_in: int, tokens_out: int
) -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            client = setup.client()

            def streamed() -> Any:
                with client.messages.stream(
                    model=path, max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                ) as s:
                    return s.get_final_message()

            final = await in_thread(streamed)
            gw = setup.gw
            metric = "iop_openai_requests_total"
            await wait_until(
                lambda: _total(_samples(gw), metric, endpoint="messages", status="ok") == 1
            )
            samples = _samples(gw)
            usage = "iop_openai_usage_tokens_total"
            got_in = _total(samples, usage, endpoint="messages", token_type="input")
            got_out = _total(samples, usage, endpoint="messages", token_type="output")
            assert (got_in, got_out) == (tokens_in, tokens_out)
            if path != "native":  # translated: the reply says what was metered
                assert final.usage.output_tokens == tokens_out
                assert final.usage.input_tokens == tokens_in


async def test_limits_refusals_are_anthropic_errors() -> None:
    with trio.fail_after(60):
        async with messages_gateway(
            openai={"max_body_bytes": 4096},
            limits={"default": {"requests_per_minute": 1}},
        ) as setup:
            client = setup.client()
            hello: Any = [{"role": "user", "content": "hi"}]
            await in_thread(
                lambda: client.messages.create(model="echo", max_tokens=8, messages=hello)
            )
            with pytest.raises(anthropic.RateLimitError) as limited:
                await in_thread(
                    lambda: client.messages.create(model="echo", max_tokens=8, messages=hello)
                )
            assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
            assert limited.value.response.headers.get("retry-after")
            big: Any = [{"role": "user", "content": "x" * 8000}]
            with pytest.raises(anthropic.RequestTooLargeError) as large:
                await in_thread(
                    lambda: client.messages.create(model="echo", max_tokens=8, messages=big)
                )
            assert large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]


async def test_error_after_the_stream_started_is_an_error_event() -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:

            def cut_after_two(req: RecordedRequest) -> MockReply | None:
                if req.path != "/api/chat":
                    return None
                lines = [
                    json.dumps({"model": "m", "message": {"role": "assistant", "content": w}})
                    for w in ("one ", "two ")
                ]
                return MockReply(
                    headers=[("content-type", "application/x-ndjson")],
                    chunks=[line.encode() + b"\n" for line in lines],
                    reset_after_chunks=True,
                )

            setup.ollama.handler = cut_after_two
            client = setup.client()
            seen: list[str] = []

            def streamed() -> None:
                with client.messages.stream(
                    model="llama", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                ) as s:
                    for event in s:
                        seen.append(event.type)

            with pytest.raises(anthropic.APIStatusError) as cut:
                await in_thread(streamed)
            assert cut.value.body["type"] == "error"  # type: ignore[index]
            assert seen[0] == "message_start" and "message_stop" not in seen


async def test_beta_client_and_its_query_string() -> None:
    """Claude Code posts to ``/v1/messages?beta=true`` (the SDK's beta namespace)."""
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            client = setup.client()
            for path in ("native", "chat"):
                msg = await in_thread(
                    lambda path=path: client.beta.messages.create(  # type: ignore[misc]
                        model=path,
                        max_tokens=16,
                        messages=[{"role": "user", "content": "hi"}],
                        betas=["interleaved-thinking-2025-05-14"],
                    )
                )
                assert msg.content[0].type == "text"
            assert setup.native.requests[-1].header("anthropic-beta") == (
                "interleaved-thinking-2025-05-14"
            )


@pytest.mark.parametrize("path", ["chat", "llama"])
async def test_caller_gone_cancels_the_provider_and_frees_the_slot(path: str) -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            mock = setup.chat if path == "chat" else setup.ollama
            mock.reply_text = " ".join(["word"] * 40)
            mock.chunk_delay = 0.2
            body = json.dumps(
                {
                    "model": path,
                    "max_tokens": 64,
                    "stream": True,
                    "messages": [{"role": "user", "content": "talk"}],
                }
            ).encode()
            stream = await trio.open_tcp_stream(*setup.gw.host_port)
            head = (
                "POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"x-api-key: {TOKEN}\r\ncontent-length: {len(body)}\r\n\r\n"
            ).encode()
            await stream.send_all(head + body)
            got = b""
            while b"content_block_delta" not in got:
                got += await stream.receive_some(65536)
            await stream.aclose()  # the caller goes away mid-stream
            await mock.wait_client_close()  # the node let go of the provider
            pool = setup.gw.runtime.pool
            await wait_until(lambda: pool.provider_loads()[mock_pid(path)].in_flight == 0)
            metric = "iop_openai_requests_total"
            await wait_until(
                lambda: (
                    _total(_samples(setup.gw), metric, endpoint="messages", status="cancelled") == 1
                )
            )


def mock_pid(path: str) -> str:
    return {"chat": "chat-1", "llama": "ol-1"}[path]


@pytest.mark.parametrize("path", ["chat", "llama"])
async def test_provider_reasoning_is_a_thinking_block(path: str) -> None:
    with trio.fail_after(60):
        async with messages_gateway() as setup:
            mock = setup.chat if path == "chat" else setup.ollama
            mock.reasoning_text = "first this, then that"
            client = setup.client()
            ask: Any = {
                "model": path,
                "max_tokens": 2048,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "think"}],
            }
            whole = await in_thread(lambda: client.messages.create(**ask))

            def streamed() -> tuple[list[str], Any]:
                with client.messages.stream(**ask) as s:
                    deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
                    return deltas, s.get_final_message()

            deltas, final = await in_thread(streamed)
            for msg in (whole, final):
                assert [b.type for b in msg.content] == ["thinking", "text"]
                assert msg.content[0].thinking == "first this, then that"
                assert msg.content[1].text == mock.reply_text
            assert "thinking_delta" in deltas and "text_delta" in deltas
            if path == "chat":
                assert setup.chat.requests[-1].json()["reasoning_effort"] == "low"


async def test_retry_goes_to_the_next_provider_and_picks_its_path() -> None:
    """A 503 before any byte is retried on the group's other provider; each
    attempt takes that provider's path (native relay or the chat translation)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            native = await nursery.start(MockMessagesServer().serve)
            chat = await nursery.start(MockOpenAIServer().serve)
            providers = [
                {
                    "id": "n-1",
                    "type": "openai",
                    "base_url": native.base_url,
                    "models": ["s"],
                    "anthropic_messages": True,
                    "health_interval": 30,
                    "priority": 0,
                },
                {
                    "id": "c-1",
                    "type": "openai",
                    "base_url": chat.base_url,
                    "models": ["s"],
                    "health_interval": 30,
                    "priority": 1,
                },
            ]
            yaml_text = edge_yaml(
                models=[model("pair", {"n-1": "s", "c-1": "s"})],
                nodes=[node(providers=providers)],
            )
            async with running_gateway(yaml_text) as gw:
                client = anthropic.Anthropic(
                    base_url=gw.base_url.removesuffix("/v1"), api_key="k", max_retries=0
                )
                ask: Any = {
                    "model": "pair",
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                await _all_healthy(gw)  # so the first attempt goes by priority: n-1
                native.mode = "status503"  # the native one fails: translated on the other
                msg = await in_thread(lambda: client.messages.create(**ask))
                assert msg.content[0].text == chat.reply_text  # type: ignore[union-attr]
                assert [r.path for r in native.requests if r.method == "POST"] == ["/v1/messages"]
                assert [r.path for r in chat.requests if r.method == "POST"] == [
                    "/v1/chat/completions"
                ]

                def streamed() -> Any:
                    with client.messages.stream(**ask) as s:
                        return s.get_final_message()

                final = await in_thread(streamed)
                assert final.content[0].text == chat.reply_text
                native.mode, chat.mode = "ok", "status503"  # and the other way round
                msg = await in_thread(lambda: client.messages.create(**ask))
                assert msg.content[0].text == native.reply_text  # type: ignore[union-attr]
                final = await in_thread(streamed)
                assert final.content[0].text == native.reply_text
            nursery.cancel_scope.cancel()


async def _all_healthy(gw: Gateway) -> None:
    while True:
        doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
        if all(p["health"] == "healthy" for p in doc["providers"]):
            return
        await trio.sleep(0.02)
