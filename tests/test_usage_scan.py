"""The SSE/NDJSON usage scanners' fast path: whole lines without a marker are skipped,
and nothing a marker-bearing line says is lost, however the body is cut."""

from __future__ import annotations

import json

from iopd.node.usage_extract import NdjsonUsageScanner, SseUsageScanner


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
