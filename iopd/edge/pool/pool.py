"""The trio layer of the provider pool: park waiting requests, wake them, release leases.

Why it is thin: every decision is made synchronously by ``Scheduler``; this
module only turns "enqueued" into an awaited ``trio.Event``, makes sure a
lease is released exactly once on every exit path (success, exception, cancel,
timeout, shutdown), passes ``trio.current_time()`` as the scheduler's ``now``,
and runs the one timer passive ejection needs (``run_outlier_timer``: wake
waiters when an ejection or a 429 saturation runs out).  It also keeps the
operator's runtime controls (``controls.ControlTable``) and hands the
scheduler the config under them, so the scheduler never knows of them.
With several edges it takes the nodes' load reports and ``Busy``
answers (``set_remote_load``, ``provider_busy``) and tells the nodes which
providers it has waiters for (``on_waiting``, only the changes, only when
something waits or waited: nothing on the hot path of an idle queue).  All scheduler calls
are synchronous, so the cleanup in ``finally`` blocks needs no shielding and
cannot be interrupted half-way.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple

import trio

from iopd.errors import NodeDispatchError, QueueFull, QueueTimeout
from iopd.vocabulary import ContextClass, DispatchOutcome, Health, ProviderType

from .controls import ControlTable, ProviderControl, ShownState, shown_state
from .outliers import EjectionStatus, Transition
from .retry_rules import FailureReason
from .routing import RouteAsk
from .scheduler import (
    AttemptOutcome,
    Grant,
    PoolSnapshot,
    ProviderLoad,
    Scheduler,
    Waiter,
    WaiterState,
)

__all__ = ["Lease", "ProviderPool", "WaitObserver", "WaitingObserver"]

#: ``on_wait_done(group_id, waited_seconds, outcome)``: called once per ``lease()`` attempt.
WaitObserver = Callable[[str, float, DispatchOutcome], None]
#: ``on_waiting(node_id, provider_id, waiting)``: this edge now has (or no longer
#: has) waiters ``provider_id`` could serve; sent to its node (``wire.Waiting``).
WaitingObserver = Callable[[str, str, bool], None]

logger = logging.getLogger(__name__)

#: Upper bound of the Retry-After hint on a queue timeout (seconds).
MAX_RETRY_AFTER = 60


class _Ask(NamedTuple):
    """What a request asks of every group it tries (the scheduler's keyword arguments)."""

    long: bool
    requires: frozenset[str]
    exclude: frozenset[str]
    principal: str
    ask: RouteAsk | None  # the prompt and session key (``routing``)


@dataclass(frozen=True)
class Lease:
    """The provider a request runs on, held for the life of ``async with pool.lease(...)``."""

    provider_id: str
    node_id: str
    provider_type: ProviderType
    target: str  # the provider's served name: goes into the request's ``model``
    long: bool  # holds a long-context slot (in addition to a normal one)
    waited: float  # seconds spent in the queue (0.0 when admitted at once)
    group_id: str = ""  # the group that serves it (a fallback group, or the one asked for)
    grant: Grant | None = field(default=None, repr=False, compare=False)


class ProviderPool:
    """Capacity-aware, outlier-aware provider selection with one fair queue.

    The edge feeds it ``set_node_connected``, ``set_provider_health`` and
    ``apply_snapshot``; request handlers use ``async with pool.lease(...)``
    and report each attempt's verdict inside the block
    (``attempt_succeeded``/``attempt_failed``/``attempt_saturated``/
    ``attempt_caller_credentialed``; leaving
    the block without one abandons the attempt).  Nodes start disconnected;
    provider health starts ``unknown`` (available).
    """

    def __init__(
        self,
        snapshot: PoolSnapshot,
        *,
        on_wait_done: WaitObserver | None = None,
        on_waiting: WaitingObserver | None = None,
    ) -> None:
        #: The config's snapshot and the runtime controls over it;
        #: the scheduler decides on ``self._controls.effective()``.
        self._controls = ControlTable(snapshot)
        self._scheduler = Scheduler(snapshot)
        self._events: dict[Waiter, trio.Event] = {}
        self._on_wait_done = on_wait_done
        self._outliers_changed = trio.Event()
        self.on_waiting = on_waiting
        #: Providers the nodes were told this edge waits for, with their node.
        self._waiting_told: dict[str, str] = {}

    # ------------------------------------------------------------ leases

    def lease(
        self,
        group_id: str,
        *,
        context_class: ContextClass = "normal",
        requires: frozenset[str] = frozenset(),
        exclude: frozenset[str] = frozenset(),
        queue_timeout: float | None = None,
        body_bytes: int = 0,
        principal: str = "",
        fallbacks: Sequence[str] = (),
        fallback_on_queue_timeout: bool = False,
        on_queued: Callable[[], Awaitable[None]] | None = None,
        prompt: bytes = b"",
        session_key: str | None = None,
    ) -> _PoolLease:
        """Hold one slot of a provider of ``group_id`` for the body of the block.

        ``exclude``: provider ids that already failed this request.
        ``principal``: whose request it is (its ``share`` and ``max_concurrent``
        come from the snapshot's principal policies).  ``fallbacks``: group
        ids tried in order when the group has no choosable candidate, also
        when its last candidate goes away while the request waits, and --
        with ``fallback_on_queue_timeout`` -- for an immediate slot when the
        wait runs out.  ``body_bytes`` (the request body's size) counts
        against ``max_queued_bytes`` while the request waits.  ``on_queued``
        is awaited when the request has to wait, within its wait (a shared
        ``max_concurrent`` slot is given back then: waiting holds none).  Raises
        ``NodeDispatchError`` (no live candidate, also while waiting),
        ``QueueFull`` (would wait, queue full by count or bytes) or
        ``QueueTimeout`` (waited ``queue_timeout``, else the group's, else
        the pool default).  ``prompt`` (``prompt_blocks.prompt_bytes``) and
        ``session_key`` feed the cache-aware choice of a ``prefix`` group.
        """
        acquire = functools.partial(
            self._acquire,
            group_id,
            fallbacks,
            fallback_on_queue_timeout,
            _Ask(
                context_class == "long",
                requires,
                exclude,
                principal,
                RouteAsk(prompt, session_key),
            ),
            queue_timeout=queue_timeout,
            body_bytes=body_bytes,
            on_queued=on_queued,
        )
        return _PoolLease(self, acquire)

    async def _acquire(
        self,
        group_id: str,
        fallbacks: Sequence[str],
        fallback_on_queue_timeout: bool,
        want: _Ask,
        *,
        queue_timeout: float | None,
        body_bytes: int,
        on_queued: Callable[[], Awaitable[None]] | None,
    ) -> tuple[Grant, float]:
        chain = (group_id, *fallbacks)
        started = trio.current_time()
        try:
            outcome = self._scheduler.request(
                group_id,
                fallbacks=fallbacks,
                queue_timeout=queue_timeout,
                body_bytes=body_bytes,
                now=started,
                long=want.long,
                requires=want.requires,
                exclude=want.exclude,
                principal=want.principal,
                ask=want.ask,
            )
        except QueueFull:
            self._observe(group_id, 0.0, "queue_full")
            raise
        except NodeDispatchError:
            self._observe(group_id, 0.0, "dispatch_error")
            raise
        if not isinstance(outcome, Grant):
            self._tell_waiting()
            self._outliers_changed.set()  # a routing patience may end before the timer's
        while not isinstance(outcome, Grant):
            waiter = outcome
            await self._wait(waiter, group_id, started, on_queued)
            if waiter.state is WaiterState.ADMITTED and waiter.grant is not None:
                outcome = waiter.grant
                break
            # The rest of the chain after the group it waited in.
            rest = chain[chain.index(waiter.group_id) + 1 :] if waiter.group_id in chain else ()
            if waiter.state is WaiterState.FAILED:
                error = waiter.error or NodeDispatchError(
                    f"model group '{group_id}' has no available provider"
                )
                if not (isinstance(error, NodeDispatchError) and rest):
                    self._observe(
                        group_id,
                        trio.current_time() - started,
                        "dispatch_error" if isinstance(error, NodeDispatchError) else "cancelled",
                    )
                    raise error
                left = waiter.queue_timeout - (trio.current_time() - started)
                try:
                    outcome = self._scheduler.request(
                        rest[0],
                        fallbacks=rest[1:],
                        queue_timeout=max(0.0, left),
                        body_bytes=body_bytes,
                        now=trio.current_time(),
                        **want._asdict(),
                    )
                except (QueueFull, NodeDispatchError) as e:
                    outcome_name: DispatchOutcome = (
                        "queue_full" if isinstance(e, QueueFull) else "dispatch_error"
                    )
                    self._observe(group_id, trio.current_time() - started, outcome_name)
                    raise
                self._tell_waiting()
                continue
            # Timed out.
            self._scheduler.cancel(waiter)
            self._tell_waiting()
            grant = self._fallback_now(rest, want) if fallback_on_queue_timeout else None
            if grant is not None:
                outcome = grant
                break
            self._observe(group_id, trio.current_time() - started, "queue_timeout")
            raise QueueTimeout(
                f"no provider of model group '{group_id}' became free within "
                f"{waiter.queue_timeout:g}s; retry later",
                retry_after=min(MAX_RETRY_AFTER, max(1, math.ceil(waiter.queue_timeout))),
            )
        waited = trio.current_time() - started
        self._observe(group_id, waited, "admitted")
        return outcome, waited

    async def _wait(
        self,
        waiter: Waiter,
        group_id: str,
        started: float,
        on_queued: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Park until the waiter is resolved or its ``queue_timeout`` runs out
        (``on_queued`` first: the event is set even if it resolves meanwhile)."""
        event = self._events[waiter] = trio.Event()
        try:
            with trio.move_on_after(waiter.queue_timeout):
                if on_queued is not None:
                    await on_queued()
                await event.wait()
        except BaseException:
            # Cancelled from outside while waiting (or admitted at the same
            # instant): leave no trace in the queue and hold no slot.
            if waiter.grant is not None:
                self._release(waiter.grant)
            else:
                self._scheduler.cancel(waiter)
                self._tell_waiting()
            self._observe(group_id, trio.current_time() - started, "cancelled")
            raise
        finally:
            self._events.pop(waiter, None)

    def _fallback_now(self, groups: Sequence[str], want: _Ask) -> Grant | None:
        """The first fallback group with a free slot right now (queue-timeout fallback)."""
        now = trio.current_time()
        for gid in groups:
            grant = self._scheduler.try_now(gid, now=now, **want._asdict())
            if grant is not None:
                return grant
        return None

    def _release(self, grant: Grant) -> None:
        self._wake(self._scheduler.release(grant, trio.current_time()))

    def _wake(self, resolved: list[Waiter]) -> None:
        for waiter in resolved:
            event = self._events.get(waiter)
            if event is not None:
                event.set()
        if resolved:
            self._tell_waiting()

    def _tell_waiting(self) -> None:
        """Tell the nodes what changed in the set of providers this edge waits for."""
        told = self._waiting_told
        if self.on_waiting is None or (not told and not self._scheduler.queue_depth):
            return
        now = self._scheduler.waiting_providers()
        providers = self._scheduler.snapshot.providers
        for pid in now.difference(told):
            slot = providers.get(pid)
            if slot is not None:
                told[pid] = slot.node_id
                self._notify_waiting(slot.node_id, pid, True)
        for pid in [p for p in told if p not in now]:
            self._notify_waiting(told.pop(pid), pid, False)

    def _notify_waiting(self, node_id: str, provider_id: str, waiting: bool) -> None:
        assert self.on_waiting is not None
        try:
            self.on_waiting(node_id, provider_id, waiting)
        except Exception:
            logger.exception("event=callback_failed component=pool callback=on_waiting")

    def _observe(self, group_id: str, waited: float, outcome: DispatchOutcome) -> None:
        # A failing metrics hook must never cost a lease (or leak one).
        if self._on_wait_done is not None:
            try:
                self._on_wait_done(group_id, waited, outcome)
            except Exception:
                logger.exception("event=callback_failed component=pool callback=on_wait_done")

    # ------------------------------------------------------------ attempts

    def attempt_succeeded(self, lease: Lease) -> Transition | None:
        """The lease's attempt worked (a caller's 4xx too).  Report before leaving the block."""
        return self._verdict(lambda g, now: self._scheduler.attempt_succeeded(g, now), lease)

    def attempt_failed(self, lease: Lease, reason: FailureReason) -> Transition | None:
        """The attempt failed; ``EJECTED`` when this failure ejected the provider."""
        return self._verdict(lambda g, now: self._scheduler.attempt_failed(g, reason, now), lease)

    def attempt_saturated(self, lease: Lease, seconds: float) -> Transition | None:
        """The provider answered 429 (``seconds``: its Retry-After, bounded by the tracker)."""
        return self._verdict(
            lambda g, now: self._scheduler.attempt_saturated(g, seconds, now), lease
        )

    def attempt_caller_credentialed(self, lease: Lease) -> Transition | None:
        """The provider answered 429 or 5xx to the caller's own provider credential:
        relayed to that caller only; the provider is neither saturated nor failed
        for anyone (a probe's half-open slot frees)."""
        return self._verdict(
            lambda g, now: self._scheduler.attempt_caller_credentialed(g, now), lease
        )

    def attempt_abandoned(self, lease: Lease) -> Transition | None:
        """The attempt ended without a verdict (leaving the block does this too)."""
        return self._verdict(lambda g, now: self._scheduler.attempt_abandoned(g, now), lease)

    def _verdict(
        self, report: Callable[[Grant, float], AttemptOutcome], lease: Lease
    ) -> Transition | None:
        if lease.grant is None:
            return None
        transition, resolved = report(lease.grant, trio.current_time())
        if transition is not None:
            self._outliers_changed.set()  # the timer's next deadline may have moved
        self._wake(resolved)
        return transition

    async def run_outlier_timer(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Wake waiters when an ejection turns half-open or a 429 saturation ends.

        Runs for the life of the edge; sleeps until the tracker's next change
        or until an attempt's verdict moves it.
        """
        task_status.started()
        while True:
            self._outliers_changed = trio.Event()
            when = self._scheduler.next_outlier_change()
            with trio.move_on_at(math.inf if when is None else when):
                await self._outliers_changed.wait()
            self._wake(self._scheduler.outliers_due(trio.current_time()))

    # ------------------------------------------------------------ state feeds

    def set_node_connected(self, node_id: str, connected: bool) -> None:
        """A node session came up (True) or went away (False); re-examines waiters.

        A new session knows nothing of this edge's waiters: they are told again.
        """
        for pid in [p for p, n in self._waiting_told.items() if n == node_id]:
            del self._waiting_told[pid]
        self._wake(self._scheduler.set_node_connected(node_id, connected, trio.current_time()))
        self._tell_waiting()

    def set_remote_load(
        self, node_id: str, provider_id: str, in_flight: int, long_in_flight: int, offered: int
    ) -> None:
        """``node_id``'s load report for ``provider_id`` (see ``Scheduler.set_remote_load``)."""
        self._wake(
            self._scheduler.set_remote_load(
                node_id, provider_id, in_flight, long_in_flight, offered, trio.current_time()
            )
        )

    def provider_busy(
        self, node_id: str, provider_id: str, in_flight: int, long_in_flight: int, offered: int
    ) -> None:
        """``node_id`` answered ``Busy`` for ``provider_id``: blocked until its next report."""
        self._scheduler.provider_busy(node_id, provider_id, in_flight, long_in_flight, offered)

    def set_provider_health(self, provider_id: str, health: Health) -> None:
        """Record a provider's probe result (unknown | healthy | unhealthy); re-examines.

        ``healthy`` also ends an ejection caused by connect failures.
        """
        self._wake(self._scheduler.set_provider_health(provider_id, health, trio.current_time()))
        self._outliers_changed.set()

    def apply_snapshot(self, snapshot: PoolSnapshot) -> None:
        """Swap the pool's config (copy-on-write refresh); re-examines waiters.

        Leases taken before keep counting against their provider until released.
        Runtime controls are kept, except those of providers ``snapshot`` lacks.
        """
        self._controls.reconfigure(snapshot)
        self._apply_effective()

    def _apply_effective(self) -> None:
        """Give the scheduler the config under the controls, as a refresh does.

        A whole re-index and re-examination of every waiter: controls are rare
        operator actions, and this way they take the path refreshes take.
        """
        effective = self._controls.effective()
        self._wake(self._scheduler.apply_snapshot(effective, trio.current_time()))
        self._outliers_changed.set()

    def set_control(self, provider_id: str, control: ProviderControl) -> None:
        """Set a provider's runtime state and overrides; wakes every waiter it
        admits or fails.  ``KeyError`` for a provider the config does not have.

        Leases held on the provider finish normally, whatever the new values.
        """
        self._controls.set(provider_id, control)
        self._apply_effective()

    def control(self, provider_id: str) -> ProviderControl:
        """A provider's runtime state and overrides (the default when it has none)."""
        return self._controls.get(provider_id)

    def shown_state(self, provider_id: str) -> ShownState:
        """``active``, ``draining``, ``drained`` or ``disabled`` (``/status``)."""
        in_flight = self._scheduler.in_flight(provider_id)[0]
        return shown_state(self._controls.get(provider_id), in_flight)

    def fail_all_waiters(self, exc_factory: Callable[[], BaseException]) -> None:
        """Shutdown: every current waiter is woken and raises ``exc_factory()``."""
        waiters = self._scheduler.fail_all_waiters()
        for waiter in waiters:
            waiter.error = exc_factory()
        self._wake(waiters)

    # ------------------------------------------------------------ status

    @property
    def snapshot(self) -> PoolSnapshot:
        """The effective snapshot (the config under the runtime controls)."""
        return self._scheduler.snapshot

    @property
    def configured(self) -> PoolSnapshot:
        """The snapshot as the config gave it."""
        return self._controls.configured

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
        return self._scheduler.snapshot.max_queue

    @property
    def queued_bytes(self) -> int:
        """Request-body bytes held by the requests waiting in the global queue."""
        return self._scheduler.queued_bytes

    @property
    def max_queued_bytes(self) -> int:
        return self._scheduler.snapshot.max_queued_bytes

    def provider_loads(self) -> dict[str, ProviderLoad]:
        """Per-provider in_flight, long_in_flight, queued, capacities and load ratio."""
        return self._scheduler.provider_loads()

    def queued_by_group(self) -> dict[str, int]:
        """Waiters per model group asked for."""
        return self._scheduler.queued_by_group()

    def principal_loads(self) -> dict[str, tuple[int, int]]:
        """``(in_flight, queued)`` per principal holding or waiting for a slot."""
        return self._scheduler.principal_loads()

    def ejection(self, provider_id: str) -> EjectionStatus | None:
        """The provider's passive ejection (times on trio's clock), or None."""
        return self._scheduler.ejection(provider_id, trio.current_time())


class _PoolLease:
    """:meth:`ProviderPool.lease` (a class: no generator frame on the hot path)."""

    __slots__ = ("_pool", "_acquire", "_grant")

    def __init__(
        self, pool: ProviderPool, acquire: Callable[[], Awaitable[tuple[Grant, float]]]
    ) -> None:
        self._pool = pool
        self._acquire = acquire  # the pool's _acquire with this lease's arguments
        self._grant: Grant | None = None

    async def __aenter__(self) -> Lease:
        if self._grant is not None:
            raise RuntimeError("a pool lease is entered once")
        grant, waited = await self._acquire()
        self._grant = grant
        return Lease(
            provider_id=grant.provider_id,
            node_id=grant.node_id,
            provider_type=grant.provider_type,
            target=grant.target,
            long=grant.long,
            waited=waited,
            group_id=grant.group_id,
            grant=grant,
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        grant = self._grant
        assert grant is not None
        self._pool._release(grant)
