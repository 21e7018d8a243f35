"""Strict output (SPEC §4): return only what is inside ``<completion>…</completion>``.

When ``openai.strict_output`` is on, the normalized path adds a system
instruction (``openai.strict_output_instruction``) asking for the final answer
inside a ``<completion>`` element, and the edge returns only the element's
content, without surrounding whitespace.  A missing closing tag at the end is
tolerated (the rest of the text is the answer); without the element the text
is returned unchanged.

Streaming: :class:`StrictStreamFilter` produces, over any split of the text
into deltas, exactly what :func:`extract_completion` gives for the whole text.
The price is that **text before the opening tag is withheld** until the tag
shows up (it is dropped then) or the stream ends without it (then the whole
text is released at once by :meth:`StrictStreamFilter.flush`).  A possible
partial tag and trailing whitespace at a delta boundary are also held back
until the next delta decides them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CLOSE_TAG",
    "OPEN_TAG",
    "StrictStreamFilter",
    "extract_completion",
    "strict_system_message",
]

OPEN_TAG = "<completion>"
CLOSE_TAG = "</completion>"


def strict_system_message(instruction: str) -> dict[str, Any]:
    """The system message that asks for the ``<completion>`` element."""
    return {"role": "system", "content": instruction}


def extract_completion(text: str) -> str:
    """The stripped content of the first ``<completion>`` element, or ``text`` unchanged."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return text
    rest = text[start + len(OPEN_TAG) :]
    end = rest.find(CLOSE_TAG)
    return (rest if end < 0 else rest[:end]).strip()


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class StrictStreamFilter:
    """Streams only the inside of ``<completion>``; see the module docstring."""

    def __init__(self) -> None:
        self._state = "search"  # search -> inside -> done
        self._buffer = ""  # search: all text so far; inside: text not yet released
        self._emitted_any = False
        self._searched = 0  # search: the open tag cannot start before this offset

    def feed(self, delta: str) -> str:
        """Take the next delta; return the text that can be released now."""
        if self._state == "done" or not delta:
            return ""
        self._buffer += delta
        if self._state == "search":
            start = self._buffer.find(OPEN_TAG, self._searched)
            if start < 0:
                self._searched = max(0, len(self._buffer) - len(OPEN_TAG) + 1)
                return ""
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._state = "inside"
        end = self._buffer.find(CLOSE_TAG)
        if end >= 0:
            ready = self._buffer[:end].rstrip()
            self._buffer = ""
            self._state = "done"
            return self._release(ready)
        keep = _partial_tag_len(self._buffer, CLOSE_TAG)
        ready = self._buffer[: len(self._buffer) - keep]
        stripped = ready.rstrip()  # trailing whitespace waits: it may precede the close tag
        self._buffer = self._buffer[len(stripped) :]
        return self._release(stripped)

    def _release(self, text: str) -> str:
        if not self._emitted_any:
            text = text.lstrip()
            if not text:
                return ""
            self._emitted_any = True
        return text

    def flush(self) -> str:
        """End of stream: release what is left (the whole text if no element appeared)."""
        if self._state == "search":
            rest, self._buffer = self._buffer, ""
            self._state = "done"
            return rest
        if self._state == "inside":
            rest, self._buffer = self._buffer.rstrip(), ""
            self._state = "done"
            return self._release(rest)
        return ""
