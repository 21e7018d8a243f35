"""The sizes the edge keeps of the free text a node sends, and the one cut.

Why: an authenticated node is still a peer the edge does not control.  A
string it sends is bounded only by the frame cap (16 MiB by default), and
the edge keeps some of them (a provider's ``last_error`` in ``/status`` and
the console), relays others to callers (a run's or tunnel's error message)
and logs a few.  Each is cut here, at the one place it enters the edge,
before anything scans it (the secret scrubber is linear, but linear in 16
MiB is a stall of the loop).  A long string is cut, never a reason to
refuse the message.

Cutting first and scrubbing the result is as safe as scrubbing first: the
scrubber masks every run of ``MIN_RUN`` characters of a secret wherever it
is, so a secret the cut splits is masked in the part that is kept.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "CUT_MARK",
    "MAX_ERROR_CODE_CHARS",
    "MAX_FINISH_REASON_CHARS",
    "MAX_LAST_ERROR_CHARS",
    "MAX_NODE_MESSAGE_CHARS",
    "STATUS_TEXT_BUDGET",
    "bounded",
    "cut",
    "last_error_limit",
]

#: A provider's last probe error as ``/status``, the console and the log keep it.
MAX_LAST_ERROR_CHARS = 512
#: The ``last_error`` characters one ``ProviderStatus`` may make the edge keep
#: (and scrub) in all: a message naming more than 16 providers keeps less of
#: each (``last_error_limit``).  The scrubber's worst case (a text made of
#: pieces of secrets) is about a microsecond a character.
STATUS_TEXT_BUDGET = 8192
#: A run's or tunnel's error message, as a caller and the console see it.
MAX_NODE_MESSAGE_CHARS = 2048
#: A run's or tunnel's error code (a short word; compared, never shown).
MAX_ERROR_CODE_CHARS = 64
#: A run's ``finish_reason`` (a short word the caller gets in the response).
MAX_FINISH_REASON_CHARS = 64
#: What ends a string that was cut.
CUT_MARK = "..."


def last_error_limit(providers: int) -> int:
    """The ``last_error`` size kept of each of ``providers`` reported in one message."""
    return min(MAX_LAST_ERROR_CHARS, STATUS_TEXT_BUDGET // max(1, providers))


def cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its first
    characters and ``CUT_MARK``, ``limit`` characters in all (the same object
    when nothing was cut)."""
    if len(text) <= limit:
        return text
    return text[: max(0, limit - len(CUT_MARK))] + CUT_MARK


def bounded(text: str, limit: int, scrub: Callable[[str], str]) -> str:
    """``text`` cut to ``limit``, then scrubbed of the edge's secrets."""
    return scrub(cut(text, limit))
