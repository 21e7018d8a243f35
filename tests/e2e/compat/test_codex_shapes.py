"""Codex's ``/v1/responses`` requests on normalized providers (echo, ollama).

Codex sends, on its first turn already, a ``namespace`` tool (its MCP
servers' tools), built-in tools (``web_search``), a ``custom`` tool (the
freeform ``apply_patch``), and on later turns ``reasoning`` and
``custom_tool_call`` items in its input, with ``reasoning``, ``include``,
``store``, ``prompt_cache_key`` and ``parallel_tool_calls``.  Each used to be
a 400 on a normalized provider; now the built-in tools are dropped (named in
``X-Iopd-Dropped-Tools``, counted), the others mapped, and a custom tool's
call comes back as a ``custom_tool_call`` the agent runs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.support.configs import (
    echo_yaml,
    ollama_only_yaml,
)
from tests.support.gateway import http_request, metric, running_gateway
from tests.support.mock_providers import MockOllamaServer

PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch"

CODEX_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
        },
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Use the `apply_patch` tool to edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch"},
    },
    {"type": "web_search"},
    {
        "type": "namespace",
        "name": "mcp__docs",
        "description": "The docs server's tools",
        "tools": [
            {
                "type": "function",
                "name": "lookup",
                "description": "Looks a page up",
                "strict": False,
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            }
        ],
    },
]


def _codex_body(input_items: list[Any], *, stream: bool) -> dict[str, Any]:
    return {
        "model": "m",
        "instructions": "You are Codex.",
        "input": input_items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "high", "summary": "auto"},
        "store": False,
        "stream": stream,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-codex-session",
    }


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _events(body: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[len(b"data: ") :])
        for line in body.split(b"\n")
        if line.startswith(b"data: ")
    ]


def _echo_yaml(extra: str = "") -> str:
    return echo_yaml(extra_models="  - id: m\n    providers: {echo-1: echo}\n", openai_extra=extra)


async def _post(gw: Any, body: dict[str, Any], headers: list[tuple[str, str]] | None = None) -> Any:
    return await http_request(gw.host_port, "POST", "/v1/responses", body=body, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_codex_first_turn_on_echo_drops_web_search_and_runs(stream: bool) -> None:
    with trio.fail_after(30):
        async with running_gateway(_echo_yaml()) as gw:
            resp = await _post(gw, _codex_body([_user("say hi")], stream=stream))
            assert resp.status == 200, resp.body
            assert resp.header("x-iopd-dropped-tools") == "web_search"
            if stream:
                final = _events(resp.body)[-1]
                assert final["type"] == "response.completed"
                doc = final["response"]
            else:
                doc = json.loads(resp.body)
            text = [
                p["text"] for i in doc["output"] if i["type"] == "message" for p in i["content"]
            ]
            assert text == ["say hi"]
            assert doc["model"] == "m"  # the caller's model, not the served "echo"
            assert metric(gw, "iop_openai_dropped_tools_total", tool_type="web_search") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_custom_tool_call_comes_back_as_custom_tool_call(stream: bool) -> None:
    """Echo runs the text tool protocol: the user's ``<tool_call>`` text is the
    model's call of ``apply_patch`` (one string argument), answered as Codex
    expects it: a ``custom_tool_call`` with the patch as ``input``."""
    call = json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    with trio.fail_after(30):
        async with running_gateway(_echo_yaml()) as gw:
            body = _codex_body([_user(f"<tool_call>{call}</tool_call>")], stream=stream)
            resp = await _post(gw, body)
            assert resp.status == 200, resp.body
            if stream:
                events = _events(resp.body)
                kinds = [e["type"] for e in events]
                assert "response.custom_tool_call_input.delta" in kinds
                assert "response.custom_tool_call_input.done" in kinds
                doc = events[-1]["response"]
            else:
                doc = json.loads(resp.body)
            items = [i for i in doc["output"] if i["type"] == "custom_tool_call"]
            assert len(items) == 1 and items[0]["name"] == "apply_patch"
            assert items[0]["input"] == PATCH

            # The next turn: the call, its output and a reasoning item go back.
            again = _codex_body(
                [
                    _user("edit it"),
                    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
                    {
                        "type": "custom_tool_call",
                        "call_id": items[0]["call_id"],
                        "name": "apply_patch",
                        "input": PATCH,
                    },
                    {
                        "type": "custom_tool_call_output",
                        "call_id": items[0]["call_id"],
                        "output": "Success. Updated the following files:\nA hello.txt",
                    },
                    _user("done?"),
                ],
                stream=False,
            )
            resp = await _post(gw, again)
            assert resp.status == 200, resp.body
            assert json.loads(resp.body)["output"][0]["content"][0]["text"] == "done?"


async def test_namespaced_call_names_its_namespace_on_echo() -> None:
    call = json.dumps({"name": "lookup", "arguments": {"q": "trio"}})
    with trio.fail_after(30):
        async with running_gateway(_echo_yaml()) as gw:
            resp = await _post(
                gw, _codex_body([_user(f"<tool_call>{call}</tool_call>")], stream=False)
            )
            assert resp.status == 200, resp.body
            items = [i for i in json.loads(resp.body)["output"] if i["type"] == "function_call"]
            assert [(i["name"], i.get("namespace"), json.loads(i["arguments"])) for i in items] == [
                ("lookup", "mcp__docs", {"q": "trio"})
            ]


async def test_reject_policy_refuses_what_it_cannot_run() -> None:
    with trio.fail_after(30):
        async with running_gateway(_echo_yaml("  unsupported_tools: reject\n")) as gw:
            resp = await _post(gw, _codex_body([_user("hi")], stream=False))
            assert resp.status == 400
            error = json.loads(resp.body)["error"]
            assert error["param"] == "tools[2].type" and "web_search" in error["message"]
            assert resp.header("x-iopd-dropped-tools") is None


async def test_codex_shapes_on_ollama_map_fields_and_tools(
    ollama_mock: MockOllamaServer,
) -> None:
    mock = ollama_mock
    with trio.fail_after(30):
        mock.tool_calls = [{"name": "apply_patch", "arguments": {"input": PATCH}}]
        yaml_text = ollama_only_yaml(mock.base_url, "m")
        async with running_gateway(yaml_text) as gw:
            body = _codex_body(
                [
                    _user("first"),
                    {"type": "reasoning", "id": "rs_1", "summary": []},
                    _user("write hello.txt"),
                ],
                stream=True,
            )
            body.update(top_k=20, min_p=0.05, repetition_penalty=1.1)
            resp = await _post(gw, body)
            assert resp.status == 200, resp.body
            assert resp.header("x-iopd-dropped-tools") == "web_search"
            sent = mock.requests[-1].json()
            assert sent["think"] == "high"
            assert sent["options"] == {"top_k": 20, "min_p": 0.05, "repeat_penalty": 1.1}
            names = [t["function"]["name"] for t in sent["tools"]]
            assert names == ["shell", "apply_patch", "lookup"]
            patch_tool = sent["tools"][1]["function"]
            assert patch_tool["parameters"]["required"] == ["input"]
            assert (
                "start: begin_patch"
                in patch_tool["parameters"]["properties"]["input"]["description"]
            )
            # the reasoning item is dropped, the messages kept in order
            assert [m["content"] for m in sent["messages"]] == [
                "You are Codex.",
                "first",
                "write hello.txt",
            ]
            final = _events(resp.body)[-1]
            assert final["type"] == "response.completed"
            assert final["response"]["model"] == "m"  # not the served mock:latest
            custom = [i for i in final["response"]["output"] if i["type"] == "custom_tool_call"]
            assert [(i["name"], i["input"]) for i in custom] == [("apply_patch", PATCH)]
