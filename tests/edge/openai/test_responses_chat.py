"""``/v1/responses`` on a chat-only provider: the pure translations both ways
(``responses_api/chat_request.py``, ``chat_reply.py``) and the translating
responder (``translating.py``) fed as the relay feeds it."""

from __future__ import annotations

import json
from typing import Any, cast

import msgspec
import pytest

from iopd import errors
from iopd.edge.openai.incoming.requests import ResponsesRequest
from iopd.edge.openai.outgoing.responses import ResponseEvents
from iopd.edge.openai.responses_api.chat_reply import (
    ChunkEvents,
    chat_usage,
    response_from_completion,
)
from iopd.edge.openai.responses_api.chat_request import chat_body
from iopd.edge.openai.responses_api.translating import Translating
from iopd.http.server import Responder

TOOLS: list[Any] = [
    {"type": "function", "name": "shell", "parameters": {"type": "object"}},
    {"type": "custom", "name": "apply_patch"},
    {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "look"}]},
    {"type": "web_search"},
]


def _sse(doc: Any) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _chunk(delta: Any = None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return _sse({"object": "chat.completion.chunk", "choices": choices, **extra})


def _events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def _stream(tools: list[Any] | None = None) -> ChunkEvents:
    return ChunkEvents(
        ResponseEvents(response_id="resp_1", model="coder", created_at=1, tools=tools)
    )


# ------------------------------------------------------------------ request


def test_chat_body_maps_input_tools_and_fields() -> None:
    body = ResponsesRequest.parse(
        {
            "model": "coder",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                {"role": "user", "content": "go"},
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": True,
            "stream": True,
            "max_output_tokens": 99,
            "temperature": 0.5,
            "reasoning": {"effort": "low"},
            "store": False,
            "prompt_cache_key": "k",
        }
    )
    made = chat_body(body, "served", unsupported_tools="drop")
    chat = made.body
    assert made.dropped_tools == ("web_search",)
    assert chat["model"] == "served"
    assert chat["messages"] == [
        {"role": "system", "content": "be brief\n\nrules"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    names = [t["function"]["name"] for t in chat["tools"]]  # type: ignore[index, union-attr]
    assert names == ["shell", "apply_patch", "look"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is True
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert (chat["max_tokens"], chat["temperature"], chat["reasoning_effort"]) == (99, 0.5, "low")
    assert "store" not in chat and "prompt_cache_key" not in chat


def test_chat_body_rejects_built_in_tools_under_reject_and_state() -> None:
    body = ResponsesRequest.parse({"model": "m", "input": "x", "tools": TOOLS})
    with pytest.raises(errors.InvalidRequest) as caught:
        chat_body(body, "s", unsupported_tools="reject")
    assert caught.value.param == "tools[3].type"
    body = ResponsesRequest.parse({"model": "m", "input": "x", "previous_response_id": "r"})
    with pytest.raises(errors.InvalidRequest):
        chat_body(body, "s", unsupported_tools="drop")


def test_forced_tool_choice_is_chat_s_function_choice() -> None:
    raw = {
        "model": "m",
        "input": "x",
        "tools": TOOLS[:1],
        "tool_choice": {"type": "function", "name": "shell"},
    }
    chat = chat_body(ResponsesRequest.parse(raw), "s", unsupported_tools="drop").body
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "shell"}}


# ------------------------------------------------------------------- answer


def test_usage_from_chat() -> None:
    usage = chat_usage(
        {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 3},
            "completion_tokens_details": {"reasoning_tokens": 2},
        }
    )
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (10, 4)
    assert (usage.cached_input_tokens, usage.reasoning_tokens) == (3, 2)
    assert chat_usage(None) is None


def test_whole_completion_with_calls() -> None:
    doc: Any = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"id": "a", "function": {"name": "shell", "arguments": "{}"}},
                        {
                            "id": "b",
                            "function": {"name": "apply_patch", "arguments": '{"input": "P"}'},
                        },
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
    }
    resp = response_from_completion(
        doc, response_id="resp_1", model="coder", created_at=1, metadata=None, tools=TOOLS
    )
    output: Any = resp["output"]
    assert [(o["type"], o["call_id"]) for o in output] == [
        ("function_call", "a"),
        ("custom_tool_call", "b"),
    ]
    assert output[1]["input"] == "P"
    assert resp["status"] == "completed" and resp["model"] == "coder"
    assert resp["usage"]["input_tokens"] == 5  # type: ignore[index, call-overload]


def test_stream_joins_arguments_split_across_deltas_and_parallel_calls() -> None:
    stream = _stream(TOOLS)
    data = b""
    pieces = [
        {
            "tool_calls": [
                {"index": 0, "id": "a", "function": {"name": "shell", "arguments": '{"c'}}
            ]
        },
        {
            "tool_calls": [
                {"index": 1, "id": "b", "function": {"name": "apply_patch", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": 'md": "ls"}'}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"input": "*** P"}'}}]},
    ]
    for delta in pieces:
        data += stream.data(_chunk(delta)[6:-2])
    data += stream.data(_chunk({}, "tool_calls")[6:-2])
    data += stream.data(_chunk(usage={"prompt_tokens": 9, "completion_tokens": 3})[6:-2])
    data += stream.data(b"[DONE]")
    assert stream.data(b"[DONE]") == b"" and stream.finish() == b""
    events = _events(data)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["call_id"]) for i in done] == [
        ("function_call", "a"),
        ("custom_tool_call", "b"),
    ]
    assert done[0]["arguments"] == '{"cmd": "ls"}' and done[1]["input"] == "*** P"
    final = events[-1]["response"]
    assert final["usage"]["input_tokens"] == 9 and final["usage"]["output_tokens"] == 3
    assert [o["type"] for o in final["output"]] == ["function_call", "custom_tool_call"]


def test_stream_text_reasoning_and_length() -> None:
    stream = _stream()
    data = stream.data(_chunk({"reasoning_content": "hm"})[6:-2])
    data += stream.data(_chunk({"content": "Hel"})[6:-2]) + stream.data(
        _chunk({"content": "lo"})[6:-2]
    )
    data += stream.data(_chunk({}, "length")[6:-2])
    data += stream.finish()  # a stream that ended without [DONE]
    events = _events(data)
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == [
        "Hel",
        "lo",
    ]
    assert any(e["type"] == "response.reasoning_text.delta" for e in events)
    assert events[-1]["type"] == "response.incomplete"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "message"]


def test_stream_error_payload_is_an_error_event() -> None:
    stream = _stream()
    data = stream.data(b'{"error": {"message": "boom"}}')
    assert b"boom" in data and stream.done
    assert stream.finish() == b""


# --------------------------------------------------------------- responder


class _Inner:
    """The caller's responder as far as ``Translating`` uses it."""

    def __init__(self) -> None:
        self.started = self.finished = False
        self.unsent = False
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body = b""

    def start_held(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.started, self.status, self.headers = True, status, headers

    def write_held(self, data: bytes) -> bool:
        self.body += data
        return True

    def end_held(self) -> bool:
        self.finished = True
        return True


def _translating(inner: _Inner, stream: bool = False) -> Translating:
    body = ResponsesRequest.parse({"model": "coder", "input": "x", "stream": stream})
    translating = Translating(
        cast(Responder, inner), body, response_id="resp_1", announce=lambda d: None
    )
    translating.translate = True
    return translating


def test_responder_translates_a_whole_answer() -> None:
    inner = _Inner()
    t = _translating(inner)
    t.start_held(200, [("content-type", "application/json"), ("content-length", "99")])
    doc = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
    encoded = msgspec.json.encode(doc)
    assert t.write_held(encoded[:5]) and t.write_held(encoded[5:])
    assert inner.body == b""  # held until the end
    assert t.end_held()
    assert ("content-length", "99") not in inner.headers
    resp = json.loads(inner.body)
    assert resp["object"] == "response" and resp["output"][0]["content"][0]["text"] == "hi"


def test_responder_passes_errors_and_translates_streams_line_by_line() -> None:
    inner = _Inner()
    t = _translating(inner)
    t.start_held(400, [("content-type", "application/json")])
    t.write_held(b'{"error": {"message": "bad"}}')
    t.end_held()
    assert inner.status == 400 and inner.body == b'{"error": {"message": "bad"}}'
    inner = _Inner()
    t = _translating(inner, stream=True)
    t.start_held(200, [("content-type", "text/event-stream")])
    raw = _chunk({"content": "Hi"}) + _chunk({}, "stop") + b"data: [DONE]\n\n"
    for i in range(0, len(raw), 7):  # the provider's bytes in arbitrary pieces
        t.write_held(raw[i : i + 7])
    t.end_held()
    events = _events(inner.body)
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi"
