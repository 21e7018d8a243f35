"""``read_timeout`` for a provider client's reads, without a cancel scope per read.

A streamed reply is read piece by piece, and every wait for the provider's
next bytes is bounded by ``read_timeout``.  A trio cancel scope around each
wait costs about 7 µs to enter and leave (`scripts/bench_read_watch.py`),
more than the read itself and a tenth of the node's CPU per relayed chunk
with hundreds of streams open.  Here a wait costs a clock read and a dict
entry instead:

* ``ReadWatch.begin(key, timeout, expire)`` notes when the wait for ``key``
  expires, ``end(key)`` forgets it;
* one task per watch (a trio system task, started at the first wait, ended
  once nothing is waited for at its wake-up) sleeps until the earliest
  expiry it knows of and calls ``expire()`` of every wait that is still
  running past its own expiry; a wait that begins earlier than the task's
  wake-up moves the wake-up (with one ``timeout`` per client, a new wait
  never expires before the ones already running, so that is rare).

``expire`` must make the waiting task stop on its own: the provider client
closes the connection's socket, which wakes the task blocked on it
(trio's ``notify_closing``) with ``ClosedResourceError``; the connection
notes the timeout first, and its ``receive`` raises ``trio.TooSlowError``
as the scope did.  A wait is timed out exactly when it lasted
``timeout`` (the task wakes at that instant), never earlier; a connection
whose read timed out is never reused anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import trio

__all__ = ["ReadWatch"]


class ReadWatch:
    """The running waits of one client and the task that times them out."""

    __slots__ = ("_waits", "_wake_at", "_scope", "_running")

    def __init__(self) -> None:
        # key -> (expiry, expire callback)
        self._waits: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._wake_at = math.inf
        self._scope: trio.CancelScope | None = None
        self._running = False

    @property
    def waiting(self) -> int:
        """Waits now running (tests, diagnostics)."""
        return len(self._waits)

    def begin(self, key: Hashable, timeout: float, expire: Callable[[], None]) -> None:
        """A wait for ``key`` starts now; ``expire()`` if it lasts ``timeout``."""
        at = trio.current_time() + timeout
        self._waits[key] = (at, expire)
        if at < self._wake_at:
            self._wake_at = at
            if self._scope is not None:
                self._scope.deadline = at
            elif not self._running:
                self._running = True
                trio.lowlevel.spawn_system_task(self._run, name="iopd.http.read_watch")

    def end(self, key: Hashable) -> None:
        """The wait for ``key`` is over (bytes came, or it was cancelled)."""
        self._waits.pop(key, None)

    async def _run(self) -> None:
        try:
            while self._waits:
                with trio.CancelScope(deadline=self._wake_at) as scope:
                    self._scope = scope
                    await trio.sleep_forever()
                self._scope = None
                self._expire_due(trio.current_time())
        finally:
            self._scope = None
            self._running = False
            self._wake_at = math.inf

    def _expire_due(self, now: float) -> None:
        nxt = math.inf
        for key, (at, expire) in list(self._waits.items()):
            if at <= now:
                del self._waits[key]
                try:
                    expire()
                except OSError:  # pragma: no cover - closing a socket; never raised into trio
                    pass
            elif at < nxt:
                nxt = at
        self._wake_at = nxt
