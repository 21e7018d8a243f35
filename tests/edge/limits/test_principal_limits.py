"""Per-principal limits: every rule and boundary of ``iopd.edge.principals.limiter``.

Times are wall-clock seconds since the epoch; ``MIDNIGHT`` is a UTC midnight
(2023-11-15T00:00:00Z), so day boundaries are exact.
"""

from __future__ import annotations

from typing import Any

import pytest

from iopd.config.schema import LimitDefaults, LimitsSection, PrincipalLimit
from iopd.edge.principals.limiter import (
    DAY_S,
    RETRY_SCAN_LIMIT,
    Admission,
    Limits,
    NeverFits,
    PrincipalLimiter,
    Rejection,
    Settlement,
    WindowStatus,
    format_reset,
)
from iopd.edge.principals.reservation import (
    DEFAULT_OUTPUT_RESERVATION_TOKENS,
    Reservation,
    reservation_for,
)

MIDNIGHT = 1_700_006_400.0
T = MIDNIGHT + 12 * 3600  # noon, far from any day boundary
assert MIDNIGHT % DAY_S == 0


def section(default: dict[str, int] | None = None, **principals: dict[str, int]) -> LimitsSection:
    return LimitsSection(
        default=LimitDefaults(**(default or {})),
        principals=[PrincipalLimit(principal_ref=ref, **v) for ref, v in principals.items()],
    )


def limiter(
    now: float = T, default: dict[str, int] | None = None, **p: dict[str, int]
) -> PrincipalLimiter:
    return PrincipalLimiter(section(default, **p), now)


def r(tokens: int) -> Reservation:
    """A reservation with an explicit maximum output (must fit whole)."""
    return Reservation(0, tokens)


def admit(lim: PrincipalLimiter, tokens: int, now: float, ref: str = "a") -> Admission:
    out = lim.try_admit(ref, r(tokens), now)
    assert isinstance(out, Admission), out
    return out


def reject(lim: PrincipalLimiter, tokens: int, now: float, ref: str = "a") -> Rejection:
    out = lim.try_admit(ref, r(tokens), now)
    assert isinstance(out, Rejection), out
    return out


def used(lim: PrincipalLimiter, now: float, ref: str = "a") -> tuple[int, int, int]:
    st = lim.status(now)[ref]
    return (st.requests_per_minute.used, st.tokens_per_minute.used, st.tokens_per_day.used)


# ------------------------------------------------------------------ requests per minute


def test_requests_per_minute_admits_up_to_the_limit() -> None:
    lim = limiter(a={"requests_per_minute": 3})
    for i in range(3):
        admit(lim, 1, T + i)
    rej = reject(lim, 1, T + 3)
    assert (rej.limit, rej.type, rej.limit_value, rej.used, rej.requested) == (
        "requests_per_minute",
        "requests",
        3,
        3,
        1,
    )
    assert rej.retry_after_s == 57.0  # the first admission (T) leaves the window at T + 60


def test_the_window_is_open_at_the_start_and_closed_at_the_end() -> None:
    """An admission at t counts for (t, t + 60): gone exactly at t + 60, not a moment before."""
    lim = limiter(a={"requests_per_minute": 1})
    admit(lim, 1, T)
    assert reject(lim, 1, T + 59.75).retry_after_s == 0.25
    admit(lim, 1, T + 60)
    assert reject(lim, 1, T + 60).retry_after_s == 60.0


def test_requests_retry_after_waits_for_enough_admissions_to_leave() -> None:
    lim = limiter(a={"requests_per_minute": 2})
    admit(lim, 1, T)
    admit(lim, 1, T + 10)
    assert reject(lim, 1, T + 30).retry_after_s == 30.0
    # lowered below what the window holds: two must leave before one more fits
    lim.apply_config(section(a={"requests_per_minute": 1}), T + 30)
    assert reject(lim, 1, T + 30).retry_after_s == 40.0


def test_a_request_counts_once_whatever_happens_to_it() -> None:
    """Retries and fallbacks hold the one Admission; settling it never un-counts the request."""
    lim = limiter(a={"requests_per_minute": 2})
    adm = admit(lim, 5, T)
    lim.started(adm)
    lim.finished(adm)  # attempt 1 failed over
    lim.started(adm)  # attempt 2
    lim.settle(adm, 0, T + 1)
    lim.settle(adm, 0, T + 2)
    assert used(lim, T + 2)[0] == 1
    admit(lim, 1, T + 3)
    reject(lim, 1, T + 4)


# ------------------------------------------------------------------ tokens per minute


def test_tokens_per_minute_counts_reservations() -> None:
    lim = limiter(a={"tokens_per_minute": 100})
    admit(lim, 60, T)
    admit(lim, 40, T + 1)
    rej = reject(lim, 1, T + 2)
    assert (rej.limit, rej.type, rej.used, rej.requested) == ("tokens_per_minute", "tokens", 100, 1)
    assert rej.retry_after_s == 58.0
    assert reject(lim, 50, T + 2).retry_after_s == 58.0  # the first entry frees 60
    assert reject(lim, 70, T + 2).retry_after_s == 59.0  # both must go


def test_settling_below_the_reservation_returns_the_difference_at_once() -> None:
    lim = limiter(a={"tokens_per_minute": 100})
    adm = admit(lim, 100, T)
    reject(lim, 30, T + 1)
    assert lim.settle(adm, 70, T + 2) == Settlement(
        returned_tokens=30, debt_tokens=0, freed_slot=False
    )
    admit(lim, 30, T + 3)
    assert used(lim, T + 3)[1] == 100


def test_overshoot_is_debt_stamped_at_settlement() -> None:
    """used > reserved: the excess is a new entry at the settlement time, for a full minute."""
    lim = limiter(a={"tokens_per_minute": 100})
    adm = admit(lim, 100, T)
    assert lim.settle(adm, 150, T + 30) == Settlement(0, 50, False)
    assert used(lim, T + 30)[1] == 150  # over the limit: only debt can do this
    rej = reject(lim, 1, T + 30)
    assert rej.retry_after_s == 30.0  # the reservation (stamped T) leaves; the debt stays
    assert used(lim, T + 60)[1] == 50
    admit(lim, 50, T + 60)
    reject(lim, 1, T + 89)
    assert used(lim, T + 90)[1] == 50  # the debt left at T + 90


def test_settling_after_the_reservation_left_the_window() -> None:
    lim = limiter(a={"tokens_per_minute": 100})
    long_short = admit(lim, 100, T)
    long_over = admit(lim, 0, T)
    assert lim.settle(long_short, 40, T + 70) == Settlement(0, 0, False)  # nothing to give back
    assert lim.settle(long_over, 30, T + 70) == Settlement(0, 30, False)
    assert used(lim, T + 70)[1] == 30


def test_no_metered_usage_settles_the_full_reservation() -> None:
    lim = limiter(a={"tokens_per_minute": 100, "tokens_per_day": 1000})
    adm = admit(lim, 80, T)
    assert lim.settle(adm, None, T + 1) == Settlement(0, 0, False)
    assert used(lim, T + 1) == (1, 80, 80)


def test_settling_twice_changes_nothing() -> None:
    lim = limiter(a={"tokens_per_minute": 100, "tokens_per_day": 1000, "max_concurrent": 1})
    adm = admit(lim, 50, T)
    lim.started(adm)
    assert lim.settle(adm, 80, T + 1) == Settlement(0, 30, True)
    assert lim.settle(adm, 0, T + 2) == Settlement(0, 0, False)
    assert used(lim, T + 2) == (1, 80, 80)
    assert lim.status(T + 2)["a"].admitted == 0


def test_a_negative_usage_counts_as_zero() -> None:
    lim = limiter(a={"tokens_per_minute": 100})
    adm = admit(lim, 50, T)
    assert lim.settle(adm, -7, T).returned_tokens == 50


# ------------------------------------------------------------------ tokens per day


def test_the_day_is_the_utc_calendar_day() -> None:
    lim = limiter(MIDNIGHT - 10, a={"tokens_per_day": 100})
    admit(lim, 100, MIDNIGHT - 10)
    rej = reject(lim, 1, MIDNIGHT - 0.5)
    assert (rej.limit, rej.retry_after_s) == ("tokens_per_day", 0.5)
    admit(lim, 100, MIDNIGHT)  # midnight itself belongs to the new day
    assert used(lim, MIDNIGHT)[2] == 100
    assert reject(lim, 1, MIDNIGHT + 1).retry_after_s == DAY_S - 1


def test_day_overshoot_is_carried_into_the_next_day() -> None:
    lim = limiter(T, a={"tokens_per_day": 1000})
    adm = admit(lim, 1000, T)
    lim.settle(adm, 2500, T + 60)
    assert used(lim, T + 60)[2] == 2500
    # after one midnight 1500 remain, after two 500, after three nothing
    assert reject(lim, 600, T + 61).retry_after_s == MIDNIGHT + 3 * DAY_S - (T + 61)
    assert reject(lim, 500, T + 61).retry_after_s == MIDNIGHT + 2 * DAY_S - (T + 61)
    assert used(lim, MIDNIGHT + DAY_S)[2] == 1500
    assert used(lim, MIDNIGHT + 2 * DAY_S)[2] == 500
    admit(lim, 500, MIDNIGHT + 2 * DAY_S)
    reject(lim, 1, MIDNIGHT + 2 * DAY_S)
    assert used(lim, MIDNIGHT + 3 * DAY_S)[2] == 0


def test_a_day_without_a_day_limit_carries_nothing() -> None:
    lim = limiter(T, a={"tokens_per_minute": 10_000})
    adm = admit(lim, 1000, T)
    lim.settle(adm, 5000, T + 1)
    assert used(lim, T + 1)[2] == 5000  # still counted, for status and a later limit
    assert used(lim, MIDNIGHT + DAY_S)[2] == 0


def test_a_request_across_midnight_charges_the_new_day_only_its_overshoot() -> None:
    lim = limiter(MIDNIGHT - 60, a={"tokens_per_day": 1000})
    short = admit(lim, 300, MIDNIGHT - 60)
    over = admit(lim, 300, MIDNIGHT - 60)
    lim.settle(short, 100, MIDNIGHT + 60)  # the old day is closed: nothing given back
    lim.settle(over, 450, MIDNIGHT + 60)
    assert used(lim, MIDNIGHT + 60)[2] == 150


def test_midnight_before_a_refresh_carries_by_the_old_day_limit() -> None:
    lim = limiter(T, a={"tokens_per_day": 1000})
    lim.settle(admit(lim, 1000, T), 1800, T + 1)
    lim.apply_config(section(a={"tokens_per_day": 100}), MIDNIGHT + DAY_S + 5)
    assert used(lim, MIDNIGHT + DAY_S + 5)[2] == 800  # 1800 - 1000, not 1800 - 100


# ------------------------------------------------------------------ can never fit


def test_a_reservation_over_the_limit_itself_can_never_fit() -> None:
    lim = limiter(a={"tokens_per_minute": 100, "tokens_per_day": 1000})
    out = lim.try_admit("a", Reservation(10, 91, output_param="max_completion_tokens"), T)
    assert out == NeverFits("a", "tokens_per_minute", 100, 101, "max_completion_tokens")
    assert "lower max_completion_tokens" in out.message
    out = lim.try_admit("a", Reservation(150, 0, input_param="input"), T)
    assert isinstance(out, NeverFits) and out.param == "input"
    assert lim.status(T)["a"] == lim.status(T)["a"].__class__(
        "a",
        Limits(0, 0, 100, 1000, 1),
        0,
        0,
        WindowStatus(0, 0, None, 0.0),
        WindowStatus(100, 0, 100, 0.0),
        WindowStatus(1000, 0, 1000, 0.0),
    )  # nothing was counted
    admit(lim, 100, T)  # exactly the limit fits


def test_the_day_limit_can_also_be_too_small() -> None:
    lim = limiter(a={"tokens_per_day": 50})
    out = lim.try_admit("a", r(51), T)
    assert isinstance(out, NeverFits) and out.limit == "tokens_per_day"


def test_a_default_output_reservation_is_cut_to_the_limit() -> None:
    """Without max_tokens only the input must fit; the default output shrinks to the limit."""
    lim = limiter(a={"tokens_per_minute": 1000, "tokens_per_day": 3000})
    adm = lim.try_admit("a", reservation_for(200, None), T)
    assert isinstance(adm, Admission) and adm.reserved_tokens == 1000
    lim.settle(adm, 300, T + 1)
    out = lim.try_admit("a", reservation_for(1001, None, input_param="input"), T + 2)
    assert isinstance(out, NeverFits) and out.param == "input" and out.requested == 1001


def test_without_max_tokens_the_reservation_is_cut_to_what_the_window_has_left() -> None:
    """TPM 4096: after one small request, one without max_tokens is admitted with
    the room left, not refused; it waits only while even its input does not fit."""
    lim = limiter(a={"tokens_per_minute": 4096})
    first = lim.try_admit("a", reservation_for(3, 1), T)
    assert isinstance(first, Admission)
    lim.settle(first, 3, T)
    adm = lim.try_admit("a", reservation_for(5, None), T + 1)
    assert isinstance(adm, Admission) and adm.reserved_tokens == 4093
    lim.settle(adm, 10, T + 2)
    assert used(lim, T + 2)[1] == 13
    # An explicit max_tokens that does not fit what is left still waits (429).
    assert isinstance(lim.try_admit("a", reservation_for(5, 4090), T + 3), Rejection)
    # The window full to the last token: a request without max_tokens waits for its input.
    full = lim.try_admit("a", reservation_for(0, None), T + 3)
    assert isinstance(full, Admission) and full.reserved_tokens == 4096 - 13
    out = lim.try_admit("a", reservation_for(5, None), T + 4)
    assert isinstance(out, Rejection) and out.requested == 5
    lim.settle(full, 0, T + 5)
    # Nothing held: the minute is empty once it has passed, the day keeps the usage.
    assert lim.status_of("a", T + 5).admitted == 0
    assert used(lim, T + 64) == (0, 0, 13)


def test_without_max_tokens_the_day_budget_cuts_too() -> None:
    lim = limiter(a={"tokens_per_minute": 1000, "tokens_per_day": 1500})
    adm = lim.try_admit("a", reservation_for(10, None), T)
    assert isinstance(adm, Admission) and adm.reserved_tokens == 1000
    lim.settle(adm, 900, T)
    nxt = lim.try_admit("a", reservation_for(10, None), T + 61)
    assert isinstance(nxt, Admission) and nxt.reserved_tokens == 600


def test_reservation_for() -> None:
    assert reservation_for(10, 100, n=3) == Reservation(10, 300, True, "messages", "max_tokens")
    default = reservation_for(10, None, n=2)
    assert default.tokens == 10 + 2 * DEFAULT_OUTPUT_RESERVATION_TOKENS
    assert default.required == 10 and default.output_param is None
    assert reservation_for(-5, 7, n=0, output_param="max_output_tokens").tokens == 7
    with pytest.raises(ValueError):
        Reservation(-1, 0)


# ------------------------------------------------------------------ zero and several limits


def test_zero_is_unlimited_but_still_counted() -> None:
    lim = limiter()
    for i in range(1000):
        admit(lim, 10**9, T + i * 0.01)
    st = lim.status(T + 10)["a"]
    assert st.requests_per_minute == WindowStatus(0, 1000, None, pytest.approx(59.99))
    assert st.tokens_per_minute.remaining is None and st.tokens_per_day.used == 10**12
    assert lim.headers("a", T + 10) == []
    assert lim.can_start("a")


def test_the_rejection_names_the_limit_that_waits_longest() -> None:
    lim = limiter(a={"requests_per_minute": 1, "tokens_per_minute": 100, "tokens_per_day": 150})
    admit(lim, 100, T)
    rej = reject(lim, 60, T + 1)
    assert rej.limit == "tokens_per_day" and rej.retry_after_s == MIDNIGHT + DAY_S - (T + 1)
    assert rej.retry_after_header == str(int(MIDNIGHT + DAY_S - (T + 1)))
    assert reject(lim, 50, T + 1).limit in ("requests_per_minute", "tokens_per_minute")


def test_rejection_text() -> None:
    rej = Rejection("team-a", "requests_per_minute", 600, 600, 1, 0.2)
    assert rej.retry_after_header == "1"
    assert rej.message == (
        "Rate limit reached for requests per minute of principal 'team-a': limit 600, "
        "used 600, requested 1. Please try again in 200ms."
    )
    assert Rejection("t", "tokens_per_minute", 1, 1, 1, 2.01).retry_after_header == "3"


def test_retry_after_scan_is_capped_and_never_too_early() -> None:
    lim = limiter(a={"tokens_per_minute": 2 * RETRY_SCAN_LIMIT})
    for i in range(2 * RETRY_SCAN_LIMIT):
        admit(lim, 1, T + i * 0.1)
    exact = reject(lim, RETRY_SCAN_LIMIT, T + 20)
    assert exact.retry_after_s == pytest.approx(T + (RETRY_SCAN_LIMIT - 1) * 0.1 + 60 - (T + 20))
    capped = reject(lim, RETRY_SCAN_LIMIT + 1, T + 20)
    assert capped.retry_after_s == pytest.approx(
        T + (2 * RETRY_SCAN_LIMIT - 1) * 0.1 + 60 - (T + 20)
    )


# ------------------------------------------------------------------ headers


def test_headers_remaining_counts_the_current_request() -> None:
    lim = limiter(a={"requests_per_minute": 3, "tokens_per_minute": 1000})
    admit(lim, 100, T)
    assert lim.headers("a", T) == [
        ("x-ratelimit-limit-requests", "3"),
        ("x-ratelimit-remaining-requests", "2"),
        ("x-ratelimit-reset-requests", "1m0s"),
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "900"),
        ("x-ratelimit-reset-tokens", "1m0s"),
    ]
    admit(lim, 900, T + 30)
    reject(lim, 1, T + 30.5)
    assert dict(lim.headers("a", T + 30.5)) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "59.5s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "59.5s",
    }


def test_headers_with_only_a_day_budget_describe_the_day() -> None:
    lim = limiter(a={"tokens_per_day": 500})
    admit(lim, 200, T)
    assert lim.headers("a", T) == [
        ("x-ratelimit-limit-tokens", "500"),
        ("x-ratelimit-remaining-tokens", "300"),
        ("x-ratelimit-reset-tokens", "12h0m0s"),
    ]


def test_headers_of_a_principal_that_never_called() -> None:
    lim = limiter(a={"requests_per_minute": 5})
    assert dict(lim.headers("a", T))["x-ratelimit-remaining-requests"] == "5"
    assert lim.headers("b", T) == []


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0ms"),
        (-1, "0ms"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.9991, "1m0s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (61.25, "1m1.25s"),
        (3600, "1h0m0s"),
        (86399, "23h59m59s"),
    ],
)
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


# ------------------------------------------------------------------ concurrency


def test_concurrency_is_counted_by_started_and_finished() -> None:
    lim = limiter(a={"max_concurrent": 2})
    a1, a2, a3 = (admit(lim, 1, T) for _ in range(3))
    lim.started(a1)
    lim.started(a1)  # idempotent
    assert lim.can_start("a")
    lim.started(a2)
    assert not lim.can_start("a") and lim.can_start("b")
    with pytest.raises(RuntimeError):
        lim.started(a3)
    assert lim.status(T)["a"].in_flight == 2 and lim.status(T)["a"].admitted == 3
    assert lim.finished(a1) is True
    assert lim.finished(a1) is False
    lim.started(a3)
    assert lim.settle(a3, 1, T).freed_slot is True  # settling gives the slot back
    assert lim.settle(a2, 1, T).freed_slot is True
    lim.settle(a1, 1, T)
    assert lim.status(T)["a"].in_flight == 0
    lim.started(a1)  # a settled admission never runs again
    assert lim.status(T)["a"].in_flight == 0


def test_lowering_max_concurrent_lets_running_requests_finish() -> None:
    lim = limiter(a={"max_concurrent": 3})
    held = [admit(lim, 1, T) for _ in range(3)]
    for a in held:
        lim.started(a)
    lim.apply_config(section(a={"max_concurrent": 1}), T)
    assert lim.status(T)["a"].in_flight == 3
    lim.finished(held[0])
    lim.finished(held[1])
    assert not lim.can_start("a")
    lim.finished(held[2])
    assert lim.can_start("a")


# ------------------------------------------------------------------ refresh, idle, clock


def test_refresh_keeps_counters_and_applies_changed_limits() -> None:
    lim = limiter(a={"requests_per_minute": 3, "tokens_per_minute": 1000})
    admit(lim, 400, T)
    admit(lim, 400, T + 1)
    lim.apply_config(section(a={"requests_per_minute": 2, "tokens_per_minute": 1000}), T + 2)
    assert reject(lim, 1, T + 2).limit == "requests_per_minute"
    lim.apply_config(section(a={"requests_per_minute": 5, "tokens_per_minute": 500}), T + 3)
    assert reject(lim, 1, T + 3).limit == "tokens_per_minute"
    # removed from config: the default applies, on the same counters
    lim.apply_config(section({"tokens_per_minute": 900}), T + 4)
    admit(lim, 100, T + 4)
    reject(lim, 1, T + 4)
    assert used(lim, T + 4)[:2] == (3, 900)


def test_limit_set_by_a_refresh_counts_the_minute_already_under_way() -> None:
    lim = limiter()
    admit(lim, 800, T)
    lim.apply_config(section({"tokens_per_minute": 1000}), T + 1)
    assert reject(lim, 201, T + 1).retry_after_s == 59.0


def test_an_idle_principal_loses_its_entry() -> None:
    lim = limiter(a={"tokens_per_day": 10_000})
    adm = admit(lim, 10, T, ref="a")
    b = admit(lim, 10, T, ref="b")
    lim.settle(b, 0, T)  # b: one request counted in the minute, nothing in the day
    assert lim.forget_idle(T + 59) == []
    assert lim.forget_idle(T + 60) == ["b"]
    lim.settle(adm, 5, T + 61)
    assert lim.forget_idle(T + 3600) == []  # "a" still has today's 5 tokens
    assert set(lim.status(T + 3600)) == {"a"}
    lim.apply_config(section(), MIDNIGHT + DAY_S)  # a refresh prunes too
    assert lim.status(MIDNIGHT + DAY_S) == {}


def test_status_lists_configured_and_active_principals() -> None:
    lim = limiter(a={"requests_per_minute": 2})
    admit(lim, 5, T, ref="unmapped")
    st = lim.status(T)
    assert list(st) == ["a", "unmapped"]
    assert st["a"].requests_per_minute == WindowStatus(2, 0, 2, 0.0)
    assert st["unmapped"].tokens_per_day == WindowStatus(0, 5, None, MIDNIGHT + DAY_S - T)
    assert lim.share_of("a") == 1 and lim.limits_for("zzz") == Limits()


def test_time_never_runs_backwards() -> None:
    """A clock stepped back cannot make a window forget or hold entries longer."""
    lim = limiter(a={"requests_per_minute": 1})
    admit(lim, 1, T + 100)
    assert reject(lim, 1, T).retry_after_s == 60.0  # taken as T + 100
    admit(lim, 1, T + 160)


def test_a_principal_with_several_tokens_shares_one_budget() -> None:
    """Limits key on principal_ref: the edge passes the same ref for each of its tokens."""
    lim = limiter(a={"requests_per_minute": 1})
    admit(lim, 1, T, ref="a")
    reject(lim, 1, T, ref="a")


def limits_section_from(data: dict[str, Any]) -> LimitsSection:
    import msgspec

    return msgspec.convert(data, LimitsSection)


def test_partial_principal_entry_inherits_default() -> None:
    lim = PrincipalLimiter(
        limits_section_from(
            {
                "default": {"requests_per_minute": 1, "share": 2},
                "principals": [{"principal_ref": "a", "tokens_per_day": 9}],
            }
        ),
        T,
    )
    assert lim.limits_for("a") == Limits(0, 1, 0, 9, 2)
    assert lim.share_of("a") == 2


def test_withdraw_undoes_an_admission_exactly() -> None:
    """A request found to have no live candidate never counted (a 502 before admission)."""
    from iopd.config.schema import LimitDefaults, LimitsSection
    from iopd.edge.principals.limiter import Admission, PrincipalLimiter
    from iopd.edge.principals.reservation import reservation_for

    section = LimitsSection(
        default=LimitDefaults(requests_per_minute=2, tokens_per_minute=100, tokens_per_day=1000)
    )
    lim = PrincipalLimiter(section, now=1000.0)
    first = lim.try_admit("p", reservation_for(10, 20), 1000.0)
    second = lim.try_admit("p", reservation_for(10, 20), 1000.5)
    assert isinstance(first, Admission) and isinstance(second, Admission)
    lim.withdraw(first, 1001.0)
    lim.withdraw(first, 1001.0)  # twice: nothing more
    st = lim.status_of("p", 1001.0)
    assert (st.requests_per_minute.used, st.tokens_per_minute.used) == (1, 30)
    assert (st.tokens_per_day.used, st.admitted) == (30, 1)
    lim.settle(second, 5, 1002.0)
    lim.withdraw(second, 1002.0)  # after settle: nothing
    st = lim.status_of("p", 1002.0)
    assert (st.requests_per_minute.used, st.tokens_per_minute.used, st.admitted) == (1, 5, 0)


def test_no_usage_settles_the_larger_of_the_reservation_and_the_estimate() -> None:
    lim = limiter(a={"tokens_per_minute": 2000})
    adm = lim.try_admit("a", reservation_for(1, None), T)
    assert isinstance(adm, Admission) and adm.reserved_tokens == 2000
    out = lim.settle(adm, None, T + 1, estimated=3001)
    assert out == Settlement(0, 1001, False)
    assert used(lim, T + 1)[1] == 3001
    assert isinstance(lim.try_admit("a", reservation_for(1, None), T + 2), Rejection)
    small = limiter(a={"tokens_per_minute": 2000})
    adm = small.try_admit("a", reservation_for(1, 100), T)
    assert isinstance(adm, Admission)
    assert small.settle(adm, None, T + 1, estimated=20) == Settlement(0, 0, False)
    assert used(small, T + 1)[1] == 101  # the reservation, the larger
    adm = small.try_admit("a", reservation_for(1, 100), T + 2)
    assert isinstance(adm, Admission)
    small.settle(adm, 7, T + 3, estimated=5000)  # usage metered: it alone counts
    assert used(small, T + 3)[1] == 108
