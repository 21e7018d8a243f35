"""Tool calls: the text protocol instruction, parsing and validation, native restore."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from iopd.edge.openai.incoming.jsonschema import ValidationBudget
from iopd.edge.openai.outgoing.tools import (
    new_call_id,
    parse_text_tool_calls,
    restore_native_tool_call,
    tool_instruction,
)
from iopd.errors import ProviderError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters at all
TOOLS: list[dict[str, Any]] = [WEATHER, CLOCK]


def block(payload: Any) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>{text}</tool_call>"


def assert_openai_call(call: dict[str, Any], name: str, arguments: dict[str, Any]) -> None:
    assert set(call) == {"id", "type", "function"}
    assert call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["type"] == "function"
    assert call["function"]["name"] == name
    assert json.loads(call["function"]["arguments"]) == arguments
    ChatCompletionMessageFunctionToolCall.model_validate(call)


# --------------------------------------------------------------- instruction


def test_instruction_describes_every_function_tool() -> None:
    text = tool_instruction([*TOOLS, {"type": "web_search"}])
    assert "Tool: get_weather" in text
    assert "Description: Current weather for a city." in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text  # type: ignore[index]
    assert "Tool: now" in text
    assert '"properties": {}' in text  # a tool without parameters is described as {}
    assert "web_search" not in text
    assert '<tool_call>{"name": "<tool name>", "arguments": {' in text
    assert "plain text" in text


def test_instruction_accepts_responses_style_flat_tools() -> None:
    flat = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    assert "Tool: lookup" in tool_instruction([flat])


# ------------------------------------------------------------------ parsing


def test_no_block_is_plain_text() -> None:
    result = parse_text_tool_calls("The weather is nice.", TOOLS)
    assert (result.calls, result.content, result.fallback) == (None, "The weather is nice.", False)


def test_prose_mentioning_a_tool_is_never_a_call() -> None:
    text = 'I would call get_weather with {"city": "Paris"} but I will not.'
    result = parse_text_tool_calls(text, TOOLS)
    assert (result.calls, result.content, result.fallback) == (None, text, False)


def test_one_valid_block() -> None:
    result = parse_text_tool_calls(
        block({"name": "get_weather", "arguments": {"city": "Paris"}}), TOOLS
    )
    assert not result.fallback and result.content is None
    assert result.calls is not None and len(result.calls) == 1
    assert_openai_call(result.calls[0], "get_weather", {"city": "Paris"})


def test_several_blocks_with_text_around_and_string_arguments() -> None:
    text = (
        "Let me check.\n"
        + block({"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})})
        + "\n"
        + block('\n  {"name": "now", "arguments": {}}\n')
        + "\n"
    )
    result = parse_text_tool_calls(text, TOOLS)
    assert not result.fallback
    assert result.content == "Let me check."
    assert result.calls is not None and len(result.calls) == 2
    assert_openai_call(result.calls[0], "get_weather", {"city": "Oslo", "unit": "c"})
    assert_openai_call(result.calls[1], "now", {})
    assert result.calls[0]["id"] != result.calls[1]["id"]


def test_missing_arguments_means_empty_object() -> None:
    result = parse_text_tool_calls(block({"name": "now"}), TOOLS)
    assert result.calls is not None
    assert_openai_call(result.calls[0], "now", {})
    # ... which still has to satisfy the schema.
    assert parse_text_tool_calls(block({"name": "get_weather"}), TOOLS).fallback


def test_code_fence_inside_the_block_is_tolerated() -> None:
    text = '<tool_call>\n```json\n{"name": "now", "arguments": {}}\n```\n</tool_call>'
    result = parse_text_tool_calls(text, TOOLS)
    assert result.calls is not None and not result.fallback


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (block({"name": "get_weather", "arguments": {"city": 3}}), "do not match its schema"),
        (block({"name": "get_weather", "arguments": {"town": "x"}}), "do not match its schema"),
        (block({"name": "get_weather", "arguments": {"city": "x", "unit": "k"}}), "schema"),
        (block({"name": "delete_everything", "arguments": {}}), "unknown tool"),
        (block({"arguments": {}}), "unknown tool"),
        (block('{"name": "now", "arguments": {}'), "not valid JSON"),
        (block("get_weather(city='Paris')"), "not valid JSON"),
        (block('["now"]'), "not a JSON object"),
        (block({"name": "now", "arguments": "{oops"}), "not valid JSON"),
        (block({"name": "now", "arguments": [1]}), "not a JSON object"),
        (block('{"name": "now", "arguments": {"x": NaN}}'), "not valid JSON"),
        ('<tool_call>{"name": "now", "arguments": {}}', "not closed"),
        (block({"name": "now"}) + '<tool_call>{"name": "now"}', "not closed"),
    ],
)
def test_invalid_blocks_fall_back_to_the_original_text(text: str, problem: str) -> None:
    result = parse_text_tool_calls(text, TOOLS)
    assert result.calls is None
    assert result.content == text
    assert result.fallback is True
    assert problem in result.problem


def test_one_bad_block_among_good_ones_falls_back_whole() -> None:
    text = block({"name": "now", "arguments": {}}) + block({"name": "nope", "arguments": {}})
    result = parse_text_tool_calls(text, TOOLS)
    assert (result.calls, result.content, result.fallback) == (None, text, True)


def test_no_tools_declared_means_every_block_is_invalid() -> None:
    result = parse_text_tool_calls(block({"name": "now", "arguments": {}}), [])
    assert result.fallback and result.calls is None


# ------------------------------------------------------------ native restore


@pytest.mark.parametrize(
    ("native", "expected_args"),
    [
        (
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
            '{"a":1}',
        ),
        ({"function": {"name": "f", "arguments": {"a": 1}}}, '{"a":1}'),  # Ollama
        ({"function": {"index": 0, "name": "f", "arguments": {}}}, "{}"),
        ({"name": "f", "arguments": {"a": [1, "x"]}}, '{"a":[1,"x"]}'),  # flat
        ({"function": {"name": "f"}}, "{}"),
        ({"id": "", "function": {"name": "f", "arguments": None}}, "{}"),
    ],
)
def test_restore_native_tool_call(native: dict[str, Any], expected_args: str) -> None:
    restored = restore_native_tool_call(native, 0)
    assert restored["type"] == "function"
    assert restored["function"] == {"name": "f", "arguments": expected_args}
    if native.get("id"):
        assert restored["id"] == native["id"]
    else:
        assert restored["id"].startswith("call_") and len(restored["id"]) > 10
    ChatCompletionMessageFunctionToolCall.model_validate(restored)


def test_restore_without_a_name_is_a_provider_error() -> None:
    with pytest.raises(ProviderError) as info:
        restore_native_tool_call({"function": {"arguments": {}}}, 3)
    assert "#3" in info.value.message


def test_call_ids_are_unique() -> None:
    assert len({new_call_id() for _ in range(100)}) == 100


# ------------------------------------------------------------ bounded work


def test_unclosed_tags_are_scanned_once() -> None:
    # Quadratic before: 88 KB of unclosed tags took 5 s.
    text = "<tool_call>" * 100_000
    result = parse_text_tool_calls(text, TOOLS)
    assert (result.calls, result.content, result.fallback) == (None, text, True)
    assert "not closed" in result.problem


def test_many_blocks_and_the_text_between_them() -> None:
    text = ("x " + block({"name": "now", "arguments": {}})) * 1_000 + " end"
    result = parse_text_tool_calls(text, TOOLS)
    assert result.calls is not None and len(result.calls) == 1_000
    assert result.content == ("x " * 1_000 + " end").strip()


def test_fence_with_long_whitespace_runs() -> None:
    # The fence regex backtracked cubically: 1,000 "\n " pairs took 10 s.
    text = "<tool_call>```" + "\n " * 100_000 + "x```</tool_call>"
    result = parse_text_tool_calls(text, TOOLS)
    assert result.fallback and "not valid JSON" in result.problem


def test_deeply_nested_block_is_invalid_json_not_a_crash() -> None:
    result = parse_text_tool_calls(block("[" * 100_000), TOOLS)
    assert result.fallback and "not valid JSON" in result.problem


def test_costly_arguments_fall_back_to_text() -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "allOf": [{"$ref": "#"}] * 3}},
    }
    text = block({"name": "f", "arguments": {}})
    result = parse_text_tool_calls(text, [tool])
    assert (result.calls, result.content, result.fallback) == (None, text, True)


def test_blocks_of_one_answer_share_one_budget() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"properties": {"v": {"items": {"type": "integer"}}}},
        },
    }
    one = block({"name": "f", "arguments": {"v": list(range(600))}})
    assert parse_text_tool_calls(one, [tool], ValidationBudget(max_steps=1_000)).calls
    result = parse_text_tool_calls(one * 2, [tool], ValidationBudget(max_steps=1_000))
    assert result.fallback and "validation stopped" in result.problem


def test_instruction_survives_a_schema_too_deep_to_encode() -> None:
    deep: Any = {}
    for _ in range(5_000):
        deep = {"not": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    assert "nested too deeply" in tool_instruction([tool])
