"""The request's retry policy: the paths report how each attempt ended.

A request may be served by several attempts, each on its own lease (the
lease itself is ``prepare.Leasing``'s).  The relay and the normalized paths
never decide whether to retry: they *report* to the request's
:class:`Attempts` -- :meth:`~Attempts.succeeded`, or
:meth:`~Attempts.failed` with what happened (an ``AttemptFailure``) and
whether any byte of the answer reached the caller -- and get a
:class:`AttemptVerdict` back.  On ``RETRY`` the path returns without writing
anything; :func:`~iopd.edge.openai.prepare.until_done` leases the next
candidate and runs the path's attempt again.  That is the whole interface.

What a report does: it tells the pool's outlier tracker about the provider
(failure, saturation, success, or a credential error that is the caller's
own) and the metrics, and logs the attempt.  Then the retry is made only when
every one of these holds:

* ``retry_rules.classify_failure`` says it is *safe*.  The hard rule is that
  nothing of the answer reached the caller: once a byte (the head included)
  went out, a second provider's answer would be spliced onto the first's,
  and a caller cannot tell; before it, the caller saw nothing and the next
  provider's answer is the whole answer.  A failure after the provider had
  the request is also unsafe when the request may have acted (a ``cli``
  process that started);
* an attempt is left (``provider_pool.retry_attempts``);
* a candidate that has not failed this request remains in the group or its
  fallbacks (a provider that failed it is never tried again, and with the
  caller's own provider credentials only providers of the first one's
  ``base_url`` origin are: the key never goes to another host);
* the group's ``RetryBudget`` allows one (retries stay a bounded share of
  the group's requests, so a failing provider cannot double the load).

A node that answers ``Busy`` (its slots were full when the run arrived) is
no failure: the lease is taken again, without spending a retry.
"""

from __future__ import annotations

import enum
import logging

import trio

from iopd.edge.openai.lifecycle import Call
from iopd.edge.pool.outliers import SATURATION_DEFAULT_SECONDS, Transition
from iopd.edge.pool.pool import Lease
from iopd.edge.pool.retry_rules import (
    AttemptFailure,
    FailureKind,
    RetryPolicy,
    TrackerEffect,
    classify_failure,
    url_origin,
)
from iopd.edge.runtime.edge_runtime import EdgeRuntime

__all__ = ["AttemptVerdict", "Attempts"]

log = logging.getLogger("iopd.edge.request")


class AttemptVerdict(enum.Enum):
    """What a failed attempt's report answers."""

    #: Nothing reached the caller and another attempt may be made: return
    #: without writing; the next lease runs the attempt again.
    RETRY = "retry"
    #: This attempt's end is the request's: raise its error.
    FINAL = "final"


class Attempts:
    """One request's attempts and the policy over them (see the module docstring)."""

    __slots__ = (
        "_rt",
        "_call",
        "_group_id",
        "_chain",
        "_provider_auth",
        "_failed",
        "_retries",
        "_lease",
        "_carries_credential",
        "_reported",
    )

    def __init__(
        self, rt: EdgeRuntime, call: Call, group_id: str, chain: tuple[str, ...], provider_auth: bool
    ) -> None:
        self._rt = rt
        self._call = call
        self._group_id = group_id  # the group asked for (the retry budget's)
        self._chain = chain  # its fallback groups
        self._provider_auth = provider_auth  # the caller sent its own provider credential
        self._failed: frozenset[str] = frozenset()  # providers that failed it (never again)
        self._retries = 0
        self._lease: Lease | None = None  # the attempt in progress
        self._carries_credential = False
        self._reported = False  # this attempt's end was reported

    def begin(self, lease: Lease, *, relay: bool) -> None:
        """An attempt starts on ``lease`` (the lease's owner calls it).

        ``relay``: the attempt relays the caller's body, which carries the
        caller's provider credential when it sent one.
        """
        self._lease, self._reported = lease, False
        self._carries_credential = self._provider_auth and relay

    def end(self) -> None:
        """The attempt's lease is given back: nothing more is reported for it."""
        self._lease = None

    # ------------------------------------------------------- what the paths report

    def succeeded(self) -> None:
        """The attempt worked (a caller's 4xx relayed counts as working)."""
        lease = self._lease
        if lease is not None and not self._reported:
            self._reported = True
            self._rt.pool.attempt_succeeded(lease)

    def failed(
        self,
        failure: AttemptFailure,
        *,
        caller_saw_bytes: bool,
        retry_after: float = SATURATION_DEFAULT_SECONDS,
    ) -> AttemptVerdict:
        """Report a failed attempt; ``RETRY`` when the path should leave it to the next.

        Synchronous: the path decides while its stream is still open, before
        writing anything.  ``retry_after``: a 429's bounded ``Retry-After``.
        ``RETRY`` spends one retry of the group's budget (a node's ``Busy``:
        none).  Only the first report of an attempt counts.
        """
        lease = self._lease
        if lease is None or self._reported:
            return AttemptVerdict.FINAL
        self._reported = True
        if failure.kind is FailureKind.NODE_BUSY:  # node full: lease again, not a failure
            return AttemptVerdict.RETRY
        rt, out = self._rt, self._call.out
        pool_cfg = self._call.snap.config.provider_pool
        verdict = classify_failure(
            failure,
            caller_saw_bytes=caller_saw_bytes,
            retry_on_timeout=pool_cfg.retry_on_timeout,
            caller_credentialed=self._carries_credential,
        )
        transition: Transition | None = None
        if verdict.effect is TrackerEffect.FAILURE and verdict.reason is not None:
            transition = rt.pool.attempt_failed(lease, verdict.reason)
        elif verdict.effect is TrackerEffect.SATURATED:
            transition = rt.pool.attempt_saturated(lease, retry_after)
        elif verdict.effect is TrackerEffect.SUCCESS:
            rt.pool.attempt_succeeded(lease)
        elif verdict.effect is TrackerEffect.CALLER_CREDENTIALED:
            rt.pool.attempt_caller_credentialed(lease)
        if verdict.reason is not None:
            rt.metrics.count_attempt_failure(
                lease.group_id or self._group_id, lease.provider_id, verdict.reason.value
            )
        if transition is Transition.EJECTED:
            rt.metrics.count_ejection(lease.provider_id)
            log.warning(
                "event=provider_ejected provider=%s reason=%s",
                lease.provider_id,
                verdict.reason.value if verdict.reason else "-",
            )
        self._failed |= {lease.provider_id}
        why = verdict.no_retry.value if verdict.no_retry is not None else None
        if why is None:
            why = self._retry_refusal(pool_cfg.retry_attempts)
        log.info(
            "event=attempt_failed request_id=%s group=%s provider=%s failure=%s status=%s "
            "retry=%s tracker=%s",
            out.request_id,
            lease.group_id or self._group_id,
            lease.provider_id,
            failure.kind.value,
            failure.status if failure.status is not None else "-",
            "yes" if why is None else f"no({why})",
            verdict.effect.value,
        )
        if why is not None:
            return AttemptVerdict.FINAL
        self._retries += 1
        rt.metrics.count_retry(self._group_id)
        return AttemptVerdict.RETRY

    # ------------------------------------------------------------ the next lease

    def exclude(self) -> frozenset[str]:
        """The providers the next lease may not go to: those that failed, and
        -- with the caller's provider credentials -- every provider of another
        ``base_url`` origin than the first one leased."""
        if not self._provider_auth or not self._failed:
            return self._failed
        catalog = self._call.snap.catalog
        first = catalog.providers.get(next(iter(self._failed)))
        origin = _origin(first.config.base_url) if first is not None else None
        other = {
            pid for pid, ref in catalog.providers.items() if _origin(ref.config.base_url) != origin
        }
        return self._failed | other

    def _retry_refusal(self, attempts: int) -> str | None:
        """Why a safe retry is not made (attempts, candidates, budget), or None (spent)."""
        if not RetryPolicy(attempts=attempts).attempt_left(self._retries):
            return "attempts"
        if not self._candidates_left():
            return "no_candidate"
        if not self._rt.retry_budget.try_retry(self._group_id, trio.current_time()):
            return "budget"
        return None

    def _candidates_left(self) -> bool:
        """A provider of the group or its fallbacks this request may still go to."""
        catalog = self._call.snap.catalog
        exclude = self.exclude()
        for gid in (self._group_id, *self._chain):
            spec = catalog.group(gid)
            if spec is not None and any(pid not in exclude for pid, _ in spec.providers):
                return True
        return False


def _origin(base_url: str | None) -> str | None:
    try:
        return url_origin(base_url) if base_url else None
    except ValueError:
        return None
