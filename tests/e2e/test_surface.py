"""End to end: the rest of the OpenAI-compatible surface.

Complements ``test_openai.py``: strict output, generation policy,
metadata and run metadata, long context, provider-auth forwarding, the
legacy route forms, the queue, provider errors, the raw ``/v1/responses``
relay and cancel on the passthrough path.  Every test starts a real edge on
loopback port 0 (``tests/support/gateway.py``) with real nodes, or with a scripted
``FakeNode`` where the test must read the ``RunRequest`` the edge sends.

Providers are told apart with ``cli`` providers running tiny Python scripts
(the interpreter running the tests) that print something observable.
"""

from __future__ import annotations

import base64
import json
import statistics
from typing import Any

import trio

from iopd.config.schema import DEFAULT_STRICT_OUTPUT_INSTRUCTION
from tests.support.configs import (
    cli_provider,
    echo_entry,
    gateway_yaml,
    http_provider,
    node_entry,
    passthrough_yaml,
    remote_yaml,
)
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    in_thread,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import (
    MockOllamaServer,
    MockOpenAIServer,
    MockReply,
    RecordedRequest,
)
from tests.support.wire_peers import FakeNode
from wire.messages import RunEvent, RunRequest, Usage

CHAT = "/v1/chat/completions"
PRINCIPAL_TOKEN = "sk-canary-surface-0001"


# ------------------------------------------------------------------ helpers


def chat_body(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def assert_error(resp: RawResponse, status: int, code: str, param: str | None = None) -> None:
    assert resp.status == status, (resp.status, resp.body)
    err = resp.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body (``[DONE]`` excluded)."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def streamed_text(body: bytes) -> str:
    text = ""
    for ev in sse_events(body):
        for choice in ev.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    return text


# ------------------------------------------------------------ strict output

# Prints the prompt it received base64-encoded inside <completion>, with noise
# around: the edge must return only the inside.
STDIN_B64_SCRIPT = (
    "import sys, base64; d = sys.stdin.buffer.read(); "
    "print('noise before <completion>' + base64.b64encode(d).decode() + '</completion> after')"
)


async def test_strict_output_instruction_reaches_cli_and_only_inside_returns() -> None:
    yaml_text = gateway_yaml(
        models="  - id: cli\n    providers: {cli-1: cli}\n",
        nodes=node_entry("node-a", cli_provider("cli-1", STDIN_B64_SCRIPT)),
        openai_extra="  strict_output: true",
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            for stream in (False, True):
                r = await http_request(
                    gw.host_port, "POST", CHAT, body=chat_body("cli", "question?", stream=stream)
                )
                assert r.status == 200, r.body
                text = (
                    streamed_text(r.body)
                    if stream
                    else r.json()["choices"][0]["message"]["content"]
                )
                prompt = base64.b64decode(text.strip()).decode()
                # The system instruction comes before the caller's message.
                assert DEFAULT_STRICT_OUTPUT_INSTRUCTION in prompt
                assert prompt.index(DEFAULT_STRICT_OUTPUT_INSTRUCTION) < prompt.index("question?")


async def test_strict_output_with_echo_streaming_and_not() -> None:
    yaml_text = gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(delay_ms=0)),
        openai_extra="  strict_output: true",
    )
    said = "chatter <completion>inside words</completion> trailing"
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": said}]
                )
            )
            assert resp.choices[0].message.content == "inside words"

            def stream() -> str:
                out = ""
                for chunk in client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": said}], stream=True
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        out += chunk.choices[0].delta.content
                return out

            assert (await in_thread(stream)).strip() == "inside words"
            # Without the element the whole text comes back.
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "no tags here"}]
                )
            )
            assert resp.choices[0].message.content == "no tags here"


# -------------------------------------------------------- generation policy


async def test_generation_policy_normalized_fills_defaults_and_caps() -> None:
    """Normalized (ollama): the node's request to the provider shows the policy applied."""
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOllamaServer().serve)
            yaml_text = gateway_yaml(
                models=(
                    "  - id: gen\n    providers: {ol-1: 'mock:latest'}\n"
                    "    generation: {defaults: {temperature: 0.25, top_p: 0.5},"
                    " limits: {max_tokens: 100}}\n"
                ),
                nodes=node_entry(
                    "node-a",
                    http_provider("ol-1", "ollama", mock.base_url, models="['mock:latest']"),
                ),
            )
            async with running_gateway(yaml_text) as gw:
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("gen", "hi", max_tokens=5000, top_p=0.9),
                )
                assert r.status == 200, r.body
                sent = [q for q in mock.requests if q.path == "/api/chat"][-1].json()
                assert sent["model"] == "mock:latest"
                # default filled, caller's own value kept, limit capped
                assert sent["options"]["temperature"] == 0.25
                assert sent["options"]["top_p"] == 0.9
                assert sent["options"]["num_predict"] == 100
                # A request under the limit keeps its value; no limit adds a field.
                r = await http_request(
                    gw.host_port, "POST", CHAT, body=chat_body("gen", "hi", max_tokens=7)
                )
                assert r.status == 200
                sent = [q for q in mock.requests if q.path == "/api/chat"][-1].json()
                assert sent["options"]["num_predict"] == 7
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("gen", "hi"))
                sent = [q for q in mock.requests if q.path == "/api/chat"][-1].json()
                assert "num_predict" not in sent["options"]
                # A limited field that is not a number: 400 naming it.
                r = await http_request(
                    gw.host_port, "POST", CHAT, body=chat_body("gen", "hi", max_tokens="many")
                )
                assert r.status == 400
                assert r.json()["error"]["param"] == "max_tokens"
            n.cancel_scope.cancel()


async def test_generation_policy_passthrough_adds_nothing_and_refuses_over_limit() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            yaml_text = gateway_yaml(
                models=(
                    "  - id: gen\n    providers: {oa-1: mock-model}\n"
                    "    generation: {defaults: {temperature: 0.25},"
                    " limits: {max_tokens: 100, max_completion_tokens: 80}}\n"
                ),
                nodes=node_entry(
                    "node-a", http_provider("oa-1", "openai", mock.base_url, models="[mock-model]")
                ),
            )
            async with running_gateway(yaml_text) as gw:
                r = await http_request(
                    gw.host_port, "POST", CHAT, body=chat_body("gen", "hi", max_tokens=50)
                )
                assert r.status == 200, r.body
                sent = mock.requests[-1].json()
                assert "temperature" not in sent
                assert sent["max_tokens"] == 50
                before = len(mock.requests)
                for field, value in (("max_tokens", 101), ("max_completion_tokens", 81)):
                    body = chat_body("gen", "hi", **{field: value})
                    r = await http_request(gw.host_port, "POST", CHAT, body=body)
                    assert_error(r, 400, "invalid_request_error", param=field)
                # /v1/responses spells it max_output_tokens; the error names that field.
                r = await http_request(
                    gw.host_port,
                    "POST",
                    "/v1/responses",
                    body={"model": "gen", "input": "x", "max_output_tokens": 81},
                )
                assert_error(r, 400, "invalid_request_error", param="max_output_tokens")
                assert len(mock.requests) == before  # refused before reaching the provider
            n.cancel_scope.cancel()


async def test_passthrough_limit_is_a_400_before_dispatch() -> None:
    """On passthrough a request over a generation limit gets 400.  For a
    group whose providers all relay raw, that answer does not depend on which
    provider is picked, so it must not wait for (or be masked by) dispatch: it
    used to be checked only after a lease, so with the node down (or the queue
    full) the caller got a retryable 502/429/503 for a request that can never
    succeed."""
    with trio.fail_after(30):
        async with running_gateway(passthrough_yaml(), nodes=[]) as gw:
            cases = [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1000}, "max_tokens"),
                ("/v1/responses", {"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
            ]
            for path, body, param in cases:
                r = await http_request(gw.host_port, "POST", path, body={"model": "direct", **body})
                assert r.status == 400, (path, r.status, r.body)
                err = r.json()["error"]
                assert err["code"] == "invalid_request_error" and err["param"] == param
            # Within the limit the same request is dispatched (and fails: no node).
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body={"model": "direct", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 10},
            )
            assert r.status == 502 and r.json()["error"]["code"] == "node_dispatch_error"


# ------------------------------------------------------------------ metadata


async def test_workspace_becomes_cli_cwd_and_relative_is_refused(tmp_path: Any) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    yaml_text = gateway_yaml(
        models=(
            "  - id: cli\n    providers: {cli-1: cli}\n"
            "  - id: echo\n    providers: {echo-1: echo}\n"
        ),
        nodes=node_entry(
            "node-a",
            cli_provider("cli-1", "import os; print(os.getcwd())") + echo_entry(delay_ms=0),
        ),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            r = await http_request(
                gw.host_port,
                "POST",
                CHAT,
                body=chat_body("cli", "where?", metadata={"workspace": str(workspace)}),
            )
            assert r.status == 200, r.body
            cwd = r.json()["choices"][0]["message"]["content"].strip()
            assert await trio.Path(cwd).samefile(workspace)
            for bad in ("relative/dir", "./x", ""):
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("cli", "where?", metadata={"workspace": bad}),
                )
                assert_error(r, 400, "invalid_request_error", param="metadata.workspace")
            # The rule is for groups with a cli provider: an echo group passes it on.
            r = await http_request(
                gw.host_port,
                "POST",
                CHAT,
                body=chat_body("echo", "where?", metadata={"workspace": "relative/dir"}),
            )
            assert r.status == 200, r.body


async def test_metadata_over_16_entries_is_refused() -> None:
    yaml_text = gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(delay_ms=0)),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            ok = {f"k{i}": "v" for i in range(16)}
            r = await http_request(
                gw.host_port, "POST", CHAT, body=chat_body("echo", "a", metadata=ok)
            )
            assert r.status == 200
            # workspace does not count against the 16
            r = await http_request(
                gw.host_port,
                "POST",
                CHAT,
                body=chat_body("echo", "a", metadata={**ok, "workspace": "/tmp"}),
            )
            assert r.status == 200, r.body
            too_many = {f"k{i}": "v" for i in range(17)}
            for path, body in (
                (CHAT, chat_body("echo", "a", metadata=too_many)),
                ("/v1/responses", {"model": "echo", "input": "a", "metadata": too_many}),
            ):
                r = await http_request(gw.host_port, "POST", path, body=body)
                assert_error(r, 400, "invalid_request_error", param="metadata")
            r = await http_request(
                gw.host_port, "POST", CHAT, body=chat_body("echo", "a", metadata={"n": 1})
            )
            assert r.status == 400


def _complete(req: RunRequest, text: str) -> list[RunEvent]:
    return [
        RunEvent(stream_id=req.stream_id, kind="text", text=text),
        RunEvent(
            stream_id=req.stream_id,
            kind="complete",
            finish_reason="stop",
            usage=Usage(input_tokens=1, output_tokens=1),
        ),
    ]


async def _post_and_capture(
    gw: Gateway, node: FakeNode, body: dict[str, Any], headers: list[tuple[str, str]]
) -> tuple[RawResponse, RunRequest]:
    """POST ``body`` while ``node`` reads the RunRequest and answers it."""
    result: list[RawResponse] = []

    async def post() -> None:
        result.append(await http_request(gw.host_port, "POST", CHAT, body=body, headers=headers))

    async with trio.open_nursery() as n:
        n.start_soon(post)
        req = await node.receive(RunRequest)
        for ev in _complete(req, "done"):
            await node.send(ev)
    return result[0], req


async def test_run_metadata_seen_by_the_node() -> None:
    """A FakeNode reads the RunRequest: principal fields overwritten, run fields added."""
    auth = f"""  principal_tokens:
    - {{token_ref: app-1, token_hash_sha256: {token_hash(PRINCIPAL_TOKEN)}, principal_ref: user-1, alias: alice}}
  long_context_threshold_tokens: 50"""
    yaml_text = gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(delay_ms=0)),
        openai_extra=auth,
    )
    headers = [("authorization", f"Bearer {PRINCIPAL_TOKEN}")]
    with trio.fail_after(30):
        async with running_gateway(yaml_text, nodes=[]) as gw:
            host, port = gw.handle.wire
            async with FakeNode.connect(
                host, port, node_id="node-a", token=node_token("node-a")
            ) as node:
                await wait_until(lambda: gw.runtime.hub.connected_since("node-a") is not None)
                meta = {
                    "iop_principal_ref": "mallory",
                    "iop_principal_alias": "mallory",
                    "iop_principal_source": "open",
                    "iop_token_ref": "stolen",
                    "team": "blue",
                    "workspace": "/srv/ws",
                }
                r, req = await _post_and_capture(
                    gw, node, chat_body("echo", "short", metadata=meta), headers
                )
                assert r.status == 200, r.body
                assert r.json()["choices"][0]["message"]["content"] == "done"
                md = req.metadata
                assert md["iop_principal_ref"] == "user-1"
                assert md["iop_principal_alias"] == "alice"
                assert md["iop_token_ref"] == "app-1"
                assert md["iop_principal_source"] == "principal_token"
                assert md["team"] == "blue"
                assert "workspace" not in md and req.workspace == "/srv/ws"
                assert md["openai_model"] == "echo"
                assert md["openai_stream"] == "false"
                assert md["estimated_input_tokens"] == "2"  # ceil(5 / 4)
                assert md["context_class"] == "normal"
                assert req.target == "echo" and req.adapter == "echo"
                # The workspace is never mixed into the prompt.
                assert "/srv/ws" not in json.dumps(req.messages)

                long_text = "x" * 400  # 100 estimated tokens >= threshold 50
                r, req = await _post_and_capture(
                    gw, node, chat_body("echo", long_text, stream=True), headers
                )
                assert r.status == 200
                assert req.metadata["context_class"] == "long"
                assert req.metadata["estimated_input_tokens"] == "100"
                assert req.metadata["openai_stream"] == "true"
                assert req.metadata["iop_principal_source"] == "principal_token"


# -------------------------------------------------------------- long context

WHOAMI = "print('served-by-{pid}')"


async def test_long_request_lands_on_the_long_capable_provider() -> None:
    long_prov = cli_provider(
        "cli-long", WHOAMI.format(pid="cli-long"), extra="        long_context_capacity: 1\n"
    )
    short_prov = cli_provider("cli-short", WHOAMI.format(pid="cli-short"))
    yaml_text = gateway_yaml(
        models="  - id: cli\n    providers: {cli-long: cli, cli-short: cli}\n",
        nodes=node_entry("node-a", long_prov) + node_entry("node-b", short_prov),
        openai_extra="  long_context_threshold_tokens: 20",
    )

    async def served_by(text: str) -> str:
        r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("cli", text))
        assert r.status == 200, r.body
        content: str = r.json()["choices"][0]["message"]["content"].strip()
        return content.removeprefix("served-by-")

    with trio.fail_after(60):
        async with running_gateway(yaml_text) as gw:
            long_text = "y" * 200  # 50 tokens
            assert {await served_by(long_text) for _ in range(4)} == {"cli-long"}
            # Normal requests spread over both (round-robin on equal load).
            assert {await served_by("short") for _ in range(4)} == {"cli-long", "cli-short"}


# ----------------------------------------------------- provider auth forwarding


def mixed_auth_yaml(base_url: str, *, required: bool, capacity: int = 4, pool: str = "") -> str:
    return gateway_yaml(
        models=(
            "  - id: remote\n    providers: {oa-1: mock-model}\n"
            "  - id: echo\n    providers: {echo-1: echo}\n"
        ),
        nodes=node_entry(
            "node-a",
            http_provider("oa-1", "openai", base_url, models="[mock-model]", capacity=capacity)
            + echo_entry(delay_ms=0),
        ),
        openai_extra=(
            "  provider_auth: {header: X-Provider-Authorization, target_header: Authorization,"
            f" required: {'true' if required else 'false'}}}"
        ),
        pool=pool,
    )


async def test_provider_auth_forwarded_and_caller_authorization_dropped() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            async with running_gateway(mixed_auth_yaml(mock.base_url, required=False)) as gw:
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("remote", "hi"),
                    headers=[
                        ("authorization", "Bearer caller-secret-1"),
                        ("x-provider-authorization", "Bearer provider-key-9"),
                    ],
                )
                assert r.status == 200, r.body
                sent = mock.requests[-1]
                assert sent.header("authorization") == "Bearer provider-key-9"
                assert sent.header("x-provider-authorization") is None
                assert b"caller-secret-1" not in repr(sent.headers).encode()
                # Without the header: the caller's Authorization is still not forwarded.
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("remote", "hi"),
                    headers=[("authorization", "Bearer caller-secret-1")],
                )
                assert r.status == 200
                assert mock.requests[-1].header("authorization") is None
            n.cancel_scope.cancel()


async def test_provider_auth_required_rejects_before_queueing() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.chunk_delay = 0.05
            yaml_text = mixed_auth_yaml(
                mock.base_url, required=True, capacity=1, pool="provider_pool: {max_queue: 0}"
            )
            async with running_gateway(yaml_text) as gw:
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("remote", "hi"))
                assert_error(r, 401, "provider_auth_required")
                assert r.json()["error"]["type"] == "authentication_error"
                assert mock.requests == [] or all(q.method == "GET" for q in mock.requests)
                # Normalized groups do not need it.
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", "hi"))
                assert r.status == 200
                # With the only slot busy (max_queue 0), a request without the header is
                # still a 401, not a 429: the check comes before the queue.
                pool = gw.runtime.pool
                done = trio.Event()

                async def busy() -> None:
                    await http_request(
                        gw.host_port,
                        "POST",
                        CHAT,
                        body=chat_body("remote", "hi", stream=True),
                        headers=[("x-provider-authorization", "Bearer k")],
                    )
                    done.set()

                n.start_soon(busy)
                await wait_until(lambda: pool.provider_loads()["oa-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("remote", "hi"))
                assert_error(r, 401, "provider_auth_required")
                r = await http_request(
                    gw.host_port,
                    "POST",
                    CHAT,
                    body=chat_body("remote", "hi"),
                    headers=[("x-provider-authorization", "Bearer k")],
                )
                assert_error(r, 429, "queue_full")
                await done.wait()
            n.cancel_scope.cancel()


# ------------------------------------------------------------- legacy routes


async def test_legacy_routes_and_single_target_fallback() -> None:
    providers = (
        cli_provider("cli-group", WHOAMI.format(pid="cli-group"), models="[g]")
        + cli_provider("cli-route", WHOAMI.format(pid="cli-route"), models="[r]")
        + cli_provider("cli-fallback", WHOAMI.format(pid="cli-fallback"), models="[fb]")
    )
    openai_extra = """  model_routes:
    - {model: legacy-a, node: node-a, adapter: cli-route, target: r}
    - {model: shadowed, node: node-a, adapter: cli-route, target: r}
  node: node-a
  adapter: cli-fallback
  target: fb"""
    yaml_text = gateway_yaml(
        models="  - id: group-m\n    providers: {cli-group: g}\n  - id: shadowed\n    providers: {cli-group: g}\n",
        nodes=node_entry("node-a", providers),
        openai_extra=openai_extra,
    )

    with trio.fail_after(60):
        async with running_gateway(yaml_text) as gw:
            client = gw.sdk()
            models = await in_thread(lambda: client.models.list())
            # models[], then legacy routes (a route shadowed by models[] once), then fallback
            assert [m.id for m in models.data] == ["group-m", "shadowed", "legacy-a", "fb"]

            async def served_by(model: str) -> str:
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body(model, "x"))
                assert r.status == 200, r.body
                assert r.json()["model"] == model
                return str(r.json()["choices"][0]["message"]["content"]).strip()

            assert await served_by("group-m") == "served-by-cli-group"
            assert await served_by("shadowed") == "served-by-cli-group"  # models[] first
            assert await served_by("legacy-a") == "served-by-cli-route"
            assert await served_by("anything-else") == "served-by-cli-fallback"
            assert await served_by("fb") == "served-by-cli-fallback"


# --------------------------------------------------------------------- queue


async def test_legacy_route_queue_timeout_overrides_the_root_one() -> None:
    yaml_text = gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(capacity=1, delay_ms=60)),
        openai_extra=(
            "  model_routes:\n"
            "    - {model: quick, node: node-a, adapter: echo-1, target: echo, queue_timeout: 0.05}"
        ),
        pool="provider_pool: {max_queue: 4, queue_timeout: 60}",
    )
    with trio.fail_after(20):  # below the root queue_timeout: only the override ends the wait
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("quick", "x"))
                assert_error(r, 503, "queue_timeout")
            assert first[0].status == 200


def queue_yaml(*, pool: str, delay_ms: int = 30) -> str:
    return gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(capacity=1, delay_ms=delay_ms)),
        pool=pool,
    )


SLOW_TEXT = " ".join(f"w{i}" for i in range(10))  # 10 chunks


async def _hold_slot(gw: Gateway, results: list[RawResponse]) -> None:
    results.append(
        await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", SLOW_TEXT))
    )


async def test_queue_full_when_max_queue_is_zero() -> None:
    with trio.fail_after(30):
        async with running_gateway(queue_yaml(pool="provider_pool: {max_queue: 0}")) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", "x"))
                assert_error(r, 429, "queue_full")
                assert r.json()["error"]["type"] == "rate_limit_error"
            assert first[0].status == 200
            assert first[0].json()["choices"][0]["message"]["content"] == SLOW_TEXT


async def test_queue_timeout_is_503_with_retry_after() -> None:
    yaml_text = queue_yaml(pool="provider_pool: {max_queue: 4, queue_timeout: 0.05}", delay_ms=60)
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("echo", "x"))
                assert_error(r, 503, "queue_timeout")
                assert r.json()["error"]["type"] == "server_error"
                retry = r.header("retry-after")
                assert retry is not None and int(retry) >= 1
                assert pool.queue_depth == 0
            assert first[0].status == 200


async def test_waiter_is_admitted_when_the_slot_frees() -> None:
    yaml_text = queue_yaml(pool="provider_pool: {max_queue: 4, queue_timeout: 20}")
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            pool = gw.runtime.pool
            first: list[RawResponse] = []
            second: list[RawResponse] = []
            async with trio.open_nursery() as n:
                n.start_soon(_hold_slot, gw, first)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)

                async def waiter() -> None:
                    second.append(
                        await http_request(
                            gw.host_port, "POST", CHAT, body=chat_body("echo", "queued one")
                        )
                    )

                n.start_soon(waiter)
                await wait_until(lambda: pool.queue_depth == 1)
                assert not first  # still holding the slot while the waiter queues
            assert first[0].status == 200
            assert second[0].status == 200
            assert second[0].json()["choices"][0]["message"]["content"] == "queued one"
            assert pool.queue_depth == 0
            await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 0)


# ----------------------------------------------------------- provider errors


async def test_normalized_provider_error_and_timeout() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOllamaServer().serve)
            yaml_text = gateway_yaml(
                models="  - id: ol\n    providers: {ol-1: 'mock:latest'}\n",
                nodes=node_entry(
                    "node-a",
                    http_provider(
                        "ol-1",
                        "ollama",
                        mock.base_url,
                        models="['mock:latest']",
                        # One probe only, before the mock fails on purpose: a
                        # probe in "error500" or "hang" mode marks it unhealthy.
                        extra="        read_timeout: 0.3\n        health_interval: 3600\n",
                    ),
                ),
            )
            async with running_gateway(yaml_text) as gw:
                await wait_until(
                    lambda: getattr(gw.runtime.health.get("ol-1"), "health", "") == "healthy"
                )
                mock.mode = "error500"
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("ol", "hi"))
                assert_error(r, 502, "provider_error")
                assert r.json()["error"]["type"] == "server_error"
                mock.mode = "hang"
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("ol", "hi"))
                assert_error(r, 504, "provider_timeout")
                mock.mode = "ok"
                r = await http_request(gw.host_port, "POST", CHAT, body=chat_body("ol", "hi"))
                assert r.status == 200
                await wait_until(lambda: gw.runtime.pool.provider_loads()["ol-1"].in_flight == 0)
            n.cancel_scope.cancel()


async def test_passthrough_provider_error_relayed_as_is() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            body_bytes = b'{"error": {"message": "upstream exploded", "type": "weird", "code": 7}}'

            def handler(req: RecordedRequest) -> MockReply | None:
                if req.method == "POST":
                    return MockReply(
                        status=500,
                        headers=[("content-type", "application/json"), ("x-upstream", "yes")],
                        body=body_bytes,
                    )
                return None

            mock.handler = handler
            yaml_text = remote_yaml(mock.base_url)
            async with running_gateway(yaml_text) as gw:
                for path, body in (
                    (CHAT, chat_body("remote", "hi")),
                    ("/v1/responses", {"model": "remote", "input": "hi", "stream": True}),
                ):
                    r = await http_request(gw.host_port, "POST", path, body=body)
                    assert r.status == 500
                    assert r.body == body_bytes
                    assert r.header("x-upstream") == "yes"
                pool = gw.runtime.pool
                await wait_until(lambda: pool.provider_loads()["oa-1"].in_flight == 0)
            n.cancel_scope.cancel()


# -------------------------------------------------- responses passthrough


async def test_responses_stream_relayed_raw_with_unknown_fields() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.reasoning_text = "thinking hard"
            yaml_text = gateway_yaml(
                models="  - id: codex\n    providers: {oa-1: mock-model}\n",
                nodes=node_entry(
                    "node-a", http_provider("oa-1", "openai", mock.base_url, models="[mock-model]")
                ),
            )
            body = {
                "model": "codex",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                "stream": True,
                "store": False,
                "reasoning": {"effort": "high", "summary": "auto"},
                "include": ["reasoning.encrypted_content"],
                "parallel_tool_calls": False,
                "x_codex_future": {"a": [1, 2]},
            }
            async with running_gateway(yaml_text) as gw:
                r = await http_request(gw.host_port, "POST", "/v1/responses", body=body)
                assert r.status == 200, r.body
                assert r.header("content-type") == "text/event-stream"
                assert r.header("x-accel-buffering") == "no"
                sent = mock.requests[-1]
                assert sent.path == "/v1/responses"
                sent_body = sent.json()
                assert sent_body == {**body, "model": "mock-model"}
                # The exact bytes the provider produces for the same request.
                expected = b"".join(mock._responses(sent_body).chunks or [])
                assert r.body == expected
                kinds = [ev["type"] for ev in sse_events(r.body)]
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                assert "response.reasoning_text.delta" in kinds

            n.cancel_scope.cancel()


# ------------------------------------------------------ passthrough cancel


async def _open_stream_and_close(gw: Gateway, body: dict[str, Any]) -> float:
    """Start a streaming request, read until the first SSE event, then close.

    Returns the trio time of the close.
    """
    import h11

    conn = h11.Connection(h11.CLIENT)
    payload = json.dumps(body).encode()
    stream = await trio.open_tcp_stream(*gw.host_port)
    try:
        await stream.send_all(
            conn.send(
                h11.Request(
                    method="POST",
                    target=CHAT,
                    headers=[
                        ("host", "edge"),
                        ("content-type", "application/json"),
                        ("content-length", str(len(payload))),
                    ],
                )
            )
            + conn.send(h11.Data(data=payload))
            + conn.send(h11.EndOfMessage())
        )
        got = b""
        while b"data: " not in got:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                assert data, "the edge closed before the first event"
                conn.receive_data(data)
            elif isinstance(ev, h11.Response):
                assert ev.status_code == 200
            elif isinstance(ev, h11.Data):
                got += bytes(ev.data)
            else:
                raise AssertionError(f"unexpected {ev!r}")
    finally:
        closed_at = trio.current_time()
        await trio.aclose_forcefully(stream)
    return closed_at


async def test_passthrough_cancel_closes_the_provider_connection() -> None:
    runs = 20
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.reply_text = " ".join(f"w{i}" for i in range(100))
            mock.chunk_delay = 0.05  # 100 chunks x 50 ms: only a cancel ends it early
            yaml_text = remote_yaml(mock.base_url)
            async with running_gateway(yaml_text) as gw:
                pool = gw.runtime.pool
                delays: list[float] = []
                for i in range(runs):
                    closed_at = await _open_stream_and_close(
                        gw, chat_body("remote", "stream please", stream=True)
                    )
                    await mock.wait_client_close(i + 1)
                    delays.append(mock.client_closed_at[i] - closed_at)
                    await wait_until(lambda: pool.provider_loads()["oa-1"].in_flight == 0)
                # Every cancelled stream was cut well before its natural end.
                assert all(d < 100 * 0.05 for d in delays)
                delays_ms = sorted(d * 1000 for d in delays)
                print(
                    f"\npassthrough cancel -> provider close over {runs} runs: "
                    f"p50={statistics.median(delays_ms):.2f} ms max={delays_ms[-1]:.2f} ms"
                )
            n.cancel_scope.cancel()
