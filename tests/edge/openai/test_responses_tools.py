"""The Responses tools a normalized provider takes (``incoming/responses_tools.py``)
and how their calls go back out (``outgoing/responses.py``): pure tables."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iopd.edge.openai.incoming.responses_tools import (
    ToolOrigin,
    dropped_header,
    plan_tools,
    tool_choice_plan,
    unsupported_refusal,
)
from iopd.edge.openai.outgoing.responses import build_response, responses_input_to_messages
from iopd.errors import InvalidRequest

FN = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"},
}


def _names(tools: list[Any] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or []]


def test_function_custom_and_namespace_tools_flatten() -> None:
    ns = {
        "type": "namespace",
        "name": "mcp__fs",
        "tools": [
            {"type": "function", "name": "read", "parameters": {"type": "object"}},
            {"type": "function", "name": "shell"},  # taken at the top: renamed
            {"type": "custom", "name": "raw"},
        ],
    }
    plan = plan_tools([FN, CUSTOM, {"type": "web_search"}, ns])
    assert _names(plan.function_tools) == ["shell", "apply_patch", "read", "mcp__fs__shell", "raw"]
    assert plan.unsupported == [(2, "web_search")] and plan.dropped_types == ["web_search"]
    assert plan.origin("shell") is None  # a plain top-level function
    assert plan.origin("apply_patch") == ToolOrigin("custom", "apply_patch")
    assert plan.origin("mcp__fs__shell") == ToolOrigin("function", "shell", "mcp__fs")
    assert plan.origin("raw") == ToolOrigin("custom", "raw", "mcp__fs")
    assert plan.flat_name("shell", "mcp__fs") == "mcp__fs__shell"
    custom = plan.function_tools[1]["function"]  # type: ignore[index]
    assert custom["parameters"]["required"] == ["input"]
    assert (
        "lark grammar:\nstart: patch" in custom["parameters"]["properties"]["input"]["description"]
    )
    assert custom["description"] == "Edit files."


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "function", "name": "bad name"}], "tools[0].name"),
        ([{"type": "function", "name": "f", "parameters": []}], "tools[0].parameters"),
    ],
)
def test_malformed_function_tools_are_a_400_naming_the_field(tools: list[Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        plan_tools(tools)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "custom"}], "tools[0].name"),
        ([FN, {"type": "namespace", "name": "n", "tools": {}}], "tools[1].tools"),
        ([{"type": "namespace", "name": "n", "tools": ["x"]}], "tools[0].tools[0]"),
        ([{"type": "namespace", "name": "n.x", "tools": []}], "tools[0].name"),
        ([FN, {"type": "namespace", "name": "n", "tools": [FN, FN]}], "tools[1].tools[1].name"),
    ],
)
def test_malformed_custom_or_namespace_tools_are_the_normalized_paths_400(
    tools: list[Any], param: str
) -> None:
    """Left to a passthrough provider to judge; on the normalized path, the 400."""
    plan = plan_tools(tools)
    refusal = unsupported_refusal(plan)
    assert plan.problem is refusal and refusal is not None and refusal.param == param


def test_dropped_types_are_safe_labels_and_the_header_is_bounded() -> None:
    odd = [{"type": "x\r\nSet-Cookie: a=b"}, {"type": 7}, {"type": "web_search"}]
    plan = plan_tools(odd + [{"type": f"t{i}"} for i in range(20)])
    assert plan.dropped_types[:2] == ["unknown", "web_search"]
    name, value = dropped_header(plan.dropped_types)
    assert name == "X-Iopd-Dropped-Tools"
    assert value == "unknown, web_search, t0, t1, t2, t3, t4, t5, +14 more"
    assert "\r" not in value and "\n" not in value


def test_unsupported_tools_refusal_names_the_first() -> None:
    assert unsupported_refusal(plan_tools([FN])) is None
    refusal = unsupported_refusal(plan_tools([FN, {"type": "image_generation"}, {"type": "mcp"}]))
    assert refusal is not None and refusal.param == "tools[1].type"
    assert "image_generation" in refusal.message


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, (None, None)),
        ("none", ("none", None)),
        ("required", ("required", None)),
        ({"type": "function", "name": "shell"}, ("required", "shell")),
        ({"type": "custom", "name": "apply_patch"}, ("required", "apply_patch")),
        ({"type": "web_search"}, ("auto", None)),
        ({"type": "allowed_tools", "mode": "required", "tools": []}, ("required", None)),
    ],
)
def test_tool_choice(choice: Any, expected: tuple[str | None, str | None]) -> None:
    assert tool_choice_plan(choice, plan_tools([FN, CUSTOM])) == expected


def test_tool_choice_bad_values() -> None:
    for choice in ("sometimes", 3, {"type": "function"}):
        with pytest.raises(InvalidRequest) as info:
            tool_choice_plan(choice, plan_tools([FN]))
        assert info.value.param.startswith("tool_choice")


def test_codex_input_items_to_messages() -> None:
    req = {
        "tools": [CUSTOM, {"type": "namespace", "name": "ns", "tools": [dict(FN, name="f")]}],
        "input": [
            {"role": "user", "content": "go"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "P"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "f",
                "namespace": "ns",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c2", "output": "done"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        ],
    }
    messages = responses_input_to_messages(req)
    assert messages[0] == {"role": "user", "content": "go"}
    call = messages[1]["tool_calls"][0]
    assert call["function"] == {
        "name": "apply_patch",
        "arguments": json.dumps({"input": "P"}, separators=(",", ":")),
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert messages[3]["tool_calls"][0]["function"]["name"] == "f"
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "done"}
    assert len(messages) == 5


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"input": "P"}', "P"),
        ('{"patch": "P"}', "P"),  # the one string argument the model chose
        ("not json", "not json"),
        ('"P"', "P"),
        ('{"a": 1, "b": 2}', '{"a": 1, "b": 2}'),
    ],
)
def test_custom_call_goes_back_as_custom_tool_call(arguments: str, expected: str) -> None:
    doc = build_response(
        response_id="resp_1",
        model="m",
        created_at=0,
        text="",
        reasoning_text="",
        usage=None,
        tool_calls=[{"id": "c1", "function": {"name": "apply_patch", "arguments": arguments}}],
        tools=[CUSTOM],
    )
    (item,) = doc["output"]
    assert item["type"] == "custom_tool_call" and item["call_id"] == "c1"
    assert item["name"] == "apply_patch" and item["input"] == expected


def test_namespaced_call_goes_back_with_its_namespace_and_name() -> None:
    ns = {"type": "namespace", "name": "ns", "tools": [dict(FN)]}
    doc = build_response(
        response_id="resp_1",
        model="m",
        created_at=0,
        text="",
        reasoning_text="",
        usage=None,
        tool_calls=[{"id": "c1", "function": {"name": "ns__shell", "arguments": "{}"}}],
        tools=[FN, ns],
    )
    (item,) = doc["output"]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "shell", "ns")
