"""The retry budget of each model group over a sliding minute, pure and bounded.

Why a budget: retries route a request around one failing provider, but when
every provider of a group fails, retrying every request would multiply the
load on a fleet that is already down.  So retries may add at most
``ratio`` of a group's requests over the last minute, plus ``minimum``
retries per group per minute that are always allowed (a lone failing
provider in a quiet group is still routed around).

The window is a ring of one-second buckets per group: memory is fixed per
group (``BUCKETS`` counters of each kind), a check is O(1), and advancing the
clock clears at most ``BUCKETS`` buckets whatever the gap.  "The last minute"
is therefore the current second and the 59 before it.  Time is passed in
(seconds on any monotonic clock; a clock that steps back is treated as
standing still); groups that leave the configuration are dropped with
``retain``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BUCKETS", "RetryBudget", "RetryBudgetPolicy"]

#: Buckets of one second each: the window is one minute.
BUCKETS = 60


@dataclass(frozen=True, slots=True)
class RetryBudgetPolicy:
    """``provider_pool.retry_budget`` (``ratio``) and ``retry_budget_min`` (``minimum``)."""

    ratio: float = 0.2
    minimum: int = 10

    def allowed(self, requests: int, retries: int) -> bool:
        """True when one more retry fits: ``retries + 1 <= ratio * requests + minimum``."""
        return retries + 1 <= self.ratio * requests + self.minimum


class _Window:
    """Requests and retries of one group, per second, over the last ``BUCKETS`` seconds."""

    __slots__ = ("requests", "retries", "second", "total_requests", "total_retries")

    def __init__(self, second: int) -> None:
        self.requests = [0] * BUCKETS
        self.retries = [0] * BUCKETS
        self.total_requests = 0
        self.total_retries = 0
        self.second = second  # the absolute second of the newest bucket

    def advance(self, second: int) -> int:
        """Move the window to ``second`` (never backwards); the index of its bucket."""
        gap = second - self.second
        if gap > 0:
            for s in range(self.second + 1, self.second + 1 + min(gap, BUCKETS)):
                i = s % BUCKETS
                self.total_requests -= self.requests[i]
                self.total_retries -= self.retries[i]
                self.requests[i] = 0
                self.retries[i] = 0
            self.second = second
        return self.second % BUCKETS


class RetryBudget:
    """Per-group retry budget.  Call ``note_request`` once per request, ``try_retry`` per retry.

    A request that falls back to another group is counted once, under the
    group it was sent to first; its retries spend that group's budget.
    """

    def __init__(self, policy: RetryBudgetPolicy | None = None) -> None:
        self.policy = policy if policy is not None else RetryBudgetPolicy()
        self._windows: dict[str, _Window] = {}

    def set_policy(self, policy: RetryBudgetPolicy) -> None:
        """A config refresh: the new limits apply from the next check; counts are kept."""
        self.policy = policy

    def note_request(self, group_id: str, now: float) -> None:
        """A request for ``group_id`` made its first attempt."""
        window, i = self._window(group_id, now)
        window.requests[i] += 1
        window.total_requests += 1

    def try_retry(self, group_id: str, now: float) -> bool:
        """Spend one retry of ``group_id`` if the budget allows it; False (nothing spent) if not."""
        window, i = self._window(group_id, now)
        if not self.policy.allowed(window.total_requests, window.total_retries):
            return False
        window.retries[i] += 1
        window.total_retries += 1
        return True

    def counts(self, group_id: str, now: float) -> tuple[int, int]:
        """(requests, retries) of ``group_id`` over the minute ending at ``now``."""
        window = self._windows.get(group_id)
        if window is None:
            return (0, 0)
        window.advance(math.floor(now))
        return (window.total_requests, window.total_retries)

    def retain(self, group_ids: Iterable[str]) -> None:
        """Forget every group not in ``group_ids`` (after a config refresh)."""
        keep = set(group_ids)
        for gid in [g for g in self._windows if g not in keep]:
            del self._windows[gid]

    def _window(self, group_id: str, now: float) -> tuple[_Window, int]:
        second = math.floor(now)
        window = self._windows.get(group_id)
        if window is None:
            window = self._windows[group_id] = _Window(second)
        return window, window.advance(second)
