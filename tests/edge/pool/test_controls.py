"""Runtime controls in the pool: states, overrides, waiters, refresh.

The hypothesis machine in ``tests/edge/pool/test_pool_stateful.py`` checks controls
against its reference at random; these are the named cases an operator
relies on, through the trio layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import trio
import trio.testing

from iopd.edge.pool import Lease, PoolSnapshot, ProviderControl, ProviderPool
from iopd.edge.pool.scheduler import Grant
from iopd.errors import NodeDispatchError, ProviderDrained
from tests.support.pools import hold, in_flight, make_pool


@dataclasses.dataclass
class Holders:
    """Tasks that each take a lease from ``pool`` and hold it until ``release_all``."""

    pool: ProviderPool
    nursery: trio.Nursery
    release: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: The leases granted so far, in grant order (a queued holder has none yet).
    got: list[Lease] = dataclasses.field(default_factory=list)

    async def start(self, group: str, count: int = 1) -> None:
        """``count`` more holders on ``group``, then wait until each has its lease or queues."""
        for _ in range(count):
            await self.nursery.start(hold, self.pool, group, self.release, self.got)
        await trio.testing.wait_all_tasks_blocked()

    def release_all(self) -> None:
        self.release.set()


async def test_capacity_increase_admits_a_waiter_at_once(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(capacity=1)
    async with trio.open_nursery() as nursery:
        holders = Holders(pool, nursery)
        await holders.start("only-a", count=2)
        assert len(holders.got) == 1 and pool.queue_depth == 1
        started = trio.current_time()
        pool.set_control("a", ProviderControl(capacity=2))
        await trio.testing.wait_all_tasks_blocked()
        assert len(holders.got) == 2 and pool.queue_depth == 0
        assert trio.current_time() == started  # woken by the change, not by a timer
        assert in_flight(pool, "a") == 2
        holders.release_all()
    assert in_flight(pool, "a") == 0


async def test_draining_takes_no_new_request_and_is_drained_at_zero(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool(capacity=2)
    async with trio.open_nursery() as nursery:
        holders = Holders(pool, nursery)
        await holders.start("only-a")
        pool.set_control("a", ProviderControl(state="draining"))
        assert pool.shown_state("a") == "draining"
        with pytest.raises(NodeDispatchError):  # its group's only provider takes nothing new
            async with pool.lease("only-a"):
                pass
        async with pool.lease("m") as lease:  # the group's other provider serves
            assert lease.provider_id == "b"
        assert in_flight(pool, "a") == 1  # the lease in flight is untouched
        holders.release_all()
    assert in_flight(pool, "a") == 0
    assert pool.shown_state("a") == "drained"


async def test_disabled_refuses_new_requests_while_in_flight_finish(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool(capacity=2)
    async with trio.open_nursery() as nursery:
        holders = Holders(pool, nursery)
        await holders.start("m")
        assert holders.got[0].provider_id == "a"
        pool.set_control("a", ProviderControl(state="disabled"))
        assert pool.shown_state("a") == "disabled"
        for _ in range(3):
            async with pool.lease("m") as lease:
                assert lease.provider_id == "b"
        holders.release_all()
    assert pool.shown_state("a") == "disabled"  # never "drained": that is draining's
    pool.set_control("a", ProviderControl())
    async with pool.lease("only-a") as lease:
        assert lease.provider_id == "a"


async def test_re_enabling_admits_a_waiter(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(capacity=1)
    async with trio.open_nursery() as nursery:
        holders = Holders(pool, nursery)
        await holders.start("m", count=2)
        assert {lease.provider_id for lease in holders.got} == {"a", "b"}
        pool.set_control("a", ProviderControl(state="disabled", capacity=5))
        await holders.start("m")
        assert len(holders.got) == 2 and pool.queue_depth == 1  # b is full, a is out
        pool.set_control("a", ProviderControl(capacity=5))
        await trio.testing.wait_all_tasks_blocked()
        assert len(holders.got) == 3 and holders.got[2].provider_id == "a"
        holders.release_all()


async def test_capacity_below_in_flight_lets_leases_finish(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(capacity=3)
    async with trio.open_nursery() as nursery:
        holders = Holders(pool, nursery)
        await holders.start("only-a", count=3)
        pool.set_control("a", ProviderControl(capacity=1))
        assert pool.provider_loads()["a"].capacity == 1
        assert in_flight(pool, "a") == 3
        await holders.start("only-a")
        assert len(holders.got) == 3 and pool.queue_depth == 1
        holders.release_all()
    assert in_flight(pool, "a") == 0 and pool.queue_depth == 0
    assert len(holders.got) == 4  # the waiter ran once the three were back under 1


async def test_priority_override_changes_the_tie_break() -> None:
    pool = make_pool(capacity=2)  # a: priority 0, b: priority 1
    pool.set_control("a", ProviderControl(priority=5))
    assert pool.snapshot.providers["a"].priority == 5
    assert pool.configured.providers["a"].priority == 0
    grant = pool.scheduler.request("m")
    assert isinstance(grant, Grant) and grant.provider_id == "b"


async def test_controls_survive_a_refresh_and_a_removed_provider_drops_its_own() -> None:
    pool = make_pool(capacity=2)
    pool.set_control("a", ProviderControl(state="draining", capacity=4))
    pool.set_control("b", ProviderControl(priority=7))
    conf = pool.configured
    resized = {**conf.providers, "a": dataclasses.replace(conf.providers["a"], capacity=9)}
    pool.apply_snapshot(dataclasses.replace(conf, providers=resized))
    assert pool.control("a") == ProviderControl(state="draining", capacity=4)
    assert pool.snapshot.providers["a"].capacity == 4  # the override still wins
    assert pool.configured.providers["a"].capacity == 9
    assert not pool.snapshot.providers["a"].enabled
    without_b = {"a": resized["a"]}
    groups = {"only-a": conf.groups["only-a"]}
    pool.apply_snapshot(PoolSnapshot(without_b, groups))
    assert pool.control("b") == ProviderControl()
    pool.apply_snapshot(conf)  # b is back: as configured, no override
    assert pool.snapshot.providers["b"].priority == conf.providers["b"].priority
    assert pool.control("a").state == "draining"


async def test_unknown_provider_and_negative_capacity_are_refused() -> None:
    pool = make_pool()
    with pytest.raises(KeyError):
        pool.set_control("nope", ProviderControl(state="disabled"))
    with pytest.raises(ValueError):
        pool.set_control("a", ProviderControl(capacity=-1))
    assert pool.control("a") == ProviderControl()


async def test_a_default_control_leaves_no_entry() -> None:
    pool: ProviderPool = make_pool()
    pool.set_control("a", ProviderControl(capacity=3))
    pool.set_control("a", ProviderControl())
    assert pool.snapshot == pool.configured


async def test_a_group_whose_providers_are_all_drained_answers_503_provider_drained(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool()
    pool.set_control("a", ProviderControl(state="draining"))
    pool.set_control("b", ProviderControl(state="draining"))
    with pytest.raises(ProviderDrained) as got:
        async with pool.lease("m"):
            pass
    err = got.value
    assert (err.status, err.code) == (503, "provider_drained")
    assert err.message == (
        "model group 'm' is drained: every provider of it is drained by an operator "
        "(a drained, b drained); retry later, or `iopd provider enable ID`"
    )
    assert isinstance(err, NodeDispatchError)  # fallbacks are tried as for any dead group


@pytest.mark.parametrize(
    ("setup", "detail"),
    [
        (lambda p: p.set_control("a", ProviderControl(state="disabled")), "a disabled, b drained"),
        (lambda p: p.set_node_connected("n1", False), "a node n1 disconnected, b drained"),
        (lambda p: p.set_provider_health("a", "unhealthy"), "a unhealthy, b drained"),
    ],
    ids=["disabled", "disconnected", "unhealthy"],
)
async def test_a_group_without_a_provider_says_each_ones_state(
    autojump_clock: trio.abc.Clock, setup: Callable[[ProviderPool], object], detail: str
) -> None:
    pool = make_pool()
    pool.set_control("b", ProviderControl(state="draining"))
    setup(pool)
    with pytest.raises(NodeDispatchError) as got:
        async with pool.lease("m"):
            pass
    assert not isinstance(got.value, ProviderDrained)
    assert got.value.status == 502
    assert got.value.message == f"model group 'm' has no available provider: {detail}"


async def test_a_waiter_failed_by_a_drain_gets_provider_drained(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool()
    errors: list[BaseException] = []

    async def wait_for_a() -> None:
        try:
            async with pool.lease("only-a"):
                pass
        except NodeDispatchError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        holders = Holders(pool, nursery)
        await holders.start("only-a")
        nursery.start_soon(wait_for_a)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.queue_depth == 1
        pool.set_control("a", ProviderControl(state="draining"))
        await trio.testing.wait_all_tasks_blocked()
        holders.release_all()
    (err,) = errors
    assert isinstance(err, ProviderDrained) and err.status == 503
