"""One check per request field: each bad value a 400 naming its ``param``."""

from __future__ import annotations

import json

import pytest

from iopd.edge.openai.incoming import request_fields as f
from iopd.errors import InvalidRequest
from iopd.json_types import JSONObject, JSONValue


def _param(exc: pytest.ExceptionInfo[InvalidRequest]) -> str | None:
    return exc.value.param


@pytest.mark.parametrize(
    ("value", "number", "integer"),
    [(1, True, True), (2.0, True, True), (2.5, True, False), (True, False, False), ("1", False, False)],
)
def test_numbers_are_never_booleans(value: JSONValue, number: bool, integer: bool) -> None:
    assert f.is_number(value) is number
    assert f.is_int(value) is integer


def test_rewrite_model_keeps_the_rest_of_the_body() -> None:
    raw: JSONObject = {"model": "alias", "messages": [], "temperature": 0.5}
    assert json.loads(f.rewrite_model(raw, "served-7b")) == {**raw, "model": "served-7b"}
    assert raw["model"] == "alias"  # the caller's dict is not changed


def test_model_is_a_required_non_empty_string() -> None:
    assert f.model({"model": "m"}) == "m"
    for raw in ({}, {"model": ""}, {"model": 3}):
        with pytest.raises(InvalidRequest) as info:
            f.model(raw)
        assert _param(info) == "model"


def test_opt_number_range_and_type() -> None:
    assert f.opt_number({}, "temperature", 0, 2) is None
    assert f.opt_number({"temperature": None}, "temperature", 0, 2) is None  # null is absent
    assert f.opt_number({"temperature": 1.5}, "temperature", 0, 2) == 1.5
    with pytest.raises(InvalidRequest, match="between 0 and 2") as info:
        f.opt_number({"temperature": 2.5}, "temperature", 0, 2)
    assert _param(info) == "temperature"
    with pytest.raises(InvalidRequest, match="a number, got boolean"):
        f.opt_number({"temperature": True}, "temperature", 0, 2)


def test_opt_int_takes_an_integral_float_as_an_int() -> None:
    assert f.opt_int({"seed": 4.0}, "seed") == 4
    assert isinstance(f.opt_int({"seed": 4.0}, "seed"), int)
    with pytest.raises(InvalidRequest, match="at least 1"):
        f.opt_int({"max_tokens": 0}, "max_tokens", 1)
    with pytest.raises(InvalidRequest, match="an integer"):
        f.opt_int({"seed": 1.5}, "seed")


def test_stop_is_a_string_or_a_few_strings() -> None:
    assert f.stop({"stop": "END"}) == "END"
    assert f.stop({"stop": ["a", "b"]}) == ["a", "b"]
    assert f.stop({}) is None
    with pytest.raises(InvalidRequest, match="at most 4"):
        f.stop({"stop": ["a"] * 5})
    with pytest.raises(InvalidRequest) as info:
        f.stop({"stop": ["a", 1]})
    assert _param(info) == "stop"


def test_n_is_at_least_one() -> None:
    assert f.choices({}) == 1
    assert f.choices({"n": 3}) == 3
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(InvalidRequest):
            f.choices({"n": bad})


def test_metadata_bounds_and_the_workspace_key() -> None:
    assert f.metadata({"metadata": {"a": "b"}}) == {"a": "b"}
    sixteen = {f"k{i}": "v" for i in range(16)}
    # ``workspace`` is a path: larger, and not one of the 16 entries.
    assert len(f.metadata({"metadata": {**sixteen, "workspace": "/w" * 1000}})) == 17
    with pytest.raises(InvalidRequest, match="at most 16 entries"):
        f.metadata({"metadata": {**sixteen, "k16": "v"}})
    with pytest.raises(InvalidRequest) as info:
        f.metadata({"metadata": {"a": 1}})
    assert _param(info) == "metadata.a"
    with pytest.raises(InvalidRequest, match="64 characters"):
        f.metadata({"metadata": {"k" * 65: "v"}})
    with pytest.raises(InvalidRequest, match="4096"):
        f.metadata({"metadata": {"workspace": "x" * 4097}})


def test_messages_name_the_first_bad_field() -> None:
    good = [{"role": "user", "content": "hi"}]
    assert f.messages({"messages": good}) == good
    cases: list[tuple[JSONValue, str]] = [
        (None, "messages"),
        ("hi", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ]
    for value, param in cases:
        with pytest.raises(InvalidRequest) as info:
            f.messages({"messages": value})
        assert _param(info) == param, value
    # An assistant message with tool calls may leave its content out.
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    f.messages({"messages": [{"role": "assistant", "tool_calls": [call]}]})


def test_chat_tools_are_named_functions() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    assert f.chat_tools({"tools": [tool]}) == [tool]
    with pytest.raises(InvalidRequest) as info:
        f.chat_tools({"tools": [{"type": "function", "function": {"name": "bad name"}}]})
    assert _param(info) == "tools[0].function.name"
    with pytest.raises(InvalidRequest) as info:
        f.chat_tools({"tools": [{"type": "retrieval"}]})
    assert _param(info) == "tools[0].type"


def test_text_format_becomes_a_response_format() -> None:
    assert f.text_format({}) is None
    assert f.text_format({"text": {"format": {"type": "text"}}}) is None
    schema = {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "extra": 1}
    assert f.text_format({"text": {"format": schema}}) == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert f.text_format({"text": {"format": {"type": "json_object"}}}) == {"type": "json_object"}


def test_tool_choice() -> None:
    assert f.tool_choice({"tool_choice": "auto"}) == "auto"
    named = {"type": "function", "function": {"name": "f"}}
    assert f.tool_choice({"tool_choice": named}) == named
    for bad, param in (
        ("sometimes", "tool_choice"),
        (3, "tool_choice"),
        ({"type": "function", "function": {}}, "tool_choice.function.name"),
    ):
        with pytest.raises(InvalidRequest) as info:
            f.tool_choice({"tool_choice": bad})
        assert _param(info) == param


def test_as_dict_decodes_bytes_once() -> None:
    raw: JSONObject = {"a": 1}
    assert f.as_dict(raw) is raw
    assert f.as_dict(b'{"a": 1}') == raw
