"""Per-principal limits as pure synchronous logic: rates, token budgets, concurrency counts.

Why this module is shaped this way: like the pool's scheduler, every decision
is made here, synchronously, with no I/O and no clock read -- the caller
passes ``now`` (wall-clock seconds since the epoch, because the day budget
follows the calendar day in UTC).  Time never runs backwards inside the
limiter: a ``now`` older than one already seen is taken as that one, so a
clock stepped back cannot make a window forget what it counted.

The rules, exactly:

* A request is **admitted** against a :class:`Reservation` (input estimate
  plus ``n`` x its maximum output).  Admission checks every limit in force
  and records the request in all of them at once, or in none.  Admission
  never takes a window over its limit.  A request that set no maximum
  output holds its reservation cut to the room the token windows have left
  (down to its input estimate, ``limit_decisions.cut_to_room``): it waits
  only while even its input does not fit.
* **Requests per minute** is a sliding log of admission times; a request
  counts at its admission, once, for 60 s (the window is ``(now - 60, now]``).
  Retries and fallbacks hold the same :class:`Admission`, so they never
  count again.
* **Tokens per minute** is a sliding log of ``(time, amount)`` entries.  At
  admission an entry of the reservation is stamped with the admission time.
  At settlement with the metered usage ``used``: when ``used`` is below the
  reservation the entry shrinks to ``used`` (the difference is returned at
  once, as long as the entry is still in the window); when ``used`` exceeds
  it, the overshoot ``used - reserved`` is **debt**: a new entry stamped with
  the settlement time, so it counts against the full minute after the
  request ended.  Only debt can take a window over its limit; while it does,
  nothing more is admitted.
* **Tokens per day** is a counter for the current UTC day.  The reservation
  is added at admission; settlement on the same day adds ``used - reserved``
  (either sign), on a later day only the overshoot (the admission day is
  closed).  At each UTC midnight the part of the closed day's total above
  ``tokens_per_day`` is carried into the new day as debt (a day with the
  limit off carries nothing).
* **Concurrency** is a counter of admissions that ``started`` and have not
  ``finished``; the pool asks :meth:`PrincipalLimiter.can_start` before it
  grants a slot, so waiting happens in the pool's queue, never here.
* ``0`` means unlimited, but usage is recorded all the same, so a limit set
  by a refresh applies at once to the minute and the day already under way.

Memory: per principal, the request log holds one timestamp per request
admitted in the last 60 s (at most ``requests_per_minute`` when that is set);
the token log one entry per request admitted, plus one per request that
ended with debt, in the last 60 s.  Principals come from the config (plus
the unmapped caller), and a principal's state is dropped as soon as it is
idle (:meth:`PrincipalLimiter.forget_idle`), which changes nothing it would
decide.  Every call is O(1) amortized except a rejection, whose
``Retry-After`` scan is capped at :data:`RETRY_SCAN_LIMIT` entries.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from iopd.config.schema import LimitsSection
from iopd.edge.principals.decisions import (
    Limits,
    NeverFits,
    PrincipalStatus,
    Rejection,
    Settlement,
    WindowStatus,
    cut_to_room,
    headers_of,
    limits_from_config,
    reserved_tokens,
    settled_tokens,
    window_status,
)
from iopd.edge.principals.ratelimit_headers import format_reset
from iopd.edge.principals.reservation import Reservation
from iopd.vocabulary import LimitName

__all__ = [
    "DAY_S",
    "RETRY_SCAN_LIMIT",
    "WINDOW_S",
    "Admission",
    "LimitName",
    "Limits",
    "NeverFits",
    "PrincipalLimiter",
    "PrincipalStatus",
    "Rejection",
    "Settlement",
    "WindowStatus",
    "format_reset",
    "headers_of",
    "limits_from_config",
    "reserved_tokens",
    "window_status",
]

WINDOW_S = 60.0
DAY_S = 86_400
#: Token-log entries a rejection examines for an exact ``Retry-After``; past
#: that it answers with the time the whole log has expired (always enough).
RETRY_SCAN_LIMIT = 64


# ------------------------------------------------------------------ results


@dataclass(eq=False)
class Admission:
    """An admitted request.  Held once for the request's whole life (retries included)."""

    principal_ref: str
    reserved_tokens: int
    admitted_at: float
    _state: _PrincipalState = field(repr=False)
    _day: int = field(repr=False)
    _entry: _TokenEntry | None = field(repr=False)
    running: bool = False
    settled: bool = False


# ------------------------------------------------------------------ state


class _TokenEntry:
    __slots__ = ("amount", "live", "stamp")

    def __init__(self, stamp: float, amount: int) -> None:
        self.stamp = stamp
        self.amount = amount
        self.live = True


class _TokenLog:
    """Sliding log of (time, tokens); ``total`` is the sum of the live entries."""

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: deque[_TokenEntry] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        entries = self.entries
        while entries and now - entries[0].stamp >= WINDOW_S:
            e = entries.popleft()
            e.live = False
            self.total -= e.amount

    def add(self, stamp: float, amount: int) -> _TokenEntry | None:
        if amount <= 0:
            return None
        e = _TokenEntry(stamp, amount)
        self.entries.append(e)
        self.total += amount
        return e

    def shrink(self, e: _TokenEntry, to: int) -> int:
        """Cut a live entry down to ``to`` tokens; returns how many were given back."""
        if not e.live or to >= e.amount:
            return 0
        back = e.amount - to
        e.amount = to
        self.total -= back
        return back

    def wait_until_room(self, room: int, now: float) -> float:
        """Seconds until at most ``room`` tokens are in the window, if nothing else changes."""
        excess = self.total - room
        if excess <= 0:
            return 0.0
        for i, e in enumerate(self.entries):
            if i >= RETRY_SCAN_LIMIT:
                break
            excess -= e.amount
            if excess <= 0:
                return e.stamp + WINDOW_S - now
        return self.entries[-1].stamp + WINDOW_S - now


class _PrincipalState:
    """What one principal has used; every field returns to zero when it is idle."""

    __slots__ = ("admitted", "day", "day_total", "requests", "running", "tokens")

    def __init__(self, day: int) -> None:
        self.requests: deque[float] = deque()
        self.tokens = _TokenLog()
        self.day = day
        self.day_total = 0
        self.admitted = 0
        self.running = 0

    def advance(self, now: float, tokens_per_day: int) -> None:
        """Drop what left the minute windows; roll the day over with its carried debt."""
        requests = self.requests
        while requests and now - requests[0] >= WINDOW_S:
            requests.popleft()
        self.tokens.expire(now)
        today = _day_of(now)
        if today != self.day:
            days = today - self.day
            if tokens_per_day > 0:
                self.day_total = max(0, self.day_total - days * tokens_per_day)
            else:
                self.day_total = 0
            self.day = today

    def idle(self) -> bool:
        return not (
            self.requests or self.tokens.entries or self.day_total or self.admitted or self.running
        )


def _day_of(now: float) -> int:
    return int(now // DAY_S)


# ------------------------------------------------------------------ the limiter


class PrincipalLimiter:
    """Admission, settlement and concurrency counts for every principal (see the module doc)."""

    def __init__(self, section: LimitsSection | None = None, now: float = 0.0) -> None:
        self._now = now
        self._default = Limits()
        self._limits: dict[str, Limits] = {}
        self._states: dict[str, _PrincipalState] = {}
        self.apply_config(section if section is not None else LimitsSection(), now)

    # ------------------------------------------------------------- config

    def apply_config(self, section: LimitsSection, now: float) -> None:
        """Swap the limits (refresh).  Counters are kept; a changed limit applies from now on.

        Every principal is first brought up to ``now`` under the limits it had,
        so a midnight that passed before the refresh carries debt by the old
        ``tokens_per_day``.  Idle principals are dropped.
        """
        now = self._clock(now)
        for ref, state in self._states.items():
            state.advance(now, self.limits_for(ref).tokens_per_day)
        self._default, self._limits = limits_from_config(section)
        self.forget_idle(now)

    def limits_for(self, principal_ref: str) -> Limits:
        """The limits in force for a principal (its own entry, else ``limits.default``)."""
        return self._limits.get(principal_ref, self._default)

    def share_of(self, principal_ref: str) -> int:
        """The principal's weight in the pool's fair queue."""
        return self.limits_for(principal_ref).share

    # ------------------------------------------------------------- admission

    def try_admit(
        self, principal_ref: str, reservation: Reservation, now: float
    ) -> Admission | Rejection | NeverFits:
        """Admit a request against every rate and budget at once, or say why not."""
        now = self._clock(now)
        limits = self.limits_for(principal_ref)
        tokens = reserved_tokens(principal_ref, limits, reservation)
        if isinstance(tokens, NeverFits):
            return tokens
        state = self._state(principal_ref, now, limits)
        tokens = cut_to_room(limits, reservation, tokens, state.tokens.total, state.day_total)
        rejection = self._over_limit(principal_ref, state, limits, tokens, now)
        if rejection is not None:
            return rejection
        state.requests.append(now)
        entry = state.tokens.add(now, tokens)
        state.day_total += tokens
        state.admitted += 1
        return Admission(principal_ref, tokens, now, state, state.day, entry)

    def _over_limit(
        self, ref: str, state: _PrincipalState, limits: Limits, tokens: int, now: float
    ) -> Rejection | None:
        """The limit that keeps this request out longest, or None when it fits all of them."""
        worst: Rejection | None = None
        for rejection in self._violations(ref, state, limits, tokens, now):
            if worst is None or rejection.retry_after_s > worst.retry_after_s:
                worst = rejection
        return worst

    def _violations(
        self, ref: str, state: _PrincipalState, limits: Limits, tokens: int, now: float
    ) -> Iterator[Rejection]:
        rpm = limits.requests_per_minute
        count = len(state.requests)
        if rpm and count + 1 > rpm:
            wait = state.requests[count - rpm] + WINDOW_S - now
            yield Rejection(ref, "requests_per_minute", rpm, count, 1, wait)
        tpm = limits.tokens_per_minute
        if tpm and state.tokens.total + tokens > tpm:
            wait = state.tokens.wait_until_room(tpm - tokens, now)
            yield Rejection(ref, "tokens_per_minute", tpm, state.tokens.total, tokens, wait)
        tpd = limits.tokens_per_day
        if tpd and state.day_total + tokens > tpd:
            # After k midnights the carried total is day_total - k * tpd.
            days = -(-(state.day_total + tokens - tpd) // tpd)
            wait = (state.day + days) * DAY_S - now
            yield Rejection(ref, "tokens_per_day", tpd, state.day_total, tokens, wait)

    def settle(
        self, admission: Admission, used_tokens: int | None, now: float, estimated: int = 0
    ) -> Settlement:
        """End an admitted request with its metered usage (``None``: none metered,
        the larger of the reservation and ``estimated``, see ``settled_tokens``).

        Gives back its concurrency slot if it holds one.  Settling twice does
        nothing the second time.
        """
        now = self._clock(now)
        if admission.settled:
            return Settlement(0, 0, False)
        freed = self.finished(admission)
        admission.settled = True
        state = admission._state
        state.admitted -= 1
        state.advance(now, self.limits_for(admission.principal_ref).tokens_per_day)
        reserved = admission.reserved_tokens
        used = settled_tokens(reserved, used_tokens, estimated)
        returned = 0
        if admission._entry is not None:
            returned = state.tokens.shrink(admission._entry, used)
        debt = max(0, used - reserved)
        state.tokens.add(now, debt)
        if state.day == admission._day:
            state.day_total += used - reserved
        else:
            state.day_total += debt
        self._drop_if_idle(admission.principal_ref, state)
        return Settlement(returned, debt, freed)

    def withdraw(self, admission: Admission, now: float) -> None:
        """Undo an admission as if it never happened (no live candidate: a 502
        before it counts).  After :meth:`settle`, or a second time, a no-op."""
        now = self._clock(now)
        if admission.settled:
            return
        self.finished(admission)
        admission.settled = True
        state = admission._state
        state.admitted -= 1
        try:
            state.requests.remove(admission.admitted_at)  # any equal stamp is as good
        except ValueError:
            pass  # already out of the window
        if admission._entry is not None:
            state.tokens.shrink(admission._entry, 0)
        if state.day == admission._day:
            state.day_total -= admission.reserved_tokens
        state.advance(now, self.limits_for(admission.principal_ref).tokens_per_day)
        self._drop_if_idle(admission.principal_ref, state)

    # ------------------------------------------------------------- concurrency

    def can_start(self, principal_ref: str) -> bool:
        """True when the principal may run one more request now (``max_concurrent``)."""
        limit = self.limits_for(principal_ref).max_concurrent
        state = self._states.get(principal_ref)
        return limit == 0 or (state.running if state is not None else 0) < limit

    def started(self, admission: Admission) -> None:
        """The request got its provider slot.  Idempotent; the pool checks ``can_start`` first."""
        if admission.running or admission.settled:
            return
        if not self.can_start(admission.principal_ref):
            raise RuntimeError("started() over max_concurrent: the pool must ask can_start()")
        admission.running = True
        admission._state.running += 1

    def finished(self, admission: Admission) -> bool:
        """The request gave its provider slot back; True when that freed a concurrency slot."""
        if not admission.running:
            return False
        admission.running = False
        admission._state.running -= 1
        return True

    # ------------------------------------------------------------- views

    def headers(self, principal_ref: str, now: float) -> list[tuple[str, str]]:
        """OpenAI's ``x-ratelimit-*`` headers for a principal, as things stand.

        Called right after an admission, ``remaining`` already counts it.
        The ``-tokens`` trio describes ``tokens_per_minute``, or
        ``tokens_per_day`` when only that is set.  A principal without rates
        or budgets gets none.
        """
        limits = self.limits_for(principal_ref)
        if not limits.rate_limited:
            return []
        return headers_of(self._status_of(principal_ref, now, limits))

    def status(self, now: float) -> dict[str, PrincipalStatus]:
        """Every configured or active principal, sorted by ref."""
        refs = sorted(self._limits.keys() | self._states.keys())
        return {ref: self._status_of(ref, now, self.limits_for(ref)) for ref in refs}

    def status_of(self, principal_ref: str, now: float) -> PrincipalStatus:
        """One principal's windows, as things stand (a blank view for an idle one)."""
        return self._status_of(principal_ref, now, self.limits_for(principal_ref))

    def forget_idle(self, now: float) -> list[str]:
        """Drop the state of idle principals (nothing in flight, windows and day empty)."""
        now = self._clock(now)
        dropped = []
        for ref, state in list(self._states.items()):
            state.advance(now, self.limits_for(ref).tokens_per_day)
            if self._drop_if_idle(ref, state):
                dropped.append(ref)
        return dropped

    # ------------------------------------------------------------- internals

    def _clock(self, now: float) -> float:
        if now > self._now:
            self._now = now
        return self._now

    def _state(self, ref: str, now: float, limits: Limits) -> _PrincipalState:
        state = self._states.get(ref)
        if state is None:
            state = self._states[ref] = _PrincipalState(_day_of(now))
        else:
            state.advance(now, limits.tokens_per_day)
        return state

    def _drop_if_idle(self, ref: str, state: _PrincipalState) -> bool:
        if state.idle() and self._states.get(ref) is state:
            del self._states[ref]
            return True
        return False

    def _status_of(self, ref: str, now: float, limits: Limits) -> PrincipalStatus:
        now = self._clock(now)
        state = self._states.get(ref)
        if state is None:
            state = _PrincipalState(_day_of(now))  # a blank view; not stored
        else:
            state.advance(now, limits.tokens_per_day)
        requests_reset = state.requests[-1] + WINDOW_S - now if state.requests else 0.0
        entries = state.tokens.entries
        tokens_reset = entries[-1].stamp + WINDOW_S - now if entries else 0.0
        tpd = limits.tokens_per_day
        day_reset = 0.0
        if state.day_total:
            days = max(1, -(-state.day_total // tpd)) if tpd else 1
            day_reset = (state.day + days) * DAY_S - now
        return PrincipalStatus(
            principal_ref=ref,
            limits=limits,
            in_flight=state.running,
            admitted=state.admitted,
            requests_per_minute=window_status(
                limits.requests_per_minute, len(state.requests), requests_reset
            ),
            tokens_per_minute=window_status(limits.tokens_per_minute, state.tokens.total, tokens_reset),
            tokens_per_day=window_status(tpd, state.day_total, day_reset),
        )
