"""Passive outlier ejection of providers, as a pure state machine with time passed in.

Why: a provider that fails every request keeps being chosen until its health
probe notices, and a probe can pass (``/v1/models`` answers) while every
completion fails.  So the edge watches the attempts themselves:
``EjectionPolicy.after_failures`` consecutive failed attempts eject a
provider for ``seconds``; when that runs out it is *half-open*: exactly one
request (the probe) goes through; its success ends the ejection, its failure
ejects again for twice as long, up to ``MAX_FACTOR`` times ``seconds``.  A
429 is not a failure: it makes the provider *saturated* (not chosen) for its
``Retry-After``, bounded.

Why a streak must come from several principals: a caller can craft requests
a provider fails (or send them with a key the provider refuses), and one
caller's requests must not take a provider away from everyone.  So a streak
ejects only when its failures came from at least ``EjectionPolicy.principals``
distinct principals -- except a streak of connect failures only: a request
that never reached the provider cannot have caused them.  And an attempt
that carried the caller's own provider credential, answered with an error
status, is the caller's business (``attempt_caller_credentialed``): it is
neither a failure nor a saturation, and it leaves the streak as it was.

Per provider the phases are::

    closed --N failures--> ejected --until--> half-open --probe starts--> probing
      ^                                           ^                          |
      +------------- probe succeeds --------------+---- probe abandoned -----+
                      probe fails: ejected again for twice as long  <--------+

Results are matched to the attempt that produced them through an
``Attempt`` ticket: a ticket belongs to one epoch (the closed period, one
ejection, or one probe of it), and results of another epoch are ignored, so
a slow attempt that started before an ejection cannot end it or extend it,
and only the running probe's result decides a half-open provider.  A last-resort request to a provider
that is still ejected (every candidate is) is its probe, if none is out.

Nothing here reads a clock or does I/O.  The trio layer asks ``next_change``
when to look again and ``due`` which providers came back by time; the
scheduler asks ``is_choosable`` and ``last_resort``.
"""

from __future__ import annotations

import datetime
import enum
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from .retry_rules import FailureReason

__all__ = [
    "MAX_FACTOR",
    "SATURATION_DEFAULT_SECONDS",
    "SATURATION_MAX_SECONDS",
    "Attempt",
    "EjectionPolicy",
    "EjectionStatus",
    "OutlierTracker",
    "Transition",
    "health_display",
    "saturation_seconds",
]

#: An ejection that is renewed doubles, up to this many times ``seconds``.
MAX_FACTOR = 10
#: Saturation after a 429 without a usable ``Retry-After``.
SATURATION_DEFAULT_SECONDS = 1.0
#: The longest saturation a ``Retry-After`` can ask for.
SATURATION_MAX_SECONDS = 60.0
_RETRY_AFTER_MAX_CHARS = 64


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    """``provider_pool.eject_after_failures`` and ``eject_seconds``.

    ``principals``: how many distinct principals a streak's failures must
    come from before it ejects (a connect-only streak needs no second one).
    2, unless the config can tell only one caller apart (no principal
    tokens, or one principal and no other way in): then everyone is that
    one caller, and 1 keeps passive ejection working.
    """

    after_failures: int = 5  # 0 disables ejection
    seconds: float = 30.0
    principals: int = 2

    def __post_init__(self) -> None:
        if self.principals < 1:
            raise ValueError(f"principals must be >= 1 (got {self.principals})")

    @property
    def enabled(self) -> bool:
        return self.after_failures > 0


class Transition(enum.Enum):
    """How one call changed a provider's availability (None from a call: it did not)."""

    EJECTED = "ejected"  # newly ejected (or ejected again after a failed probe)
    RESTORED = "restored"  # an ejection ended (probe success, health probe, policy off)
    SATURATED = "saturated"  # a 429: not choosable until its Retry-After
    PROBE_RELEASED = "probe_released"  # the half-open slot is free again


@dataclass(frozen=True, slots=True)
class Attempt:
    """A ticket for one attempt on a provider; hand it back with the attempt's result."""

    provider_id: str
    epoch: int
    probe: bool


@dataclass(frozen=True, slots=True)
class EjectionStatus:
    """A provider's current ejection, for ``/status`` and logs.

    Times are on the caller's clock; ``/status`` converts ``until`` to wall
    time.  ``half_open``: ``until`` has passed and the next request is the
    probe; ``probing``: that probe is running.
    """

    since: float
    until: float
    cause: FailureReason
    factor: int
    half_open: bool
    probing: bool


class _State:
    """One provider's record; kept as long as the provider is configured."""

    __slots__ = (
        "cause",
        "ejected_at",
        "epoch",
        "factor",
        "failures",
        "first_principal",
        "last_non_connect",
        "mixed",
        "probing",
        "saturated_until",
        "ticket",
        "until",
        "until_reported",
    )

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.failures = 0  # consecutive failures in the closed phase
        self.last_non_connect: FailureReason | None = None  # of the current streak
        self.first_principal: str | None = None  # whose failure began the streak
        self.mixed = False  # another principal's failure is in the streak too
        self.ejected_at: float | None = None  # None: closed
        self.until = 0.0
        self.until_reported = False  # due() has announced the half-open phase
        self.factor = 1
        self.cause = FailureReason.CONNECT
        self.probing = False
        self.saturated_until: float | None = None
        self.ticket: Attempt | None = None  # the epoch's shared non-probe ticket

    @property
    def ejected(self) -> bool:
        return self.ejected_at is not None


class OutlierTracker:
    """Consecutive failures, ejections, half-open probes and 429 saturation per provider.

    Every method takes ``now`` from one monotonic clock.  State exists only
    for provider ids the caller passes in (configured providers); ``retain``
    drops the others after a refresh.
    """

    def __init__(self, policy: EjectionPolicy | None = None) -> None:
        self.policy = policy if policy is not None else EjectionPolicy()
        self._states: dict[str, _State] = {}
        self._epochs = itertools.count(1)

    # ------------------------------------------------------------------ queries

    def is_choosable(self, provider_id: str, now: float) -> bool:
        """May a request be sent to this provider now (as one of several candidates)?"""
        s = self._states.get(provider_id)
        if s is None:
            return True
        if s.saturated_until is not None and now < s.saturated_until:
            return False
        return not s.ejected or (not s.probing and now >= s.until)

    def is_ejected(self, provider_id: str) -> bool:
        """True from the ejection until its probe (or a health probe) ends it."""
        s = self._states.get(provider_id)
        return s is not None and s.ejected

    def ejection(self, provider_id: str, now: float) -> EjectionStatus | None:
        """The provider's ejection, or None when it is not ejected."""
        s = self._states.get(provider_id)
        if s is None or s.ejected_at is None:
            return None
        return EjectionStatus(
            since=s.ejected_at,
            until=s.until,
            cause=s.cause,
            factor=s.factor,
            half_open=now >= s.until,
            probing=s.probing,
        )

    def saturated_until(self, provider_id: str, now: float) -> float | None:
        """When the provider's 429 saturation ends, or None when it is not saturated."""
        s = self._states.get(provider_id)
        if s is None or s.saturated_until is None or now >= s.saturated_until:
            return None
        return s.saturated_until

    def last_resort(self, provider_ids: Sequence[str], now: float) -> str | None:
        """Which candidate to try when none is choosable (never a dead end by ejection alone).

        In order: a choosable one; the saturated one whose saturation ends
        first; the ejected one ejected longest ago (one whose probe is running
        last).  Ties go to the earlier id in ``provider_ids``; None only when
        it is empty.
        """
        best: str | None = None
        best_rank: tuple[int, float] = (0, 0.0)
        for pid in provider_ids:
            rank = self._exclusion_rank(pid, now)
            if best is None or rank < best_rank:
                best, best_rank = pid, rank
        return best

    def next_change(self, now: float) -> float | None:
        """The earliest time after which ``due`` will report something, or None.

        May be ``<= now`` when something is already due.
        """
        times: list[float] = []
        for s in self._states.values():
            if s.ejected and not s.probing and not s.until_reported:
                times.append(s.until)
            if s.saturated_until is not None:
                times.append(s.saturated_until)
        return min(times) if times else None

    def due(self, now: float) -> list[str]:
        """Providers that became choosable by time since the last call, in id order.

        An ejection that ran out (half-open now) or a saturation that ended is
        reported once; the caller re-examines the waiters of those providers.
        """
        out: list[str] = []
        for pid, s in self._states.items():
            changed = False
            if s.saturated_until is not None and now >= s.saturated_until:
                s.saturated_until = None
                changed = True
            if s.ejected and not s.probing and not s.until_reported and now >= s.until:
                s.until_reported = True
                changed = True
            if changed:
                out.append(pid)
        return sorted(out)

    # ----------------------------------------------------------------- attempts

    def attempt_started(self, provider_id: str, now: float) -> Attempt:
        """A request was sent to ``provider_id``: the ticket for its result.

        The first attempt on an ejected provider (after expiry, or as a last
        resort) is its probe; the provider is not choosable while it runs.
        """
        s = self._state(provider_id)
        if s.ejected and not s.probing:
            s.probing = True
            s.epoch = next(self._epochs)  # each probe its own epoch: an earlier one is stale
            return Attempt(provider_id, s.epoch, probe=True)
        # Non-probe tickets of one epoch are equal: share one (admission is hot).
        ticket = s.ticket
        if ticket is None or ticket.epoch != s.epoch:
            ticket = s.ticket = Attempt(provider_id, s.epoch, probe=False)
        return ticket

    def attempt_succeeded(self, attempt: Attempt, now: float) -> Transition | None:
        """The attempt worked (a caller's 4xx counts as working): the failure streak restarts."""
        s = self._current(attempt)
        if s is None:
            return None
        if s.ejected:
            if not attempt.probe:
                return None
            self._close(s)
            return Transition.RESTORED
        self._restart_streak(s)
        return None

    def attempt_failed(
        self, attempt: Attempt, reason: FailureReason, now: float, *, principal: str = ""
    ) -> Transition | None:
        """The attempt failed (retried or not).  ``EJECTED`` when this failure ejected it.

        ``principal``: whose request it was (``""`` is one principal like any
        other).  Only two principals' failures eject (``EjectionPolicy.principals``);
        a probe's failure ejects again whoever sent it: one request decides it.
        """
        if reason is FailureReason.STATUS_429:
            raise ValueError("a 429 is not a failure: use attempt_saturated")
        s = self._current(attempt)
        if s is None:
            return None
        if s.ejected:
            if not attempt.probe:
                return None
            self._eject(s, reason, now, factor=min(s.factor * 2, MAX_FACTOR))
            return Transition.EJECTED
        s.failures += 1
        if reason is not FailureReason.CONNECT:
            s.last_non_connect = reason
        if s.first_principal is None:
            s.first_principal = principal
        elif principal != s.first_principal:
            s.mixed = True
        if not self.policy.enabled or s.failures < self.policy.after_failures:
            return None
        if self.policy.principals > 1 and not s.mixed and s.last_non_connect is not None:
            return None  # one principal's streak: it may be that caller's doing
        cause = FailureReason.CONNECT if s.last_non_connect is None else s.last_non_connect
        self._eject(s, cause, now, factor=1)
        return Transition.EJECTED

    def attempt_saturated(
        self, attempt: Attempt, now: float, seconds: float = SATURATION_DEFAULT_SECONDS
    ) -> Transition | None:
        """The provider answered 429: not chosen for ``seconds`` (bounded); not a failure.

        A probe that gets a 429 decides nothing: the half-open slot is free
        again once the saturation ends.
        """
        s = self._states.get(attempt.provider_id)
        if s is None:
            return None
        if attempt.probe and attempt.epoch == s.epoch and s.probing:
            s.probing = False
        seconds = min(max(seconds, 0.0), SATURATION_MAX_SECONDS)
        if not seconds > 0:
            return None
        until = now + seconds
        if s.saturated_until is None or until > s.saturated_until:
            s.saturated_until = until
        return Transition.SATURATED

    def attempt_caller_credentialed(self, attempt: Attempt) -> Transition | None:
        """The provider answered an error status to a request that carried the
        caller's own provider credential: that answer is about the caller's key
        (its quota, its rights), not the provider, so it is neither a failure
        nor a saturation and leaves the streak as it was.  A probe answered so
        decides nothing: the half-open slot is free again (``PROBE_RELEASED``),
        as for an attempt that ended without a verdict.
        """
        return self.attempt_abandoned(attempt)

    def attempt_abandoned(self, attempt: Attempt) -> Transition | None:
        """The attempt ended without a verdict (caller gone, deadline): only a probe matters."""
        s = self._current(attempt)
        if s is None or not attempt.probe or not s.probing:
            return None
        s.probing = False
        return Transition.PROBE_RELEASED

    def health_probe_succeeded(self, provider_id: str) -> Transition | None:
        """The node's health probe passed: ends an ejection caused by connect failures only.

        A provider can answer its health probe while its completions fail, so
        any other ejection waits for its own half-open probe.
        """
        s = self._states.get(provider_id)
        if s is None or not s.ejected or s.cause is not FailureReason.CONNECT:
            return None
        self._close(s)
        return Transition.RESTORED

    # ------------------------------------------------------------- configuration

    def set_policy(self, policy: EjectionPolicy) -> list[str]:
        """A config refresh.  Turning ejection off ends every ejection: those ids are returned.

        Otherwise running ejections keep their end; the new values apply to
        the next failure (a streak already at a lowered threshold ejects then).
        """
        self.policy = policy
        if policy.enabled:
            return []
        restored = sorted(pid for pid, s in self._states.items() if s.ejected)
        for pid in restored:
            self._close(self._states[pid])
        return restored

    def retain(self, provider_ids: Iterable[str]) -> None:
        """Forget every provider not in ``provider_ids`` (removed by a refresh)."""
        keep = set(provider_ids)
        for pid in [p for p in self._states if p not in keep]:
            del self._states[pid]

    # ------------------------------------------------------------------ internals

    def _state(self, provider_id: str) -> _State:
        s = self._states.get(provider_id)
        if s is None:
            s = self._states[provider_id] = _State(next(self._epochs))
        return s

    def _current(self, attempt: Attempt) -> _State | None:
        """The provider's state if the attempt belongs to its current epoch, else None."""
        s = self._states.get(attempt.provider_id)
        if s is None or s.epoch != attempt.epoch:
            return None
        return s

    def _eject(self, s: _State, cause: FailureReason, now: float, *, factor: int) -> None:
        s.epoch = next(self._epochs)
        s.ejected_at = now
        s.factor = factor
        s.until = now + self.policy.seconds * factor
        s.until_reported = False
        s.cause = cause
        s.probing = False
        self._restart_streak(s)

    def _close(self, s: _State) -> None:
        s.epoch = next(self._epochs)
        s.ejected_at = None
        s.factor = 1
        s.probing = False
        self._restart_streak(s)

    @staticmethod
    def _restart_streak(s: _State) -> None:
        s.failures = 0
        s.last_non_connect = None
        s.first_principal = None
        s.mixed = False

    def _exclusion_rank(self, provider_id: str, now: float) -> tuple[int, float]:
        if self.is_choosable(provider_id, now):
            return (0, 0.0)
        s = self._states[provider_id]
        if s.ejected_at is None:
            assert s.saturated_until is not None
            return (1, s.saturated_until)
        return (3 if s.probing else 2, s.ejected_at)


def health_display(*, connected: bool, ejected: bool, health: str) -> str:
    """The ``health`` a provider shows in ``/status``: ``disconnected`` > ``ejected`` > probe.

    ``health`` is the node's probe result (``unknown``, ``healthy``,
    ``unhealthy``).  A provider whose node is not connected shows
    ``disconnected`` whatever else holds; an ejected one ``ejected`` even when
    its probe says healthy (that is the point of passive ejection).
    """
    if not connected:
        return "disconnected"
    if ejected:
        return "ejected"
    return health


def saturation_seconds(
    retry_after: str | bytes | None,
    *,
    wall_now: float | None = None,
    default: float = SATURATION_DEFAULT_SECONDS,
) -> float:
    """Seconds a 429's ``Retry-After`` asks for, within ``[0, SATURATION_MAX_SECONDS]``.

    Accepts delta-seconds (``"2"``, also a decimal ``"1.5"``) and, when
    ``wall_now`` (Unix time) is given, an HTTP-date.  Anything else -- absent,
    empty, too long, malformed -- gives ``default``.  The provider's value is
    never trusted beyond the bound.
    """
    if retry_after is None:
        return default
    if isinstance(retry_after, bytes):
        retry_after = retry_after.decode("latin-1")
    text = retry_after.strip()
    if not text or len(text) > _RETRY_AFTER_MAX_CHARS:
        return default
    seconds: float
    if all(c.isdigit() or c == "." for c in text) and text.isascii() and text.count(".") <= 1:
        if text == ".":
            return default
        seconds = float(text)
    elif wall_now is not None:
        try:
            when = parsedate_to_datetime(text)
            if when.tzinfo is None:  # "-0000": an HTTP-date is always GMT
                when = when.replace(tzinfo=datetime.UTC)
            seconds = when.timestamp() - wall_now
        except (TypeError, ValueError, IndexError, OverflowError):
            return default
    else:
        return default
    if math.isnan(seconds):
        return default
    return min(max(seconds, 0.0), SATURATION_MAX_SECONDS)
