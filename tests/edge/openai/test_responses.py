"""Normalized /v1/responses: input conversion and the response object."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.types.responses import Response

from iopd.edge.openai.outgoing.responses import (
    ResponseEvents,
    build_response,
    new_response_id,
    responses_input_to_messages,
)
from iopd.errors import InvalidRequest
from wire.messages import Usage


def sdk(obj: dict[str, Any]) -> Response:
    return Response.model_validate(json.loads(msgspec.json.encode(obj)))


# --------------------------------------------------------------------- input


def test_string_input_becomes_a_user_message() -> None:
    assert responses_input_to_messages({"model": "m", "input": "hi"}) == [
        {"role": "user", "content": "hi"}
    ]


def test_instructions_become_a_system_message() -> None:
    req = {"model": "m", "input": "hi", "instructions": "be brief", "stream": False}
    assert responses_input_to_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    # Empty instructions add nothing.
    assert responses_input_to_messages({"input": "x", "instructions": ""}) == [
        {"role": "user", "content": "x"}
    ]


def test_list_input_as_the_sdk_and_langchain_send_it() -> None:
    req = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "developer", "content": "house rules"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "b", "annotations": []}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "out-1"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "out-2"}],
            },
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]},
        ],
    }
    assert responses_input_to_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "house rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "b"}],
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x":1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "out-1"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "out-2"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]


def test_a_function_call_without_an_assistant_message_before_it() -> None:
    req = {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    assert responses_input_to_messages(req) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }
    ]


@pytest.mark.parametrize(
    ("req", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "hi", "instructions": ["x"]}, "instructions"),
    ],
)
def test_what_only_a_passthrough_provider_serves_is_a_clear_400(
    req: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        responses_input_to_messages(req)
    assert info.value.status == 400
    assert info.value.param == param
    assert "is not supported on this model's providers" in info.value.message


@pytest.mark.parametrize(
    ("req", "param"),
    [
        ({"input": {"text": "hi"}}, "input"),
        ({"input": 3}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]}, "input[0].output"),
    ],
)
def test_malformed_input_is_a_400_naming_the_field(req: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        responses_input_to_messages(req)
    assert info.value.param == param


def test_missing_input_is_a_400() -> None:
    with pytest.raises(InvalidRequest) as info:
        responses_input_to_messages({"model": "m"})
    assert info.value.param == "input"


# ------------------------------------------------------------------ response


def test_response_text_only_exact_shape() -> None:
    out = build_response(
        response_id="resp_1",
        model="qwen3.6:35b",
        created_at=1_700_000_000,
        text="Hello",
        reasoning_text="",
        usage=Usage(input_tokens=4, output_tokens=2),
        metadata={"k": "v"},
    )
    message = out["output"][0]
    assert message["id"].startswith("msg_")
    assert out == {
        "id": "resp_1",
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "model": "qwen3.6:35b",
        "output": [
            {
                "type": "message",
                "id": message["id"],
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "metadata": {"k": "v"},
        "usage": {
            "input_tokens": 4,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 6,
        },
    }
    parsed = sdk(out)
    assert parsed.output_text == "Hello"
    assert parsed.model == "qwen3.6:35b"
    assert parsed.usage is not None and parsed.usage.total_tokens == 6


def test_response_with_reasoning_and_detailed_usage() -> None:
    out = build_response(
        response_id=new_response_id(),
        model="g",
        created_at=1,
        text="42",
        reasoning_text="let me think",
        usage=Usage(input_tokens=10, output_tokens=8, reasoning_tokens=5, cached_input_tokens=3),
        metadata=None,
    )
    assert out["id"].startswith("resp_")
    reasoning, message = out["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert message["type"] == "message"
    assert out["metadata"] == {}
    parsed = sdk(out)
    assert parsed.output_text == "42"
    assert parsed.usage is not None
    assert parsed.usage.input_tokens_details.cached_tokens == 3
    assert parsed.usage.output_tokens_details.reasoning_tokens == 5
    assert parsed.usage.total_tokens == 18


def test_response_without_usage_and_truncated() -> None:
    out = build_response(
        response_id="resp_2",
        model="g",
        created_at=1,
        text="cut",
        reasoning_text="",
        usage=None,
        metadata={},
        finish_reason="length",
    )
    assert out["usage"] is None
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    parsed = sdk(out)
    assert parsed.status == "incomplete" and parsed.usage is None


# ------------------------------------------------------------------ stream


def _events(data: bytes) -> list[Any]:
    """The SDK's parsed events of a Responses SSE body (``event:`` == ``type`` checked)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    out = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        head, body = block.split(b"\n", 1)
        assert head.startswith(b"event: ") and body.startswith(b"data: ")
        doc = json.loads(body[6:])
        assert head[7:].decode() == doc["type"]
        out.append(adapter.validate_python(doc))
    return out


def _replayed(events: list[Any]) -> Any:
    """The SDK's own stream accumulator over ``events``: its final response."""
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState

    state: Any = ResponseStreamState(input_tools=omit, text_format=omit)
    for ev in events:
        state.handle_event(ev)
    return state._completed_response


def test_stream_events_text_then_completed() -> None:
    ev = ResponseEvents(response_id="resp_s", model="m", created_at=1, metadata={"k": "v"})
    data = ev.start() + ev.text("Hel") + ev.text("lo") + ev.finish("stop", Usage(input_tokens=3, output_tokens=2))
    events = _events(data)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = _replayed(events)
    assert final.output_text == "Hello" and final.id == "resp_s"
    assert final.usage.total_tokens == 5 and final.metadata == {"k": "v"}


def test_stream_events_reasoning_text_and_function_calls() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    ev = ResponseEvents(response_id="resp_t", model="m", created_at=1, tools=tools)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    data = (
        ev.start()
        + ev.reasoning("hmm")
        + ev.text("calling")
        + ev.function_call(call)
        + ev.function_call({**call, "id": "call_2"})
        + ev.finish("tool_calls", None)
    )
    events = _events(data)
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 4
    assert kinds.count("response.output_item.done") == 4
    assert "response.reasoning_text.delta" in kinds
    assert kinds.count("response.function_call_arguments.done") == 2
    final = _replayed(events)
    assert [item.type for item in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert final.output[2].call_id == "call_1" and final.output[2].arguments == '{"a":1}'
    assert final.output_text == "calling"
    assert final.tools[0].name == "f" and final.tool_choice == "auto"


def test_stream_events_cut_at_the_limit_and_empty_output() -> None:
    ev = ResponseEvents(response_id="resp_c", model="m", created_at=1)
    events = _events(ev.start() + ev.text("cu") + ev.finish("length", None))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"
    empty = ResponseEvents(response_id="resp_e", model="m", created_at=1)
    events = _events(empty.start() + empty.finish("stop", None))
    final = _replayed(events)
    assert final.output_text == "" and len(final.output) == 1
