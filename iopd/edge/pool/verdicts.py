"""The attempt verdicts of the scheduler (moved out of ``scheduler.py`` whole).

Every grant carries the outlier tracker's ticket; the request path reports
its verdict once (``attempt_succeeded/failed/saturated``, or
``attempt_caller_credentialed`` for an error answered to the caller's own
provider credential), and a grant released without one is abandoned.  A
verdict that changes a provider's standing re-examines the waiters that list
it.  ``Scheduler`` inherits these methods; the state they use is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from .candidates import Grant
from .fair_queue import Waiter
from .outliers import Attempt, OutlierTracker, Transition
from .retry_rules import FailureReason

__all__ = ["AttemptOutcome", "AttemptVerdicts", "NOTHING"]


class AttemptOutcome(NamedTuple):
    """What an attempt's verdict did: the tracker's transition and the waiters it resolved."""

    transition: Transition | None
    resolved: list[Waiter]


NOTHING = AttemptOutcome(None, [])


class AttemptVerdicts:
    """The verdict half of ``Scheduler`` (a mixin: ``Scheduler`` supplies the state)."""

    if TYPE_CHECKING:

        @property
        def outliers(self) -> OutlierTracker: ...

        def _clock(self, now: float | None) -> float: ...

        def _claim_verdict(self, grant: Grant) -> Attempt | None: ...

        def _outlier_changed(
            self, provider_id: str, transition: Transition | None, now: float
        ) -> AttemptOutcome: ...

    # ------------------------------------------------------------ attempts

    def attempt_succeeded(self, grant: Grant, now: float | None = None) -> AttemptOutcome:
        """The grant's attempt worked (a caller's 4xx counts as working)."""
        return self._verdict(grant, now, self.outliers.attempt_succeeded)

    def attempt_failed(
        self, grant: Grant, reason: FailureReason, now: float | None = None
    ) -> AttemptOutcome:
        """The grant's attempt failed (retried or not); may eject its provider
        (when the streak holds another principal's failure too: the grant's
        principal is whose failure this is)."""
        if reason is FailureReason.STATUS_429:
            raise ValueError("a 429 is not a failure: use attempt_saturated")
        return self._verdict(
            grant,
            now,
            lambda a, t: self.outliers.attempt_failed(a, reason, t, principal=grant.principal),
        )

    def attempt_saturated(
        self, grant: Grant, seconds: float, now: float | None = None
    ) -> AttemptOutcome:
        """The provider answered 429: not chosen for ``seconds`` (bounded by the tracker)."""
        return self._verdict(
            grant, now, lambda a, t: self.outliers.attempt_saturated(a, t, seconds)
        )

    def attempt_caller_credentialed(
        self, grant: Grant, now: float | None = None
    ) -> AttemptOutcome:
        """The provider answered an error status to the caller's own credential:
        the verdict closes, the provider's standing is untouched (a probe's slot frees)."""
        return self._verdict(
            grant, now, lambda a, _t: self.outliers.attempt_caller_credentialed(a)
        )

    def attempt_abandoned(self, grant: Grant, now: float | None = None) -> AttemptOutcome:
        """The attempt ended without a verdict (caller gone, deadline)."""
        return self._verdict(grant, now, lambda a, _t: self.outliers.attempt_abandoned(a))

    def _verdict(
        self,
        grant: Grant,
        now: float | None,
        apply: Callable[[Attempt, float], Transition | None],
    ) -> AttemptOutcome:
        """Claim the grant's one verdict and let ``apply`` give it to the tracker."""
        attempt = self._claim_verdict(grant)
        if attempt is None:
            return NOTHING
        now = self._clock(now)
        return self._outlier_changed(grant.provider_id, apply(attempt, now), now)
