"""A settlement whose outcome was unknown is sent again at recovery and counted once.

The store is frozen (SIGSTOP) while an edge settles: the call runs over
``limits.backend_timeout``, which starts an outage, yet the command sits in
the server's socket and runs when the server thaws.  The edge cannot know
that, so it sends the settlement again at recovery; the store's ``done``
set must make the second one a no-op.  The same holds when the store died
with the call (SIGKILL): then the first never ran, and the one sent at
recovery is the one that counts.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from iopd.config.schema import LimitsSection, PrincipalLimit
from iopd.edge.metering.metrics import GatewayMetrics
from iopd.edge.principals.backend import SharedAdmission
from iopd.edge.principals.reservation import Reservation
from iopd.edge.principals.shared_limits import SharedLimits
from iopd.edge.principals.store import LimitsStore
from tests.support.redis_server import RedisServer, running_redis

REF = "team-r"


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


def shared_limits(redis: RedisServer) -> SharedLimits:
    section = LimitsSection(
        principals=[
            PrincipalLimit(principal_ref=REF, tokens_per_minute=10_000, tokens_per_day=100_000)
        ],
        backend="redis",
        redis_url=redis.url,
        backend_timeout=0.3,
        lease_ttl=3.0,
    )
    return SharedLimits(section, LimitsStore(redis.url, timeout=0.3), GatewayMetrics("edge-r"))


async def windows(redis: RedisServer) -> tuple[int, int, int]:
    """(requests, tokens in the minute, tokens today) as the store holds them."""
    store = LimitsStore(redis.url, timeout=2.0)
    async with store.client:
        view = await store.withdraw(REF, "probe-never-admitted", 0, 0, -1)
    return view.requests, view.tokens, view.day_total


async def settle_through_an_outage(
    redis: RedisServer, freeze: Any, thaw: Any, *, used: int
) -> tuple[int, int, int]:
    limits = shared_limits(redis)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(limits.run)
            admission = await limits.admit(REF, Reservation(100, 200))
            assert isinstance(admission, SharedAdmission)
            assert await windows(redis) == (1, 300, 300)
            freeze()
            await limits.settle(admission, used)  # runs over backend_timeout: an outage
            assert limits.backend_row()["state"] == "outage"
            thaw()
            # Polling on purpose: the probe (ping, then the redo) tells no one.
            while limits.backend_row()["state"] != "ok":  # noqa: ASYNC110
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    return await windows(redis)


async def test_a_settlement_that_ran_unseen_is_sent_again_and_counted_once(
    redis: RedisServer,
) -> None:
    """Frozen store: the first settlement runs when it thaws, the one sent at recovery is a no-op."""
    assert redis.proc is not None
    proc = redis.proc
    for used in (120, 450):  # below the reservation (returned), above it (debt)
        got = await settle_through_an_outage(
            redis,
            lambda: proc.send_signal(signal.SIGSTOP),
            lambda: proc.send_signal(signal.SIGCONT),
            used=used,
        )
        assert got == (1, used, used), used  # not used - 300 + used, nor debt twice
        redis.command("FLUSHALL")


async def test_a_settlement_lost_with_the_store_is_sent_at_recovery(redis: RedisServer) -> None:
    """Killed store: the settlement never ran; the one sent at recovery counts (a fresh store)."""
    got = await settle_through_an_outage(redis, redis.kill, redis.start, used=450)
    assert got == (0, 150, 150)  # the admission died with the store; the debt is carried
