"""Routing around failing providers in the pool: one test per rule.

Ejected or saturated providers are not chosen while another candidate exists
(even a busy one); the last resort serves when all are excluded; ``exclude``
keeps a retry off the providers that failed it; fallback groups are tried in
order when a group has no choosable candidate; the trio layer's timer wakes
waiters when an ejection or a saturation runs out.
"""

from __future__ import annotations

import trio
import trio.testing

from iopd.edge.pool import GroupPolicy, PoolSnapshot, ProviderPool, ProviderSlot
from iopd.edge.pool.outliers import EjectionPolicy, Transition
from iopd.edge.pool.retry_rules import FailureReason
from iopd.edge.pool.scheduler import Grant, Scheduler, Waiter
from iopd.errors import NodeDispatchError, QueueTimeout

CONNECT = FailureReason.CONNECT
STATUS_5XX = FailureReason.STATUS_5XX


def routing_snapshot(
    groups: dict[str, list[str]] | None = None,
    *,
    capacity: int = 1,
    after_failures: int = 1,
    seconds: float = 10.0,
) -> PoolSnapshot:
    groups = groups if groups is not None else {"g": ["a", "b"]}
    pids = sorted({p for members in groups.values() for p in members})
    return PoolSnapshot(
        {pid: ProviderSlot(pid, "n0", "openai", capacity) for pid in pids},
        {gid: GroupPolicy(gid, tuple((p, f"{p}@{gid}") for p in m)) for gid, m in groups.items()},
        max_queue=100,
        queue_timeout=30.0,
        # One caller (as with no principal tokens): one failure of anyone ejects.
        ejection=EjectionPolicy(after_failures=after_failures, seconds=seconds, principals=1),
    )


def connected(snapshot: PoolSnapshot) -> Scheduler:
    s = Scheduler(snapshot)
    s.set_node_connected("n0", True, now=0.0)
    return s


def eject(s: Scheduler, pid: str, now: float, group: str = "g") -> None:
    """Fail one attempt on ``pid`` (policy: one failure ejects)."""
    grant = s.request(group, exclude=frozenset(s.snapshot.providers) - {pid}, now=now)
    assert isinstance(grant, Grant) and grant.provider_id == pid
    outcome = s.attempt_failed(grant, STATUS_5XX, now)
    assert outcome.transition is Transition.EJECTED
    s.release(grant, now)


# ------------------------------------------------------------------ choice


def test_an_ejected_provider_is_not_chosen_while_another_candidate_exists() -> None:
    s = connected(routing_snapshot(capacity=2))
    eject(s, "a", 0.0)
    grants = [s.request("g", now=1.0) for _ in range(2)]
    assert [g.provider_id for g in grants if isinstance(g, Grant)] == ["b", "b"]
    # b is full: the next request waits for b rather than going to ejected a.
    assert isinstance(s.request("g", now=1.0), Waiter)


def test_a_saturated_provider_is_skipped_until_its_retry_after() -> None:
    s = connected(routing_snapshot(capacity=2))
    g = s.request("g", now=0.0)
    assert isinstance(g, Grant)
    assert s.attempt_saturated(g, 5.0, 0.0).transition is Transition.SATURATED
    s.release(g, 0.0)
    other = "b" if g.provider_id == "a" else "a"
    got = s.request("g", now=1.0)
    assert isinstance(got, Grant) and got.provider_id == other
    s.release(got, 1.0)
    assert s.outliers_due(5.0) == []  # nothing waited; the saturation is over
    assert g.provider_id not in s._index.flagged


def test_every_candidate_ejected_the_one_ejected_longest_ago_serves() -> None:
    s = connected(routing_snapshot())
    eject(s, "b", 0.0)
    eject(s, "a", 1.0)
    got = s.request("g", now=2.0)
    assert isinstance(got, Grant) and got.provider_id == "b"  # never a dead end
    assert got.attempt is not None and got.attempt.probe


def test_a_half_open_provider_gets_exactly_one_probe() -> None:
    s = connected(routing_snapshot(capacity=3, seconds=10.0))
    eject(s, "a", 0.0)
    probe = s.request("g", exclude=frozenset({"b"}), now=11.0)
    assert isinstance(probe, Grant) and probe.provider_id == "a" and probe.attempt is not None
    assert probe.attempt.probe
    # While the probe runs, a is excluded again: everyone else goes to b.
    assert all(
        isinstance(g, Grant) and g.provider_id == "b"
        for g in (s.request("g", now=11.0) for _ in range(3))
    )
    assert s.attempt_succeeded(probe, 12.0).transition is Transition.RESTORED
    assert "a" not in s._index.flagged


def test_a_probe_released_without_verdict_frees_the_half_open_slot() -> None:
    s = connected(routing_snapshot(capacity=1, seconds=10.0))
    eject(s, "a", 0.0)
    held_b = s.request("g", exclude=frozenset({"a"}), now=11.0)
    probe = s.request("g", now=11.0)
    assert isinstance(held_b, Grant) and isinstance(probe, Grant) and probe.provider_id == "a"
    s.release(probe, 11.5)  # no verdict: abandoned
    again = s.request("g", now=11.5)
    assert isinstance(again, Grant) and again.provider_id == "a"
    assert again.attempt is not None and again.attempt.probe


def test_a_waiter_moves_to_the_last_resort_when_its_provider_is_ejected() -> None:
    """Group {a, b}: a ejected, b busy; b's failure ejects it too -> a serves the waiter."""
    s = connected(routing_snapshot())
    eject(s, "a", 0.0)
    held = s.request("g", now=1.0)
    assert isinstance(held, Grant) and held.provider_id == "b"
    waiter = s.request("g", now=1.0)
    assert isinstance(waiter, Waiter)
    outcome = s.attempt_failed(held, CONNECT, 2.0)
    assert outcome.transition is Transition.EJECTED
    assert outcome.resolved == [waiter] and waiter.grant is not None
    assert waiter.grant.provider_id == "a"  # ejected longest ago


def test_the_end_of_an_ejection_admits_waiters() -> None:
    s = connected(routing_snapshot({"g": ["a", "b"]}))
    eject(s, "a", 0.0)
    held = s.request("g", now=1.0)
    assert isinstance(held, Grant) and held.provider_id == "b"
    waiter = s.request("g", now=1.0)
    assert isinstance(waiter, Waiter)
    assert s.next_outlier_change() == 10.0
    assert s.outliers_due(9.0) == []
    assert s.outliers_due(10.0) == [waiter]
    assert waiter.grant is not None and waiter.grant.provider_id == "a"


def test_a_healthy_probe_ends_a_connect_ejection_and_admits() -> None:
    s = connected(routing_snapshot())
    g = s.request("g", exclude=frozenset({"b"}), now=0.0)
    assert isinstance(g, Grant)
    s.attempt_failed(g, CONNECT, 0.0)
    s.release(g, 0.0)
    held = s.request("g", now=1.0)
    waiter = s.request("g", now=1.0)
    assert isinstance(held, Grant) and isinstance(waiter, Waiter)
    assert s.set_provider_health("a", "healthy", now=2.0) == [waiter]
    assert s.ejection("a") is None


def test_a_verdict_counts_once_and_not_after_release() -> None:
    s = connected(routing_snapshot(after_failures=2))
    g = s.request("g", exclude=frozenset({"b"}), now=0.0)
    assert isinstance(g, Grant)
    s.attempt_failed(g, STATUS_5XX, 0.0)
    assert s.attempt_failed(g, STATUS_5XX, 0.0).transition is None  # second report ignored
    s.release(g, 0.0)
    assert s.attempt_failed(g, STATUS_5XX, 0.0).transition is None  # after release ignored
    assert s.ejection("a") is None


# ------------------------------------------------------------------ exclude, fallbacks


def test_exclude_keeps_a_retry_off_the_providers_that_failed_it() -> None:
    s = connected(routing_snapshot(capacity=5))
    for _ in range(5):
        g = s.request("g", exclude=frozenset({"a"}))
        assert isinstance(g, Grant) and g.provider_id == "b"
    try:
        s.request("g", exclude=frozenset({"a", "b"}))
    except NodeDispatchError as e:
        assert "has not failed this request" in str(e)
    else:
        raise AssertionError("no candidate left must fail")


def test_fallback_when_every_candidate_is_ejected() -> None:
    s = connected(routing_snapshot({"g": ["a"], "f1": ["b"], "f2": ["c"]}))
    eject(s, "a", 0.0)
    eject(s, "b", 0.0, group="f1")
    got = s.request("g", fallbacks=("f1", "f2"), now=1.0)
    assert isinstance(got, Grant) and (got.group_id, got.target) == ("f2", "c@f2")


def test_no_fallback_while_the_group_has_a_busy_choosable_candidate() -> None:
    s = connected(routing_snapshot({"g": ["a"], "f": ["b"]}))
    assert isinstance(s.request("g", fallbacks=("f",)), Grant)
    waiter = s.request("g", fallbacks=("f",))
    assert isinstance(waiter, Waiter) and waiter.group_id == "g"


def test_fallback_chain_all_ejected_the_first_live_group_is_the_last_resort() -> None:
    s = connected(routing_snapshot({"g": ["a"], "f": ["b"]}))
    eject(s, "a", 0.0)
    eject(s, "b", 0.0, group="f")
    got = s.request("g", fallbacks=("f",), now=1.0)
    assert isinstance(got, Grant) and got.group_id == "g"


def test_fallback_when_the_group_has_no_live_candidate_or_requires_leaves_none() -> None:
    s = connected(routing_snapshot({"g": ["a"], "f": ["b"]}))
    s.set_provider_health("a", "unhealthy")
    got = s.request("g", fallbacks=("f",))
    assert isinstance(got, Grant) and got.group_id == "f"
    s.release(got)
    try:
        s.request("g", requires=frozenset({"ollama"}), fallbacks=("f",))
    except NodeDispatchError as e:
        assert "model group 'g'" in str(e)  # the error names the group asked for
    else:
        raise AssertionError("no live candidate in the whole chain must fail")


# ------------------------------------------------------------------ through trio


async def test_pool_timer_admits_a_waiter_when_the_ejection_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = ProviderPool(routing_snapshot({"g": ["a", "b"]}, seconds=5.0))
    pool.set_node_connected("n0", True)
    waited: list[tuple[str, float]] = []

    async def late_caller() -> None:
        async with pool.lease("g") as lease:
            waited.append((lease.provider_id, lease.waited))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run_outlier_timer)
            async with pool.lease("g", exclude=frozenset({"b"})) as lease_a:
                assert pool.attempt_failed(lease_a, STATUS_5XX) is Transition.EJECTED
            assert pool.ejection("a") is not None
            async with pool.lease("g") as lease_b:
                assert lease_b.provider_id == "b"
                nursery.start_soon(late_caller)
                await trio.sleep(20)  # b stays busy: only the end of a's ejection helps
                assert waited == [("a", 5.0)]
            nursery.cancel_scope.cancel()
    assert pool.queue_depth == 0 and not pool.scheduler.active_grants


async def test_pool_falls_back_when_the_group_dies_while_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = ProviderPool(
        PoolSnapshot(
            {
                "a": ProviderSlot("a", "n0", "openai", 1),
                "b": ProviderSlot("b", "n1", "openai", 1),
            },
            {"g": GroupPolicy("g", (("a", "a"),)), "f": GroupPolicy("f", (("b", "b"),))},
        )
    )
    pool.set_node_connected("n0", True)
    pool.set_node_connected("n1", True)
    served: list[str] = []

    async def waiter() -> None:
        async with pool.lease("g", fallbacks=("f",)) as lease:
            served.append(lease.group_id)

    with trio.fail_after(60):
        async with pool.lease("g"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(1)
                pool.set_node_connected("n0", False)  # g loses its only provider
    assert served == ["f"]


async def test_pool_falls_back_on_queue_timeout_only_when_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = ProviderPool(routing_snapshot({"g": ["a"], "f": ["b"]}))
    pool.set_node_connected("n0", True)
    with trio.fail_after(60):
        async with pool.lease("g"):
            try:
                async with pool.lease("g", fallbacks=("f",), queue_timeout=1.0):
                    raise AssertionError("g is full and b is choosable: no fallback")
            except QueueTimeout:
                pass
            async with pool.lease(
                "g", fallbacks=("f",), queue_timeout=1.0, fallback_on_queue_timeout=True
            ) as lease:
                assert (lease.group_id, lease.waited) == ("f", 1.0)
    assert pool.queue_depth == 0 and not pool.scheduler.active_grants
