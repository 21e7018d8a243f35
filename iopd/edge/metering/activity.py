"""Recent activity for the web console: usage per principal and model, recent errors.

Why not the metrics: Prometheus counters only grow, and reading "tokens per
minute of alice on gpt-4o over the last minutes" out of them needs a
Prometheus.  The console must show it from the edge alone, so every finished
request is also noted here, in memory that never grows:

* usage: one bucket per wall-clock minute, in a ring of ``minutes`` buckets
  (a bucket is reused, emptied, when its minute comes round again); in each
  bucket at most ``max_keys`` principal × model keys, the rest counted
  together under ``OTHER``;
* errors: the last ``max_errors`` failed requests, oldest dropped first.

A request is noted once, at its end, in O(1): plain synchronous code, no
I/O and no lock (the edge is one trio thread).  The names kept are the
config's only: the principal's alias (or ``principal_ref``, or ``unmapped``)
and the resolved model group (or ``unknown``), never the caller's strings;
an error message passes the snapshot's secret scrubber and is cut short.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypedDict

__all__ = [
    "OTHER",
    "ActivityRecorder",
    "ErrorRow",
    "UsageRow",
]

#: The key that counts every principal × model beyond ``max_keys`` in a minute.
OTHER: Final = "(other)"
#: The longest error message kept (characters).
MAX_MESSAGE: Final = 300
#: Minutes averaged for the ``per minute`` rates.
RATE_MINUTES: Final = 5

UsageKey = tuple[str, str]  # (principal, model group)


class UsageRow(TypedDict):
    """Usage of one principal on one model group over the recent minutes."""

    principal: str
    model: str
    requests_per_min: float  # averaged over the last ``RATE_MINUTES`` minutes
    tokens_per_min: float
    requests: int  # totals over the whole window (``window_minutes``)
    tokens: int
    errors: int


class ErrorRow(TypedDict):
    """One failed request, as the console lists it."""

    time: float  # Unix time
    principal: str
    model: str
    provider: str
    status: int  # the HTTP status answered (0: the connection was cut)
    code: str
    message: str


@dataclass(slots=True)
class _Tally:
    requests: int = 0
    tokens: int = 0
    errors: int = 0


@dataclass(slots=True)
class _Minute:
    minute: int = -1  # minutes since the epoch; -1: never used
    tallies: dict[UsageKey, _Tally] = field(default_factory=dict)


class ActivityRecorder:
    """Bounded recent usage and errors of one edge (see the module doc)."""

    def __init__(
        self,
        *,
        minutes: int = 15,
        max_keys: int = 200,
        max_errors: int = 50,
        clock: Callable[[], float] = time.time,
        scrub: Callable[[str], str] = lambda text: text,
    ) -> None:
        if minutes < RATE_MINUTES or max_keys < 1 or max_errors < 1:
            raise ValueError("minutes must be >= RATE_MINUTES, max_keys and max_errors >= 1")
        self.window_minutes = minutes
        self.max_keys = max_keys
        self._ring = [_Minute() for _ in range(minutes)]
        self._errors: deque[ErrorRow] = deque(maxlen=max_errors)
        self._clock = clock
        self._scrub = scrub
        self._latest = -1  # the latest minute noted: a clock stepping back stays in it
        #: Bumped by every note: a reader compares it to see whether anything changed.
        self.changes = 0

    # ---------------------------------------------------------------- write

    def note(
        self,
        principal: str,
        model: str,
        *,
        tokens: int = 0,
        ok: bool = True,
        provider: str = "-",
        status: int = 0,
        code: str = "",
        message: str = "",
    ) -> None:
        """Count one finished request; a failed one (``ok=False``) is also listed."""
        now = self._clock()
        bucket = self._bucket(self._minute(now))
        key = (principal, model)
        tally = bucket.tallies.get(key)
        if tally is None:
            if len(bucket.tallies) >= self.max_keys:
                key = (OTHER, OTHER)
            tally = bucket.tallies.setdefault(key, _Tally())
        tally.requests += 1
        tally.tokens += max(0, tokens)
        if not ok:
            tally.errors += 1
            self._errors.append(
                {
                    "time": round(now, 3),
                    "principal": principal,
                    "model": model,
                    "provider": provider,
                    "status": status,
                    "code": code,
                    "message": self._scrub(message)[:MAX_MESSAGE],
                }
            )
        self.changes += 1

    def _minute(self, now: float) -> int:
        minute = max(int(now // 60), self._latest)
        self._latest = minute
        return minute

    def _bucket(self, minute: int) -> _Minute:
        """The bucket of ``minute``, emptied first if it last held an older minute."""
        bucket = self._ring[minute % self.window_minutes]
        if bucket.minute != minute:
            bucket.minute = minute
            bucket.tallies.clear()
        return bucket

    # ----------------------------------------------------------------- read

    def usage(self) -> list[UsageRow]:
        """Per principal × model over the window, busiest first (tokens, then requests)."""
        current = self._minute(self._clock())
        totals: dict[UsageKey, _Tally] = {}
        recent: dict[UsageKey, _Tally] = {}
        for bucket in self._ring:
            age = current - bucket.minute
            if bucket.minute < 0 or not 0 <= age < self.window_minutes:
                continue
            for key, tally in bucket.tallies.items():
                _add(totals, key, tally)
                if age < RATE_MINUTES:
                    _add(recent, key, tally)
        rows: list[UsageRow] = []
        for key, total in totals.items():
            rate = recent.get(key, _Tally())
            rows.append(
                {
                    "principal": key[0],
                    "model": key[1],
                    "requests_per_min": round(rate.requests / RATE_MINUTES, 2),
                    "tokens_per_min": round(rate.tokens / RATE_MINUTES, 1),
                    "requests": total.requests,
                    "tokens": total.tokens,
                    "errors": total.errors,
                }
            )
        rows.sort(key=lambda r: (-r["tokens"], -r["requests"], r["principal"], r["model"]))
        return rows

    def recent_errors(self) -> list[ErrorRow]:
        """The last failed requests, newest first."""
        return list(reversed(self._errors))


def _add(into: dict[UsageKey, _Tally], key: UsageKey, tally: _Tally) -> None:
    sum_ = into.setdefault(key, _Tally())
    sum_.requests += tally.requests
    sum_.tokens += tally.tokens
    sum_.errors += tally.errors
