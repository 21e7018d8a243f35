"""End to end: the official openai SDK → a real edge → the wire → a real node → providers.

Every test starts a whole gateway on loopback port 0 (tests/support/gateway.py) and
calls it with ``openai.OpenAI`` (``max_retries=0``) in a worker thread, or
with raw HTTP where the SDK would hide what is tested.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai
import pytest
import trio

from iopd.http.client import EarlyStart
from iopd.node.adapters.http_relay import HTTPAdapter
from iopd.node.executor import NodeExecutor
from tests.support.configs import echo_yaml
from tests.support.gateway import (
    Gateway,
    http_request,
    in_thread,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer
from tests.support.replies import function_tool
from wire.messages import ProviderTunnelRequest, RunRequest

PRINCIPAL_TOKEN = "sk-canary-principal-0001"
OTHER_TOKEN = "sk-canary-principal-0002"
LEGACY_TOKEN = "sk-canary-legacy-0003"


def auth_block() -> str:
    return f"""  bearer_token: {LEGACY_TOKEN}
  principal_tokens:
    - {{token_ref: app-1, token_hash_sha256: {token_hash(PRINCIPAL_TOKEN)}, principal_ref: user-1, alias: alice}}
    - {{token_ref: app-2, token_hash_sha256: {token_hash(OTHER_TOKEN)}, principal_ref: user-1, alias: alice2}}
"""


async def test_chat_non_streaming_echo() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "hello  there world"}]
                )
            )
            assert resp.choices[0].message.content == "hello  there world"
            assert resp.choices[0].finish_reason == "stop"
            assert resp.model == "echo"
            assert resp.usage is not None
            assert resp.usage.completion_tokens == 3  # chunks: "hello  ", "there ", "world"
            assert resp.usage.prompt_tokens == (len("hello  there world") + 3) // 4


async def test_chat_streaming_echo_with_usage() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml(delay_ms=5)) as gw:
            client = gw.sdk()

            def run() -> tuple[list[str], object]:
                pieces, usage = [], None
                stream = client.chat.completions.create(
                    model="echo",
                    messages=[{"role": "user", "content": "one two three four"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        if choice.delta.content:
                            pieces.append(choice.delta.content)
                return pieces, usage

            pieces, usage = await in_thread(run)
            assert "".join(pieces) == "one two three four"
            assert len(pieces) == 4
            assert usage is not None and usage.completion_tokens == 4  # type: ignore[attr-defined]


async def test_async_client_streaming() -> None:
    """The async SDK client, driven from a worker thread's own event loop."""
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:

            def run() -> str:
                import asyncio

                async def go() -> str:
                    client = openai.AsyncOpenAI(
                        base_url=gw.base_url, api_key="x", max_retries=0, timeout=30
                    )
                    text = ""
                    stream = await client.chat.completions.create(
                        model="echo",
                        messages=[{"role": "user", "content": "async works"}],
                        stream=True,
                    )
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            text += chunk.choices[0].delta.content
                    await client.close()
                    return text

                return asyncio.run(go())

            assert await in_thread(run) == "async works"


async def test_models_list_and_unknown_model() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            models = await in_thread(lambda: client.models.list())
            assert [m.id for m in models.data] == ["echo"]
            with pytest.raises(openai.NotFoundError) as info:
                await in_thread(
                    lambda: client.chat.completions.create(
                        model="nope", messages=[{"role": "user", "content": "x"}]
                    )
                )
            assert info.value.code == "model_not_found"


async def test_responses_normalized_string_input() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.responses.create(model="echo", input="respond with this")
            )
            assert resp.output_text == "respond with this"
            assert resp.usage is not None and resp.usage.output_tokens == 3
            with pytest.raises(openai.BadRequestError):  # the edge keeps no responses
                await in_thread(
                    lambda: client.responses.create(
                        model="echo", input="more", previous_response_id=resp.id
                    )
                )


async def test_text_tool_call_through_echo() -> None:
    """echo is text-only: a <tool_call> block in its output becomes an OpenAI tool call."""
    tools = [function_tool("get_weather", {"city": {"type": "string"}}, required=["city"])]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Seoul"}}</tool_call>'
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": 1}}</tool_call>'
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": call}], tools=tools
                )
            )
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.tool_calls is not None
            fn = choice.message.tool_calls[0].function
            assert fn.name == "get_weather"
            assert json.loads(fn.arguments) == {"city": "Seoul"}
            # Invalid arguments: plain text, never an invented call.
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": bad}], tools=tools
                )
            )
            assert resp.choices[0].message.tool_calls is None
            assert resp.choices[0].message.content == bad


async def test_auth_branches() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml(auth=auth_block())) as gw:
            msgs = [{"role": "user", "content": "hi"}]
            for token in (PRINCIPAL_TOKEN, OTHER_TOKEN, LEGACY_TOKEN):
                client = gw.sdk(api_key=token)
                resp = await in_thread(
                    lambda c=client: c.chat.completions.create(model="echo", messages=msgs)
                )
                assert resp.choices[0].message.content == "hi"
            for token in ("wrong", PRINCIPAL_TOKEN + "x"):
                client = gw.sdk(api_key=token)
                with pytest.raises(openai.AuthenticationError) as info:
                    await in_thread(
                        lambda c=client: c.chat.completions.create(model="echo", messages=msgs)
                    )
                assert info.value.code == "invalid_api_key"
                assert token not in str(info.value.body)
            raw = await http_request(gw.host_port, "GET", "/v1/models")
            assert raw.status == 401
            assert raw.json()["error"]["type"] == "authentication_error"
            raw = await http_request(gw.host_port, "GET", "/healthz")
            assert raw.status == 200


async def test_error_envelopes_for_routes_and_methods() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            r = await http_request(
                gw.host_port, "POST", "/v1/images/generations", body={"model": "echo"}
            )
            assert r.status == 404 and r.json()["error"]["code"] == "not_found"
            r = await http_request(gw.host_port, "GET", "/v1/chat/completions")
            assert r.status == 405 and r.json()["error"]["code"] == "method_not_allowed"
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=b"{not json")
            assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error"
            # The admin API is not reachable through the public listener.
            for path in ("/status", "/refresh", "/metrics"):
                r = await http_request(gw.host_port, "GET", path)
                assert r.status == 404


async def test_cancel_mid_stream_frees_the_slot() -> None:
    """Closing the SDK stream mid-way: the node stops, the lease is freed."""
    with trio.fail_after(30):
        # 200 words at 200 ms = 40 s: only a working cancel beats the 30 s guard.
        async with running_gateway(echo_yaml(delay_ms=200, capacity=1)) as gw:
            client = gw.sdk()
            text = " ".join(f"w{i}" for i in range(200))

            def read_two() -> None:
                stream = client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": text}], stream=True
                )
                seen = 0
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        seen += 1
                        if seen == 2:
                            break
                stream.close()

            await in_thread(read_two)
            pool = gw.runtime.pool
            await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 0)
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "again"}]
                )
            )
            assert resp.choices[0].message.content == "again"


async def test_node_killed_mid_stream_ends_stream_with_error() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml(delay_ms=50)) as gw:
            client = gw.sdk()
            text = " ".join(f"w{i}" for i in range(200))
            started = trio.Event()
            token = trio.lowlevel.current_trio_token()

            def consume() -> str:
                stream = client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": text}], stream=True
                )
                try:
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            trio.from_thread.run_sync(started.set, trio_token=token)
                    return "completed"
                except openai.APIError as exc:
                    return f"error:{exc.message}"
                except Exception as exc:  # connection-level failure is also terminal
                    return f"exc:{type(exc).__name__}"

            result: list[str] = []

            async def run() -> None:
                result.append(await trio.to_thread.run_sync(consume))

            async with trio.open_nursery() as n:
                n.start_soon(run)
                await started.wait()
                gw.kill_node("node-a")
            assert result and result[0] != "completed"
            await wait_until(lambda: gw.runtime.pool.provider_loads()["echo-1"].in_flight == 0)
            # Nothing to dispatch to now: 502 node_dispatch_error at once.
            with pytest.raises(openai.APIStatusError) as info:
                await in_thread(
                    lambda: client.chat.completions.create(
                        model="echo", messages=[{"role": "user", "content": "x"}]
                    )
                )
            assert info.value.status_code == 502
            assert info.value.code == "node_dispatch_error"


MIXED = """
edge:
  id: edge-mixed
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
models:
  - id: mixed
    providers: {{vllm-a: served-a, echo-1: echo}}
  - id: direct
    providers: {{vllm-a: served-a}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - id: vllm-a
        type: openai
        base_url: {base}
        models: [served-a]
        capacity: 1
        health_interval: 30
      - id: echo-1
        type: echo
        models: [echo]
        capacity: 1
"""


@asynccontextmanager
async def mixed_gateway() -> AsyncIterator[tuple[MockOpenAIServer, Gateway]]:
    """A mock OpenAI provider and a gateway serving ``MIXED`` in front of it."""
    async with trio.open_nursery() as n:
        mock = MockOpenAIServer()
        await n.start(mock.serve)
        yaml_text = MIXED.format(hash=token_hash(node_token("node-a")), base=mock.base_url)
        async with running_gateway(yaml_text) as gw:
            yield mock, gw
        n.cancel_scope.cancel()


async def test_passthrough_is_byte_exact_and_rewrites_model() -> None:
    with trio.fail_after(30):
        async with mixed_gateway() as (mock, gw):
            body = {
                "model": "direct",
                "messages": [{"role": "user", "content": "hi"}],
                "x_unknown_field": {"kept": True},
            }
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body=body,
                headers=[("authorization", "Bearer caller-secret")],
            )
            assert r.status == 200
            sent = mock.requests[-1]
            assert sent.json()["model"] == "served-a"
            assert sent.json()["x_unknown_field"] == {"kept": True}
            assert sent.header("authorization") != "Bearer caller-secret"
            direct = await http_request(
                (
                    mock.base_url.split("//")[1].split(":")[0],
                    int(mock.base_url.rsplit(":", 1)[1]),
                ),
                "POST",
                "/v1/chat/completions",
                body={**body, "model": "served-a"},
            )
            # Same provider reply, relayed byte for byte (ids may differ per call).
            strip = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')
            assert strip.sub(b"", r.body) == strip.sub(b"", direct.body)

            # SSE relayed raw, with X-Accel-Buffering added.
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body={**body, "stream": True, "stream_options": {"include_usage": True}},
            )
            assert r.status == 200
            assert r.header("x-accel-buffering") == "no"
            assert r.body.rstrip().endswith(b"data: [DONE]")


async def test_mixed_group_uses_both_provider_kinds() -> None:
    with trio.fail_after(30):
        async with mixed_gateway() as (mock, gw):
            client = gw.sdk()
            seen_modes = set()
            for _ in range(4):
                resp = await in_thread(
                    lambda: client.chat.completions.create(
                        model="mixed", messages=[{"role": "user", "content": "ping pong"}]
                    )
                )
                seen_modes.add(
                    "echo" if resp.choices[0].message.content == "ping pong" else "mock"
                )
            assert seen_modes == {"echo", "mock"}


async def test_status_shows_node_and_provider() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            r = await http_request(gw.handle.admin, "GET", "/status")
            doc = r.json()
            assert doc["edge_id"] == "edge-test"
            assert doc["nodes"][0]["connected"] is True
            p = doc["providers"][0]
            assert p["id"] == "echo-1" and p["in_flight"] == 0 and p["load_ratio"] == 0
            assert doc["queue"] == {
                "depth": 0,
                "max_queue": 256,
                "queued_bytes": 0,
                "max_queued_bytes": 256 << 20,
            }


def _record_early_starts(executor: NodeExecutor) -> list[EarlyStart]:
    """Wrap ``executor.start_early`` (the node link calls it per request): the
    early starts it returned, in order."""
    started: list[EarlyStart] = []
    start_early = executor.start_early

    def recording(req: RunRequest | ProviderTunnelRequest) -> EarlyStart | None:
        early = start_early(req)
        if early is not None:
            started.append(early)
        return early

    executor.start_early = recording  # type: ignore[method-assign]
    return started


async def test_passthrough_on_a_warm_connection_is_started_early_and_stays_byte_exact() -> None:
    """From the second request on, the node's wire reader writes the relayed
    request itself (early start, on the pooled provider connection); what the
    caller gets is unchanged, streamed or whole."""
    with trio.fail_after(30):
        async with mixed_gateway() as (mock, gw):
            executor = gw.node_handles["node-a"].executor
            early_starts = _record_early_starts(executor)
            # The node's first health probe runs at start-up: let it end (its
            # connection pooled) so the first request does not race it for the
            # provider connection and dial a second one.
            adapter = executor.registry.get("vllm-a")
            assert isinstance(adapter, HTTPAdapter)
            await wait_until(lambda: adapter.client.idle_connections == 1)
            body = {"model": "direct", "messages": [{"role": "user", "content": "hi"}]}
            strip = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')
            replies = []
            for stream in (False, False, True, True):
                r = await http_request(
                    gw.host_port,
                    "POST",
                    "/v1/chat/completions",
                    body={**body, "stream": stream},
                )
                assert r.status == 200
                replies.append(strip.sub(b"", r.body))
            assert replies[0] == replies[1] and replies[2] == replies[3]
            assert replies[3].rstrip().endswith(b"data: [DONE]")
            # Every one (the health probe left a warm connection), all on
            # one provider connection.
            assert len(early_starts) == 4
            assert mock.connections_opened == 1
            posts = [req for req in mock.requests if req.method == "POST"]
            assert [req.json()["model"] for req in posts] == ["served-a"] * 4


async def test_a_whole_passthrough_reply_is_written_by_the_edges_wire_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-streaming reply with a final status leaves the edge from its wire
    reader (``NodeStream.direct``), head to end, without waking the handler
    to write it; a 5xx head is the handler's to look at (retry rules), and
    the handler writes that reply itself.  Both are what the provider sent."""
    from iopd.http.transport import ServedConnection

    writers: list[tuple[str, str]] = []  # (task, which write) per write to a caller
    send_now, send_bytes = ServedConnection.send_now, ServedConnection.send_bytes

    def record(how: str) -> None:
        writers.append((trio.lowlevel.current_task().name, how))

    def traced_send_now(self: ServedConnection, data: bytes) -> bool:
        record("send_now")
        return send_now(self, data)

    async def traced_send_bytes(
        self: ServedConnection, data: bytes, scope: trio.CancelScope | None
    ) -> None:
        record("send_bytes")
        await send_bytes(self, data, scope)

    monkeypatch.setattr(ServedConnection, "send_now", traced_send_now)
    monkeypatch.setattr(ServedConnection, "send_bytes", traced_send_bytes)
    body = {"model": "direct", "messages": [{"role": "user", "content": "hi"}]}
    with trio.fail_after(30):
        async with mixed_gateway() as (mock, gw):
            writers.clear()
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
            assert r.status == 200 and json.loads(r.body)["object"] == "chat.completion"
            assert writers and all(how == "send_now" for _, how in writers)
            assert all(task.endswith("_serve_session") for task, _ in writers)
            mock.mode = "error500"
            writers.clear()
            r = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)
            assert r.status == 500 and r.header("x-iopd-upstream-status") == "500"
            assert writers and all(how == "send_bytes" for _, how in writers)
