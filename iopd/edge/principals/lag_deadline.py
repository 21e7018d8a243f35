"""A deadline for a call to another server that measures that server, not this loop.

Why: a ``fail_after`` deadline counts the time this process's own event loop
was held up (a flood of work, a blocking call in some task); a reply the
other side sent in time then reads as a timeout.  The limits store's calls
use this instead, so an edge under load does not take a healthy store for
an outage (and fail open or closed because of its own lag).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

__all__ = ["LAG_ALLOWANCE_S", "LAG_TOLERANCE_S", "lag_aware_deadline"]

#: A call's deadline that fires later than this (s) found the loop held up.
LAG_TOLERANCE_S = 0.02
#: At most this much of the loop's lag (s) is given back to one store call:
#: a store that is really gone is still found within backend_timeout + this.
LAG_ALLOWANCE_S = 2.0

_T = TypeVar("_T")


async def lag_aware_deadline(call: Callable[[], Awaitable[_T]], timeout: float) -> _T:
    """``call()`` given ``timeout`` seconds of the loop's time, or ``trio.TooSlowError``.

    Why not ``fail_after``: a deadline counts the time this edge's own loop
    was held up (a flood of work, a blocking call in some task), and a reply
    the store sent in time then reads as a timeout.  Here a timer sleeps
    until the deadline; when it wakes later than asked, by more than
    :data:`LAG_TOLERANCE_S`, the loop was not running, so the store's reply
    may be sitting unread: that lateness is given back (the deadline moves
    by it) and the call goes on, up to :data:`LAG_ALLOWANCE_S` in all.  A
    store that does not answer is still given up on within
    ``timeout + LAG_ALLOWANCE_S`` (plus the last late wake).
    """
    got: list[_T] = []
    scope = trio.CancelScope()

    async def timer() -> None:
        wait, allowance = timeout, LAG_ALLOWANCE_S
        while True:
            asked = trio.current_time() + wait
            await trio.sleep_until(asked)
            late = trio.current_time() - asked
            if late <= LAG_TOLERANCE_S or allowance <= 0:
                break
            wait = min(late, allowance)
            allowance -= wait
        scope.cancel()

    failed: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timer)
        try:
            with scope:
                got.append(await call())
        except Exception as exc:  # raised as itself below, not in the nursery's group
            failed.append(exc)
        nursery.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if not got:
        raise trio.TooSlowError
    return got[0]
