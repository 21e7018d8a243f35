"""The pool's fair queue and per-principal concurrency.

Unit tests per rule, a hypothesis property on one shared provider (weighted
fairness within a stated bound, bounded overtaking so no waiter starves,
counters back to 0), and a trio contention test: shares 1 and 3 on one slot.

The bounds, for waiters that compete for the same slots (SFQ tags, see
``iopd/edge/pool/fair_queue.py``):

* over any run of admissions during which principals ``p`` and ``q`` both
  have waiters, ``|n_p / s_p - n_q / s_q| <= 2 / s_p + 2 / s_q``;
* a waiter of tag ``T`` enqueued at virtual time ``V`` is overtaken by at
  most ``s_q * (T - V) + 1`` later waiters of each other principal ``q``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from iopd.edge.pool import GroupPolicy, PoolSnapshot, ProviderPool, ProviderSlot
from iopd.edge.pool.candidates import PrincipalPolicy, WaitKey
from iopd.edge.pool.fair_queue import FairQueue
from iopd.edge.pool.scheduler import Grant, Scheduler, Waiter, WaiterState
from iopd.errors import QueueFull, QueueTimeout


def fair_snapshot(
    capacity: int = 1,
    principals: dict[str, PrincipalPolicy] | None = None,
    default: PrincipalPolicy = PrincipalPolicy(),
    providers: tuple[str, ...] = ("p0",),
) -> PoolSnapshot:
    return PoolSnapshot(
        {pid: ProviderSlot(pid, "n0", "echo", capacity) for pid in providers},
        {"g": GroupPolicy("g", tuple((pid, pid) for pid in providers))},
        max_queue=10_000,
        queue_timeout=30.0,
        principals=principals or {},
        default_principal=default,
    )


def connected(snapshot: PoolSnapshot) -> Scheduler:
    s = Scheduler(snapshot)
    s.set_node_connected("n0", True)
    return s


def admit_all_in_turn(s: Scheduler, first: Grant, n: int) -> list[str]:
    """Release the held grant n times in a row; the principals admitted, in order."""
    order: list[str] = []
    held = first
    for _ in range(n):
        resolved = s.release(held)
        assert len(resolved) == 1 and resolved[0].grant is not None
        held = resolved[0].grant
        order.append(held.principal)
    s.release(held)
    return order


# ------------------------------------------------------------------ rules


def test_one_principal_is_plain_fifo() -> None:
    s = connected(fair_snapshot())
    first = s.request("g")
    assert isinstance(first, Grant)
    waiters = [s.request("g", body_bytes=i) for i in range(5)]
    seen = []
    held = first
    for _ in waiters:
        (w,) = s.release(held)
        seen.append(w)
        assert w.grant is not None
        held = w.grant
    assert seen == waiters


def test_shares_split_one_slot_in_proportion() -> None:
    s = connected(fair_snapshot(principals={"a": PrincipalPolicy(1), "b": PrincipalPolicy(3)}))
    first = s.request("g", principal="a")
    assert isinstance(first, Grant)
    for _ in range(40):  # a floods first, b arrives after: b still gets 3 of every 4
        s.request("g", principal="a")
    for _ in range(40):
        s.request("g", principal="b")
    order = admit_all_in_turn(s, first, 40)
    assert order.count("b") == 30 and order.count("a") == 10
    # Every window of 4 admissions gives b 3 of them (within one of the ratio).
    for i in range(0, 40, 4):
        assert 2 <= order[i : i + 4].count("b") <= 4


def test_a_newcomer_is_not_queued_behind_a_flood() -> None:
    s = connected(fair_snapshot())
    first = s.request("g", principal="flood")
    assert isinstance(first, Grant)
    for _ in range(100):
        s.request("g", principal="flood")
    late = s.request("g", principal="late")
    assert isinstance(late, Waiter)
    (w,) = s.release(first)
    assert w.principal == "flood"  # the flood's head was due first ...
    assert w.grant is not None
    (w2,) = s.release(w.grant)
    assert w2 is late  # ... then the newcomer, not after 100 others


def test_an_emptied_line_earns_no_credit() -> None:
    """A principal whose waiters all timed out starts again from virtual time now."""
    s = connected(fair_snapshot())
    first = s.request("g", principal="b")
    assert isinstance(first, Grant)
    gone = [s.request("g", principal="a") for _ in range(50)]
    for w in gone:
        assert isinstance(w, Waiter)
        s.cancel(w)
    b2 = s.request("g", principal="b")
    a2 = s.request("g", principal="a")
    assert isinstance(b2, Waiter) and isinstance(a2, Waiter)
    assert a2.tag == b2.tag  # not 50 tags behind
    assert s.release(first) == [b2]  # equal tags: FIFO


def test_cancelled_waiters_ahead_cost_their_principal_nothing() -> None:
    """A waiter enqueued behind waiters that are then cancelled is due as if they never were."""
    s = connected(fair_snapshot())
    first = s.request("g", principal="b")
    assert isinstance(first, Grant)
    ahead = [s.request("g", principal="a") for _ in range(5)]
    late = s.request("g", principal="a")
    for w in ahead:
        assert isinstance(w, Waiter)
        s.cancel(w)
    flood = [s.request("g", principal="b") for _ in range(5)]
    assert isinstance(late, Waiter) and all(isinstance(w, Waiter) for w in flood)
    order = admit_all_in_turn(s, first, 6)
    assert order.index("a") <= 1, order  # not behind all of b's 5: shares are equal


def test_a_principal_in_several_lanes_still_gets_its_share() -> None:
    """Waiters of one principal for two groups share one tag line: one admission per turn."""

    def two_groups(capacity: int) -> PoolSnapshot:
        snap = fair_snapshot(capacity)
        groups = {gid: GroupPolicy(gid, (("p0", "p0"),)) for gid in ("g", "h")}
        return PoolSnapshot(
            snap.providers, groups, max_queue=100, queue_timeout=30.0, principals={}
        )

    s = connected(two_groups(1))
    assert isinstance(s.request("g", principal="c"), Grant)
    for i in range(4):
        s.request("gh"[i % 2], principal="a")
    for _ in range(4):
        s.request("g", principal="b")
    resolved = s.apply_snapshot(two_groups(5))  # 4 slots free at once: one pass admits 4
    assert sorted(w.principal for w in resolved) == ["a", "a", "b", "b"]


def test_max_concurrent_waits_without_holding_a_slot() -> None:
    s = connected(fair_snapshot(capacity=4, principals={"a": PrincipalPolicy(max_concurrent=1)}))
    g1 = s.request("g", principal="a")
    assert isinstance(g1, Grant)
    w = s.request("g", principal="a")
    assert isinstance(w, Waiter)  # the provider has 3 free slots: the cap holds it back
    assert s.in_flight("p0") == (1, 0)
    other = s.request("g", principal="b")
    assert isinstance(other, Grant)  # another principal is not held back
    assert s.running("a") == 1 and s.principal_loads()["a"] == (1, 1)
    assert s.release(g1) == [w]
    assert w.state is WaiterState.ADMITTED and s.running("a") == 1


def test_max_concurrent_blocked_waiter_does_not_block_others() -> None:
    """Every waiter that fits is admitted: a capped principal's head never idles a slot."""
    s = connected(fair_snapshot(capacity=2, principals={"a": PrincipalPolicy(max_concurrent=1)}))
    ga = s.request("g", principal="a")
    gb = s.request("g", principal="b")
    assert isinstance(ga, Grant) and isinstance(gb, Grant)
    wa = s.request("g", principal="a")  # over a's cap
    wb = s.request("g", principal="b")  # provider full
    assert isinstance(wa, Waiter) and isinstance(wb, Waiter)
    assert s.release(gb) == [wb]  # the slot goes to b: a is still at its cap
    assert wa.state is WaiterState.PENDING


def test_max_concurrent_raised_by_refresh_admits_at_once() -> None:
    s = connected(fair_snapshot(capacity=4, principals={"a": PrincipalPolicy(max_concurrent=1)}))
    assert isinstance(s.request("g", principal="a"), Grant)
    w = s.request("g", principal="a")
    assert isinstance(w, Waiter)
    assert s.apply_snapshot(
        fair_snapshot(capacity=4, principals={"a": PrincipalPolicy(max_concurrent=2)})
    ) == [w]


def test_default_policy_applies_to_every_unlisted_principal_separately() -> None:
    s = connected(fair_snapshot(capacity=4, default=PrincipalPolicy(max_concurrent=1)))
    assert isinstance(s.request("g", principal="x"), Grant)
    assert isinstance(s.request("g", principal="y"), Grant)
    assert isinstance(s.request("g", principal="x"), Waiter)


# ------------------------------------------------------------------ property


# Found by this property: cancelled waiters used to leave their principal's
# later waiters tagged behind them (b was admitted 5 times while a waited).
CANCELLED_AHEAD = [
    ("arrive", 0, 5),
    ("release", 0, 0),
    ("cancel", 0, 0),
    ("arrive", 0, 1),
    ("arrive", 0, 1),
    ("cancel", 0, 0),
    ("cancel", 0, 0),
    ("cancel", 0, 0),
    ("arrive", 1, 5),
]


@settings(max_examples=200, deadline=None)
@example(shares=(1, 1, 1), capacity=1, steps=CANCELLED_AHEAD)
@given(
    shares=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    capacity=st.integers(1, 2),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), st.integers(0, 2), st.integers(1, 6)),
            st.tuples(st.just("release"), st.integers(0, 100), st.just(0)),
            st.tuples(st.just("cancel"), st.integers(0, 100), st.just(0)),
        ),
        max_size=60,
    ),
)
def test_weighted_fairness_and_bounded_overtaking(
    shares: tuple[int, int, int], capacity: int, steps: list[tuple[str, int, int]]
) -> None:
    names = ["a", "b", "c"]
    share = dict(zip(names, shares, strict=True))
    s = connected(fair_snapshot(capacity, principals={n: PrincipalPolicy(share[n]) for n in names}))
    held: list[Grant] = []
    pending: list[Waiter] = []
    enqueued_at: dict[int, float] = {}  # waiter seq -> virtual time at its enqueue
    overtaken: dict[int, dict[str, int]] = {}  # pending seq -> later admitted, per principal
    # Admissions per principal since the current run in which two both wait began.
    runs: dict[tuple[str, str], dict[str, int]] = {}

    def admitted(w: Waiter) -> None:
        for v in pending:
            if v.seq < w.seq and v.principal != w.principal:
                counts = overtaken.setdefault(v.seq, {})
                counts[w.principal] = counts.get(w.principal, 0) + 1
                bound = share[w.principal] * (v.tag - enqueued_at[v.seq]) + 1
                assert counts[w.principal] <= bound + 1e-9, (v, counts)
        for (p, q), counts in runs.items():
            counts[w.principal] = counts.get(w.principal, 0) + 1
            n_p, n_q = counts.get(p, 0), counts.get(q, 0)
            lag = abs(n_p / share[p] - n_q / share[q])
            assert lag <= 2 / share[p] + 2 / share[q] + 1e-9, (p, q, counts)

    def track_runs() -> None:
        waiting = {w.principal for w in pending}
        for p in names:
            for q in names:
                if p < q:
                    both = p in waiting and q in waiting
                    if both and (p, q) not in runs:
                        runs[(p, q)] = {}
                    elif not both:
                        runs.pop((p, q), None)

    def settle(resolved: list[Waiter]) -> None:
        # The scheduler reports in enqueue order; check in admission (tag) order.
        for w in sorted(resolved, key=lambda w: (w.tag, w.seq)):
            assert w.state is WaiterState.ADMITTED and w.grant is not None
            pending.remove(w)
            admitted(w)
            held.append(w.grant)
            track_runs()

    for kind, i, n in steps:
        if kind == "arrive":
            for _ in range(n):
                vtime = s.virtual_time
                out = s.request("g", principal=names[i])
                if isinstance(out, Grant):
                    held.append(out)
                else:
                    enqueued_at[out.seq] = vtime
                    pending.append(out)
                    track_runs()
        elif kind == "release" and held:
            settle(s.release(held.pop(i % len(held))))
        elif kind == "cancel" and pending:
            w = pending.pop(i % len(pending))
            s.cancel(w)
            track_runs()
    # Drain: every waiter is admitted in the end (nobody starves).
    while held:
        settle(s.release(held.pop(0)))
    assert not pending
    assert s.queue_depth == 0 and s.in_flight("p0") == (0, 0)
    assert s.principal_loads() == {}


# ------------------------------------------------------------------ through trio


async def test_shares_1_and_3_on_one_slot_get_25_and_75_percent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two principals keep 20 requests each waiting on one slot for 400 admissions.

    Bound: the first 400 admissions split 100/300 within +-2 (the lag bound
    above with shares 1 and 3 is 2 + 2/3 admissions of ``light``).
    """
    pool = ProviderPool(
        fair_snapshot(principals={"light": PrincipalPolicy(1), "heavy": PrincipalPolicy(3)})
    )
    pool.set_node_connected("n0", True)
    admitted: list[str] = []
    total = 400

    async def caller(principal: str) -> None:
        while len(admitted) < total:
            try:
                async with pool.lease("g", principal=principal, queue_timeout=1_000.0):
                    admitted.append(principal)
                    await trio.sleep(1.0)
            except QueueTimeout:
                admitted.append(f"{principal}-timeout")

    with trio.fail_after(10_000):
        async with trio.open_nursery() as nursery:
            for principal in ("light", "heavy"):
                for _ in range(20):
                    nursery.start_soon(caller, principal)
    window = admitted[:total]
    assert "light-timeout" not in admitted and "heavy-timeout" not in admitted
    assert abs(window.count("light") - total // 4) <= 2, window.count("light")
    assert abs(window.count("heavy") - 3 * total // 4) <= 2
    assert pool.queue_depth == 0 and pool.provider_loads()["p0"].in_flight == 0
    assert pool.principal_loads() == {}


@pytest.mark.parametrize("cancel_at", [0.5, 1.5])
async def test_a_capped_waiter_cancelled_leaves_no_count(
    cancel_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    pool = ProviderPool(
        fair_snapshot(capacity=4, principals={"a": PrincipalPolicy(max_concurrent=1)})
    )
    pool.set_node_connected("n0", True)

    async def hold() -> None:
        async with pool.lease("g", principal="a"):
            await trio.sleep(1.0)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.sleep(0.1)
            with trio.move_on_after(cancel_at):
                async with pool.lease("g", principal="a") as lease:
                    assert lease.waited >= 0.9  # it waited for a's first request
                    await trio.sleep(10)
    assert pool.principal_loads() == {} and pool.queue_depth == 0
    assert pool.provider_loads()["p0"].in_flight == 0


# ------------------------------------------------- the queue itself, without a scheduler


KEY = WaitKey("g", False, frozenset())


def test_tags_alternate_by_share_and_fifo_holds_within_a_principal() -> None:
    q = FairQueue()
    a = [q.new_waiter(KEY, "a", 1, 30.0, 10) for _ in range(3)]
    b = [q.new_waiter(KEY, "b", 2, 30.0, 0) for _ in range(2)]
    # Provisional tags: a's line moves by 1 per waiter, b's (share 2) by 1/2.
    assert [w.tag for w in a] == [1.0, 2.0, 3.0]
    assert [w.tag for w in b] == [0.5, 1.0]
    assert (q.depth, q.bytes) == (5, 30)
    assert q.waiting_by_principal() == {"a": 3, "b": 2}
    assert [w.seq for w in q.pending()] == sorted(w.seq for w in [*a, *b])
    q.admit(b[0])
    assert (b[0].tag, q.vtime) == (0.5, 0.0)
    assert q.tag_of("b") == 1.0  # b's next waiter is due 1/2 later
    q.admit(a[0])
    assert q.vtime == 0.0 and q.tag_of("a") == 2.0


def test_a_cancel_costs_nothing_and_an_empty_line_forgets_its_tag() -> None:
    q = FairQueue()
    first = q.new_waiter(KEY, "a", 1, 30.0, 5)
    assert q.pop(first) and not q.pop(first)  # popped once
    assert (q.depth, q.bytes, q.waiting_of("a")) == (0, 0, 0)
    again = q.new_waiter(KEY, "a", 1, 30.0, 0)
    assert again.tag == 1.0  # not 2: the cancelled waiter never took a tag


def test_an_admitted_tag_is_kept_while_it_is_ahead_of_virtual_time() -> None:
    q = FairQueue()
    w = q.new_waiter(KEY, "a", 1, 30.0, 0)
    q.admit(w)
    # Its line is empty now, but its last tag (1.0) is still ahead of V (0.0):
    # the next waiter of a starts after it, not at V again.
    assert q.new_waiter(KEY, "a", 1, 30.0, 0).tag == 2.0


def test_drains_empty_the_queue_in_order() -> None:
    q = FairQueue()
    other = WaitKey("h", False, frozenset())
    w1 = q.new_waiter(KEY, "a", 1, 30.0, 1)
    w2 = q.new_waiter(other, "a", 1, 30.0, 2)
    w3 = q.new_waiter(KEY, "b", 1, 30.0, 3)
    assert list(q.lanes_of("a")) == [(KEY, "a"), (other, "a")]
    assert q.drain_lane((other, "a")) == [w2]
    assert q.drain() == [w1, w3]
    assert (q.depth, q.bytes, q.lanes, q.waiting_by_principal()) == (0, 0, {}, {})


def test_room_is_bounded_by_count_and_by_body_bytes() -> None:
    q = FairQueue()
    snap = PoolSnapshot({}, {}, max_queue=2, max_queued_bytes=100)
    q.check_room("g", 100, snap)
    q.new_waiter(KEY, "a", 1, 30.0, 60)
    with pytest.raises(QueueFull, match="body"):
        q.check_room("g", 41, snap)
    q.check_room("g", 40, snap)
    q.new_waiter(KEY, "a", 1, 30.0, 0)
    with pytest.raises(QueueFull, match="2 waiting"):
        q.check_room("g", 0, snap)
    with pytest.raises(QueueFull):  # a byte bound of 0 queues nothing
        FairQueue().check_room("g", 0, PoolSnapshot({}, {}, max_queue=2, max_queued_bytes=0))
