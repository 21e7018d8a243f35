"""The output estimate of a relayed body (``iopd.tokens.RelayedOutput``)."""

from __future__ import annotations

import json

from iopd.tokens import MAX_DECODED_LINE, RelayedOutput, estimate_tokens_from_chars


def _chunk(delta: dict[str, object]) -> bytes:
    doc = {"id": "chatcmpl-" + "x" * 40, "model": "some-model", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def test_sse_counts_the_text_fields_not_the_framing() -> None:
    body = b"".join(
        [
            _chunk({"role": "assistant", "content": "Hello"}),
            _chunk({"reasoning_content": "think"}),
            _chunk({"tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": "{}"}}]}),
            b'data: {"usage": {"prompt_tokens": 1, "completion_tokens": 99}}\n\n',
            b"data: [DONE]\n\n",
        ]
    )
    for size in (1, 7, len(body)):  # split anywhere, the count is the same
        out = RelayedOutput("text/event-stream; charset=utf-8")
        for i in range(0, len(body), size):
            out.feed(body[i : i + size])
        assert out.chars == len("Hello") + len("think") + len("{}")
        assert out.tokens == estimate_tokens_from_chars(12)


def test_ndjson_and_responses_events() -> None:
    out = RelayedOutput("application/x-ndjson")
    out.feed(b'{"model":"m","message":{"role":"assistant","content":"abc"},"done":false}\n')
    out.feed(b'{"model":"m","response":"de","done":true,"eval_count":5}\n')
    assert out.chars == 5
    sse = RelayedOutput("text/event-stream")
    sse.feed(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"xyz"}\n')
    sse.feed(b'data: {"type":"response.output_text.done","text":"xyz"}\n')
    sse.feed(b'data: {"type":"response.completed","response":{"output":[{"content":[{"text":"xyz"}]}]}}\n')
    assert sse.chars == 3


def test_a_json_body_counts_its_bytes_and_a_cut_line_still_counts() -> None:
    out = RelayedOutput("application/json")
    out.feed(b'{"choices":[{"message":{"content":"hi"}}]}')
    assert out.chars == 42
    cut = RelayedOutput("text/event-stream")
    cut.feed(b'data: {"choices":[{"delta":{"content":"abcdefgh')  # the caller left mid-line
    assert cut.tokens >= 2


def test_a_long_line_is_counted_by_its_bytes_without_holding_it() -> None:
    out = RelayedOutput("text/event-stream")
    piece = b"z" * 4096
    for _ in range(MAX_DECODED_LINE // 4096 + 4):
        out.feed(piece)
        assert len(out._buf) <= MAX_DECODED_LINE
    out.feed(b"\n")
    assert out.chars >= MAX_DECODED_LINE + 4096
    out.feed(b"data: not json\n")
    assert out.chars >= MAX_DECODED_LINE + 4096 + 8
