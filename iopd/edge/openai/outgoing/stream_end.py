"""Has a relayed stream's terminal event gone out?  Pure.

A coding agent closes its connection the moment it has a stream's terminal
event (Codex on ``response.completed``); the provider's own end, and the
usage the node reads there, come a moment later.  The relay asks
:class:`StreamEnd` whether the bytes it handed to the caller held the
terminal event: then the caller had its whole answer, and the request is
finished as a success (with the usage the node still sends) rather than
counted as cancelled.

The terminal events, as each API sends them:

- Chat Completions and legacy completions (SSE): the ``data: [DONE]`` line;
- Responses (SSE): the ``response.completed``, ``response.incomplete`` or
  ``response.failed`` event;
- Anthropic Messages (SSE): ``message_stop``;
- Ollama (NDJSON): the object with ``"done": true``.

A marker is matched as JSON writes it (``"type":"message_stop"``, with or
without a space after the colon): inside a JSON string its quotes would be
escaped, so text a model writes never matches.  Each ``feed`` searches the
new bytes, and the seam with the few before them (a marker split across two
writes), without copying them: the cost is linear in what is relayed and
the state is a few bytes.
"""

from __future__ import annotations

__all__ = ["StreamEnd"]

_KINDS = (b"response.completed", b"response.incomplete", b"response.failed", b"message_stop")
_MARKERS: tuple[bytes, ...] = (
    b"\ndata: [DONE]",
    b"\ndata:[DONE]",
    *(b'"type":"' + kind + b'"' for kind in _KINDS),
    *(b'"type": "' + kind + b'"' for kind in _KINDS),
    b'"done":true',
    b'"done": true',
)
_KEEP = max(len(m) for m in _MARKERS) - 1


class StreamEnd:
    """Feeds of a relayed body's bytes; :attr:`seen` once the terminal event went by."""

    __slots__ = ("_tail", "seen")

    def __init__(self) -> None:
        self._tail = b"\n"  # the body starts a line
        self.seen = False

    def feed(self, data: bytes) -> bool:
        """Look at the next relayed bytes; True once the terminal event was among them."""
        if self.seen or not data:
            return self.seen
        seam = self._tail + data[:_KEEP]  # a marker split across two writes
        for marker in _MARKERS:
            if marker in data or marker in seam:
                self.seen = True
                return True
        self._tail = data[-_KEEP:] if len(data) >= _KEEP else (self._tail + data)[-_KEEP:]
        return False
