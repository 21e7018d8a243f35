"""Usage extraction from relayed provider bodies, incrementally and in bounded memory.

Why incremental: a passthrough relay forwards body bytes as they arrive and
must not hold a whole (possibly long) stream just to find the one chunk that
carries ``usage``.  The scanners here are fed the same chunks the relay
forwards; they keep at most one line (SSE/NDJSON) or a bounded head of a JSON
body, plus a bounded tail for the overflow case, where a regex finds the last
``"usage": {...}`` object.

Pure synchronous code, no I/O: ``feed(bytes)`` then ``finish()``, then read
``usage`` (a ``wire.messages.Usage`` or None) and ``reasoning_chars`` (reasoning
text seen in the body, for the edge's observed-reasoning metrics).

Shapes understood:

* Chat Completions ``usage``: ``prompt_tokens``, ``completion_tokens``,
  ``completion_tokens_details.reasoning_tokens``, ``prompt_tokens_details.cached_tokens``;
* Responses ``usage``: ``input_tokens``, ``output_tokens``,
  ``output_tokens_details.reasoning_tokens``, ``input_tokens_details.cached_tokens``;
  in streams it sits in the ``response.completed`` event's ``response.usage``;
* Anthropic Messages ``usage``: ``input_tokens`` plus the cache's
  ``cache_read_input_tokens`` (the cached input) and
  ``cache_creation_input_tokens``, ``output_tokens``; in streams the input in
  ``message_start``'s ``message.usage``, the output in ``message_delta``;
* Ollama (NDJSON or single JSON): ``prompt_eval_count`` / ``eval_count`` of the
  object with ``done: true``.
"""

from __future__ import annotations

import re

import msgspec

from iopd.json_types import JSONValue
from wire.messages import Usage

__all__ = [
    "BodyUsageScanner",
    "JsonUsageScanner",
    "NdjsonUsageScanner",
    "SseUsageScanner",
    "scanner_for",
    "usage_from_ollama",
    "usage_from_openai",
]

#: Longest single SSE/NDJSON line (or JSON body) parsed whole.
MAX_PARSED_BYTES = 8 * 1024 * 1024
#: Tail kept of anything longer, searched for the last ``"usage"`` object.
TAIL_BYTES = 64 * 1024

_json_decode = msgspec.json.Decoder().decode
# "usage": { ...one level of nesting... }
_USAGE_RE = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')


def _int(value: JSONValue) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def usage_from_openai(obj: JSONValue) -> Usage | None:
    """A ``usage`` object of Chat Completions or Responses shape -> Usage (None if neither)."""
    if not isinstance(obj, dict):
        return None
    usage = Usage()
    if "prompt_tokens" in obj or "completion_tokens" in obj:
        usage.input_tokens = _int(obj.get("prompt_tokens"))
        usage.output_tokens = _int(obj.get("completion_tokens"))
        out_details = obj.get("completion_tokens_details")
        in_details = obj.get("prompt_tokens_details")
    elif "input_tokens" in obj or "output_tokens" in obj:
        usage.input_tokens = _int(obj.get("input_tokens"))
        usage.output_tokens = _int(obj.get("output_tokens"))
        out_details = obj.get("output_tokens_details")
        in_details = obj.get("input_tokens_details")
    else:
        return None
    if isinstance(out_details, dict):
        usage.reasoning_tokens = _int(out_details.get("reasoning_tokens"))
    if isinstance(in_details, dict):
        usage.cached_input_tokens = _int(in_details.get("cached_tokens"))
    cache_read = _int(obj.get("cache_read_input_tokens"))
    if cache_read is not None or "cache_creation_input_tokens" in obj:
        # Anthropic's: input_tokens leaves out the cache's reads and writes;
        # the input counted here holds them (as chat's prompt_tokens does).
        written = _int(obj.get("cache_creation_input_tokens")) or 0
        if usage.input_tokens is not None:
            usage.input_tokens += (cache_read or 0) + written
        usage.cached_input_tokens = cache_read
    return usage


def usage_from_ollama(obj: JSONValue) -> Usage | None:
    """Usage of an Ollama object with ``done: true`` (None otherwise)."""
    if not isinstance(obj, dict) or obj.get("done") is not True:
        return None
    if "prompt_eval_count" not in obj and "eval_count" not in obj:
        return None
    return Usage(
        input_tokens=_int(obj.get("prompt_eval_count")),
        output_tokens=_int(obj.get("eval_count")),
    )


def _usage_in_openai_document(doc: JSONValue) -> Usage | None:
    """Usage carried by a JSON body or an SSE event of either OpenAI API."""
    if not isinstance(doc, dict):
        return None
    usage = usage_from_openai(doc.get("usage"))
    if usage is not None:
        return usage
    response = doc.get("response")  # responses stream: response.completed etc.
    if isinstance(response, dict):
        return usage_from_openai(response.get("usage"))
    message = doc.get("message")  # Anthropic's message_start
    if isinstance(message, dict):
        return usage_from_openai(message.get("usage"))
    return None


def _reasoning_chars_openai(doc: JSONValue) -> int:
    """Reasoning text in one chat chunk / message or one responses event."""
    if not isinstance(doc, dict):
        return 0
    total = 0
    kind = doc.get("type")
    if isinstance(kind, str) and kind.startswith("response.reasoning") and kind.endswith(".delta"):
        delta = doc.get("delta")
        if isinstance(delta, str):
            total += len(delta)
    choices = doc.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            for key in ("delta", "message"):
                part = choice.get(key)
                if isinstance(part, dict):
                    # One text under two names (vLLM sent both for a while): count it once.
                    for field in ("reasoning_content", "reasoning"):
                        text = part.get(field)
                        if isinstance(text, str) and text:
                            total += len(text)
                            break
    return total


def _reasoning_chars_ollama(doc: JSONValue) -> int:
    if not isinstance(doc, dict):
        return 0
    total = 0
    thinking = doc.get("thinking")
    if isinstance(thinking, str):
        total += len(thinking)
    message = doc.get("message")
    if isinstance(message, dict):
        message_thinking = message.get("thinking")
        if isinstance(message_thinking, str):
            total += len(message_thinking)
    return total


def _usage_from_tail(tail: bytes, flavour: str) -> Usage | None:
    """Last-resort: the last ``"usage": {...}`` in an oversized document's tail."""
    if flavour == "ollama":
        prompt = re.findall(rb'"prompt_eval_count"\s*:\s*(\d+)', tail)
        evals = re.findall(rb'"eval_count"\s*:\s*(\d+)', tail)
        if not prompt and not evals:
            return None
        return Usage(
            input_tokens=int(prompt[-1]) if prompt else None,
            output_tokens=int(evals[-1]) if evals else None,
        )
    matches = _USAGE_RE.findall(tail)
    for raw in reversed(matches):
        try:
            usage = usage_from_openai(_json_decode(raw))
        except ValueError:
            continue
        if usage is not None:
            return usage
    return None


class BodyUsageScanner:
    """Common state: the usage found so far and reasoning characters seen."""

    flavour = "openai"

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.reasoning_chars = 0

    def feed(self, data: bytes) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def finish(self) -> None:
        """The body ended; process what is still buffered."""

    def _document(self, doc: JSONValue) -> None:
        if self.flavour == "ollama":
            usage = usage_from_ollama(doc)
            self.reasoning_chars += _reasoning_chars_ollama(doc)
        else:
            usage = _usage_in_openai_document(doc)
            self.reasoning_chars += _reasoning_chars_openai(doc)
        if usage is not None:
            previous = self.usage
            if usage.input_tokens is None and previous is not None:
                # Anthropic's message_delta counts the output only: the input
                # stays the one message_start gave.
                usage.input_tokens = previous.input_tokens
                usage.cached_input_tokens = previous.cached_input_tokens
            self.usage = usage


class _LineScanner(BodyUsageScanner):
    """Splits the body into lines with a bounded buffer; subclasses parse lines."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = bytearray()
        self._overflow = False  # current line longer than MAX_PARSED_BYTES

    #: A line holding neither of these is never decoded (subclasses set them).
    markers: tuple[bytes, bytes] = (b"", b"")

    def _skips(self, data: bytes) -> bool:
        first, second = self.markers
        return first not in data and second not in data

    def feed(self, data: bytes) -> None:
        start = 0 if self._buf else self._skip_lines(data, 0)
        while start >= 0:
            nl = data.find(b"\n", start)
            if nl < 0:
                self._append(data[start:])
                return
            self._append(data[start:nl])
            self._end_line()
            start = self._skip_lines(data, nl + 1)

    def _skip_lines(self, data: bytes, start: int) -> int:
        """Where the line work must resume in ``data`` (a line starts at
        ``start``), past the whole lines holding no marker: they would never
        be decoded (most chunks of a stream, plain content deltas, and the
        content before the usage when the end of a stream arrives in one
        piece).  -1: nothing left to look at."""
        first, second = self.markers
        at = data.find(first, start)
        other = data.find(second, start)
        if at < 0 or 0 <= other < at:
            at = other
        if at < 0:  # no marker: keep only an unfinished last line
            if data.endswith(b"\n"):
                return -1
            return data.rfind(b"\n", start) + 1 or start
        return data.rfind(b"\n", start, at) + 1 or start

    def _append(self, piece: bytes) -> None:
        if not piece:
            return
        self._buf += piece
        if len(self._buf) > MAX_PARSED_BYTES:
            self._overflow = True
        if self._overflow and len(self._buf) > TAIL_BYTES:
            del self._buf[: len(self._buf) - TAIL_BYTES]

    def _end_line(self) -> None:
        line = bytes(self._buf).rstrip(b"\r")
        overflow = self._overflow
        self._buf.clear()
        self._overflow = False
        if overflow:
            usage = _usage_from_tail(line, self.flavour)
            if usage is not None:
                self.usage = usage
            return
        self._line(line)

    def _line(self, line: bytes) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def finish(self) -> None:
        if self._buf:
            self._end_line()


class SseUsageScanner(_LineScanner):
    """``text/event-stream``: every ``data:`` line is one JSON document."""

    markers = (b'"usage"', b"reasoning")

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]" or payload[:1] != b"{":
            return
        if self._skips(payload):
            return  # most chunks: plain content deltas, not worth decoding
        try:
            doc = _json_decode(payload)
        except ValueError:
            return
        self._document(doc)


class NdjsonUsageScanner(_LineScanner):
    """Ollama's ``application/x-ndjson``: one JSON object per line."""

    flavour = "ollama"
    markers = (b"eval_count", b"thinking")

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"{"):
            return
        if self._skips(line):
            return  # most lines: plain content, not worth decoding
        try:
            doc = _json_decode(line)
        except ValueError:
            return
        self._document(doc)


class JsonUsageScanner(BodyUsageScanner):
    """A single JSON body: parsed whole up to MAX_PARSED_BYTES, else from its tail."""

    def __init__(self, flavour: str = "openai") -> None:
        super().__init__()
        self.flavour = flavour
        self._buf = bytearray()
        self._overflow = False

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > MAX_PARSED_BYTES:
            self._overflow = True
        if self._overflow and len(self._buf) > TAIL_BYTES:
            del self._buf[: len(self._buf) - TAIL_BYTES]

    def finish(self) -> None:
        data = bytes(self._buf)
        self._buf.clear()
        if self._overflow:
            usage = _usage_from_tail(data, self.flavour)
            if usage is not None:
                self.usage = usage
            return
        try:
            doc = _json_decode(data)
        except ValueError:
            return
        self._document(doc)


def scanner_for(content_type: str | None, *, flavour: str = "openai") -> BodyUsageScanner:
    """Pick a scanner by the response's content type (``flavour``: openai | ollama)."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype == "text/event-stream":
        return SseUsageScanner()
    if ctype in ("application/x-ndjson", "application/ndjson", "application/jsonl"):
        return NdjsonUsageScanner()
    if flavour == "ollama":
        # Ollama streams NDJSON; a non-streaming reply is one JSON object, which
        # the line scanner handles just as well.
        return NdjsonUsageScanner()
    return JsonUsageScanner(flavour)
