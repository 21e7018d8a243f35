"""The trio layer of the provider pool: park waiting requests, wake them, release leases.

Why it is thin: every decision is made synchronously by ``Scheduler``; this
module only turns "enqueued" into an awaited ``trio.Event`` and makes sure a
lease is released exactly once on every exit path (success, exception, cancel,
timeout, shutdown).  All scheduler calls are synchronous, so the cleanup in
``finally`` blocks needs no shielding and cannot be interrupted half-way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from iopd.errors import NodeDispatchError, QueueFull, QueueTimeout
from iopd.vocabulary import ContextClass, DispatchOutcome, Health

from .scheduler import (
    Grant,
    PoolSnapshot,
    ProviderLoad,
    Scheduler,
    Waiter,
    WaiterState,
)

__all__ = ["Lease", "ProviderPool", "WaitObserver"]

#: ``on_wait_done(group_id, waited_seconds, outcome)``: called once per ``lease()`` attempt.
WaitObserver = Callable[[str, float, DispatchOutcome], None]

logger = logging.getLogger(__name__)

#: Upper bound of the Retry-After hint on a queue timeout (seconds).
MAX_RETRY_AFTER = 60


@dataclass(frozen=True)
class Lease:
    """The provider a request runs on, held for the life of ``async with pool.lease(...)``."""

    provider_id: str
    node_id: str
    provider_type: str
    target: str  # the provider's served name: goes into the request's ``model``
    long: bool  # holds a long-context slot (in addition to a normal one)
    waited: float  # seconds spent in the queue (0.0 when admitted at once)


class ProviderPool:
    """Capacity-aware provider selection with one global FIFO queue (SPEC §2).

    The edge feeds it ``set_node_connected``, ``set_provider_health`` and
    ``apply_snapshot``; request handlers use ``async with pool.lease(...)``.
    Nodes start disconnected; provider health starts ``unknown`` (available).
    """

    def __init__(self, snapshot: PoolSnapshot, *, on_wait_done: WaitObserver | None = None) -> None:
        self._scheduler = Scheduler(snapshot)
        self._events: dict[Waiter, trio.Event] = {}
        self._on_wait_done = on_wait_done

    # ------------------------------------------------------------ leases

    @asynccontextmanager
    async def lease(
        self,
        group_id: str,
        *,
        context_class: ContextClass = "normal",
        requires: frozenset[str] = frozenset(),
        queue_timeout: float | None = None,
        body_bytes: int = 0,
    ) -> AsyncIterator[Lease]:
        """Hold one slot of a provider of ``group_id`` for the body of the block.

        ``body_bytes`` (the request body's size) counts against
        ``max_queued_bytes`` while the request waits, never once it holds a slot.
        Raises ``NodeDispatchError`` (no live candidate, also while waiting),
        ``QueueFull`` (would wait, queue full by count or bytes) or
        ``QueueTimeout`` (waited ``queue_timeout``, else the group's, else the
        pool default).
        """
        grant, waited = await self._acquire(
            group_id,
            long=context_class == "long",
            requires=requires,
            queue_timeout=queue_timeout,
            body_bytes=body_bytes,
        )
        try:
            yield Lease(
                provider_id=grant.provider_id,
                node_id=grant.node_id,
                provider_type=grant.provider_type,
                target=grant.target,
                long=grant.long,
                waited=waited,
            )
        finally:
            self._release(grant)

    async def _acquire(
        self,
        group_id: str,
        *,
        long: bool,
        requires: frozenset[str],
        queue_timeout: float | None,
        body_bytes: int,
    ) -> tuple[Grant, float]:
        try:
            outcome = self._scheduler.request(
                group_id,
                long=long,
                requires=requires,
                queue_timeout=queue_timeout,
                body_bytes=body_bytes,
            )
        except QueueFull:
            self._observe(group_id, 0.0, "queue_full")
            raise
        except NodeDispatchError:
            self._observe(group_id, 0.0, "dispatch_error")
            raise
        if isinstance(outcome, Grant):
            self._observe(group_id, 0.0, "admitted")
            return outcome, 0.0

        waiter = outcome
        event = self._events[waiter] = trio.Event()
        started = trio.current_time()
        try:
            with trio.move_on_after(waiter.queue_timeout):
                await event.wait()
        except BaseException:
            # Cancelled from outside while waiting (or admitted at the same
            # instant): leave no trace in the queue and hold no slot.
            self._events.pop(waiter, None)
            if waiter.grant is not None:
                self._release(waiter.grant)
            else:
                self._scheduler.cancel(waiter)
            self._observe(group_id, trio.current_time() - started, "cancelled")
            raise
        self._events.pop(waiter, None)
        waited = trio.current_time() - started
        # Admission wins over a timeout that fired in the same instant.
        if waiter.state is WaiterState.ADMITTED and waiter.grant is not None:
            self._observe(group_id, waited, "admitted")
            return waiter.grant, waited
        if waiter.state is WaiterState.FAILED:
            error = waiter.error or NodeDispatchError(
                f"model group '{group_id}' has no available provider"
            )
            self._observe(
                group_id,
                waited,
                "dispatch_error" if isinstance(error, NodeDispatchError) else "cancelled",
            )
            raise error
        self._scheduler.cancel(waiter)
        self._observe(group_id, waited, "queue_timeout")
        raise QueueTimeout(
            f"no provider of model group '{group_id}' became free within "
            f"{waiter.queue_timeout:g}s; retry later",
            retry_after=min(MAX_RETRY_AFTER, max(1, math.ceil(waiter.queue_timeout))),
        )

    def _release(self, grant: Grant) -> None:
        self._wake(self._scheduler.release(grant))

    def _wake(self, resolved: list[Waiter]) -> None:
        for waiter in resolved:
            event = self._events.get(waiter)
            if event is not None:
                event.set()

    def _observe(self, group_id: str, waited: float, outcome: DispatchOutcome) -> None:
        # A failing metrics hook must never cost a lease (or leak one).
        if self._on_wait_done is not None:
            try:
                self._on_wait_done(group_id, waited, outcome)
            except Exception:
                logger.exception("event=callback_failed component=pool callback=on_wait_done")

    # ------------------------------------------------------------ state feeds

    def set_node_connected(self, node_id: str, connected: bool) -> None:
        """A node session came up (True) or went away (False); re-examines waiters."""
        self._wake(self._scheduler.set_node_connected(node_id, connected))

    def set_provider_health(self, provider_id: str, health: Health) -> None:
        """Record a provider's probe result (unknown | healthy | unhealthy); re-examines."""
        self._wake(self._scheduler.set_provider_health(provider_id, health))

    def apply_snapshot(self, snapshot: PoolSnapshot) -> None:
        """Swap the pool's config (copy-on-write refresh); re-examines waiters.

        Leases taken before keep counting against their provider until released.
        """
        self._wake(self._scheduler.apply_snapshot(snapshot))

    def fail_all_waiters(self, exc_factory: Callable[[], BaseException]) -> None:
        """Shutdown: every current waiter is woken and raises ``exc_factory()``."""
        waiters = self._scheduler.fail_all_waiters()
        for waiter in waiters:
            waiter.error = exc_factory()
        self._wake(waiters)

    # ------------------------------------------------------------ status

    @property
    def snapshot(self) -> PoolSnapshot:
        return self._scheduler.snapshot

    @property
    def scheduler(self) -> Scheduler:
        """The synchronous state machine (read-only use: status, tests)."""
        return self._scheduler

    @property
    def queue_depth(self) -> int:
        """Requests currently waiting in the global queue."""
        return self._scheduler.queue_depth

    @property
    def max_queue(self) -> int:
        return self._scheduler.max_queue

    @property
    def queued_bytes(self) -> int:
        """Request-body bytes held by the requests waiting in the global queue."""
        return self._scheduler.queued_bytes

    @property
    def max_queued_bytes(self) -> int:
        return self._scheduler.max_queued_bytes

    def provider_loads(self) -> dict[str, ProviderLoad]:
        """Per-provider in_flight, long_in_flight, queued, capacities and load ratio."""
        return self._scheduler.provider_loads()
