"""A request's time limit is parked only while it waits for a lease.

The end-to-end contract (a request that runs out of time while queued is a
queue timeout, with a lease it is the provider's 504) is in
``tests/e2e/test_request_timeout.py``; this is the bookkeeping under it: a request granted
a provider at once never moves its scope's deadline (two updates of trio's
deadline heap on the path of every request), a queued one parks it once and
gets it back.
"""

from __future__ import annotations

import math
from typing import Any, cast

import trio

from iopd.edge.openai.lifecycle import Call, Outcome


def _call(seconds: float) -> tuple[Call, trio.CancelScope]:
    scope = trio.CancelScope(deadline=trio.current_time() + seconds)
    return Call(cast(Any, None), Outcome(request_id="req-1"), scope), scope


async def test_a_request_leased_at_once_keeps_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, scope = _call(5.0)
    deadline = scope.deadline
    await trio.sleep(2.0)
    assert call.time_left() == 3.0
    call.resume_deadline()  # leased without waiting: nothing to put back
    assert scope.deadline == deadline and not call.parked


async def test_a_queued_request_parks_its_deadline_once_and_gets_it_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, scope = _call(5.0)
    deadline = scope.deadline
    await call.park()  # the pool's on_queued
    call.park_deadline()  # a second wait (a retry's) changes nothing
    assert scope.deadline == math.inf and call.parked
    await trio.sleep(10.0)  # past its own limit: only the wait's bound applies now
    assert call.time_left() == 0.0
    call.resume_deadline()
    assert scope.deadline == deadline and not call.parked
    with scope:
        await trio.lowlevel.checkpoint()  # its deadline is in the past: cancelled
    assert scope.cancelled_caught
