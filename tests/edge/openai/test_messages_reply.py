"""``outgoing/messages_reply.py``: chat results as Anthropic messages and events (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iopd.edge.openai.outgoing.messages_reply import (
    MAX_SSE_LINE,
    MessageEvents,
    SseLines,
    error_envelope,
    error_type,
    message_from_completion,
    messages_usage,
    stop_reason,
)


def _events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Parse an Anthropic SSE byte stream into (event name, data) pairs."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        doc = json.loads(data_line[6:])
        assert doc["type"] == name_line[7:]  # the event name is the data's type
        out.append((name_line[7:], doc))
    return out


def _chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}}
    if finish is not None:
        choice["finish_reason"] = finish
    return {"object": "chat.completion.chunk", "choices": [choice], **extra}


def _run(chunks: list[dict[str, Any]], **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    ev = MessageEvents(message_id="msg-1", model="coder", **kw)
    data = b"".join(ev.chunk(c) for c in chunks) + ev.finish()
    assert ev.finish() == b""  # once
    return _events(data)


def _accumulate(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """What an index-keyed client (the SDK) builds from the events."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for name, doc in events:
        if name == "message_start":
            message = dict(doc["message"])
            message["content"] = []
        elif name == "content_block_start":
            assert doc["index"] == len(message["content"])
            message["content"].append(dict(doc["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][doc["index"]], doc["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta"
                partial[doc["index"]] = partial.get(doc["index"], "") + delta["partial_json"]
        elif name == "content_block_stop":
            if doc["index"] in partial:
                message["content"][doc["index"]]["input"] = json.loads(partial[doc["index"]])
        elif name == "message_delta":
            message.update(doc["delta"])
            message["usage"] = {**message["usage"], **doc["usage"]}
    return message


def test_text_stream_event_sequence() -> None:
    events = _run(
        [
            _chunk({"role": "assistant"}),
            _chunk({"content": "Hel"}),
            _chunk({"content": "lo"}),
            _chunk({}, "stop"),
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
        ],
        input_estimate=4,
    )
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"] == "msg-1" and start["model"] == "coder"
    assert start["usage"]["input_tokens"] == 4  # the estimate, until the end
    assert start["usage"]["cache_read_input_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["input_tokens"] == 5 and delta["usage"]["output_tokens"] == 2
    assert _accumulate(events)["content"] == [{"type": "text", "text": "Hello"}]


def test_tool_input_split_across_many_deltas_arrives_whole() -> None:
    arguments = json.dumps({"path": "/tmp/a.txt", "content": "line one\nline two", "n": [1, 2]})
    first = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "write_file"}}
    pieces = [arguments[i : i + 3] for i in range(0, len(arguments), 3)]
    chunks = [_chunk({"tool_calls": [first]})]
    chunks += [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in pieces]
    chunks.append(_chunk({}, "tool_calls"))
    events = _run(chunks)
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert len(deltas) == len(pieces)  # every fragment, none dropped or merged
    message = _accumulate(events)
    assert message["content"] == [
        {"type": "tool_use", "id": "call_7", "name": "write_file", "input": json.loads(arguments)}
    ]
    assert message["stop_reason"] == "tool_use"


def test_parallel_tool_calls_are_one_block_each_after_the_text() -> None:
    def call(i: int, city: str) -> dict[str, Any]:
        return {"index": i, "id": f"c{i}", "function": {"name": "weather", "arguments": city}}

    events = _run(
        [
            _chunk({"content": "Checking."}),
            _chunk({"tool_calls": [call(0, '{"city":')]}),
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
            _chunk({"tool_calls": [call(1, '{"city":"Bergen"}')]}),
            _chunk({}, "tool_calls"),
        ]
    )
    message = _accumulate(events)
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert [b.get("input") for b in message["content"][1:]] == [
        {"city": "Oslo"},
        {"city": "Bergen"},
    ]
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert starts == stops == [0, 1, 2]  # one block at a time


def test_a_name_that_comes_after_its_arguments_still_opens_the_block() -> None:
    events = _run(
        [
            _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
            _chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "x", "function": {"name": "f", "arguments": "1}"}}
                    ]
                }
            ),
            _chunk({}, "tool_calls"),
        ]
    )
    assert _accumulate(events)["content"] == [
        {"type": "tool_use", "id": "x", "name": "f", "input": {"a": 1}}
    ]


def test_thinking_then_text_blocks() -> None:
    events = _run(
        [
            _chunk({"reasoning_content": "let me "}),
            _chunk({"reasoning_content": "think"}),
            _chunk({"content": "42"}),
            _chunk({}, "length"),
        ]
    )
    message = _accumulate(events)
    assert message["content"] == [
        {"type": "thinking", "thinking": "let me think", "signature": ""},
        {"type": "text", "text": "42"},
    ]
    assert message["stop_reason"] == "max_tokens"
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert kinds == ["thinking_delta", "thinking_delta", "text_delta"]


@pytest.mark.parametrize(
    ("finish", "reason"),
    [
        ("stop", "end_turn"),
        (None, "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
        ("something_new", "end_turn"),
    ],
)
def test_stop_reasons(finish: str | None, reason: str) -> None:
    assert stop_reason(finish) == reason


def test_usage_cache_reads_are_not_input() -> None:
    usage = {
        "prompt_tokens": 30,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
    assert messages_usage(usage) == {
        "input_tokens": 18,
        "output_tokens": 4,
        "cache_read_input_tokens": 12,
        "cache_creation_input_tokens": 0,
    }
    assert messages_usage(None, 9) == {"input_tokens": 9, "output_tokens": 0}


def test_whole_completion_as_message() -> None:
    doc = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "hmm",
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        },
                        {
                            "id": "b",
                            "type": "function",
                            "function": {"name": "g", "arguments": "not json"},
                        },
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    msg = message_from_completion(doc, message_id="msg-2", model="coder")
    assert msg["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
        {"type": "tool_use", "id": "b", "name": "g", "input": {}},
    ]
    assert msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
    assert msg["usage"]["input_tokens"] == 3 and msg["usage"]["output_tokens"] == 2
    assert (msg["id"], msg["type"], msg["role"], msg["model"]) == (
        "msg-2",
        "message",
        "assistant",
        "coder",
    )


def test_stream_error_in_the_chat_stream_becomes_an_error_event() -> None:
    ev = MessageEvents(message_id="m", model="x")
    data = ev.data(b'{"error": {"message": "upstream broke"}}')
    names = [n for n, _ in _events(data)]
    assert names == ["message_start", "ping", "error"]
    assert ev.data(b'{"choices": [{"delta": {"content": "late"}}]}') == b""
    assert ev.finish() == b""


def test_done_ends_the_stream_once() -> None:
    ev = MessageEvents(message_id="m", model="x")
    data = ev.data(b'{"choices": [{"index": 0, "delta": {"content": "a"}}]}') + ev.data(b"[DONE]")
    assert [n for n, _ in _events(data)][-1] == "message_stop"
    assert ev.data(b"[DONE]") == b"" and ev.finish() == b""
    assert ev.data(b"not json") == b""


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_types_by_status(status: int, kind: str) -> None:
    assert error_type(status) == kind
    assert error_envelope(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_sse_lines_split_anywhere_and_bound_a_long_line() -> None:
    stream = b'event: x\ndata: {"a":1}\n\ndata: [DONE]\r\n\r\n'
    for size in (1, 2, 5, len(stream)):
        lines = SseLines()
        got: list[bytes] = []
        for i in range(0, len(stream), size):
            got += lines.feed(stream[i : i + size])
        assert got == [b'{"a":1}', b"[DONE]"], size
    lines = SseLines()
    assert lines.feed(b"data: " + b"x" * (MAX_SSE_LINE + 1)) == []
    assert lines.feed(b"x" * 10) == []  # still the long line: nothing kept
    assert lines.feed(b"\ndata: ok\n") == [b"ok"]
