"""Passive outlier ejection: one test per rule, under a fake clock (time is passed in)."""

from __future__ import annotations

import itertools

import pytest

from iopd.edge.pool.outliers import (
    MAX_FACTOR,
    SATURATION_MAX_SECONDS,
    Attempt,
    EjectionPolicy,
    EjectionStatus,
    OutlierTracker,
    Transition,
    health_display,
    saturation_seconds,
)
from iopd.edge.pool.retry_rules import FailureReason

R = FailureReason
POLICY = EjectionPolicy(after_failures=3, seconds=10.0)


def tracker(policy: EjectionPolicy = POLICY) -> OutlierTracker:
    return OutlierTracker(policy)


#: Callers take turns: the rules below are about streaks of several principals
#: (one principal's own streak has its own tests).
_CALLERS = itertools.cycle(["alice", "bob"])


def fail(
    t: OutlierTracker,
    pid: str,
    now: float,
    reason: R = R.STATUS_5XX,
    principal: str | None = None,
) -> Transition | None:
    who = next(_CALLERS) if principal is None else principal
    return t.attempt_failed(t.attempt_started(pid, now), reason, now, principal=who)


def succeed(t: OutlierTracker, pid: str, now: float) -> Transition | None:
    return t.attempt_succeeded(t.attempt_started(pid, now), now)


def status(t: OutlierTracker, pid: str, now: float) -> EjectionStatus:
    got = t.ejection(pid, now)
    assert got is not None, f"{pid} is not ejected"
    return got


def eject(t: OutlierTracker, pid: str, now: float, reason: R = R.STATUS_5XX) -> None:
    for _ in range(t.policy.after_failures - 1):
        assert fail(t, pid, now, reason) is None
    assert fail(t, pid, now, reason) is Transition.EJECTED


# ------------------------------------------------------------------ ejection


def test_ejected_after_n_consecutive_failures() -> None:
    t = tracker()
    assert fail(t, "p", 0.0) is None
    assert fail(t, "p", 0.0) is None
    assert t.is_choosable("p", 0.0)
    assert fail(t, "p", 1.0) is Transition.EJECTED
    assert not t.is_choosable("p", 1.0)
    status = t.ejection("p", 1.0)
    assert status is not None
    assert (status.since, status.until, status.cause, status.factor) == (1.0, 11.0, R.STATUS_5XX, 1)
    assert not status.half_open and not status.probing


def test_a_success_resets_the_count() -> None:
    t = tracker()
    fail(t, "p", 0.0)
    fail(t, "p", 0.0)
    assert succeed(t, "p", 0.0) is None
    fail(t, "p", 0.0)
    fail(t, "p", 0.0)
    assert t.is_choosable("p", 0.0) and not t.is_ejected("p")


def test_every_reason_counts_whether_retried_or_not() -> None:
    t = tracker(EjectionPolicy(after_failures=5, seconds=10.0))
    for reason in (R.CONNECT, R.RESET, R.TIMEOUT, R.STATUS_5XX):
        assert fail(t, "p", 0.0, reason) is None
    assert fail(t, "p", 0.0, R.RUN_ERROR) is Transition.EJECTED


def test_429_is_not_a_failure() -> None:
    t = tracker()
    fail(t, "p", 0.0)
    fail(t, "p", 0.0)
    a = t.attempt_started("p", 0.0)
    assert t.attempt_saturated(a, 0.0, 1.0) is Transition.SATURATED
    assert fail(t, "p", 2.0) is Transition.EJECTED  # the 429 neither counted nor reset
    with pytest.raises(ValueError):
        t.attempt_failed(t.attempt_started("q", 0.0), R.STATUS_429, 0.0)


def test_providers_are_independent() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    assert t.is_choosable("q", 0.0) and not t.is_ejected("q")
    assert t.ejection("q", 0.0) is None


def test_zero_disables_ejection() -> None:
    t = tracker(EjectionPolicy(after_failures=0, seconds=10.0))
    for _ in range(100):
        assert fail(t, "p", 0.0) is None
    assert t.is_choosable("p", 0.0)


def test_results_of_attempts_started_before_the_ejection_are_ignored() -> None:
    t = tracker()
    slow = [t.attempt_started("p", 0.0) for _ in range(4)]
    eject(t, "p", 1.0)
    assert t.attempt_failed(slow[0], R.STATUS_5XX, 2.0) is None  # does not extend it
    assert t.attempt_succeeded(slow[1], 2.0) is None  # does not end it
    assert status(t, "p", 2.0).until == 11.0
    # After the probe closed it, an old failure does not start a new streak.
    assert succeed(t, "p", 11.0) is Transition.RESTORED
    assert t.attempt_failed(slow[2], R.STATUS_5XX, 12.0) is None
    fail(t, "p", 12.0)
    fail(t, "p", 12.0)
    assert t.is_choosable("p", 12.0)  # two counted failures, not three


# ------------------------------------------------- who failed: one principal alone


def test_one_principals_streak_never_ejects_a_second_principal_does() -> None:
    t = tracker()
    for _ in range(20):  # far past eject_after_failures: still one caller's doing
        assert fail(t, "p", 0.0, principal="mallory") is None
    assert not t.is_ejected("p") and t.is_choosable("p", 0.0)
    assert fail(t, "p", 1.0, principal="alice") is Transition.EJECTED
    assert status(t, "p", 1.0).cause is R.STATUS_5XX


def test_every_failure_kind_needs_a_second_principal_but_connect() -> None:
    for reason in (R.RESET, R.TIMEOUT, R.STATUS_5XX, R.RUN_ERROR):
        t = tracker()
        for _ in range(5):
            assert fail(t, "p", 0.0, reason, principal="mallory") is None, reason
    t = tracker()
    # A request that never reached the provider cannot have caused its failure.
    assert fail(t, "p", 0.0, R.CONNECT, principal="mallory") is None
    assert fail(t, "p", 0.0, R.CONNECT, principal="mallory") is None
    assert fail(t, "p", 0.0, R.CONNECT, principal="mallory") is Transition.EJECTED
    assert status(t, "p", 0.0).cause is R.CONNECT


def test_a_connect_failure_does_not_vouch_for_one_principals_other_failures() -> None:
    t = tracker()
    assert fail(t, "p", 0.0, R.STATUS_5XX, principal="mallory") is None
    assert fail(t, "p", 0.0, R.CONNECT, principal="mallory") is None
    assert fail(t, "p", 0.0, R.STATUS_5XX, principal="mallory") is None
    assert fail(t, "p", 0.0, R.CONNECT, principal="mallory") is None
    assert not t.is_ejected("p")


def test_anonymous_callers_are_one_principal() -> None:
    t = tracker()
    for _ in range(4):
        assert fail(t, "p", 0.0, principal="") is None
    assert fail(t, "p", 0.0, principal="alice") is Transition.EJECTED


def test_a_success_forgets_who_failed() -> None:
    t = tracker()
    fail(t, "p", 0.0, principal="alice")
    fail(t, "p", 0.0, principal="bob")
    succeed(t, "p", 0.0)
    for _ in range(5):  # a new streak, bob's alone
        assert fail(t, "p", 0.0, principal="bob") is None
    assert fail(t, "p", 0.0, principal="alice") is Transition.EJECTED


def test_one_principal_is_enough_when_the_config_knows_only_one() -> None:
    t = tracker(EjectionPolicy(after_failures=3, seconds=10.0, principals=1))
    assert fail(t, "p", 0.0, principal="") is None
    assert fail(t, "p", 0.0, principal="") is None
    assert fail(t, "p", 0.0, principal="") is Transition.EJECTED


def test_principals_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="principals"):
        EjectionPolicy(principals=0)


def test_a_probe_failure_ejects_again_whoever_sent_it() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 10.0)
    assert probe.probe
    assert t.attempt_failed(probe, R.STATUS_5XX, 10.0, principal="mallory") is Transition.EJECTED


# ------------------------------------------------------- the caller's own credential


def test_an_answer_to_the_callers_credential_is_neither_failure_nor_saturation() -> None:
    t = tracker()
    fail(t, "p", 0.0, principal="alice")
    fail(t, "p", 0.0, principal="bob")
    for _ in range(10):
        assert t.attempt_caller_credentialed(t.attempt_started("p", 0.0)) is None
    assert t.is_choosable("p", 0.0) and t.saturated_until("p", 0.0) is None
    assert t.next_change(0.0) is None
    # The streak is as it was: neither reset nor lengthened.
    assert fail(t, "p", 0.0, principal="alice") is Transition.EJECTED


def test_a_probe_answered_to_the_callers_credential_decides_nothing() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 10.0)
    assert probe.probe and not t.is_choosable("p", 10.0)
    assert t.attempt_caller_credentialed(probe) is Transition.PROBE_RELEASED
    assert t.is_ejected("p") and t.is_choosable("p", 10.0)  # half-open again
    assert t.attempt_caller_credentialed(probe) is None  # once
    second = t.attempt_started("p", 10.0)
    assert second.probe
    assert t.attempt_succeeded(second, 10.0) is Transition.RESTORED


def test_a_stale_credentialed_verdict_is_ignored() -> None:
    t = tracker()
    slow = t.attempt_started("p", 0.0)
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 10.0)
    assert t.attempt_caller_credentialed(slow) is None
    assert status(t, "p", 10.0).probing  # the probe still holds the slot
    assert t.attempt_succeeded(probe, 10.0) is Transition.RESTORED


# ---------------------------------------------------------------- expiry, half-open


def test_half_open_at_expiry_lets_exactly_one_request_through() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    assert not t.is_choosable("p", 9.999)
    assert t.is_choosable("p", 10.0)
    probe = t.attempt_started("p", 10.0)
    assert probe.probe
    assert not t.is_choosable("p", 10.0)  # the probe is running
    assert not t.is_choosable("p", 1000.0)
    status = t.ejection("p", 10.0)
    assert status is not None and status.half_open and status.probing
    assert t.attempt_succeeded(probe, 12.0) is Transition.RESTORED
    assert t.is_choosable("p", 12.0) and t.ejection("p", 12.0) is None


def test_a_failed_probe_doubles_the_ejection_up_to_ten_times() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    now, factors = 10.0, []
    for _ in range(6):
        probe = t.attempt_started("p", now)
        assert probe.probe
        assert t.attempt_failed(probe, R.TIMEOUT, now) is Transition.EJECTED
        current = status(t, "p", now)
        assert current.since == now and current.cause is R.TIMEOUT
        assert current.until == now + 10.0 * current.factor
        factors.append(current.factor)
        assert not t.is_choosable("p", current.until - 0.001)
        now = current.until
    assert factors == [2, 4, 8, MAX_FACTOR, MAX_FACTOR, MAX_FACTOR]
    # Success ends it and the next ejection starts at 1x again.
    assert t.attempt_succeeded(t.attempt_started("p", now), now) is Transition.RESTORED
    eject(t, "p", now)
    assert status(t, "p", now).factor == 1


def test_an_abandoned_probe_frees_the_half_open_slot() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 10.0)
    assert t.attempt_abandoned(probe) is Transition.PROBE_RELEASED
    assert t.is_choosable("p", 10.0)
    assert t.attempt_abandoned(probe) is None  # once
    assert t.attempt_abandoned(t.attempt_started("q", 0.0)) is None  # not a probe


def test_an_earlier_probe_cannot_decide_a_later_one() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    first = t.attempt_started("p", 10.0)
    t.attempt_abandoned(first)
    second = t.attempt_started("p", 10.0)
    assert second.probe
    assert t.attempt_succeeded(first, 11.0) is None  # a late report of the abandoned probe
    assert status(t, "p", 11.0).probing
    assert t.attempt_failed(second, R.STATUS_5XX, 11.0) is Transition.EJECTED


def test_non_probe_attempts_during_the_probe_decide_nothing() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 10.0)
    extra = t.attempt_started("p", 10.0)  # a last resort while the probe runs
    assert not extra.probe
    assert t.attempt_succeeded(extra, 10.0) is None
    assert t.attempt_failed(extra, R.CONNECT, 10.0) is None
    assert t.attempt_abandoned(extra) is None
    assert status(t, "p", 10.0).probing
    assert t.attempt_failed(probe, R.CONNECT, 11.0) is Transition.EJECTED


def test_a_last_resort_on_a_still_ejected_provider_is_its_probe() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 3.0)  # before expiry: every candidate was ejected
    assert probe.probe
    assert t.attempt_succeeded(probe, 4.0) is Transition.RESTORED


# -------------------------------------------------------------------- health probe


def test_health_probe_ends_only_connect_ejections() -> None:
    t = tracker()
    eject(t, "c", 0.0, R.CONNECT)
    eject(t, "s", 0.0, R.STATUS_5XX)
    assert status(t, "c", 0.0).cause is R.CONNECT
    assert t.health_probe_succeeded("c") is Transition.RESTORED
    assert t.is_choosable("c", 0.0) and not t.is_ejected("c")
    assert t.health_probe_succeeded("s") is None
    assert t.is_ejected("s") and not t.is_choosable("s", 0.0)
    assert t.health_probe_succeeded("c") is None  # nothing left to end
    assert t.health_probe_succeeded("unknown") is None


def test_a_mixed_streak_is_not_a_connect_ejection() -> None:
    t = tracker()
    fail(t, "p", 0.0, R.STATUS_5XX)
    fail(t, "p", 0.0, R.CONNECT)
    assert fail(t, "p", 0.0, R.CONNECT) is Transition.EJECTED
    assert status(t, "p", 0.0).cause is R.STATUS_5XX
    assert t.health_probe_succeeded("p") is None


def test_a_reejection_takes_the_probe_failures_cause() -> None:
    t = tracker()
    eject(t, "p", 0.0, R.CONNECT)
    t.attempt_failed(t.attempt_started("p", 10.0), R.STATUS_5XX, 10.0)
    assert t.health_probe_succeeded("p") is None
    t2 = tracker()
    eject(t2, "p", 0.0, R.STATUS_5XX)
    t2.attempt_failed(t2.attempt_started("p", 10.0), R.CONNECT, 10.0)
    assert t2.health_probe_succeeded("p") is Transition.RESTORED


def test_health_probe_does_not_touch_a_closed_streak() -> None:
    t = tracker()
    fail(t, "p", 0.0, R.CONNECT)
    fail(t, "p", 0.0, R.CONNECT)
    assert t.health_probe_succeeded("p") is None
    assert fail(t, "p", 0.0, R.CONNECT) is Transition.EJECTED


# -------------------------------------------------------------------- saturation


def test_saturation_lasts_its_retry_after() -> None:
    t = tracker()
    a = t.attempt_started("p", 5.0)
    assert t.attempt_saturated(a, 5.0, 2.0) is Transition.SATURATED
    assert not t.is_choosable("p", 6.999)
    assert t.saturated_until("p", 6.0) == 7.0
    assert t.is_choosable("p", 7.0) and t.saturated_until("p", 7.0) is None
    assert not t.is_ejected("p")


def test_saturation_is_bounded() -> None:
    t = tracker()
    t.attempt_saturated(t.attempt_started("p", 0.0), 0.0, 1e9)
    assert t.saturated_until("p", 0.0) == SATURATION_MAX_SECONDS
    assert t.attempt_saturated(t.attempt_started("q", 0.0), 0.0, -5) is None
    assert t.attempt_saturated(t.attempt_started("q", 0.0), 0.0, float("nan")) is None
    assert t.is_choosable("q", 0.0)


def test_saturation_keeps_the_later_end() -> None:
    t = tracker()
    t.attempt_saturated(t.attempt_started("p", 0.0), 0.0, 5.0)
    t.attempt_saturated(t.attempt_started("p", 1.0), 1.0, 1.0)
    assert t.saturated_until("p", 1.0) == 5.0


def test_a_429_on_the_probe_frees_the_slot_after_the_saturation() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 10.0)
    assert t.attempt_saturated(probe, 10.0, 1.0) is Transition.SATURATED
    status = t.ejection("p", 10.0)
    assert status is not None and not status.probing  # still ejected, decided nothing
    assert not t.is_choosable("p", 10.5)
    assert t.is_choosable("p", 11.0)
    assert t.attempt_started("p", 11.0).probe


# ------------------------------------------------------------------ last resort


def test_last_resort_prefers_choosable_then_saturated_then_ejected_longest_ago() -> None:
    t = tracker()
    eject(t, "late", 5.0)
    eject(t, "early", 1.0)
    t.attempt_saturated(t.attempt_started("sat2", 0.0), 0.0, 3.0)
    t.attempt_saturated(t.attempt_started("sat1", 0.0), 0.0, 2.0)
    assert t.last_resort(["late", "early", "sat2", "sat1", "ok"], 1.5) == "ok"
    assert t.last_resort(["late", "early", "sat2", "sat1"], 1.5) == "sat1"
    assert t.last_resort(["late", "early"], 6.0) == "early"
    assert t.last_resort(["late", "early"], 11.0) == "early"  # half-open: choosable again
    assert t.last_resort([], 0.0) is None


def test_last_resort_is_never_a_dead_end() -> None:
    t = tracker()
    for pid in ("a", "b"):
        eject(t, pid, 0.0)
    t.attempt_started("a", 1.0)  # a's probe runs (a last resort before expiry)
    assert t.last_resort(["a", "b"], 2.0) == "b"  # a probe running ranks last
    t.attempt_started("b", 2.0)
    assert t.last_resort(["a", "b"], 2.0) == "a"  # both probing: still an answer
    assert t.last_resort(["b", "a"], 2.0) == "b"  # ties go to the earlier id


# -------------------------------------------------------------- due, next change


def test_due_reports_each_return_once() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    t.attempt_saturated(t.attempt_started("q", 0.0), 0.0, 4.0)
    assert t.next_change(0.0) == 4.0
    assert t.due(3.9) == []
    assert t.due(4.0) == ["q"]
    assert t.due(4.0) == []
    assert t.next_change(4.0) == 10.0
    assert t.due(10.0) == ["p"]
    assert t.due(11.0) == []
    assert t.next_change(11.0) is None


def test_a_running_probe_is_not_due() -> None:
    t = tracker()
    eject(t, "p", 0.0)
    probe = t.attempt_started("p", 2.0)  # a last-resort probe before expiry
    assert t.next_change(2.0) is None and t.due(20.0) == []
    t.attempt_failed(probe, R.CONNECT, 3.0)  # ejected again until 23
    assert t.next_change(3.0) == 23.0 and t.due(23.0) == ["p"]


# --------------------------------------------------------------- configuration


def test_turning_ejection_off_ends_every_ejection() -> None:
    t = tracker()
    eject(t, "b", 0.0)
    eject(t, "a", 0.0)
    assert t.set_policy(EjectionPolicy(after_failures=3, seconds=99.0)) == []
    assert status(t, "a", 0.0).until == 10.0  # kept
    assert t.set_policy(EjectionPolicy(after_failures=0, seconds=10.0)) == ["a", "b"]
    assert t.is_choosable("a", 0.0) and t.is_choosable("b", 0.0)


def test_a_lowered_threshold_ejects_at_the_next_failure() -> None:
    t = tracker(EjectionPolicy(after_failures=5, seconds=10.0))
    for _ in range(3):
        fail(t, "p", 0.0)
    t.set_policy(EjectionPolicy(after_failures=2, seconds=7.0))
    assert fail(t, "p", 1.0) is Transition.EJECTED
    assert status(t, "p", 1.0).until == 8.0


def test_retain_forgets_removed_providers() -> None:
    t = tracker()
    eject(t, "gone", 0.0)
    ticket = t.attempt_started("gone", 1.0)
    t.retain(["kept"])
    assert t.is_choosable("gone", 0.0) and t.ejection("gone", 0.0) is None
    assert t.attempt_failed(ticket, R.CONNECT, 1.0) is None  # a stale ticket is harmless
    assert t.attempt_saturated(ticket, 1.0, 5.0) is None
    assert t._states == {}


def test_foreign_tickets_are_ignored() -> None:
    t = tracker()
    bogus = Attempt("p", epoch=10**9, probe=True)
    t.attempt_started("p", 0.0)
    assert t.attempt_failed(bogus, R.CONNECT, 0.0) is None
    assert t.attempt_succeeded(bogus, 0.0) is None


# -------------------------------------------------------------- display, parsing


@pytest.mark.parametrize(
    ("connected", "ejected", "health", "shown"),
    [
        (False, True, "unhealthy", "disconnected"),
        (False, False, "healthy", "disconnected"),
        (True, True, "unhealthy", "ejected"),
        (True, True, "healthy", "ejected"),
        (True, True, "unknown", "ejected"),
        (True, False, "unhealthy", "unhealthy"),
        (True, False, "healthy", "healthy"),
        (True, False, "unknown", "unknown"),
    ],
)
def test_health_display_precedence(connected: bool, ejected: bool, health: str, shown: str) -> None:
    assert health_display(connected=connected, ejected=ejected, health=health) == shown


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, 1.0),
        ("", 1.0),
        ("  ", 1.0),
        ("0", 0.0),
        ("2", 2.0),
        (b"3", 3.0),
        (" 1.5 ", 1.5),
        ("3600", SATURATION_MAX_SECONDS),
        ("9" * 64, SATURATION_MAX_SECONDS),
        ("9" * 65, 1.0),  # too long to look at
        ("-1", 1.0),
        ("1e3", 1.0),
        ("1.2.3", 1.0),
        (".", 1.0),
        ("٣", 1.0),  # a non-ASCII digit
        ("soon", 1.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 1.0),  # a date needs wall_now
    ],
)
def test_saturation_seconds(value: str | bytes | None, seconds: float) -> None:
    assert saturation_seconds(value) == seconds


def test_saturation_seconds_http_date() -> None:
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    at = 1445412480.0  # that instant, Unix time
    assert saturation_seconds(date, wall_now=at - 5) == 5.0
    assert saturation_seconds(date, wall_now=at + 5) == 0.0  # in the past
    assert saturation_seconds(date, wall_now=at - 1e6) == SATURATION_MAX_SECONDS
    assert saturation_seconds("Wed, 21 Oct 2015 07:28:00 -0000", wall_now=at - 5) == 5.0
    assert saturation_seconds("Wed, 99 Oct 2015 07:28:00 GMT", wall_now=at) == 1.0
    assert saturation_seconds("2", wall_now=at, default=7.0) == 2.0
    assert saturation_seconds("nope", wall_now=at, default=7.0) == 7.0
