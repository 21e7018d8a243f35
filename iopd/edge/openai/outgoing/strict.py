"""Strict output: return only what is inside ``<completion>…</completion>``.

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

from iopd.edge.openai.incoming.jsonschema import JSONObject

__all__ = [
    "CLOSE_TAG",
    "OPEN_TAG",
    "StrictStreamFilter",
    "extract_completion",
    "strict_system_message",
]

OPEN_TAG = "<completion>"
CLOSE_TAG = "</completion>"


def strict_system_message(instruction: str) -> JSONObject:
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
    """Streams only the inside of ``<completion>``; see the module docstring.

    Each delta costs time proportional to its own length, never to the text
    so far (the stream is the model's answer, an echo of the caller's text for
    an ``echo`` model): nothing is rescanned, and held-back text is kept as a
    list of pieces joined only when released.
    """

    def __init__(self) -> None:
        self._state = "search"  # search -> inside -> done
        self._seen: list[str] = []  # search: all text so far (released at flush without a tag)
        self._tail = ""  # search: the end of the text so far that may begin the open tag
        self._space: list[str] = []  # inside: held-back whitespace (it may precede the close tag)
        self._partial = ""  # inside: a held-back possible start of the close tag
        self._emitted_any = False

    def feed(self, delta: str) -> str:
        """Take the next delta; return the text that can be released now."""
        if self._state == "done" or not delta:
            return ""
        if self._state == "search":
            window = self._tail + delta
            start = window.find(OPEN_TAG)
            if start < 0:
                self._seen.append(delta)
                self._tail = window[-(len(OPEN_TAG) - 1) :]
                return ""
            self._seen, self._tail = [], ""
            self._state = "inside"
            delta = window[start + len(OPEN_TAG) :]
        return self._feed_inside(delta)

    def _feed_inside(self, delta: str) -> str:
        # Held back so far: whitespace (self._space), then a possible tag start
        # (self._partial).  The close tag holds no whitespace, so it can only
        # occur in ``self._partial + delta``.
        text = self._partial + delta
        end = text.find(CLOSE_TAG)
        if end >= 0:
            ready = text[:end].rstrip()
            held = "".join(self._space) if ready else ""
            self._space, self._partial = [], ""
            self._state = "done"
            return self._release(held + ready)
        keep = _partial_tag_len(text, CLOSE_TAG)
        body = text[: len(text) - keep]
        self._partial = text[len(text) - keep :]
        stripped = body.rstrip()  # trailing whitespace waits: it may precede the close tag
        if not stripped:
            if body:
                self._space.append(body)
            return ""
        held = "".join(self._space)
        self._space = [body[len(stripped) :]] if len(stripped) < len(body) else []
        return self._release(held + stripped)

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
            rest = "".join(self._seen)
            self._seen, self._tail = [], ""
            self._state = "done"
            return rest
        if self._state == "inside":
            rest = ("".join(self._space) + self._partial).rstrip()
            self._space, self._partial = [], ""
            self._state = "done"
            return self._release(rest)
        return ""
