"""``incoming/messages_request.py``: a Messages body validated and translated to chat (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iopd.edge.openai.incoming.messages_request import (
    CountTokensBody,
    MessagesBody,
    count_tokens_messages,
    to_chat,
)
from iopd.errors import InvalidRequest


def _body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "coder",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def test_system_blocks_text_image_tool_use_and_results() -> None:
    raw = _body(
        system=[
            {"type": "text", "text": "be brief"},
            {"type": "text", "text": "be kind", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "tu1", "name": "read", "input": {"path": "a"}},
                    {"type": "tool_use", "id": "tu2", "name": "read", "input": {"path": "b"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu1", "content": "A"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu2",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "no such"},
                            {"type": "text", "text": "file"},
                        ],
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    )
    chat, untranslatable = to_chat(raw)
    assert untranslatable is None
    assert chat["messages"] == [
        {"role": "system", "content": "be brief\n\nbe kind"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {
                    "id": "tu1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path":"a"}'},
                },
                {
                    "id": "tu2",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path":"b"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "tu1", "content": "A"},
        {"role": "tool", "tool_call_id": "tu2", "content": "no such\nfile"},
        {"role": "user", "content": "go on"},
    ]


def test_fields_tools_and_tool_choice() -> None:
    tool = {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    chat, _ = to_chat(
        _body(
            stream=True,
            temperature=0.2,
            top_p=0.9,
            top_k=40,
            stop_sequences=["STOP"],
            metadata={"user_id": "u-9"},
            tools=[tool, server_tool],
            tool_choice={"type": "tool", "name": "read", "disable_parallel_tool_use": True},
            thinking={"type": "enabled", "budget_tokens": 2048},
        )
    )
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.2, 0.9, 40)
    assert chat["stop"] == ["STOP"] and chat["user"] == "u-9" and chat["max_tokens"] == 100
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "read",
                "parameters": {"type": "object"},
                "description": "Read a file",
            },
        }
    ]  # the server tool has no chat form
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "read"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["reasoning_effort"] == "low"


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "auto"), ("any", "required"), ("none", "none")]
)
def test_tool_choice_modes(choice: str, expected: str) -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    chat, _ = to_chat(_body(tools=[tool], tool_choice={"type": choice}))
    assert chat["tool_choice"] == expected


@pytest.mark.parametrize(
    ("thinking", "effort"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, "low"),
        ({"type": "enabled", "budget_tokens": 8000}, "medium"),
        ({"type": "enabled", "budget_tokens": 32000}, "high"),
        ({"type": "adaptive"}, None),
        ({"type": "between_tools"}, None),
        ({"type": "disabled"}, None),
    ],
)
def test_thinking_as_reasoning_effort(thinking: dict[str, Any], effort: str | None) -> None:
    chat, _ = to_chat(_body(thinking=thinking))
    assert chat.get("reasoning_effort") == effort


def test_output_config_effort_and_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat, _ = to_chat(
        _body(output_config={"effort": "max", "format": {"type": "json_schema", "schema": schema}})
    )
    assert "reasoning_effort" not in chat  # an effort alone asks no thinking
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    chat, _ = to_chat(
        _body(output_config={"effort": "low"}, thinking={"type": "enabled", "budget_tokens": 50000})
    )
    assert chat["reasoning_effort"] == "low"  # with thinking: the effort sent


def test_messages_body_is_a_chat_request_keeping_the_callers_body() -> None:
    raw = _body(top_k=5, thinking={"type": "enabled", "budget_tokens": 9000})
    body = MessagesBody.parse(json.dumps(raw).encode())
    assert body.anthropic == raw
    assert body.messages == [{"role": "user", "content": "hi"}]
    assert body.params() == {"max_tokens": 100, "top_k": 5, "reasoning_effort": "medium"}
    assert body.untranslatable is None and not body.stream


def test_a_pdf_document_is_left_to_a_native_provider() -> None:
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
    }
    text_doc = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "notes"},
    }
    body = MessagesBody.parse(_body(messages=[{"role": "user", "content": [text_doc, pdf]}]))
    assert body.untranslatable is not None and "messages[0].content[1]" in body.untranslatable
    assert body.messages == [{"role": "user", "content": "notes"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages[0].content[0].type",
        ),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"temperature": 1.5}, "temperature"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
        ({"metadata": {"user_id": 5}}, "metadata.user_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/bmp", "data": ""},
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].source.media_type",
        ),
    ],
)
def test_bad_fields_name_the_callers_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        MessagesBody.parse(_body(**fields))
    assert exc.value.param == param


def test_system_turns_among_the_messages_join_the_leading_system_message() -> None:
    chat, _ = to_chat(
        _body(
            system="base",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "system", "content": [{"type": "text", "text": "agents: a, b"}]},
                {"role": "system", "content": "more"},
                {"role": "user", "content": "go"},
            ],
        )
    )
    assert chat["messages"] == [
        {"role": "system", "content": "base\n\nagents: a, b\n\nmore"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "go"},
    ]
    chat, _ = to_chat(_body(messages=[{"role": "user", "content": "x"}, {"role": "system", "content": "s"}]))
    assert chat["messages"][0] == {"role": "system", "content": "s"}


def test_a_long_user_id_is_cut_not_refused() -> None:
    chat, _ = to_chat(_body(metadata={"user_id": "u" * 1000}))
    assert chat["user"] == "u" * 256


def test_count_tokens_needs_no_max_tokens() -> None:
    raw = {"model": "coder", "system": "s", "messages": [{"role": "user", "content": "abc"}]}
    body = CountTokensBody.parse(raw)
    assert body.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "abc"}]
    assert count_tokens_messages(raw) == body.messages
