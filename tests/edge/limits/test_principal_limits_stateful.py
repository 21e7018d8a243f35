"""Stateful property test of the per-principal limiter.

Hypothesis drives ``PrincipalLimiter`` through random admissions, settlements
(below, at and above the reservation, with no usage and an output estimate, twice), starts and
finishes, clock advances across minute edges and UTC midnights, refreshes
(limits up, down, to and from unlimited, entries added and removed), idle
pruning and clocks stepped back.  After every step it is compared with a
deliberately naive reference that keeps the full history of every request
and recomputes each window, day and counter from it, and the invariants are
checked directly: admission never takes a limit over, no request or token is
counted twice or lost, a rejection's ``Retry-After`` is when it would fit,
and everything returns to the initial state once all requests end and the
windows and days pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from iopd.config.schema import LimitDefaults, LimitsSection, PrincipalLimit
from iopd.edge.principals.limiter import (
    DAY_S,
    RETRY_SCAN_LIMIT,
    WINDOW_S,
    Admission,
    LimitName,
    Limits,
    NeverFits,
    PrincipalLimiter,
    Rejection,
    Settlement,
    limits_from_config,
)
from iopd.edge.principals.reservation import Reservation

REFS = ["a", "b", "unmapped"]
MIDNIGHT = 1_700_006_400
START = MIDNIGHT - 150  # the first UTC midnight comes early in most runs


@st.composite
def limit_sections(draw: st.DrawFn) -> LimitsSection:
    default = LimitDefaults(
        max_concurrent=draw(st.sampled_from([0, 1, 2])),
        requests_per_minute=draw(st.sampled_from([0, 1, 3])),
        tokens_per_minute=draw(st.sampled_from([0, 60, 100])),
        tokens_per_day=draw(st.sampled_from([0, 100, 250])),
        share=draw(st.integers(1, 3)),
    )
    principals = []
    for ref in ("a", "b"):
        if draw(st.booleans()):
            continue
        opt = st.none() | st.sampled_from([0, 1, 2, 3, 50, 80])
        principals.append(
            PrincipalLimit(
                principal_ref=ref,
                max_concurrent=draw(st.none() | st.sampled_from([0, 1, 2])),
                requests_per_minute=draw(opt),
                tokens_per_minute=draw(opt),
                tokens_per_day=draw(st.none() | st.sampled_from([0, 90, 200])),
                share=draw(st.none() | st.integers(1, 3)),
            )
        )
    return LimitsSection(default=default, principals=principals)


# ------------------------------------------------------------------ reference


_RESOLVED: dict[int, tuple[LimitsSection, tuple[Limits, dict[str, Limits]]]] = {}


def _resolved(section: LimitsSection) -> tuple[Limits, dict[str, Limits]]:
    hit = _RESOLVED.get(id(section))
    if hit is None or hit[0] is not section:
        hit = _RESOLVED[id(section)] = (section, limits_from_config(section))
    return hit[1]


@dataclass
class RefRequest:
    ident: int
    ref: str
    admitted: int
    reserved: int  # the effective reservation
    settled: int | None = None
    used: int | None = None
    running: bool = False

    def day_charges(self) -> list[tuple[int, int]]:
        """(time, tokens) this request adds to the day counters."""
        out = [(self.admitted, self.reserved)]
        if self.settled is not None and self.used is not None:
            same_day = self.settled // DAY_S == self.admitted // DAY_S
            delta = self.used - self.reserved
            out.append((self.settled, delta if same_day else max(0, delta)))
        return out


@dataclass
class Reference:
    """The rules, recomputed from the whole history on every question."""

    configs: list[tuple[int, LimitsSection]]  # (applied at, section), in order
    requests: list[RefRequest] = field(default_factory=list)

    def limits(self, ref: str, before: int | None = None) -> Limits:
        """Limits in force now, or (``before``) as last applied strictly before that time."""
        section = self.configs[-1][1]
        if before is not None:
            section = self.configs[0][1]
            for t, s in self.configs:
                if t < before:
                    section = s
        default, principals = _resolved(section)
        return principals.get(ref, default)

    def mine(self, ref: str) -> list[RefRequest]:
        return [q for q in self.requests if q.ref == ref]

    def requests_in_window(self, ref: str, t: int) -> int:
        return sum(1 for q in self.mine(ref) if t - q.admitted < WINDOW_S)

    def token_entries(self, ref: str, t: int) -> list[int]:
        """Amounts of the token-log entries in the window at ``t``."""
        out = []
        for q in self.mine(ref):
            done = q.settled is not None and q.used is not None and q.settled <= t
            if t - q.admitted < WINDOW_S:
                out.append(min(q.used, q.reserved) if done and q.used is not None else q.reserved)
            if done and q.settled is not None and q.used is not None and t - q.settled < WINDOW_S:
                out.append(max(0, q.used - q.reserved))
        return [x for x in out if x > 0]

    def tokens_in_window(self, ref: str, t: int) -> int:
        return sum(self.token_entries(ref, t))

    def day_total(self, ref: str, t: int) -> int:
        """Day by day from the first charge: carry what is over the limit, add the day's charges.

        Days with nothing charged and nothing carried are skipped (they change nothing).
        """
        by_day: dict[int, int] = {}
        for q in self.mine(ref):
            for when, amount in q.day_charges():
                if when <= t:
                    by_day[when // DAY_S] = by_day.get(when // DAY_S, 0) + amount
        total = 0
        day = min(by_day, default=t // DAY_S)
        while day <= t // DAY_S:
            tpd = self.limits(ref, before=day * DAY_S).tokens_per_day
            total = max(0, total - tpd) if tpd else 0
            total += by_day.get(day, 0)
            if total == 0:
                later = [d for d in by_day if d > day]
                day = min(later) if later else t // DAY_S + 1
            else:
                day += 1
        return total

    def effective(self, ref: str, res: Reservation, t: int) -> int:
        """Cut to the smallest token limit; with no maximum output, to the windows' room too."""
        lim = self.limits(ref)
        cap = lim.token_cap
        tokens = res.tokens
        tokens = max(res.required, cap) if cap and tokens > cap else tokens
        if res.explicit_output or self.never_fits(ref, tokens):
            return tokens
        rooms = [tokens]
        if lim.tokens_per_minute:
            rooms.append(lim.tokens_per_minute - self.tokens_in_window(ref, t))
        if lim.tokens_per_day:
            rooms.append(lim.tokens_per_day - self.day_total(ref, t))
        return max(res.required, min(rooms))

    def never_fits(self, ref: str, tokens: int) -> list[LimitName]:
        lim = self.limits(ref)
        out: list[LimitName] = []
        if lim.tokens_per_minute and tokens > lim.tokens_per_minute:
            out.append("tokens_per_minute")
        if lim.tokens_per_day and tokens > lim.tokens_per_day:
            out.append("tokens_per_day")
        return out

    def violations(self, ref: str, tokens: int, t: int) -> set[LimitName]:
        lim = self.limits(ref)
        out: set[LimitName] = set()
        if (
            lim.requests_per_minute
            and self.requests_in_window(ref, t) + 1 > lim.requests_per_minute
        ):
            out.add("requests_per_minute")
        if lim.tokens_per_minute and self.tokens_in_window(ref, t) + tokens > lim.tokens_per_minute:
            out.add("tokens_per_minute")
        if lim.tokens_per_day and self.day_total(ref, t) + tokens > lim.tokens_per_day:
            out.add("tokens_per_day")
        return out

    def running(self, ref: str) -> int:
        return sum(1 for q in self.mine(ref) if q.running)

    def open(self, ref: str) -> int:
        return sum(1 for q in self.mine(ref) if q.settled is None)

    def can_start(self, ref: str) -> bool:
        mc = self.limits(ref).max_concurrent
        return mc == 0 or self.running(ref) < mc


# ------------------------------------------------------------------ the machine


class LimiterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lim: PrincipalLimiter | None = None
        self.ref: Reference | None = None
        self.now = START  # the wall clock
        self.seen = START  # the latest time the limiter was given
        self.held: dict[int, Admission] = {}
        self.done: list[Admission] = []
        self.next_ident = 0

    def L(self) -> PrincipalLimiter:
        assert self.lim is not None
        return self.lim

    def R(self) -> Reference:
        assert self.ref is not None
        return self.ref

    def clock(self, lag: int) -> int:
        """The time passed to the limiter; the one it must use is the latest seen."""
        self.seen = max(self.seen, self.now - lag)
        return self.now - lag

    def req(self, ident: int) -> RefRequest:
        return next(q for q in self.R().requests if q.ident == ident)

    # -- rules

    @initialize(section=limit_sections())
    def start(self, section: LimitsSection) -> None:
        self.lim = PrincipalLimiter(section, START)
        self.ref = Reference([(START, section)])

    @rule(
        ref=st.sampled_from(REFS),
        input_tokens=st.integers(0, 40),
        output_tokens=st.integers(0, 60),
        explicit=st.booleans(),
        lag=st.sampled_from([0, 0, 0, 30]),
    )
    def admit(
        self, ref: str, input_tokens: int, output_tokens: int, explicit: bool, lag: int
    ) -> None:
        res = Reservation(input_tokens, output_tokens if explicit else 300, explicit)
        out = self.L().try_admit(ref, res, self.clock(lag))
        t = self.seen
        R = self.R()
        tokens = R.effective(ref, res, t)
        too_big = R.never_fits(ref, tokens)
        if too_big:
            assert isinstance(out, NeverFits), out
            assert (out.limit, out.requested) == (too_big[0], tokens)
            event("never fits")
            return
        over = R.violations(ref, tokens, t)
        if over:
            assert isinstance(out, Rejection), out
            assert out.limit in over and out.requested == (1 if out.type == "requests" else tokens)
            self.check_retry_after(ref, tokens, t, out)
            event(f"rejected: {out.limit}")
            return
        assert isinstance(out, Admission), out
        assert out.reserved_tokens == tokens and out.admitted_at == t
        if not explicit:
            event("admitted without a maximum output")
        R.requests.append(RefRequest(self.next_ident, ref, t, tokens))
        self.held[self.next_ident] = out
        self.next_ident += 1
        # admission never takes a limit over
        st_ = self.L().status(t)[ref]
        for window in (st_.requests_per_minute, st_.tokens_per_minute, st_.tokens_per_day):
            assert window.limit == 0 or window.used <= window.limit
        event("admitted")

    def check_retry_after(self, ref: str, tokens: int, t: int, rej: Rejection) -> None:
        """At ``t + retry`` (nothing else happening) it fits; a second earlier it did not."""
        R = self.R()
        wait = rej.retry_after_s
        assert wait > 0 and wait == int(wait)
        assert R.violations(ref, tokens, t + int(wait)) == set()
        exact = len(R.token_entries(ref, t)) <= RETRY_SCAN_LIMIT
        if exact:
            assert rej.limit in R.violations(ref, tokens, t + int(wait) - 1)

    @precondition(lambda self: self.held)
    @rule(
        data=st.data(),
        used=st.none() | st.integers(0, 120),
        estimated=st.sampled_from([0, 0, 50, 400]),
        lag=st.sampled_from([0, 0, 0, 45]),
    )
    def settle(self, data: st.DataObject, used: int | None, estimated: int, lag: int) -> None:
        ident = data.draw(st.sampled_from(sorted(self.held)))
        adm = self.held.pop(ident)
        out = self.L().settle(adm, used, self.clock(lag), estimated)
        q = self.req(ident)
        t = self.seen
        # No usage metered: the larger of the reservation and the output estimate.
        u = max(q.reserved, estimated) if used is None else used
        alive = t - q.admitted < WINDOW_S
        assert out == Settlement(
            returned_tokens=q.reserved - u if alive and u < q.reserved else 0,
            debt_tokens=max(0, u - q.reserved),
            freed_slot=q.running,
        )
        q.settled, q.used, q.running = t, u, False
        self.done.append(adm)
        event("debt" if u > q.reserved else "settled within the reservation")

    @precondition(lambda self: self.done)
    @rule(data=st.data())
    def settle_twice(self, data: st.DataObject) -> None:
        adm = data.draw(st.sampled_from(self.done))
        assert self.L().settle(adm, 99, self.clock(0)) == Settlement(0, 0, False)
        self.L().started(adm)  # a settled request never runs again
        assert self.L().finished(adm) is False

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def start_request(self, data: st.DataObject) -> None:
        ident = data.draw(st.sampled_from(sorted(self.held)))
        q = self.req(ident)
        assert self.L().can_start(q.ref) == self.R().can_start(q.ref)
        if q.running:
            self.L().started(self.held[ident])  # idempotent
            return
        if self.R().can_start(q.ref):
            self.L().started(self.held[ident])
            q.running = True
        else:
            try:
                self.L().started(self.held[ident])
            except RuntimeError:
                event("started over max_concurrent refused")
            else:
                raise AssertionError("started over max_concurrent")

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        ident = data.draw(st.sampled_from(sorted(self.held)))
        q = self.req(ident)
        assert self.L().finished(self.held[ident]) is q.running
        q.running = False

    @rule(dt=st.sampled_from([0, 1, 9, 30, 59, 60, 61, 600, 3600, 40_000, DAY_S]))
    def advance(self, dt: int) -> None:
        self.now += dt

    @rule(section=limit_sections())
    def refresh(self, section: LimitsSection) -> None:
        self.L().apply_config(section, self.clock(0))
        self.R().configs.append((self.seen, section))

    @rule()
    def forget_idle(self) -> None:
        before = self.L().status(self.clock(0))
        dropped = self.L().forget_idle(self.seen)
        for ref in dropped:
            assert self.R().open(ref) == 0 and self.R().running(ref) == 0
            assert self.R().requests_in_window(ref, self.seen) == 0
            assert self.R().day_total(ref, self.seen) == 0
        assert self.L().status(self.seen) == {
            k: v for k, v in before.items() if k not in dropped or k in self.configured()
        }

    @rule(used=st.integers(0, 120))
    def end_everything(self, used: int) -> None:
        """Every request ends, the windows and days pass: back to the initial state."""
        for ident in sorted(self.held):
            self.settle_one(ident, used)
        self.now += 200 * DAY_S  # long enough for any carried debt at >= 90 tokens a day
        self.L().forget_idle(self.clock(0))
        assert self.L().status(self.seen).keys() == self.configured()
        for st_ in self.L().status(self.seen).values():
            assert st_.in_flight == st_.admitted == 0
            for w in (st_.requests_per_minute, st_.tokens_per_minute, st_.tokens_per_day):
                assert w.used == 0 and w.reset_s == 0 and w.remaining in (None, w.limit)
            assert self.L().can_start(st_.principal_ref)
        assert self.L()._states == {}
        event("drained")

    def settle_one(self, ident: int, used: int) -> None:
        adm = self.held.pop(ident)
        self.L().settle(adm, used, self.clock(0))
        q = self.req(ident)
        q.settled, q.used, q.running = self.seen, used, False
        self.done.append(adm)

    def configured(self) -> set[str]:
        return {p.principal_ref for p in self.R().configs[-1][1].principals}

    # -- invariants

    @invariant()
    def matches_reference(self) -> None:
        if self.lim is None:
            return
        R = self.R()
        t = self.seen
        status = self.L().status(t)
        for ref in REFS:
            lim = R.limits(ref)
            s = status.get(ref)
            if s is None:  # an idle principal without its own entry shows nothing
                assert ref not in self.configured()
                assert R.open(ref) == R.running(ref) == 0
                assert (R.requests_in_window(ref, t), R.tokens_in_window(ref, t)) == (0, 0)
                assert R.day_total(ref, t) == 0
                continue
            assert s.limits == lim
            assert (s.in_flight, s.admitted) == (R.running(ref), R.open(ref))
            assert s.requests_per_minute.used == R.requests_in_window(ref, t)
            assert s.tokens_per_minute.used == R.tokens_in_window(ref, t)
            assert s.tokens_per_day.used == R.day_total(ref, t)
            assert self.L().can_start(ref) == R.can_start(ref)
            if lim.requests_per_minute:
                headers = dict(self.L().headers(ref, t))
                remaining = max(0, lim.requests_per_minute - R.requests_in_window(ref, t))
                assert headers["x-ratelimit-remaining-requests"] == str(remaining)

    @invariant()
    def nothing_held_twice(self) -> None:
        open_ids = set(self.held)
        assert all(not a.settled for a in self.held.values())
        assert all(a.settled and not a.running for a in self.done)
        assert len(open_ids) + len(self.done) == self.next_ident


TestLimiter = LimiterMachine.TestCase
TestLimiter.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
