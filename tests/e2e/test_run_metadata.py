"""Metadata end to end: a workspace becomes the ``cli`` provider's working directory (a relative
one is refused), more than 16 entries are refused, and the node sees the run metadata."""

from __future__ import annotations

import json
from typing import Any

import trio

from tests.support.configs import cli_provider, echo_entry, gateway_yaml, node_entry
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.replies import assert_error, chat_body
from tests.support.wire_peers import FakeNode
from wire.messages import RunEvent, RunRequest, Usage

CHAT = "/v1/chat/completions"
PRINCIPAL_TOKEN = "sk-canary-surface-0001"


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
