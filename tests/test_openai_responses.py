"""Normalized /v1/responses: input conversion and the response object."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.types.responses import Response

from iopd.edge.openai.responses import (
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


@pytest.mark.parametrize(
    ("req", "param"),
    [
        ({"input": [{"role": "user", "content": "hi"}]}, "input"),
        ({"input": {"text": "hi"}}, "input"),
        ({"input": 3}, "input"),
        ({"input": "hi", "stream": True}, "stream"),
        ({"input": "hi", "instructions": ["x"]}, "instructions"),
    ],
)
def test_unsupported_input_is_a_clear_400(req: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        responses_input_to_messages(req)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.message.startswith(
        "this model's providers only support non-streaming string input; "
    )


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
