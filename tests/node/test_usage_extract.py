"""The SSE/NDJSON usage scanners' fast path: whole lines without a marker are skipped,
and nothing a marker-bearing line says is lost, however the body is cut."""

from __future__ import annotations

import json

from iopd.node.usage_extract import NdjsonUsageScanner, SseUsageScanner, scanner_for


def _sse(doc: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


_CONTENT = _sse({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
_REASONING = _sse({"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]})
_USAGE = _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
_BODY = _CONTENT * 3 + _REASONING + _CONTENT + _USAGE + b"data: [DONE]\n\n"


def test_sse_usage_and_reasoning_survive_every_cut() -> None:
    for size in (1, 2, 7, 13, len(_CONTENT), len(_BODY)):
        scanner = SseUsageScanner()
        for i in range(0, len(_BODY), size):
            scanner.feed(_BODY[i : i + size])
        scanner.finish()
        assert scanner.usage is not None, size
        assert (scanner.usage.input_tokens, scanner.usage.output_tokens) == (3, 7)
        assert scanner.reasoning_chars == len("think"), size


def test_sse_whole_content_lines_are_skipped_then_a_cut_line_is_joined() -> None:
    scanner = SseUsageScanner()
    scanner.feed(_CONTENT)  # whole lines, no marker: skipped
    cut = len(_USAGE) // 2
    scanner.feed(_CONTENT + _USAGE[:cut])  # a line left open: the slow path buffers it
    scanner.feed(_USAGE[cut:])
    assert scanner.usage is not None and scanner.usage.output_tokens == 7


def test_ndjson_done_line_after_skipped_lines() -> None:
    lines = [
        json.dumps({"message": {"content": "a"}, "done": False}).encode() + b"\n",
        json.dumps({"done": True, "prompt_eval_count": 5, "eval_count": 9}).encode() + b"\n",
    ]
    scanner = NdjsonUsageScanner()
    for line in lines:
        scanner.feed(line)
    scanner.finish()
    assert scanner.usage is not None
    assert (scanner.usage.input_tokens, scanner.usage.output_tokens) == (5, 9)


def _reference(body: bytes, scanner: SseUsageScanner) -> tuple[object, int]:
    """Every line through the per-line path: what the fast path must equal."""
    for line in body.split(b"\n"):
        scanner._line(line.rstrip(b"\r"))
    usage = scanner.usage
    return (usage.input_tokens, usage.output_tokens) if usage else None, scanner.reasoning_chars


def test_sse_any_two_pieces_give_what_every_line_gives() -> None:
    body = _CONTENT * 2 + _REASONING + _CONTENT + _REASONING + _USAGE + _CONTENT
    body += b": a comment\r\n" + b"data: [DONE]\n\n"
    expected = _reference(body, SseUsageScanner())
    assert expected == ((3, 7), 2 * len("think"))
    for cut in range(len(body) + 1):
        scanner = SseUsageScanner()
        scanner.feed(body[:cut])
        scanner.feed(body[cut:])
        scanner.finish()
        usage = scanner.usage
        got = (usage.input_tokens, usage.output_tokens) if usage else None
        assert (got, scanner.reasoning_chars) == expected, cut


class _CountingSse(SseUsageScanner):
    def __init__(self) -> None:
        super().__init__()
        self.lines = 0

    def _line(self, line: bytes) -> None:
        self.lines += 1
        super()._line(line)


def test_content_before_the_usage_in_one_piece_is_not_split_into_lines() -> None:
    # The end of a stream arriving in one read: 15 content chunks, the usage, [DONE].
    scanner = _CountingSse()
    scanner.feed(_CONTENT * 15 + _USAGE + b"data: [DONE]\n\n")
    scanner.finish()
    assert scanner.usage is not None and scanner.usage.output_tokens == 7
    # The usage line and what follows it; none of the 30 content lines.
    assert scanner.lines <= 4, scanner.lines


def test_anthropic_stream_input_from_message_start_output_from_message_delta() -> None:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "usage": {"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 4},
        },
    }
    text = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}}
    delta = {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 9}}
    body = b"event: message_start\n" + _sse(start) + _sse(text) * 3 + _sse(delta)
    scanner = SseUsageScanner()
    scanner.feed(body)
    scanner.finish()
    usage = scanner.usage
    assert usage is not None
    # the input holds the cache reads, as chat's prompt_tokens does
    assert (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens) == (14, 4, 9)


def test_anthropic_whole_message_usage() -> None:
    scanner = scanner_for("application/json")
    body = {
        "type": "message",
        "usage": {
            "input_tokens": 5,
            "output_tokens": 2,
            "cache_read_input_tokens": 3,
            "cache_creation_input_tokens": 1,
        },
    }
    scanner.feed(json.dumps(body).encode())
    scanner.finish()
    assert scanner.usage is not None
    assert (scanner.usage.input_tokens, scanner.usage.cached_input_tokens) == (9, 3)
    assert scanner.usage.output_tokens == 2
