"""Unit tests of the synchronous pool scheduler: one named test per scheduling rule."""

from __future__ import annotations

import pytest

from iopd.edge.pool.scheduler import (
    Grant,
    GroupPolicy,
    PoolSnapshot,
    ProviderSlot,
    Scheduler,
    Waiter,
    WaiterState,
)
from iopd.errors import NodeDispatchError, QueueFull


def slot(
    pid: str,
    node: str = "n1",
    *,
    type: str = "echo",
    capacity: int = 1,
    long: int = 0,
    priority: int = 0,
    enabled: bool = True,
) -> ProviderSlot:
    return ProviderSlot(pid, node, type, capacity, long, priority, enabled)


def snap(
    providers: list[ProviderSlot],
    groups: dict[str, list[str]],
    *,
    max_queue: int = 100,
    queue_timeout: float = 30.0,
    overrides: dict[str, float] | None = None,
    max_queued_bytes: int = 1 << 30,
) -> PoolSnapshot:
    overrides = overrides or {}
    return PoolSnapshot(
        providers={p.provider_id: p for p in providers},
        groups={
            gid: GroupPolicy(gid, tuple((pid, f"{pid}-model") for pid in pids), overrides.get(gid))
            for gid, pids in groups.items()
        },
        max_queue=max_queue,
        queue_timeout=queue_timeout,
        max_queued_bytes=max_queued_bytes,
    )


def scheduler(snapshot: PoolSnapshot, *nodes: str) -> Scheduler:
    s = Scheduler(snapshot)
    for node in nodes or {p.node_id for p in snapshot.providers.values()}:
        s.set_node_connected(node, True)
    return s


def grant(s: Scheduler, group: str, **kw: object) -> Grant:
    out = s.request(group, **kw)  # type: ignore[arg-type]
    assert isinstance(out, Grant), out
    return out


def wait(s: Scheduler, group: str, **kw: object) -> Waiter:
    out = s.request(group, **kw)  # type: ignore[arg-type]
    assert isinstance(out, Waiter), out
    return out


# --------------------------------------------------------------- rule 1: candidates


def test_disconnected_node_is_not_a_candidate() -> None:
    s = scheduler(snap([slot("a", "n1"), slot("b", "n2")], {"m": ["a", "b"]}), "n2")
    assert grant(s, "m").provider_id == "b"


def test_disabled_provider_is_not_a_candidate() -> None:
    s = scheduler(snap([slot("a", enabled=False), slot("b")], {"m": ["a", "b"]}))
    assert grant(s, "m").provider_id == "b"


def test_unhealthy_provider_is_not_a_candidate() -> None:
    s = scheduler(snap([slot("a"), slot("b")], {"m": ["a", "b"]}))
    s.set_provider_health("a", "unhealthy")
    assert grant(s, "m").provider_id == "b"


def test_unknown_health_counts_as_available() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    assert s.health("a") == "unknown"
    assert grant(s, "m").provider_id == "a"
    s2 = scheduler(snap([slot("a")], {"m": ["a"]}))
    s2.set_provider_health("a", "healthy")
    s2.set_provider_health("a", "unknown")
    assert grant(s2, "m").provider_id == "a"


@pytest.mark.parametrize(
    ("requires", "expected"),
    [
        (frozenset({"passthrough"}), {"o"}),
        (frozenset({"ollama"}), {"l"}),
        (frozenset({"normalized"}), {"l", "c", "e"}),
        (frozenset({"normalized", "ollama"}), {"l"}),
        (frozenset(), {"o", "l", "c", "e"}),
    ],
)
def test_requires_filters_by_provider_type(requires: frozenset[str], expected: set[str]) -> None:
    providers = [
        slot("o", type="openai", capacity=9),
        slot("l", type="ollama", capacity=9),
        slot("c", type="cli", capacity=9),
        slot("e", type="echo", capacity=9),
    ]
    s = scheduler(snap(providers, {"m": ["o", "l", "c", "e"]}))
    got = {grant(s, "m", requires=requires).provider_id for _ in range(8)}
    assert got == expected


def test_requirement_no_provider_supports_fails_dispatch() -> None:
    s = scheduler(snap([slot("e", type="echo")], {"m": ["e"]}))
    with pytest.raises(NodeDispatchError) as info:
        s.request("m", requires=frozenset({"passthrough"}))
    assert "passthrough" in info.value.message


# --------------------------------------------------------------- rule 2: selection


def test_selects_lowest_load_ratio() -> None:
    s = scheduler(snap([slot("a", capacity=4), slot("b", capacity=2)], {"m": ["a", "b"]}))
    # 0/4 vs 0/2 tie -> a; .25 vs 0 -> b; .25 vs .5 -> a; .5 vs .5 tie -> b (round
    # robin); b full -> a, a.
    picks = [grant(s, "m").provider_id for _ in range(6)]
    assert picks == ["a", "b", "a", "b", "a", "a"]


def test_tie_break_priority_then_round_robin() -> None:
    providers = [
        slot("a", capacity=10, priority=1),
        slot("b", capacity=10, priority=0),
        slot("c", capacity=10, priority=0),
    ]
    s = scheduler(snap(providers, {"m": ["a", "b", "c"]}))
    first = grant(s, "m")
    assert first.provider_id == "b"  # ratio tie, lower priority wins over a
    s.release(first)
    # b and c tie on ratio and priority: round robin alternates them.
    picks = []
    for _ in range(4):
        g = grant(s, "m")
        picks.append(g.provider_id)
        s.release(g)
    assert picks == ["c", "b", "c", "b"]


def test_selection_is_deterministic_given_same_history() -> None:
    def run() -> list[str]:
        providers = [slot(p, capacity=3) for p in "abcd"]
        s = scheduler(snap(providers, {"m": list("abcd"), "k": list("dc")}))
        out = []
        held = []
        for i in range(10):
            g = grant(s, "m" if i % 3 else "k")
            out.append(g.provider_id)
            held.append(g)
            if i % 4 == 3:
                s.release(held.pop(0))
        return out

    assert run() == run()


# --------------------------------------------------------------- rule 3: shared capacity


def test_capacity_shared_across_aliases() -> None:
    s = scheduler(snap([slot("a", capacity=2)], {"alias1": ["a"], "alias2": ["a"]}))
    g1 = grant(s, "alias1")
    g2 = grant(s, "alias2")
    assert s.in_flight("a") == (2, 0)
    w = wait(s, "alias1")
    assert s.provider_loads()["a"].queued == 1
    [admitted] = s.release(g2)
    assert admitted is w and w.grant is not None and w.grant.group_id == "alias1"
    assert w.grant.target == "a-model"
    s.release(g1)
    s.release(w.grant)
    assert s.in_flight("a") == (0, 0)


# --------------------------------------------------------------- rule 4: long context


def test_long_request_needs_long_and_normal_slot() -> None:
    providers = [slot("small", capacity=5), slot("big", capacity=2, long=1)]
    s = scheduler(snap(providers, {"m": ["small", "big"]}))
    g = grant(s, "m", long=True)
    assert g.provider_id == "big" and g.long
    assert s.in_flight("big") == (1, 1)
    # The only long slot is taken: a second long request waits although small is idle.
    w = wait(s, "m", long=True)
    normals = [grant(s, "m") for _ in range(2)]
    assert [n.provider_id for n in normals] == ["small", "small"]  # 0/5, 1/5 < 1/2
    assert w.state is WaiterState.PENDING
    assert s.release(normals[0]) == []  # a normal slot freeing does not help it
    assert s.release(g) == [w]
    assert w.grant is not None and w.grant.provider_id == "big" and w.grant.long
    assert s.in_flight("big") == (1, 1)


def test_long_request_blocked_without_normal_slot() -> None:
    s = scheduler(snap([slot("big", capacity=1, long=1)], {"m": ["big"]}))
    normal = grant(s, "m")
    w = wait(s, "m", long=True)
    assert s.in_flight("big") == (1, 0)
    [admitted] = s.release(normal)
    assert admitted is w and s.in_flight("big") == (1, 1)


def test_long_without_long_slots_uses_normal() -> None:
    s = scheduler(snap([slot("a", capacity=2), slot("b", capacity=2)], {"m": ["a", "b"]}))
    g = grant(s, "m", long=True)
    assert not g.long
    assert s.in_flight(g.provider_id) == (1, 0)


def test_long_slots_only_count_live_candidates() -> None:
    providers = [slot("big", "n1", long=1), slot("small", "n2")]
    s = scheduler(snap(providers, {"m": ["big", "small"]}), "n2")
    g = grant(s, "m", long=True)  # big's node is down: no candidate has long slots
    assert g.provider_id == "small" and not g.long


def test_long_waiter_falls_back_to_normal_slots_when_long_provider_leaves() -> None:
    providers = [slot("big", "n1", capacity=1, long=1), slot("small", "n2", capacity=2)]
    s = scheduler(snap(providers, {"m": ["big", "small"]}))
    held = grant(s, "m", long=True)
    w = wait(s, "m", long=True)  # small is idle but has no long slots
    assert s.set_node_connected("n1", False) == [w]
    assert w.grant is not None and w.grant.provider_id == "small" and not w.grant.long
    s.release(held)
    assert s.in_flight("big") == (0, 0)


# --------------------------------------------------------------- rule 5: queue


def test_waits_when_no_free_slot_and_admits_on_release() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    g = grant(s, "m")
    w = wait(s, "m")
    assert s.queue_depth == 1
    assert s.release(g) == [w]
    assert w.state is WaiterState.ADMITTED and s.queue_depth == 0


def test_fifo_within_a_group() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    g = grant(s, "m")
    waiters = [wait(s, "m") for _ in range(3)]
    order = []
    current = g
    for _ in range(3):
        [w] = s.release(current)
        order.append(w)
        assert w.grant is not None
        current = w.grant
    assert order == waiters


def test_max_queue_bounds_the_queue() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}, max_queue=2))
    grant(s, "m")
    wait(s, "m")
    wait(s, "m")
    with pytest.raises(QueueFull):
        s.request("m")
    assert s.queue_depth == 2


def test_max_queue_zero_never_waits() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}, max_queue=0))
    grant(s, "m")
    with pytest.raises(QueueFull) as info:
        s.request("m")
    assert info.value.status == 429
    assert s.queue_depth == 0


def test_max_queued_bytes_bounds_the_bodies_held_by_waiters() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}, max_queued_bytes=100))
    grant(s, "m")
    wait(s, "m", body_bytes=60)
    wait(s, "m", body_bytes=40)  # exactly at the bound: still room
    assert s.queued_bytes == 100
    with pytest.raises(QueueFull) as info:
        s.request("m", body_bytes=1)
    assert info.value.status == 429 and "100 of 100 body bytes" in info.value.message
    assert s.queue_depth == 2 and s.queued_bytes == 100


def test_one_body_larger_than_max_queued_bytes_never_waits() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}, max_queued_bytes=100))
    g = grant(s, "m")
    with pytest.raises(QueueFull):
        s.request("m", body_bytes=101)
    assert s.queued_bytes == 0
    s.release(g)
    assert isinstance(s.request("m", body_bytes=10_000), Grant)  # a free slot: not affected


def test_max_queued_bytes_does_not_touch_requests_admitted_at_once() -> None:
    s = scheduler(snap([slot("a", capacity=3)], {"m": ["a"]}, max_queued_bytes=10))
    for _ in range(3):
        assert isinstance(s.request("m", body_bytes=1_000), Grant)
    assert s.queued_bytes == 0


def test_max_queued_bytes_zero_never_waits() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}, max_queued_bytes=0))
    grant(s, "m")
    for size in (0, 1):
        with pytest.raises(QueueFull):
            s.request("m", body_bytes=size)
    assert s.queue_depth == 0 and s.queued_bytes == 0


def test_negative_body_bytes_is_a_programming_error() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    with pytest.raises(ValueError):
        s.request("m", body_bytes=-1)


def test_queued_bytes_return_to_zero_on_every_exit_path() -> None:
    """Admission, cancel, failure on node loss, refresh and shutdown each give bytes back."""
    s = scheduler(snap([slot("a", "n1"), slot("b", "n2")], {"m": ["a"], "o": ["b"]}))
    ga = grant(s, "m")
    grant(s, "o")
    admitted = wait(s, "m", body_bytes=10)
    cancelled = wait(s, "m", body_bytes=20)
    lost = wait(s, "o", body_bytes=40)
    assert s.queued_bytes == 70
    assert s.release(ga) == [admitted]
    assert s.queued_bytes == 60
    s.cancel(cancelled)
    s.cancel(cancelled)  # idempotent: bytes are given back once
    assert s.queued_bytes == 40
    assert s.set_node_connected("n2", False) == [lost]
    assert s.queued_bytes == 0 and s.queue_depth == 0
    # A refresh that removes the group fails its waiters and frees their bytes.
    s.set_node_connected("n2", True)
    refreshed = wait(s, "o", body_bytes=5)
    assert s.apply_snapshot(snap([slot("a", "n1"), slot("b", "n2")], {"m": ["a"]})) == [refreshed]
    assert s.queued_bytes == 0
    # A refresh that adds capacity admits waiters and frees their bytes.
    assert admitted.grant is not None
    w = wait(s, "m", body_bytes=7)
    assert s.queued_bytes == 7
    assert s.apply_snapshot(snap([slot("a", "n1", capacity=2)], {"m": ["a"]})) == [w]
    assert s.queued_bytes == 0
    # Shutdown empties the queue.
    wait(s, "m", body_bytes=3)
    s.fail_all_waiters(NodeDispatchError("shutting down"))
    assert s.queued_bytes == 0 and s.queue_depth == 0


def test_lowering_max_queued_bytes_keeps_the_waiters_already_queued() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}, max_queued_bytes=100))
    g = grant(s, "m")
    w = wait(s, "m", body_bytes=80)
    assert s.apply_snapshot(snap([slot("a")], {"m": ["a"]}, max_queued_bytes=50)) == []
    assert s.pending_waiters() == [w] and s.queued_bytes == 80
    with pytest.raises(QueueFull):
        s.request("m", body_bytes=1)
    assert s.release(g) == [w] and s.queued_bytes == 0
    assert s.snapshot.max_queued_bytes == 50


def test_no_head_of_line_blocking() -> None:
    providers = [slot("a"), slot("b")]
    s = scheduler(snap(providers, {"ma": ["a"], "mb": ["b"], "both": ["a", "b"]}))
    ga = grant(s, "ma")
    gb = grant(s, "mb")
    first = wait(s, "ma")  # needs a
    second = wait(s, "mb")  # needs b
    third = wait(s, "both")
    assert s.release(gb) == [second]  # first cannot fit, it does not block second
    assert first.state is WaiterState.PENDING and third.state is WaiterState.PENDING
    assert s.release(ga) == [first]  # enqueue order: first before third
    assert third.state is WaiterState.PENDING


def test_no_head_of_line_blocking_on_refresh() -> None:
    s = scheduler(snap([slot("a"), slot("b")], {"ma": ["a"], "mb": ["b"]}))
    grant(s, "ma")
    grant(s, "mb")
    first = wait(s, "ma")
    second = wait(s, "mb")
    assert s.apply_snapshot(
        snap([slot("a"), slot("b", capacity=2)], {"ma": ["a"], "mb": ["b"]})
    ) == [second]
    assert first.state is WaiterState.PENDING


def test_no_head_of_line_blocking_by_long_waiter() -> None:
    s = scheduler(snap([slot("big", capacity=3, long=1)], {"m": ["big"]}))
    long_grant = grant(s, "m", long=True)
    normal = [grant(s, "m"), grant(s, "m")]
    long_waiter = wait(s, "m", long=True)
    normal_waiter = wait(s, "m")
    # A normal slot frees: the long waiter still lacks a long slot, the later
    # normal waiter fits and is admitted.
    assert s.release(normal[0]) == [normal_waiter]
    assert long_waiter.state is WaiterState.PENDING
    assert s.release(long_grant) == [long_waiter]
    assert s.in_flight("big") == (3, 1)


def test_reexamination_admits_every_waiter_that_fits() -> None:
    s = scheduler(snap([slot("a", capacity=1)], {"m": ["a"]}))
    g = grant(s, "m")
    waiters = [wait(s, "m") for _ in range(3)]
    s.apply_snapshot(snap([slot("a", capacity=3)], {"m": ["a"]}))
    assert [w.state for w in waiters] == [
        WaiterState.ADMITTED,
        WaiterState.ADMITTED,
        WaiterState.PENDING,
    ]
    s.release(g)
    assert waiters[2].state is WaiterState.ADMITTED


def test_queue_timeout_uses_group_override() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"], "legacy": ["a"]}, overrides={"legacy": 5.0}))
    assert s.snapshot.queue_timeout_of("m") == 30.0
    assert s.snapshot.queue_timeout_of("legacy") == 5.0
    assert s.snapshot.queue_timeout_of("legacy", 2.0) == 2.0
    grant(s, "m")
    assert wait(s, "legacy").queue_timeout == 5.0
    assert wait(s, "m").queue_timeout == 30.0


def test_cancel_removes_waiter_and_is_idempotent() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    g = grant(s, "m")
    w1 = wait(s, "m")
    w2 = wait(s, "m")
    s.cancel(w1)
    s.cancel(w1)
    assert s.queue_depth == 1 and w1.state is WaiterState.CANCELLED
    assert s.release(g) == [w2]
    assert w1.grant is None


def test_cancel_after_admission_leaves_grant_to_caller() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    g = grant(s, "m")
    w = wait(s, "m")
    s.release(g)
    s.cancel(w)
    assert w.state is WaiterState.ADMITTED and s.in_flight("a") == (1, 0)


# --------------------------------------------------------------- rule 6: unavailable


def test_unknown_group_is_dispatch_error() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    with pytest.raises(NodeDispatchError) as info:
        s.request("nope")
    assert info.value.status == 502 and "nope" in info.value.message


def test_no_live_candidate_fails_at_once() -> None:
    s = scheduler(snap([slot("a", "n1")], {"m": ["a"]}), "n2")
    with pytest.raises(NodeDispatchError):
        s.request("m")
    assert s.queue_depth == 0


def test_waiter_fails_fast_when_last_candidate_disconnects() -> None:
    s = scheduler(snap([slot("a", "n1"), slot("b", "n2")], {"m": ["a", "b"], "o": ["b"]}))
    grant(s, "m")
    grant(s, "m")
    w = wait(s, "m")
    other = wait(s, "o")
    assert s.set_node_connected("n1", False) == []
    assert s.pending_waiters() == [w, other]
    assert s.set_node_connected("n2", False) == [w, other]
    assert w.state is WaiterState.FAILED and isinstance(w.error, NodeDispatchError)
    assert s.queue_depth == 0


def test_waiter_fails_when_last_provider_disabled_by_refresh() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    g = grant(s, "m")
    w = wait(s, "m")
    s.apply_snapshot(snap([slot("a", enabled=False)], {"m": ["a"]}))
    assert w.state is WaiterState.FAILED and isinstance(w.error, NodeDispatchError)
    s.release(g)
    assert s.in_flight("a") == (0, 0)


def test_waiter_fails_when_last_provider_turns_unhealthy() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    grant(s, "m")
    w = wait(s, "m")
    assert s.set_provider_health("a", "unhealthy") == [w]
    assert isinstance(w.error, NodeDispatchError)


def test_waiter_fails_when_group_removed() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    grant(s, "m")
    w = wait(s, "m")
    s.apply_snapshot(snap([slot("a")], {"other": ["a"]}))
    assert isinstance(w.error, NodeDispatchError) and "removed" in w.error.message


def test_reconnect_admits_waiters() -> None:
    s = scheduler(snap([slot("a", "n1"), slot("b", "n2")], {"m": ["a", "b"]}), "n1")
    grant(s, "m")
    w = wait(s, "m")
    assert s.set_node_connected("n2", True) == [w]
    assert w.grant is not None and w.grant.provider_id == "b"


# --------------------------------------------------------------- rule 7: leases


def test_release_is_idempotent() -> None:
    s = scheduler(snap([slot("a", capacity=2)], {"m": ["a"]}))
    g1 = grant(s, "m")
    grant(s, "m")
    s.release(g1)
    s.release(g1)
    assert s.in_flight("a") == (1, 0)


def test_lease_from_old_snapshot_releases_after_swap() -> None:
    s = scheduler(snap([slot("a", capacity=2, long=1)], {"m": ["a"]}))
    g = grant(s, "m", long=True)
    s.apply_snapshot(snap([slot("a", capacity=1, long=0)], {"m2": ["a"]}))
    assert s.in_flight("a") == (1, 1)
    s.release(g)
    assert s.in_flight("a") == (0, 0)


def test_removed_provider_keeps_counters_until_leases_end() -> None:
    s = scheduler(snap([slot("a", capacity=2), slot("b")], {"m": ["a", "b"]}))
    g = grant(s, "m")
    assert g.provider_id == "a"
    s.apply_snapshot(snap([slot("b")], {"m": ["b"]}))
    assert s.in_flight("a") == (1, 0)
    assert "a" not in s.provider_loads()
    # Re-added while the old lease runs: it keeps counting.
    s.apply_snapshot(snap([slot("a", capacity=1), slot("b")], {"m": ["a", "b"]}))
    assert s.provider_loads()["a"].in_flight == 1
    assert grant(s, "m").provider_id == "b"
    s.release(g)
    assert s.in_flight("a") == (0, 0)


def test_capacity_reduction_affects_new_admissions_only() -> None:
    s = scheduler(snap([slot("a", capacity=3)], {"m": ["a"]}))
    held = [grant(s, "m") for _ in range(3)]
    s.apply_snapshot(snap([slot("a", capacity=1)], {"m": ["a"]}))
    assert s.in_flight("a") == (3, 0)
    w = wait(s, "m")
    assert s.release(held[0]) == []
    assert s.release(held[1]) == []
    assert s.release(held[2]) == [w]


# --------------------------------------------------------------- status


def test_provider_loads_report_zero_ratio_and_queued() -> None:
    s = scheduler(snap([slot("a", capacity=2, long=1), slot("b", capacity=4)], {"m": ["a", "b"]}))
    loads = s.provider_loads()
    assert loads["a"].load_ratio == 0.0 and loads["a"].in_flight == 0
    grant(s, "m", long=True)
    loads = s.provider_loads()
    assert loads["a"].long_in_flight == 1 and loads["a"].load_ratio == 0.5
    wait(s, "m", long=True)
    loads = s.provider_loads()
    assert loads["a"].queued == 1 and loads["b"].queued == 0  # only a can take a long one


def test_fail_all_waiters_empties_queue() -> None:
    s = scheduler(snap([slot("a")], {"m": ["a"]}))
    grant(s, "m")
    ws = [wait(s, "m") for _ in range(3)]
    err = NodeDispatchError("shutting down")
    assert s.fail_all_waiters(err) == ws
    assert all(w.error is err for w in ws) and s.queue_depth == 0
