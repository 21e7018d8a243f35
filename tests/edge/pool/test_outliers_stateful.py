"""Stateful property test of the outlier tracker against a naive reference model.

Hypothesis drives the tracker through random attempts (started, then
succeeded, failed with any reason by one of a few principals, saturated by
a 429, answered to the caller's own credential, or abandoned, in any
order), clock steps, health probes, policy refreshes and providers removed
by a refresh.  A deliberately plain reference -- the failure streak as a
list, outstanding tickets as sets that an ejection or its end empties --
predicts every returned transition, and after every step the two are
compared on every query: choosable, ejected, ejection status, saturation,
last resort, next change and due.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iopd.edge.pool.outliers import (
    MAX_FACTOR,
    SATURATION_MAX_SECONDS,
    Attempt,
    EjectionPolicy,
    OutlierTracker,
    Transition,
)
from iopd.edge.pool.retry_rules import FailureReason

PIDS = ["p0", "p1", "p2"]
#: Who sent an attempt ("" is the anonymous caller, one principal like the others).
CALLERS = ["", "alice", "bob"]
FAILURES = [r for r in FailureReason if r is not FailureReason.STATUS_429]
POLICIES = st.builds(
    EjectionPolicy,
    after_failures=st.sampled_from([0, 1, 2, 3]),
    seconds=st.sampled_from([1.0, 2.5, 10.0]),
    principals=st.sampled_from([1, 2]),
)


@dataclass
class RefProvider:
    """One provider, spelled out: no epochs, just which tickets still count."""

    streak: list[tuple[FailureReason, str]] = field(default_factory=list)  # (reason, principal)
    ejected_at: float | None = None
    until: float = 0.0
    factor: int = 1
    cause: FailureReason = FailureReason.CONNECT
    probe: int | None = None  # the running probe's ticket
    closed_tickets: set[int] = field(default_factory=set)  # tickets whose result counts
    reported: bool = False  # due() announced the expiry
    saturated_until: float | None = None


@dataclass
class Reference:
    policy: EjectionPolicy
    providers: dict[str, RefProvider] = field(default_factory=dict)

    def choosable(self, pid: str, now: float) -> bool:
        p = self.providers.get(pid)
        if p is None:
            return True
        if p.saturated_until is not None and now < p.saturated_until:
            return False
        return p.ejected_at is None or (p.probe is None and now >= p.until)

    def start(self, pid: str, ticket: int) -> bool:
        p = self.providers.setdefault(pid, RefProvider())
        if p.ejected_at is not None:
            if p.probe is None:
                p.probe = ticket
                return True
            return False
        p.closed_tickets.add(ticket)
        return False

    def eject(self, p: RefProvider, cause: FailureReason, now: float, factor: int) -> None:
        p.ejected_at, p.factor, p.cause = now, factor, cause
        p.until = now + self.policy.seconds * factor
        p.probe, p.reported, p.streak = None, False, []
        p.closed_tickets.clear()

    def close(self, p: RefProvider) -> None:
        p.ejected_at, p.factor, p.probe, p.streak = None, 1, None, []
        p.closed_tickets.clear()

    def succeed(self, pid: str, ticket: int) -> Transition | None:
        p = self.providers.get(pid)
        if p is None:
            return None
        if ticket == p.probe:
            self.close(p)
            return Transition.RESTORED
        if ticket in p.closed_tickets:
            p.streak = []
        return None

    def fail(
        self, pid: str, ticket: int, reason: FailureReason, now: float, principal: str
    ) -> Transition | None:
        p = self.providers.get(pid)
        if p is None:
            return None
        if ticket == p.probe:
            self.eject(p, reason, now, min(p.factor * 2, MAX_FACTOR))
            return Transition.EJECTED
        if ticket not in p.closed_tickets:
            return None
        p.streak.append((reason, principal))
        if self.policy.after_failures == 0 or len(p.streak) < self.policy.after_failures:
            return None
        others = [r for r, _ in p.streak if r is not FailureReason.CONNECT]
        who = {w for _, w in p.streak}
        if self.policy.principals > 1 and len(who) < 2 and others:
            return None  # one principal's streak (unless it never reached the provider)
        self.eject(p, others[-1] if others else FailureReason.CONNECT, now, 1)
        return Transition.EJECTED

    def saturate(self, pid: str, ticket: int, now: float, seconds: float) -> Transition | None:
        p = self.providers.get(pid)
        if p is None:
            return None
        if ticket == p.probe:
            p.probe = None
        seconds = min(seconds, SATURATION_MAX_SECONDS)
        if seconds <= 0:
            return None
        p.saturated_until = max(p.saturated_until or 0.0, now + seconds)
        return Transition.SATURATED

    def caller_credentialed(self, pid: str, ticket: int) -> Transition | None:
        """About the caller's key: only a running probe hears of it (its slot frees)."""
        return self.abandon(pid, ticket)

    def abandon(self, pid: str, ticket: int) -> Transition | None:
        p = self.providers.get(pid)
        if p is None or ticket != p.probe:
            return None
        p.probe = None
        return Transition.PROBE_RELEASED

    def health_ok(self, pid: str) -> Transition | None:
        p = self.providers.get(pid)
        if p is None or p.ejected_at is None or p.cause is not FailureReason.CONNECT:
            return None
        self.close(p)
        return Transition.RESTORED

    def rank(self, pid: str, now: float) -> tuple[int, float]:
        if self.choosable(pid, now):
            return (0, 0.0)
        p = self.providers[pid]
        if p.ejected_at is None:
            assert p.saturated_until is not None
            return (1, p.saturated_until)
        return (3 if p.probe is not None else 2, p.ejected_at)

    def next_change(self) -> float | None:
        times = [
            p.until
            for p in self.providers.values()
            if p.ejected_at is not None and p.probe is None and not p.reported
        ]
        times += [
            p.saturated_until for p in self.providers.values() if p.saturated_until is not None
        ]
        return min(times) if times else None

    def due(self, now: float) -> list[str]:
        out = []
        for pid, p in self.providers.items():
            changed = False
            if p.saturated_until is not None and now >= p.saturated_until:
                p.saturated_until, changed = None, True
            if p.ejected_at is not None and p.probe is None and not p.reported and now >= p.until:
                p.reported, changed = True, True
            if changed:
                out.append(pid)
        return sorted(out)


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        policy = EjectionPolicy(after_failures=2, seconds=10.0, principals=2)
        self.tracker = OutlierTracker(policy)
        self.ref = Reference(policy)
        self.now = 0.0
        self.outstanding: dict[int, Attempt] = {}  # ticket id -> the tracker's ticket
        self.next_ticket = 0

    # -- attempts

    @rule(pid=st.sampled_from(PIDS))
    def start(self, pid: str) -> None:
        ident = self.next_ticket
        self.next_ticket += 1
        attempt = self.tracker.attempt_started(pid, self.now)
        assert attempt.probe == self.ref.start(pid, ident)
        if attempt.probe:
            event("probe started")
        self.outstanding[ident] = attempt

    def take(self, data: st.DataObject) -> tuple[int, Attempt]:
        ident = data.draw(st.sampled_from(sorted(self.outstanding)))
        return ident, self.outstanding.pop(ident)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def succeed(self, data: st.DataObject) -> None:
        ident, attempt = self.take(data)
        got = self.tracker.attempt_succeeded(attempt, self.now)
        assert got == self.ref.succeed(attempt.provider_id, ident)
        if got is Transition.RESTORED:
            event("probe success restored a provider")

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), reason=st.sampled_from(FAILURES), who=st.sampled_from(CALLERS))
    def fail(self, data: st.DataObject, reason: FailureReason, who: str) -> None:
        ident, attempt = self.take(data)
        got = self.tracker.attempt_failed(attempt, reason, self.now, principal=who)
        assert got == self.ref.fail(attempt.provider_id, ident, reason, self.now, who)
        if got is Transition.EJECTED:
            status = self.tracker.ejection(attempt.provider_id, self.now)
            assert status is not None
            event(f"ejected at factor {status.factor}")

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), seconds=st.sampled_from([0.0, 0.5, 1.0, 3.0, 1000.0]))
    def saturate(self, data: st.DataObject, seconds: float) -> None:
        ident, attempt = self.take(data)
        got = self.tracker.attempt_saturated(attempt, self.now, seconds)
        assert got == self.ref.saturate(attempt.provider_id, ident, self.now, seconds)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def caller_credentialed(self, data: st.DataObject) -> None:
        ident, attempt = self.take(data)
        got = self.tracker.attempt_caller_credentialed(attempt)
        assert got == self.ref.caller_credentialed(attempt.provider_id, ident)
        if got is Transition.PROBE_RELEASED:
            event("a probe answered to the caller's credential freed its slot")

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        ident, attempt = self.take(data)
        assert self.tracker.attempt_abandoned(attempt) == self.ref.abandon(
            attempt.provider_id, ident
        )

    @rule(
        pid=st.sampled_from(PIDS),
        n=st.integers(1, 3),
        reason=st.sampled_from(FAILURES),
        who=st.lists(st.sampled_from(CALLERS), min_size=1, max_size=2),
    )
    def failing_burst(self, pid: str, n: int, reason: FailureReason, who: list[str]) -> None:
        """Failures come in runs (from one principal, or two taking turns): the ones that eject."""
        for i in range(n):
            self.start(pid)
            ident = self.next_ticket - 1
            attempt = self.outstanding.pop(ident)
            caller = who[i % len(who)]
            got = self.tracker.attempt_failed(attempt, reason, self.now, principal=caller)
            assert got == self.ref.fail(pid, ident, reason, self.now, caller)
            if got is None and n >= self.ref.policy.after_failures > 0 and len(set(who)) == 1:
                event("one principal's streak did not eject")

    @rule(
        pid=st.sampled_from(PIDS),
        outcome=st.sampled_from(["ok", "fail", "429", "own_key", "none"]),
    )
    def probe_cycle(self, pid: str, outcome: str) -> None:
        """Wait for an ejection to run out, then send one request and settle it at once."""
        p = self.ref.providers.get(pid)
        if p is not None and p.ejected_at is not None:
            self.now = max(self.now, p.until)
        self.start(pid)
        ident = self.next_ticket - 1
        attempt = self.outstanding.pop(ident)
        if outcome == "ok":
            got = self.tracker.attempt_succeeded(attempt, self.now)
            assert got == self.ref.succeed(pid, ident)
            if got is Transition.RESTORED:
                event("probe success restored a provider")
        elif outcome == "fail":
            got = self.tracker.attempt_failed(attempt, FailureReason.CONNECT, self.now)
            assert got == self.ref.fail(pid, ident, FailureReason.CONNECT, self.now, "")
            if got is Transition.EJECTED and attempt.probe:
                status = self.tracker.ejection(pid, self.now)
                assert status is not None
                event(f"probe failure ejected again at factor {status.factor}")
        elif outcome == "429":
            got = self.tracker.attempt_saturated(attempt, self.now, 1.0)
            assert got == self.ref.saturate(pid, ident, self.now, 1.0)
        elif outcome == "own_key":
            got = self.tracker.attempt_caller_credentialed(attempt)
            assert got == self.ref.caller_credentialed(pid, ident)
        else:
            assert self.tracker.attempt_abandoned(attempt) == self.ref.abandon(pid, ident)

    # -- the world

    @rule(step=st.sampled_from([0.0, 0.25, 1.0, 2.5, 7.0, 30.0]))
    def tick(self, step: float) -> None:
        self.now += step

    @rule()
    def due(self) -> None:
        assert self.tracker.next_change(self.now) == self.ref.next_change()
        got = self.tracker.due(self.now)
        assert got == self.ref.due(self.now)
        if got:
            event("due reported a provider")

    @rule(pid=st.sampled_from(PIDS))
    def health_probe_ok(self, pid: str) -> None:
        got = self.tracker.health_probe_succeeded(pid)
        assert got == self.ref.health_ok(pid)
        if got is not None:
            event("health probe ended a connect ejection")

    @rule(policy=POLICIES)
    def refresh(self, policy: EjectionPolicy) -> None:
        got = self.tracker.set_policy(policy)
        self.ref.policy = policy
        expected = []
        if policy.after_failures == 0:
            expected = sorted(
                pid for pid, p in self.ref.providers.items() if p.ejected_at is not None
            )
            for pid in expected:
                self.ref.close(self.ref.providers[pid])
        assert got == expected

    @rule(keep=st.sets(st.sampled_from(PIDS)))
    def retain(self, keep: set[str]) -> None:
        self.tracker.retain(keep)
        for pid in [p for p in self.ref.providers if p not in keep]:
            del self.ref.providers[pid]

    # -- invariants

    @invariant()
    def queries_agree(self) -> None:
        now = self.now
        for pid in PIDS:
            assert self.tracker.is_choosable(pid, now) == self.ref.choosable(pid, now), pid
            p = self.ref.providers.get(pid)
            ejected = p is not None and p.ejected_at is not None
            assert self.tracker.is_ejected(pid) == ejected
            status = self.tracker.ejection(pid, now)
            if not ejected:
                assert status is None
            else:
                assert p is not None and status is not None
                assert (status.since, status.until, status.cause, status.factor) == (
                    p.ejected_at,
                    p.until,
                    p.cause,
                    p.factor,
                )
                assert status.half_open == (now >= p.until)
                assert status.probing == (p.probe is not None)
                assert 1 <= status.factor <= MAX_FACTOR
            sat = p.saturated_until if p is not None else None
            expected_sat = sat if sat is not None and now < sat else None
            assert self.tracker.saturated_until(pid, now) == expected_sat

    @invariant()
    def last_resort_agrees_and_is_never_a_dead_end(self) -> None:
        for subset in (PIDS, PIDS[:2], PIDS[1:], list(reversed(PIDS))):
            got = self.tracker.last_resort(subset, self.now)
            expected = min(subset, key=lambda pid: self.ref.rank(pid, self.now))
            assert got == expected
            if not any(self.ref.choosable(pid, self.now) for pid in subset):
                event("last resort used")

    @invariant()
    def next_change_agrees(self) -> None:
        assert self.tracker.next_change(self.now) == self.ref.next_change()

    @invariant()
    def memory_is_bounded_by_the_providers(self) -> None:
        assert set(self.tracker._states) <= set(PIDS)


TrackerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_tracker_matches_reference = TrackerMachine.TestCase
