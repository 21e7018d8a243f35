"""Trio-layer tests of ProviderPool: waiting, timeouts, cancel, release on every path."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iopd.edge.pool import GroupPolicy, PoolSnapshot, ProviderSlot
from iopd.edge.pool.pool import Lease, ProviderPool
from iopd.errors import NodeDispatchError, QueueFull, QueueTimeout
from tests.support.pools import hold, in_flight, make_pool


async def test_immediate_lease_and_release(autojump_clock: trio.abc.Clock) -> None:
    observed: list[tuple[str, float, str]] = []
    pool = make_pool(observed=observed)
    with trio.fail_after(5):
        async with pool.lease("m") as lease:
            assert (lease.provider_id, lease.target, lease.node_id) == ("a", "echo-1", "n1")
            assert lease.waited == 0.0 and not lease.long
            assert in_flight(pool, "a") == 1
    assert in_flight(pool, "a") == 0
    assert observed == [("m", 0.0, "admitted")]


async def test_waiter_admitted_on_release_records_wait(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    got: list[Lease] = []
    release = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(hold, pool, "only-a", release, got)
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(hold, pool, "only-a", trio.Event(), got)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.queue_depth == 1
            await trio.sleep(3)
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert len(got) == 2 and got[1].waited == pytest.approx(3.0)
            assert pool.queue_depth == 0 and in_flight(pool, "a") == 1
            nursery.cancel_scope.cancel()
    assert in_flight(pool, "a") == 0


async def test_queue_timeout_raises_with_retry_after(autojump_clock: trio.abc.Clock) -> None:
    observed: list[tuple[str, float, str]] = []
    pool = make_pool(group_timeout=None, queue_timeout=7, observed=observed)
    with trio.fail_after(60):
        async with pool.lease("only-a"):
            start = trio.current_time()
            with pytest.raises(QueueTimeout) as info:
                async with pool.lease("only-a"):
                    pytest.fail("must not be admitted")
            assert trio.current_time() - start == pytest.approx(7)
            assert ("Retry-After", "7") in info.value.headers
            assert info.value.status == 503
            assert pool.queue_depth == 0
    assert in_flight(pool, "a") == 0
    assert [(g, round(w, 6), o) for g, w, o in observed] == [
        ("only-a", 0.0, "admitted"),
        ("only-a", 7.0, "queue_timeout"),
    ]


async def test_queue_timeout_uses_group_override(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(queue_timeout=30)
    legacy = PoolSnapshot(
        providers=pool.snapshot.providers,
        groups={**pool.snapshot.groups, "legacy": GroupPolicy("legacy", (("a", "x"),), 2.0)},
        max_queue=10,
        queue_timeout=30,
    )
    pool.apply_snapshot(legacy)
    with trio.fail_after(60):
        async with pool.lease("only-a"):
            start = trio.current_time()
            with pytest.raises(QueueTimeout):
                async with pool.lease("legacy"):
                    pass
            assert trio.current_time() - start == pytest.approx(2)
            start = trio.current_time()
            with pytest.raises(QueueTimeout):
                async with pool.lease("legacy", queue_timeout=0.5):
                    pass
            assert trio.current_time() - start == pytest.approx(0.5)


async def test_queue_full_and_max_queue_zero(autojump_clock: trio.abc.Clock) -> None:
    observed: list[tuple[str, float, str]] = []
    pool = make_pool(max_queue=0, observed=observed)
    with trio.fail_after(5):
        async with pool.lease("only-a"):
            with pytest.raises(QueueFull):
                async with pool.lease("only-a"):
                    pass
    assert [o for _, _, o in observed] == ["admitted", "queue_full"]
    assert pool.max_queue == 0


async def test_cancel_while_waiting_leaves_queue_clean(autojump_clock: trio.abc.Clock) -> None:
    observed: list[tuple[str, float, str]] = []
    pool = make_pool(observed=observed)
    reached = False
    with trio.fail_after(60):
        async with pool.lease("only-a"):
            with trio.move_on_after(1):
                async with pool.lease("only-a"):
                    reached = True
            assert pool.queue_depth == 0
        # The cancelled waiter was never admitted and holds nothing.
        assert in_flight(pool, "a") == 0
    assert not reached
    assert [o for _, _, o in observed] == ["admitted", "cancelled"]


async def test_cancel_does_not_admit_dead_waiter(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    got: list[Lease] = []
    release = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(hold, pool, "only-a", release, got)
            async with trio.open_nursery() as waiters:
                await waiters.start(hold, pool, "only-a", trio.Event(), got)
                await trio.testing.wait_all_tasks_blocked()
                assert pool.queue_depth == 1
                waiters.cancel_scope.cancel()
            assert pool.queue_depth == 0
            release.set()
    assert len(got) == 1 and in_flight(pool, "a") == 0


async def test_release_on_exception(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    with trio.fail_after(5):
        with pytest.raises(RuntimeError):
            async with pool.lease("m"):
                raise RuntimeError("provider blew up")
    assert in_flight(pool, "a") == 0


async def test_release_on_cancel_while_holding(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    with trio.fail_after(60):
        with trio.move_on_after(1):
            async with pool.lease("m"):
                assert in_flight(pool, "a") == 1
                await trio.sleep_forever()
    assert in_flight(pool, "a") == 0


async def test_waiter_fails_fast_when_last_candidate_disconnects(
    autojump_clock: trio.abc.Clock,
) -> None:
    observed: list[tuple[str, float, str]] = []
    pool = make_pool(observed=observed)
    errors: list[BaseException] = []

    async def waiter(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with pool.lease("only-a"):
                pass
        except NodeDispatchError as exc:
            errors.append(exc)

    with trio.fail_after(60):
        async with pool.lease("only-a"):
            async with trio.open_nursery() as nursery:
                await nursery.start(waiter)
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(2)
                pool.set_node_connected("n1", False)
            assert trio.current_time() == pytest.approx(2)  # not at the 30 s timeout
    assert len(errors) == 1 and pool.queue_depth == 0
    assert in_flight(pool, "a") == 0
    assert [(g, round(w, 6), o) for g, w, o in observed] == [
        ("only-a", 0.0, "admitted"),
        ("only-a", 2.0, "dispatch_error"),
    ]


async def test_reconnect_admits_waiter(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    pool.set_node_connected("n2", False)
    got: list[Lease] = []
    with trio.fail_after(60):
        async with pool.lease("m") as first:
            assert first.provider_id == "a"
            async with trio.open_nursery() as nursery:
                await nursery.start(hold, pool, "m", trio.Event(), got)
                await trio.testing.wait_all_tasks_blocked()
                assert pool.queue_depth == 1
                pool.set_node_connected("n2", True)
                await trio.testing.wait_all_tasks_blocked()
                assert [g.provider_id for g in got] == ["b"]
                assert got[0].provider_type == "openai" and got[0].target == "gpt"
                nursery.cancel_scope.cancel()
    assert in_flight(pool, "a") == 0 and in_flight(pool, "b") == 0


async def test_fail_all_waiters_on_shutdown(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    errors: list[BaseException] = []

    async def waiter(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with pool.lease("only-a"):
                pass
        except NodeDispatchError as exc:
            errors.append(exc)

    with trio.fail_after(60):
        async with pool.lease("only-a"):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    await nursery.start(waiter)
                await trio.testing.wait_all_tasks_blocked()
                assert pool.queue_depth == 3
                pool.fail_all_waiters(lambda: NodeDispatchError("edge is shutting down"))
    assert len(errors) == 3 and len({id(e) for e in errors}) == 3
    assert pool.queue_depth == 0 and in_flight(pool, "a") == 0


async def test_admission_wins_over_simultaneous_timeout(autojump_clock: trio.abc.Clock) -> None:
    # The holder releases exactly when the waiter's deadline expires: whichever
    # the scheduler decided first is honoured and nothing leaks.
    pool = make_pool(queue_timeout=5)
    outcomes: list[str] = []

    async def holder(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with pool.lease("only-a"):
            task_status.started()
            await trio.sleep(5)

    async def waiter() -> None:
        try:
            async with pool.lease("only-a"):
                outcomes.append("admitted")
        except QueueTimeout:
            outcomes.append("timeout")

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(holder)
            nursery.start_soon(waiter)
    assert len(outcomes) == 1
    assert in_flight(pool, "a") == 0 and pool.queue_depth == 0


async def test_provider_loads_and_long_lease(autojump_clock: trio.abc.Clock) -> None:
    snapshot = PoolSnapshot(
        providers={"big": ProviderSlot("big", "n1", "ollama", 2, 1, 0, True)},
        groups={"m": GroupPolicy("m", (("big", "llama"),))},
        max_queue=4,
        queue_timeout=10,
    )
    pool = ProviderPool(snapshot)
    pool.set_node_connected("n1", True)
    with trio.fail_after(5):
        async with pool.lease("m", context_class="long", requires=frozenset({"ollama"})) as lease:
            assert lease.long
            load = pool.provider_loads()["big"]
            assert (load.in_flight, load.long_in_flight, load.load_ratio) == (1, 1, 0.5)
    load = pool.provider_loads()["big"]
    assert (load.in_flight, load.long_in_flight, load.load_ratio) == (0, 0, 0.0)


async def test_waiter_admitted_then_cancelled_in_same_step(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool()
    got: list[Lease] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as waiters:
            cm = pool.lease("only-a")
            await cm.__aenter__()
            await waiters.start(hold, pool, "only-a", trio.Event(), got)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.queue_depth == 1
            # Release admits the waiter synchronously; cancel it before it runs.
            await cm.__aexit__(None, None, None)
            assert in_flight(pool, "a") == 1 and pool.queue_depth == 0
            waiters.cancel_scope.cancel()
    assert in_flight(pool, "a") == 0 and pool.queue_depth == 0


async def test_failing_observer_does_not_leak(autojump_clock: trio.abc.Clock) -> None:
    def broken(group: str, waited: float, outcome: str) -> None:
        raise ValueError("metrics down")

    pool = ProviderPool(make_pool().snapshot, on_wait_done=broken)
    pool.set_node_connected("n1", True)
    with trio.fail_after(5):
        async with pool.lease("m") as lease:
            assert lease.provider_id == "a"
    assert in_flight(pool, "a") == 0
