"""Stateful property tests of the pool.

The synchronous scheduler is driven by hypothesis through random acquire,
release (also twice), cancel/timeout, node disconnect/reconnect, health changes
and snapshot swaps (capacity up and down, providers disabled or removed, groups
rewired, principal shares and caps, ejection policy), runtime controls (a
provider drained, disabled or back to active, capacity and priority
overridden or cleared), requests of several
principals with ``exclude`` sets and fallback groups, attempt verdicts
(success, failure, 429, abandoned) and the passing of time.  After every step
it is compared with a deliberately naive reference that walks the whole queue
in fair order (its principal's tag, then enqueue order) on every change, asking its own
outlier tracker (fed the same events) which providers are choosable, and the
invariants are checked directly: counters equal the grants held, per
principal too, capacity and ``max_concurrent`` in force were respected at
each admission, no waiter waits while it could fit (ejection never leaves a
request without a provider: the last resort serves) or while its group has
no live candidate, and the queued body bytes equal the sum over the waiters
(bounded by ``max_queued_bytes`` when they were enqueued).  Fairness bounds
and starvation are checked in ``tests/edge/pool/test_fair_queue.py``.  A randomized test
drives the same kinds of events through the trio layer.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from iopd.edge.pool import GroupPolicy, PoolSnapshot, ProviderPool, ProviderSlot
from iopd.edge.pool.candidates import PrincipalPolicy
from iopd.edge.pool.controls import ControlTable, ProviderControl, shown_state
from iopd.edge.pool.outliers import Attempt, EjectionPolicy, OutlierTracker
from iopd.edge.pool.retry_rules import FailureReason
from iopd.edge.pool.scheduler import Grant, Scheduler, Waiter, WaiterState
from iopd.errors import NodeDispatchError, QueueFull, QueueTimeout
from iopd.vocabulary import REQUIREMENT_TYPES

PIDS = [f"p{i}" for i in range(6)]
NODES = ["n0", "n1", "n2"]
GROUPS = ["g0", "g1", "g2"]
TYPES = ["openai", "ollama", "cli", "echo"]
PRINCIPALS = ["", "a", "b"]
REQUIRES = [
    frozenset(),
    frozenset({"passthrough"}),
    frozenset({"ollama"}),
    frozenset({"normalized"}),
]


def node_of(pid: str) -> str:
    return NODES[int(pid[1:]) % len(NODES)]


def type_of(pid: str) -> str:
    return TYPES[int(pid[1:]) % len(TYPES)]


@st.composite
def snapshots(draw: st.DrawFn) -> PoolSnapshot:
    providers: dict[str, ProviderSlot] = {}
    for pid in PIDS:
        if draw(st.integers(0, 7)) == 0:
            continue  # removed from this snapshot
        cap = draw(st.integers(1, 2))
        providers[pid] = ProviderSlot(
            provider_id=pid,
            node_id=node_of(pid),
            type=type_of(pid),
            capacity=cap,
            long_context_capacity=draw(st.integers(0, cap)),
            priority=draw(st.integers(0, 2)),
            enabled=draw(st.integers(0, 9)) != 0,
        )
    groups: dict[str, GroupPolicy] = {}
    for gid in GROUPS:
        if draw(st.integers(0, 9)) == 0:
            continue
        members = draw(st.lists(st.sampled_from(PIDS), unique=True, min_size=1, max_size=3))
        groups[gid] = GroupPolicy(gid, tuple((p, f"{p}@{gid}") for p in members))
    policies = st.builds(PrincipalPolicy, st.integers(1, 3), st.sampled_from([0, 0, 1, 2]))
    return PoolSnapshot(
        providers,
        groups,
        max_queue=draw(st.sampled_from([0, 3, 8])),
        queue_timeout=5.0,
        max_queued_bytes=draw(st.sampled_from([0, 10, 25, 1 << 20])),
        principals=draw(st.dictionaries(st.sampled_from(PRINCIPALS), policies, max_size=3)),
        default_principal=draw(policies),
        ejection=EjectionPolicy(draw(st.sampled_from([0, 1, 2])), draw(st.sampled_from([1, 3]))),
    )


#: Request-body sizes: small against the byte caps above, so both caps bind.
BODY_SIZES = st.integers(0, 12)


# ------------------------------------------------------------------ reference


@dataclass
class RefWaiter:
    ident: int
    group: str
    long: bool
    requires: frozenset[str]
    body_bytes: int
    principal: str = ""
    exclude: frozenset[str] = frozenset()
    start: float = 0.0
    tag: float = 0.0


@dataclass
class RefGrant:
    provider_id: str
    target: str
    long: bool
    principal: str = ""
    group: str = ""
    attempt: Attempt | None = field(default=None, compare=False)


@dataclass
class Reference:
    """The spec, written as plainly as possible: full scan on every change."""

    snapshot: PoolSnapshot
    connected: set[str] = field(default_factory=set)
    health: dict[str, str] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    long_in_flight: dict[str, int] = field(default_factory=dict)
    cursor: dict[str, int] = field(default_factory=dict)
    queue: list[RefWaiter] = field(default_factory=list)
    now: float = 0.0
    tracker: OutlierTracker = field(default_factory=OutlierTracker)
    running: dict[str, int] = field(default_factory=dict)
    vtime: float = 0.0
    tag: dict[str, float] = field(default_factory=dict)  # principals with waiters
    share: dict[str, int] = field(default_factory=dict)  # their share at the last enqueue
    last_admitted: dict[str, float] = field(default_factory=dict)
    #: Runtime controls, written out: state and overrides by provider id.
    state: dict[str, str] = field(default_factory=dict)
    capacity_override: dict[str, int] = field(default_factory=dict)
    priority_override: dict[str, int] = field(default_factory=dict)

    def capacity(self, s: ProviderSlot) -> int:
        return self.capacity_override.get(s.provider_id, s.capacity)

    def priority(self, s: ProviderSlot) -> int:
        return self.priority_override.get(s.provider_id, s.priority)

    def forget_removed(self) -> None:
        """A refresh drops the controls of providers it removed."""
        for d in (self.state, self.capacity_override, self.priority_override):
            for pid in [p for p in d if p not in self.snapshot.providers]:
                del d[pid]

    def may_start(self, principal: str) -> bool:
        cap = self.snapshot.principal(principal).max_concurrent
        return cap == 0 or self.running.get(principal, 0) < cap

    def enqueue(self, w: RefWaiter) -> None:
        """The fair-queue tag, written out (see iopd/edge/pool/fair_queue.py)."""
        p = w.principal
        share = self.share[p] = self.snapshot.principal(p).share
        ahead = sum(x.principal == p for x in self.queue)
        if not ahead:
            base = self.last_admitted.get(p, self.vtime)
            self.tag[p] = max(self.vtime, base) + 1.0 / share
        w.tag = self.tag[p] + ahead / share  # provisional: if every waiter ahead is admitted
        w.start = w.tag - 1.0 / share
        self.queue.append(w)

    def route(
        self,
        group: str,
        fallbacks: tuple[str, ...],
        long: bool,
        requires: frozenset[str],
        exclude: frozenset[str],
    ) -> str | None:
        """The group that takes a request: first with a choosable candidate, else first live."""
        first_live = None
        for gid in (group, *fallbacks):
            cands, _ = self.candidates(gid, long, requires, exclude)
            if not cands:
                continue
            if any(self.tracker.is_choosable(s.provider_id, self.now) for _, s, _ in cands):
                return gid
            first_live = first_live or gid
        return first_live

    def eligible(
        self, cands: list[tuple[int, ProviderSlot, str]]
    ) -> list[tuple[int, ProviderSlot, str]]:
        ok = [c for c in cands if self.tracker.is_choosable(c[1].provider_id, self.now)]
        if ok:
            return ok
        pick = self.tracker.last_resort([c[1].provider_id for c in cands], self.now)
        return [c for c in cands if c[1].provider_id == pick]

    def queue_has_room(self, body_bytes: int) -> bool:
        """Both queue bounds, written out: count, and body bytes (0 = never wait)."""
        held = sum(w.body_bytes for w in self.queue)
        return (
            len(self.queue) < self.snapshot.max_queue
            and self.snapshot.max_queued_bytes > 0
            and held + body_bytes <= self.snapshot.max_queued_bytes
        )

    def candidates(
        self,
        group: str,
        long: bool,
        requires: frozenset[str],
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[list[tuple[int, ProviderSlot, str]], bool]:
        policy = self.snapshot.groups.get(group)
        if policy is None:
            return [], False
        out = []
        for index, (pid, target) in enumerate(policy.providers):
            s = self.snapshot.providers.get(pid)
            if s is None or not s.enabled or s.node_id not in self.connected:
                continue
            if self.state.get(pid, "active") != "active":
                continue
            if pid in exclude:
                continue
            if self.health.get(pid, "unknown") == "unhealthy":
                continue
            if not all(s.type in REQUIREMENT_TYPES[r] for r in requires):
                continue
            out.append((index, s, target))
        if long and any(s.long_context_capacity > 0 for _, s, _ in out):
            return [c for c in out if c[1].long_context_capacity > 0], True
        return out, False

    def pick(
        self,
        group: str,
        long: bool,
        requires: frozenset[str],
        exclude: frozenset[str] = frozenset(),
        principal: str = "",
    ) -> RefGrant | None:
        if not self.may_start(principal):
            return None
        cands, use_long = self.candidates(group, long, requires, exclude)
        if not cands:
            return None
        free = [
            c
            for c in self.eligible(cands)
            if self.in_flight.get(c[1].provider_id, 0) < self.capacity(c[1])
            and (
                not use_long
                or self.long_in_flight.get(c[1].provider_id, 0) < c[1].long_context_capacity
            )
        ]
        if not free:
            return None
        cursor = self.cursor.get(group, 0)
        n = len(self.snapshot.groups[group].providers)

        def rank(c: tuple[int, ProviderSlot, str]) -> tuple[float, int, int]:
            index, s, _ = c
            return (
                self.in_flight.get(s.provider_id, 0) / self.capacity(s),
                self.priority(s),
                (index - cursor) % n if cursor < n else index,
            )

        index, s, target = min(free, key=rank)
        self.cursor[group] = index + 1
        self.in_flight[s.provider_id] = self.in_flight.get(s.provider_id, 0) + 1
        if use_long:
            self.long_in_flight[s.provider_id] = self.long_in_flight.get(s.provider_id, 0) + 1
        self.running[principal] = self.running.get(principal, 0) + 1
        attempt = self.tracker.attempt_started(s.provider_id, self.now)
        return RefGrant(s.provider_id, target, use_long, principal, group, attempt)

    def release(self, g: RefGrant) -> list[tuple[int, RefGrant | None]]:
        if g.attempt is not None:  # no verdict: abandoned (only a probe's matters)
            self.tracker.attempt_abandoned(g.attempt)
        self.in_flight[g.provider_id] -= 1
        if g.long:
            self.long_in_flight[g.provider_id] -= 1
        self.running[g.principal] -= 1
        return self.reexamine()

    def dequeue(self, w: RefWaiter) -> None:
        self.queue.remove(w)
        if not any(x.principal == w.principal for x in self.queue):
            del self.tag[w.principal], self.share[w.principal]

    def reexamine(self) -> list[tuple[int, RefGrant | None]]:
        resolved: list[tuple[int, RefGrant | None]] = []
        for w in list(self.queue):
            if not self.candidates(w.group, w.long, w.requires, w.exclude)[0]:
                self.dequeue(w)
                resolved.append((w.ident, None))
        untried = list(self.queue)
        while untried:  # the principals' tags move with each admission: pick again
            w = min(untried, key=lambda w: (self.tag[w.principal], w.ident))
            untried.remove(w)
            g = self.pick(w.group, w.long, w.requires, w.exclude, w.principal)
            if g is not None:
                p = w.principal
                tag, share = self.tag[p], self.share[p]
                self.dequeue(w)
                self.vtime = max(self.vtime, tag - 1.0 / share)
                self.last_admitted[p] = max(self.last_admitted.get(p, 0.0), tag)
                if p in self.tag:
                    self.tag[p] = max(self.vtime, tag) + 1.0 / share
                resolved.append((w.ident, g))
        resolved.sort()
        return resolved


# ------------------------------------------------------------------ the machine


def view(g: Grant) -> RefGrant:
    return RefGrant(g.provider_id, g.target, g.long, g.principal, g.group_id)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.table: ControlTable | None = None  # the pool's runtime controls
        self.ref: Reference | None = None
        self.held: list[tuple[Grant, RefGrant]] = []
        self.released: list[Grant] = []
        self.waiting: dict[int, Waiter] = {}
        self.verdict_open: set[Grant] = set()  # held grants whose verdict is open
        self.next_ident = 0
        self.step = ""

    # -- helpers

    def s(self) -> Scheduler:
        assert self.sched is not None
        return self.sched

    def r(self) -> Reference:
        assert self.ref is not None
        return self.ref

    def settle(self, real: list[Waiter], expected: list[tuple[int, RefGrant | None]]) -> None:
        """Compare the waiters one step resolved with the reference's, in enqueue order."""
        by_waiter = {id(w): ident for ident, w in self.waiting.items()}
        got: list[tuple[int, RefGrant | None]] = []
        admitted_to: set[str] = set()
        admitted_long: set[str] = set()
        principals: set[str] = set()
        for w in real:
            ident = by_waiter[id(w)]
            del self.waiting[ident]
            if w.state is WaiterState.ADMITTED:
                assert w.grant is not None
                got.append((ident, view(w.grant)))
                (admitted_long if w.grant.long else admitted_to).add(w.grant.provider_id)
                principals.add(w.grant.principal)
            else:
                assert w.state is WaiterState.FAILED
                assert isinstance(w.error, NodeDispatchError)
                got.append((ident, None))
        assert got == expected
        if any(g is not None for _, g in got):
            event(f"waiter admitted on re-examination ({self.step})")
            if (
                any(g is not None for _, g in got)
                and self.waiting
                and min(self.waiting) < max(i for i, g in got if g is not None)
            ):
                event(f"later waiter admitted past an earlier one that does not fit ({self.step})")
        if any(g is None for _, g in got):
            event("waiter failed with no live candidate")
        ref_by_ident = dict(expected)
        for w in real:
            if w.grant is not None:
                rg = ref_by_ident[by_waiter[id(w)]]
                assert rg is not None
                self.held.append((w.grant, rg))
                self.verdict_open.add(w.grant)
        self.check_capacity_at_admission(admitted_to, admitted_long, principals)

    def check_capacity_at_admission(
        self, normal: set[str], long: set[str], principals: set[str]
    ) -> None:
        """Providers and principals that admitted in this step are within the limits in force."""
        for principal in principals:
            cap = self.s().snapshot.principal(principal).max_concurrent
            assert cap == 0 or 0 < self.s().running(principal) <= cap
        for pid in normal | long:
            slot = self.r().snapshot.providers[pid]
            in_flight, long_in_flight = self.s().in_flight(pid)
            assert 0 < in_flight <= self.r().capacity(slot)
            if pid in long:
                assert 0 < long_in_flight <= slot.long_context_capacity

    # -- rules

    @initialize(
        snapshot=snapshots(),
        connected=st.sampled_from([set(NODES), set(NODES), {"n0", "n1"}, {"n1", "n2"}]),
    )
    def start(self, snapshot: PoolSnapshot, connected: set[str]) -> None:
        self.sched = Scheduler(snapshot)
        self.table = ControlTable(snapshot)
        self.ref = Reference(snapshot, tracker=OutlierTracker(snapshot.ejection))
        for node in sorted(connected):
            assert self.s().set_node_connected(node, True, now=0.0) == []
            self.r().connected.add(node)

    @rule(
        group=st.sampled_from([*GROUPS, "nope"]),
        long=st.booleans(),
        requires=st.sampled_from(REQUIRES),
        body_bytes=BODY_SIZES,
        principal=st.sampled_from(PRINCIPALS),
        exclude=st.frozensets(st.sampled_from(PIDS), max_size=2),
        fallbacks=st.lists(st.sampled_from(GROUPS), max_size=2, unique=True).map(tuple),
    )
    def acquire(
        self,
        group: str,
        long: bool,
        requires: frozenset[str],
        body_bytes: int,
        principal: str = "",
        exclude: frozenset[str] = frozenset(),
        fallbacks: tuple[str, ...] = (),
    ) -> None:
        ref = self.r()
        routed = ref.route(group, fallbacks, long, requires, exclude)
        try:
            out = self.s().request(
                group,
                long=long,
                requires=requires,
                body_bytes=body_bytes,
                principal=principal,
                exclude=exclude,
                fallbacks=fallbacks,
                now=ref.now,
            )
        except NodeDispatchError:
            assert routed is None
            return
        except QueueFull:
            assert routed is not None and not ref.queue_has_room(body_bytes)
            assert ref.pick(routed, long, requires, exclude, principal) is None
            if len(ref.queue) < ref.snapshot.max_queue:
                event("queue full by bytes")
            return
        assert routed is not None
        if routed != group:
            event("served by a fallback group")
        if exclude & ref.snapshot.providers.keys():
            event("request with providers excluded")
        if isinstance(out, Grant):
            expected = ref.pick(routed, long, requires, exclude, principal)
            assert expected == view(out)
            self.held.append((out, expected))
            self.verdict_open.add(out)
            if not ref.tracker.is_choosable(out.provider_id, ref.now) and out.attempt:
                event("last resort served (every candidate excluded)")
            self.check_capacity_at_admission(
                set() if out.long else {out.provider_id},
                {out.provider_id} if out.long else set(),
                {out.principal},
            )
        else:
            assert ref.pick(routed, long, requires, exclude, principal) is None
            if not ref.may_start(principal):
                event("waits for its principal's max_concurrent")
            assert ref.queue_has_room(body_bytes)
            assert out.body_bytes == body_bytes
            ident = self.next_ident
            self.next_ident += 1
            ref.enqueue(RefWaiter(ident, routed, long, requires, body_bytes, principal, exclude))
            assert (out.start, out.tag) == (ref.queue[-1].start, ref.queue[-1].tag)
            self.waiting[ident] = out

    @rule(
        group=st.sampled_from(GROUPS),
        long=st.booleans(),
        sizes=st.lists(BODY_SIZES, min_size=1, max_size=4),
    )
    def acquire_burst(self, group: str, long: bool, sizes: list[int]) -> None:
        """Requests are the common event: a burst of them fills slots and the queue."""
        for body_bytes in sizes:
            self.acquire(group, long, frozenset(), body_bytes)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.step = "release"
        i = data.draw(st.integers(0, len(self.held) - 1))
        grant, rg = self.held.pop(i)
        real = self.s().release(grant, now=self.r().now)
        self.released.append(grant)
        if grant not in self.verdict_open:
            rg.attempt = None  # its verdict is in: nothing to abandon
        self.verdict_open.discard(grant)
        self.settle(real, self.r().release(rg))

    @precondition(lambda self: self.held)
    @rule(
        data=st.data(),
        verdict=st.sampled_from(["ok", "connect", "5xx", "429", "own_key", "abandoned"]),
        seconds=st.sampled_from([0.5, 2.0]),
    )
    def attempt_verdict(self, data: st.DataObject, verdict: str, seconds: float) -> None:
        """The request path reports an attempt's result (a second report is ignored)."""
        self.step = f"verdict {verdict}"
        grant, rg = data.draw(st.sampled_from(self.held))
        ref, now = self.r(), self.r().now
        if verdict == "ok":
            outcome = self.s().attempt_succeeded(grant, now)
        elif verdict == "429":
            outcome = self.s().attempt_saturated(grant, seconds, now)
        elif verdict == "abandoned":
            outcome = self.s().attempt_abandoned(grant, now)
        elif verdict == "own_key":
            outcome = self.s().attempt_caller_credentialed(grant, now)
        else:
            reason = FailureReason.CONNECT if verdict == "connect" else FailureReason.STATUS_5XX
            outcome = self.s().attempt_failed(grant, reason, now)
        expected_transition = None
        if grant in self.verdict_open and rg.attempt is not None:
            self.verdict_open.discard(grant)
            t = ref.tracker
            if verdict == "ok":
                expected_transition = t.attempt_succeeded(rg.attempt, now)
            elif verdict == "429":
                expected_transition = t.attempt_saturated(rg.attempt, now, seconds)
            elif verdict == "abandoned":
                expected_transition = t.attempt_abandoned(rg.attempt)
            elif verdict == "own_key":
                expected_transition = t.attempt_caller_credentialed(rg.attempt)
            else:  # the failure is the grant's principal's
                expected_transition = t.attempt_failed(
                    rg.attempt, reason, now, principal=rg.principal
                )
            rg.attempt = None
        assert outcome.transition == expected_transition
        if outcome.transition is not None:
            event(f"outlier transition {outcome.transition.value}")
        self.settle(outcome.resolved, ref.reexamine())

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0]))
    def time_passes(self, dt: float) -> None:
        """The pool's timer: providers whose ejection or saturation ran out come back."""
        self.step = "time_passes"
        ref = self.r()
        ref.now += dt
        real = self.s().outliers_due(ref.now)
        ref.tracker.due(ref.now)
        self.settle(real, ref.reexamine())

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def release_twice(self, data: st.DataObject) -> None:
        grant = data.draw(st.sampled_from(self.released))
        before = {pid: self.s().in_flight(pid) for pid in PIDS}
        assert self.s().release(grant) == []
        assert before == {pid: self.s().in_flight(pid) for pid in PIDS}

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel_or_timeout(self, data: st.DataObject) -> None:
        ident = data.draw(st.sampled_from(sorted(self.waiting)))
        w = self.waiting.pop(ident)
        self.s().cancel(w)
        assert w.state is WaiterState.CANCELLED
        self.r().dequeue(next(x for x in self.r().queue if x.ident == ident))

    @rule(node=st.sampled_from(NODES), connected=st.booleans())
    def node_event(self, node: str, connected: bool) -> None:
        self.step = "node_event"
        real = self.s().set_node_connected(node, connected, now=self.r().now)
        if connected:
            self.r().connected.add(node)
        else:
            self.r().connected.discard(node)
        self.settle(real, self.r().reexamine())

    @rule(
        pid=st.sampled_from(PIDS),
        health=st.sampled_from(["unknown", "healthy", "unhealthy"]),
    )
    def health_event(self, pid: str, health: str) -> None:
        self.step = "health_event"
        real = self.s().set_provider_health(pid, health, now=self.r().now)  # type: ignore[arg-type]
        if health == "healthy":
            self.r().tracker.health_probe_succeeded(pid)
        self.r().health[pid] = health
        self.settle(real, self.r().reexamine())

    @rule(snapshot=snapshots())
    def swap_snapshot(self, snapshot: PoolSnapshot) -> None:
        self.step = "swap_snapshot"
        self._swap(snapshot)

    def t(self) -> ControlTable:
        assert self.table is not None
        return self.table

    def _swap(self, snapshot: PoolSnapshot) -> None:
        """A refresh, as the pool makes it: the new config under the kept controls."""
        self.t().reconfigure(snapshot)
        real = self.s().apply_snapshot(self.t().effective(), now=self.r().now)
        self.r().snapshot = snapshot
        self.r().forget_removed()
        self.r().tracker.set_policy(snapshot.ejection)
        self.r().tracker.retain(snapshot.providers)
        self.settle(real, self.r().reexamine())

    @rule(pid=st.sampled_from(PIDS), capacity=st.integers(1, 3), data=st.data())
    def resize_provider(self, pid: str, capacity: int, data: st.DataObject) -> None:
        """A refresh that changes one provider's capacity (live-applied setting)."""
        self.step = "resize_provider"
        current = self.t().configured
        old = current.providers.get(pid)
        if old is None:
            return
        long = data.draw(st.integers(0, capacity))
        providers = {
            **current.providers,
            pid: ProviderSlot(pid, old.node_id, old.type, capacity, long, old.priority, True),
        }
        self._swap(dataclasses.replace(current, providers=providers))

    @rule(
        pid=st.sampled_from(PIDS),
        state=st.sampled_from(["active", "active", "draining", "disabled"]),
        capacity=st.sampled_from([None, None, 0, 1, 3]),
        priority=st.sampled_from([None, None, 0, 5]),
    )
    def control(self, pid: str, state: str, capacity: int | None, priority: int | None) -> None:
        """An operator's runtime control: state, capacity and priority overrides."""
        self.step = "control"
        ref = self.r()
        control = ProviderControl(state, capacity, priority)  # type: ignore[arg-type]
        if pid not in ref.snapshot.providers:
            with pytest.raises(KeyError):
                self.t().set(pid, control)
            return
        self.t().set(pid, control)
        real = self.s().apply_snapshot(self.t().effective(), now=ref.now)
        for d, value in (
            (ref.state, None if state == "active" else state),
            (ref.capacity_override, capacity),
            (ref.priority_override, priority),
        ):
            if value is None:
                d.pop(pid, None)
            else:
                d[pid] = value  # type: ignore[index]
        if capacity is not None and self.s().in_flight(pid)[0] > capacity:
            event("capacity override below in-flight")
        self.settle(real, ref.reexamine())

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), capacity=st.sampled_from([None, 3]))
    def control_admits(self, data: st.DataObject, capacity: int | None) -> None:
        """A provider a waiter could use is re-enabled, or its capacity raised."""
        ref = self.r()
        w = data.draw(st.sampled_from(ref.queue))
        policy = ref.snapshot.groups.get(w.group)
        pids = [p for p, _ in policy.providers if p in ref.snapshot.providers] if policy else []
        if pids:
            self.control(data.draw(st.sampled_from(pids)), "active", capacity, None)

    # -- invariants

    @invariant()
    def controls_are_shown(self) -> None:
        """Effective values and the shown state follow the reference's controls."""
        if self.sched is None:
            return
        ref = self.r()
        for pid, slot in ref.snapshot.providers.items():
            effective = self.s().snapshot.providers[pid]
            assert effective.capacity == ref.capacity(slot)
            assert effective.priority == ref.priority(slot)
            state = ref.state.get(pid, "active")
            if state == "draining" and not self.s().in_flight(pid)[0]:
                state = "drained"
            assert shown_state(self.t().get(pid), self.s().in_flight(pid)[0]) == state

    @invariant()
    def counters_match_grants_held(self) -> None:
        if self.sched is None:
            return
        for pid in PIDS:
            n = sum(1 for g, _ in self.held if g.provider_id == pid)
            n_long = sum(1 for g, _ in self.held if g.provider_id == pid and g.long)
            assert self.s().in_flight(pid) == (n, n_long)
            assert (self.r().in_flight.get(pid, 0), self.r().long_in_flight.get(pid, 0)) == (
                n,
                n_long,
            )
        for principal in PRINCIPALS:
            running = sum(1 for g, _ in self.held if g.principal == principal)
            assert self.s().running(principal) == self.r().running.get(principal, 0) == running
        assert self.s().active_grants == {g for g, _ in self.held}

    @invariant()
    def queue_matches_reference(self) -> None:
        if self.sched is None:
            return
        pending = self.s().pending_waiters()
        assert [self.waiting[r.ident] for r in self.r().queue] == pending
        assert self.s().queue_depth == len(pending)
        assert all(w.state is WaiterState.PENDING for w in pending)

    @invariant()
    def queued_bytes_are_the_waiters_bodies(self) -> None:
        if self.sched is None:
            return
        held = sum(w.body_bytes for w in self.s().pending_waiters())
        assert self.s().queued_bytes == held == sum(w.body_bytes for w in self.r().queue)
        if self.s().queue_depth == 0:
            assert self.s().queued_bytes == 0

    @invariant()
    def no_waiter_waits_while_it_fits(self) -> None:
        if self.sched is None:
            return
        ref = self.r()
        for w in ref.queue:
            cands, use_long = ref.candidates(w.group, w.long, w.requires, w.exclude)
            assert cands, "a waiter without live candidates must have failed"
            if not ref.may_start(w.principal):
                continue  # it waits for its principal, holding no slot
            for _, s, _ in ref.eligible(cands):
                in_flight, long_in_flight = self.s().in_flight(s.provider_id)
                fits = in_flight < ref.capacity(s) and (
                    not use_long or long_in_flight < s.long_context_capacity
                )
                assert not fits, f"waiter {w.ident} waits while {s.provider_id} is free"

    def teardown(self) -> None:
        if self.sched is None:
            return
        # Finish everything: cancel the waiters, release every lease.
        for w in list(self.waiting.values()):
            self.s().cancel(w)
        self.waiting.clear()
        self.r().queue.clear()
        while self.held:
            grant, _ = self.held.pop()
            assert self.s().release(grant) == []
        assert self.s().queue_depth == 0 and self.s().queued_bytes == 0
        assert all(self.s().in_flight(pid) == (0, 0) for pid in PIDS)
        assert not self.s().active_grants
        assert self.s().principal_loads() == {}
        assert all(self.s().running(p) == 0 for p in PRINCIPALS)


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerStateful = SchedulerMachine.TestCase


# ------------------------------------------------------------------ through trio


@pytest.mark.parametrize("seed", range(12))
async def test_randomized_trio_workload_leaks_nothing(
    seed: int, autojump_clock: trio.abc.Clock
) -> None:
    rng = random.Random(seed)
    base = {
        pid: ProviderSlot(pid, node_of(pid), type_of(pid), 2, 1 if pid == "p1" else 0, 0, True)
        for pid in PIDS
    }
    groups = {
        "g0": GroupPolicy("g0", (("p0", "a"), ("p1", "b"), ("p2", "c"))),
        "g1": GroupPolicy("g1", (("p2", "c"), ("p3", "d"))),
        "g2": GroupPolicy("g2", (("p4", "e"), ("p5", "f")), queue_timeout=2.0),
    }
    pool = ProviderPool(
        PoolSnapshot(base, groups, max_queue=8, queue_timeout=4.0, max_queued_bytes=5_000)
    )
    for node in NODES:
        pool.set_node_connected(node, True)
    outcomes: dict[str, int] = {}
    violations: list[str] = []

    def check() -> None:
        for pid, load in pool.provider_loads().items():
            if load.in_flight < 0 or load.long_in_flight < 0:
                violations.append(f"{pid} negative")
        held = sum(w.body_bytes for w in pool.scheduler.pending_waiters())
        if pool.queued_bytes != held:
            violations.append(f"queued bytes {pool.queued_bytes} != {held} held by waiters")

    async def client(i: int) -> None:
        group = rng.choice(list(groups))
        long = rng.random() < 0.3
        hold_for = rng.uniform(0.1, 3.0)
        body_bytes = rng.randint(0, 2_000)
        try:
            with trio.move_on_after(rng.uniform(0.5, 8.0)):  # caller gives up
                async with pool.lease(
                    group, context_class="long" if long else "normal", body_bytes=body_bytes
                ) as lease:
                    # Capacity may have shrunk since admission; 3 is the most ever configured.
                    in_flight, long_in_flight = pool.scheduler.in_flight(lease.provider_id)
                    if in_flight > 3 or long_in_flight > 1 or (lease.long and not long_in_flight):
                        violations.append(f"{lease.provider_id} over capacity")
                    if rng.random() < 0.2:
                        raise RuntimeError("provider failed")
                    await trio.sleep(hold_for)
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                    return
            outcomes["gave_up"] = outcomes.get("gave_up", 0) + 1
        except QueueFull:
            outcomes["full"] = outcomes.get("full", 0) + 1
        except QueueTimeout:
            outcomes["timeout"] = outcomes.get("timeout", 0) + 1
        except NodeDispatchError:
            outcomes["dispatch"] = outcomes.get("dispatch", 0) + 1
        except RuntimeError:
            outcomes["error"] = outcomes.get("error", 0) + 1
        finally:
            check()

    async def chaos() -> None:
        for _ in range(20):
            await trio.sleep(rng.uniform(0.1, 1.0))
            roll = rng.random()
            if roll < 0.15:
                pid = rng.choice(PIDS)
                if pid in pool.configured.providers:
                    pool.set_control(
                        pid,
                        ProviderControl(
                            rng.choice(["active", "active", "draining", "disabled"]),
                            rng.choice([None, 0, 1, 3]),
                            rng.choice([None, 1]),
                        ),
                    )
            elif roll < 0.3:
                pool.set_node_connected(rng.choice(NODES), rng.random() < 0.6)
            elif roll < 0.5:
                pool.set_provider_health(
                    rng.choice(PIDS), rng.choice(["unknown", "healthy", "unhealthy"])
                )
            else:
                providers = {
                    pid: ProviderSlot(
                        pid,
                        s.node_id,
                        s.type,
                        rng.randint(1, 3),
                        rng.randint(0, 1),
                        rng.randint(0, 2),
                        rng.random() < 0.85,
                    )
                    for pid, s in base.items()
                    if rng.random() < 0.9
                }
                pool.apply_snapshot(
                    PoolSnapshot(
                        providers, groups, rng.randint(0, 8), 4.0, rng.choice([0, 3_000, 6_000])
                    )
                )
            check()
        for node in NODES:
            pool.set_node_connected(node, True)

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chaos)
            for i in range(60):
                nursery.start_soon(client, i)
                await trio.sleep(rng.uniform(0.0, 0.3))
    assert not violations
    assert sum(outcomes.values()) == 60
    assert pool.queue_depth == 0 and pool.queued_bytes == 0
    assert all(s.in_flight(pid) == (0, 0) for s in [pool.scheduler] for pid in PIDS)
    assert not pool.scheduler.active_grants
