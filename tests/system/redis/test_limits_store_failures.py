"""The shared limits store fails safe and recovers by itself.

A real ``redis-server`` keeps the counters; between it and each edge
(``SharedLimits``) sits a ``RogueProxy`` the test tells to answer garbage,
a truncated bulk reply, or to pass bytes unchanged; ``CLIENT PAUSE`` stalls
the real one.  Every scenario asserts what was admitted against the bound
``docs/operations.md`` states for its ``on_backend_error`` mode, and ends
with nothing leaked: every admission withdrawn or settled, the store's
windows, slots and this edge's own counts back to zero.

The windows run on the server's clock, so these tests use the real clock;
each takes seconds, well inside one minute's window.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from iopd import errors
from iopd.config.schema import LimitsSection, PrincipalLimit
from iopd.edge.metering.metrics import GatewayMetrics
from iopd.edge.principals.backend import SharedAdmission
from iopd.edge.principals.lag_deadline import LAG_ALLOWANCE_S
from iopd.edge.principals.reservation import Reservation
from iopd.edge.principals.shared_limits import SharedLimits
from iopd.edge.principals.store import LimitsStore, Unseen
from tests.support.redis_server import RedisServer, running_redis
from tests.support.rogue_store import RogueProxy

REF = "team-f"
TIMEOUT = 0.3


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


def section(url: str, mode: str, **limits: int) -> LimitsSection:
    return LimitsSection(
        principals=[PrincipalLimit(principal_ref=REF, **limits)],
        backend="redis",
        redis_url=url,
        on_backend_error=mode,  # type: ignore[arg-type]
        backend_timeout=TIMEOUT,
        lease_ttl=3.0,
    )


@asynccontextmanager
async def edge(
    url: str, mode: str = "local", name: str = "edge-f", **limits: int
) -> AsyncIterator[SharedLimits]:
    sec = section(url, mode, **limits)
    backstop = TIMEOUT + LAG_ALLOWANCE_S + 1.0
    store = LimitsStore(url, timeout=TIMEOUT, backstop=backstop)
    shared = SharedLimits(sec, store, GatewayMetrics(name))
    async with trio.open_nursery() as nursery:
        await nursery.start(shared.run)
        yield shared
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def proxy(redis: RedisServer) -> AsyncIterator[RogueProxy]:
    async with trio.open_nursery() as nursery:
        rogue: RogueProxy = await nursery.start(RogueProxy(redis.port).serve)
        yield rogue
        nursery.cancel_scope.cancel()


async def store_windows(redis: RedisServer) -> tuple[int, int, int, int]:
    """(requests, tokens in the minute, tokens today, slots) as the store holds them."""
    store = LimitsStore(redis.url, timeout=2.0)
    async with store.client:
        view = await store.withdraw(REF, "probe-never-admitted", 0, 0, -1)
        slots = await store.slots_held(REF)
    return view.requests, view.tokens, view.day_total, slots


async def until_ok(shared: SharedLimits) -> float:
    """Seconds until the edge leaves ``outage``."""
    start = trio.current_time()
    while shared.backend_row()["state"] != "ok":  # noqa: ASYNC110 - the probe tells no one
        await trio.sleep(0.02)
    return trio.current_time() - start


async def until_outage(shared: SharedLimits) -> None:
    while shared.backend_row()["state"] != "outage":  # noqa: ASYNC110
        await trio.sleep(0.02)


async def try_admit(shared: SharedLimits, tokens: int = 10) -> SharedAdmission | None:
    got = await shared.admit(REF, Reservation(tokens, 0))
    return got if isinstance(got, SharedAdmission) else None


async def end_all_and_check_nothing_leaked(
    shared: SharedLimits, redis: RedisServer, held: list[SharedAdmission]
) -> None:
    """Withdraw every admission (so every window returns to zero at once) and look."""
    assert shared.backend_row()["state"] == "ok"
    for admission in held:
        await shared.withdraw(admission)
    assert await store_windows(redis) == (0, 0, 0, 0)
    assert shared._leases == {} and shared._redo == []
    assert shared._unseen == {} and shared._unseen_day == {}
    if shared._local is not None:
        assert shared._local.running == {}
        status = shared._local.limiter.status_of(REF, time.time())
        assert (status.requests_per_minute.used, status.tokens_per_minute.used) == (0, 0)
        assert (status.tokens_per_day.used, status.admitted) == (0, 0)


# ------------------------------------------------------------------ garbage


async def test_garbage_replies_flapping_admit_one_limit_in_all_and_the_store_learns_them(
    redis: RedisServer,
) -> None:
    """``local``, one edge, RPM 10: an outage that flaps (garbage, clean, garbage...)
    neither restarts this edge's counts nor the store's window: 10 in all."""
    with trio.fail_after(40):
        async with proxy(redis) as rogue, edge(rogue.url, requests_per_minute=10) as shared:
            held: list[SharedAdmission] = []
            for _round in range(4):
                for _ in range(2):
                    got = await try_admit(shared)
                    if got:
                        held.append(got)
                rogue.set_mode("garbage")
                for _ in range(6):
                    got = await try_admit(shared)
                    if got:
                        held.append(got)
                assert shared.backend_row()["state"] == "outage"
                rogue.set_mode("relay")
                await until_ok(shared)
            assert len(held) == 10  # this edge's bound: one limit's worth in the window
            assert (await store_windows(redis))[0] == 10  # the store knows every one
            assert await try_admit(shared) is None
            assert shared.errors_total >= 4
            await end_all_and_check_nothing_leaked(shared, redis, held)


async def test_tokens_admitted_during_an_outage_are_written_with_their_usage(
    redis: RedisServer,
) -> None:
    """Settled during the outage: the store gets the usage (below the reservation,
    and above it: debt); still running: the reservation, settled there later."""
    with trio.fail_after(30):
        async with proxy(redis) as rogue, edge(rogue.url, tokens_per_minute=10_000) as shared:
            rogue.set_mode("garbage")
            a, b, c = [await try_admit(shared, 100) for _ in range(3)]
            assert a and b and c and shared.backend_row()["state"] == "outage"
            await shared.settle(a, 40)
            await shared.settle(b, 250)
            rogue.set_mode("relay")
            await until_ok(shared)
            assert (await store_windows(redis))[:3] == (3, 40 + 250 + 100, 40 + 250 + 100)
            await shared.settle(c, 70)
            assert (await store_windows(redis))[:3] == (3, 360, 360)


async def test_admissions_written_twice_count_once(redis: RedisServer) -> None:
    """``record`` sent again (its first answer lost) is skipped; a running one is
    then an ordinary admission: its settlement and its lease work as any other."""
    if time.time() % 86_400 < 120:
        pytest.skip("too close to UTC midnight: the entries' days would differ")
    with trio.fail_after(20):
        store = LimitsStore(redis.url, timeout=2.0)
        async with store.client:
            unseen = [
                Unseen("done-1", 5.0, 30, debt=20, debt_age_s=1.0, settled=True),
                Unseen("run-1", 2.0, 100, slot=True),
                Unseen("old-1", 90.0, 7, settled=True),  # past the minute: the day only
            ]
            for _ in range(2):
                days = await store.record(REF, 0, 3.0, unseen)
            assert len(set(days)) == 1
            assert await store_windows(redis) == (2, 150, 157, 1)
            await store.settle(REF, "run-1", 100, 60, 0, days[1])
            assert await store_windows(redis) == (2, 110, 117, 0)
            await store.settle(REF, "done-1", 30, 500, 0, days[0])  # done: a no-op
            assert await store_windows(redis) == (2, 110, 117, 0)


# ------------------------------------------------------------------ truncated reply


@pytest.mark.parametrize("mode", ["local", "reject"])
async def test_a_truncated_reply_rebuilds_the_client_and_the_outage_ends_by_itself(
    redis: RedisServer, mode: str
) -> None:
    """``$1000000000\\r\\nabc`` leaves a connection waiting for a gigabyte: the
    client is discarded, and once the store answers properly the edge is back
    within ``recovery_bound_s``; with ``reject`` nothing is admitted meanwhile."""
    with trio.fail_after(40):
        async with proxy(redis) as rogue, edge(rogue.url, mode, requests_per_minute=10) as shared:
            first = await try_admit(shared)
            assert first is not None
            held = [first]
            before = rogue.connections
            rogue.set_mode("truncate")
            if mode == "reject":
                with pytest.raises(errors.LimitsUnavailable):
                    await try_admit(shared)
            else:
                during = await try_admit(shared)
                assert during is not None
                held.append(during)
            assert shared.backend_row()["state"] == "outage"
            await trio.sleep(2.5)  # the probes meanwhile get truncated replies too
            rogue.set_mode("relay")
            took = await until_ok(shared)
            # The outage left one call: the withdrawal of the admission whose answer was cut.
            assert took <= shared.recovery_bound_s() + TIMEOUT
            assert rogue.connections >= before + 2  # a new client for each probe
            assert (await store_windows(redis))[0] == len(held)
            after = await try_admit(shared)
            assert after is not None
            held.append(after)
            await end_all_and_check_nothing_leaked(shared, redis, held)


async def test_a_stalled_store_whose_calls_ran_unseen_counts_only_what_was_admitted(
    redis: RedisServer,
) -> None:
    """``reject``: the store runs the admission but its reply is held back; the
    edge refuses the request (503), and the admission that ran is withdrawn at
    recovery: the store counts only what was served."""
    with trio.fail_after(30):
        async with (
            proxy(redis) as rogue,
            edge(rogue.url, "reject", requests_per_minute=5) as shared,
        ):
            first = await try_admit(shared)
            assert first is not None
            rogue.set_mode("stall")
            with pytest.raises(errors.LimitsUnavailable):
                await try_admit(shared)
            assert (await store_windows(redis))[0] == 2  # it ran, unseen
            with pytest.raises(errors.LimitsUnavailable):
                await try_admit(shared)  # the outage holds: not even sent
            rogue.set_mode("relay")
            await until_ok(shared)
            assert (await store_windows(redis))[0] == 1
            await end_all_and_check_nothing_leaked(shared, redis, [first])


# ------------------------------------------------------------------ CLIENT PAUSE


async def test_client_pause_admits_one_limit_in_all_on_one_edge(redis: RedisServer) -> None:
    """``CLIENT PAUSE 4000``, RPM 10, ``local``: 4 s of outage and the calls it held
    back run when it ends, yet 10 in all, and the store's count agrees."""
    with trio.fail_after(40):
        async with edge(redis.url, requests_per_minute=10) as shared:
            held = [a for a in [await try_admit(shared) for _ in range(3)] if a]
            assert len(held) == 3
            assert redis.command("CLIENT", "PAUSE", "4000").startswith(b"+OK")
            healthy_at = trio.current_time() + 4.0
            for _ in range(15):
                got = await try_admit(shared)
                if got:
                    held.append(got)
            assert shared.backend_row()["state"] == "outage"
            assert len(held) == 10
            await until_ok(shared)
            # Left: one principal's admissions to write, one withdrawal to send again.
            late = trio.current_time() - healthy_at
            assert late <= shared.recovery_bound_s() + 2 * TIMEOUT
            assert (await store_windows(redis))[0] == 10
            assert await try_admit(shared) is None
            await end_all_and_check_nothing_leaked(shared, redis, held)


# ------------------------------------------------------------------ slots


async def test_slots_held_through_an_outage_stay_within_the_cap_and_are_given_back(
    redis: RedisServer,
) -> None:
    """``max_concurrent: 2``: a store slot held when the outage starts counts in this
    edge's own count; the one taken locally becomes a store lease at recovery."""
    with trio.fail_after(30):
        async with proxy(redis) as rogue, edge(rogue.url, max_concurrent=2) as shared:
            a = await try_admit(shared)
            assert a is not None and a.slot
            rogue.set_mode("garbage")
            b = await try_admit(shared)
            assert b is not None and shared.backend_row()["state"] == "outage"
            assert await shared.try_slot(b)  # the second slot, this edge's own count
            c = await try_admit(shared)
            assert c is not None
            assert not await shared.try_slot(c)  # a's store slot counts: the cap holds
            assert shared._local is not None and shared._local.running == {REF: 2}
            rogue.set_mode("relay")
            await until_ok(shared)
            assert (await store_windows(redis))[3] == 2  # b's lease is in the store now
            assert not await shared.try_slot(c)
            await shared.settle(a, 5)
            assert await shared.try_slot(c)
            await shared.settle(b, 5)
            await shared.settle(c, 5)
            assert (await store_windows(redis))[3] == 0
            assert shared._local.running == {} and shared._leases == {}


# ------------------------------------------------------------------ loop lag


async def test_a_reply_read_late_because_the_loop_was_held_up_is_no_timeout(
    redis: RedisServer,
) -> None:
    """While a call waits for the store's (immediate) reply, another task blocks
    the whole loop for twice the timeout: that is the edge's lag, not the store's."""
    with trio.fail_after(30):
        async with edge(redis.url, "reject", requests_per_minute=100) as shared:
            real = shared.store.admit
            got: list[SharedAdmission | None] = []

            def block() -> None:
                time.sleep(2 * TIMEOUT)  # a flood of work, a blocking call: the loop stops

            async with trio.open_nursery() as nursery:

                async def admit_while_blocked(*args: Any, **kwargs: Any) -> Any:
                    nursery.start_soon(_run, block)
                    return await real(*args, **kwargs)

                shared.store.admit = admit_while_blocked  # type: ignore[method-assign]
                for _ in range(5):
                    got.append(await try_admit(shared))
            shared.store.admit = real  # type: ignore[method-assign]
            assert all(got) and len(got) == 5
            assert shared.backend_row()["state"] == "ok" and shared.errors_total == 0
            await end_all_and_check_nothing_leaked(shared, redis, [a for a in got if a])


async def _run(f: Any) -> None:
    f()


async def test_two_edges_with_a_blocked_loop_admit_exactly_the_limit(redis: RedisServer) -> None:
    """Two edges, RPM 20, a task hogging the loop (blocking calls of 0.5 s) while
    callers admit on both: no outage, and exactly 20 get in."""
    with trio.fail_after(60):
        async with (
            edge(redis.url, requests_per_minute=20, name="edge-1") as one,
            edge(redis.url, requests_per_minute=20, name="edge-2") as two,
        ):
            held: list[tuple[SharedLimits, SharedAdmission]] = []
            done = trio.Event()

            async def hog() -> None:
                while not done.is_set():
                    time.sleep(0.5)  # noqa: ASYNC251 - the loop held up on purpose
                    await trio.sleep(0.01)

            async def caller(shared: SharedLimits) -> None:
                for _ in range(15):
                    got = await try_admit(shared)
                    if got:
                        held.append((shared, got))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(hog)
                async with trio.open_nursery() as callers:
                    for shared in (one, two, one, two):
                        callers.start_soon(caller, shared)
                done.set()
            assert len(held) == 20
            assert one.errors_total == two.errors_total == 0
            assert (await store_windows(redis))[0] == 20
            for shared, admission in held:
                await shared.withdraw(admission)
            assert await store_windows(redis) == (0, 0, 0, 0)


# ------------------------------------------------------------------ two edges


async def test_two_edges_one_in_outage_admit_at_most_one_extra_limit(redis: RedisServer) -> None:
    """RPM 20; edge 1 gets garbage from the start, edge 2 the store: ``local``
    admits at most the limit plus one limit for the edge in outage (40), and at
    recovery the store learns all of them: neither edge admits more."""
    with trio.fail_after(60):
        async with (
            proxy(redis) as rogue,
            edge(rogue.url, requests_per_minute=20, name="edge-1") as one,
            edge(redis.url, requests_per_minute=20, name="edge-2") as two,
        ):
            rogue.set_mode("garbage")
            ones = [a for a in [await try_admit(one) for _ in range(30)] if a]
            twos = [a for a in [await try_admit(two) for _ in range(30)] if a]
            assert len(twos) == 20 and len(ones) <= 20
            rogue.set_mode("relay")
            await until_ok(one)
            assert (await store_windows(redis))[0] == len(ones) + len(twos)
            assert await try_admit(one) is None and await try_admit(two) is None
            for a in ones:
                await one.withdraw(a)
            for a in twos:
                await two.withdraw(a)
            assert await store_windows(redis) == (0, 0, 0, 0)
