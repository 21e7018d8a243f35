"""The one token estimate used everywhere: ceil(code points of text / 4).

Input: text parts are string message contents, the ``text`` of content
parts, and string ``input`` of /v1/responses.  Output: the text of a relayed
body (:class:`RelayedOutput`), by the same rule, for a request whose
provider reported no usage.
Where it is used: docs/ARCHITECTURE.md, "The input-token estimate".
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from iopd.json_types import JSONValue


def estimate_tokens_from_chars(chars: int) -> int:
    """ceil(chars / 4) without floats."""
    return (chars + 3) // 4


def content_parts(content: JSONValue) -> Iterable[str]:
    """Yield the text parts of one message ``content``: a string, or a list of parts."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    yield text


def content_text(content: JSONValue) -> str:
    """One message's text: string content, or its text parts joined ("" otherwise)."""
    return content if isinstance(content, str) else "".join(content_parts(content))


def text_parts(messages: Iterable[JSONValue]) -> Iterable[str]:
    """Yield every text part of OpenAI-shaped chat messages."""
    for msg in messages:
        if isinstance(msg, dict):
            yield from content_parts(msg.get("content"))


def estimate_input_tokens(messages: Iterable[JSONValue]) -> int:
    """The estimate over all text parts of ``messages``."""
    return estimate_tokens_from_chars(sum(len(t) for t in text_parts(messages)))


# ------------------------------------------------------------------ output relayed

#: A stream line longer than this is not decoded: all its bytes count as text
#: (never fewer tokens than it held, and no unbounded parse on the loop).
MAX_DECODED_LINE = 64 * 1024

_decode = msgspec.json.Decoder().decode
_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "text", "response", "thinking", "delta")


def _text_chars(doc: JSONValue, depth: int = 0) -> int:
    """Code points of the output text in one decoded stream chunk.

    Text is what the model wrote under the field names of Chat Completions
    deltas and messages, Responses events, and Ollama lines (content,
    reasoning, text, response, thinking, tool-call arguments); ids, model
    names and the rest of the framing are not counted.
    """
    if depth > 6:
        return 0
    if isinstance(doc, list):
        return sum(_text_chars(x, depth + 1) for x in doc)
    if not isinstance(doc, dict):
        return 0
    kind = doc.get("type") if depth == 0 else None
    if isinstance(kind, str) and kind.startswith("response.") and not kind.endswith(".delta"):
        return 0  # a Responses event that repeats text its deltas already carried
    total = 0
    for key, value in doc.items():
        if isinstance(value, str):
            if key in _TEXT_KEYS or key == "arguments":
                total += len(value)
        elif isinstance(value, dict | list) and key not in ("usage", "logprobs"):
            total += _text_chars(value, depth + 1)
    return total


class RelayedOutput:
    """The output text of a relayed provider body, counted as it is relayed.

    Why: a stream that reports no usage (or whose usage chunk never arrives,
    the caller having left) is settled against its principal's token limits
    by this, with the same characters-per-token rule as the input estimate
    (:func:`estimate_tokens_from_chars`).  An SSE or NDJSON stream is split
    into lines (at most :data:`MAX_DECODED_LINE` bytes held) and each line's
    text fields counted; any other body (one JSON document, almost all of it
    the text) counts its bytes.  Fed only the bytes actually written to the
    caller, each once.
    """

    __slots__ = ("_buf", "_lines", "_long", "chars")

    def __init__(self, content_type: str) -> None:
        ctype = content_type.split(";")[0].strip().lower()
        self._lines = ctype == "text/event-stream" or ctype.endswith("ndjson") or ctype.endswith(
            "jsonl"
        )
        self._buf = bytearray()
        self._long = False  # the current line went past MAX_DECODED_LINE
        self.chars = 0

    @property
    def tokens(self) -> int:
        """The output tokens relayed so far, by the one estimate (a partial line included)."""
        return estimate_tokens_from_chars(self.chars + len(self._buf))

    def feed(self, data: bytes) -> None:
        if not self._lines:
            self.chars += len(data)
            return
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                self._hold(data[start:])
                return
            self._hold(data[start:nl])
            self._line()
            start = nl + 1

    def _hold(self, piece: bytes) -> None:
        if self._long:
            self.chars += len(piece)
            return
        self._buf += piece
        if len(self._buf) > MAX_DECODED_LINE:
            self.chars += len(self._buf)
            self._buf.clear()
            self._long = True

    def _line(self) -> None:
        line = bytes(self._buf).strip()
        self._buf.clear()
        if self._long:
            self._long = False
            return
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if not line.startswith(b"{"):
            return
        try:
            self.chars += _text_chars(_decode(line))
        except ValueError:
            self.chars += len(line)  # not JSON: count it all rather than nothing
