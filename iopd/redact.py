"""Scrub configured secrets out of free text, including pieces of them.

Why pieces: text that quotes a secret is often cut — a provider's error body
is quoted up to 512 bytes, a log line is shortened — and a cut key still
gives most of it away.  The rule: any run of ``MIN_RUN`` (8) or more
characters of a configured secret is replaced with ``***``; a secret shorter
than that is replaced where it occurs whole, unless it is shorter than
``MIN_SECRET`` (4): a "secret" of one to three characters is no secret, and
masking every ``t`` of a log line would only make it unreadable.

How, in time linear in the text: every ``MIN_RUN``-character window of every
secret goes into one set; each position of the text whose window is in the
set marks those ``MIN_RUN`` characters.  A run of 8 or more characters of a
secret is exactly a chain of such windows, so the marked ranges, merged,
cover every run (and nothing that is not one).

Only every ``STRIDE``-th position is looked up first, with a 4-character
gram: any 8 characters of text hold a 4-gram starting at a multiple of 5,
so a window can only start in the 5 positions before such a gram hit.  Text
without a secret (nearly every log line) costs one lookup per 5 characters.

Pure: no I/O, no state after construction; build one ``Scrubber`` per set
of secrets and reuse it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

__all__ = ["MASK", "MIN_RUN", "MIN_SECRET", "Scrubber", "url_secrets"]

#: The shortest piece of a secret that is scrubbed (shorter secrets: whole only).
MIN_RUN = 8
#: Shorter secrets are not scrubbed at all (see the module docstring).
MIN_SECRET = 4
#: The prefilter: grams of ``GRAM`` characters looked up every ``STRIDE`` positions.
#: Any ``MIN_RUN`` consecutive characters contain such a gram (GRAM + STRIDE - 1 <= MIN_RUN).
GRAM = 4
STRIDE = MIN_RUN - GRAM + 1
#: What a scrubbed range becomes.
MASK = "***"


class Scrubber:
    """Replaces every piece (``MIN_RUN``+ characters) of ``secrets`` in a text with ``***``."""

    __slots__ = ("_grams", "_short", "_windows")

    def __init__(self, secrets: Iterable[str | None]) -> None:
        windows: set[str] = set()
        short: set[str] = set()
        for secret in secrets:
            if not secret or len(secret) < MIN_SECRET:
                continue
            if len(secret) < MIN_RUN:
                short.add(secret)
                continue
            for i in range(len(secret) - MIN_RUN + 1):
                windows.add(secret[i : i + MIN_RUN])
        self._windows = frozenset(windows)
        self._grams = frozenset(w[i : i + GRAM] for w in windows for i in range(MIN_RUN - GRAM + 1))
        self._short = tuple(sorted(short, key=len, reverse=True))

    def __bool__(self) -> bool:
        """False when there is nothing to scrub (no secret configured)."""
        return bool(self._windows or self._short)

    def scrub(self, text: str, mask: str = MASK) -> str:
        """``text`` with every covered range replaced by ``mask`` (the same object if none)."""
        if not self or not text:
            return text
        ranges = self._window_ranges(text)
        if self._short:
            ranges = _merge(ranges + self._short_ranges(text))
        if not ranges:
            return text
        parts: list[str] = []
        at = 0
        for start, end in ranges:
            parts.append(text[at:start])
            parts.append(mask)
            at = end
        parts.append(text[at:])
        return "".join(parts)

    def _window_ranges(self, text: str) -> list[tuple[int, int]]:
        """Merged ranges of the text covered by secret windows, in order."""
        windows, grams = self._windows, self._grams
        ranges: list[tuple[int, int]] = []
        if not windows:
            return ranges
        last = len(text) - MIN_RUN  # the last start of a window
        start = end = -1
        for q in range(0, last + STRIDE, STRIDE):
            if text[q : q + GRAM] not in grams:
                continue
            # The windows holding this gram start in (q - STRIDE, q]; each start
            # belongs to exactly one q, so every position is tried once, in order.
            for i in range(max(0, q - STRIDE + 1), min(q, last) + 1):
                if text[i : i + MIN_RUN] in windows:
                    if i > end:  # not touching the open range: close it, open a new one
                        if end >= 0:
                            ranges.append((start, end))
                        start = i
                    end = i + MIN_RUN
        if end >= 0:
            ranges.append((start, end))
        return ranges

    def _short_ranges(self, text: str) -> list[tuple[int, int]]:
        """Ranges of whole occurrences of the short secrets (``str.find``: C speed)."""
        ranges: list[tuple[int, int]] = []
        for secret in self._short:
            at = text.find(secret)
            while at >= 0:
                ranges.append((at, at + len(secret)))
                at = text.find(secret, at + len(secret))
        return ranges


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges with every overlapping or touching pair joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def url_secrets(url: str | None) -> list[str]:
    """The secret of a URL such as ``redis://user:password@host``: its password
    (both as written and percent-decoded), or nothing."""
    if not url:
        return []
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:
        return []
    if not password:
        return []
    return list(dict.fromkeys([password, urllib.parse.unquote(password)]))
