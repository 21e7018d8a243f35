"""The provider pool's scheduling decisions as pure synchronous logic.

Why this module is shaped this way: every decision -- which provider a request
gets, who waits, who is admitted when a slot frees, who fails because its group
lost its last live provider -- happens here, synchronously, with no I/O and no
clock (callers pass ``now``).  The trio layer (``pool.py``) only parks and
wakes tasks.  Because an admission is made in the same synchronous step that
frees a slot, there is never a moment where a slot is free while a waiter that
fits it sleeps.

It joins three parts: ``candidates`` (the live candidates of a request and
the choice among them, outlier-aware), ``fair_queue`` (who waits, in weighted
fair order across principals) and ``outliers`` (passive ejection, owned by
the candidate index).  What this module adds:

* **Fitting.** A waiter fits when its principal is under ``max_concurrent``
  and an eligible candidate has a free slot.  The scheduler is the one owner
  of the running count per principal (grants held, counted at admission and
  release), so a request over its principal's cap waits in the queue like a
  request for a full provider and never holds a slot while it waits.
* **Re-examination** merges lane heads by ``(tag, seq)``: it admits exactly
  the waiters a walk over every waiter in that order would admit ("every
  waiter that fits, in fair order").  A release re-examines only lanes whose
  candidates include the released provider, plus the releasing principal's
  lanes when it has a cap; an outlier change only the lanes that list the
  provider; a liveness change the groups that list it.
* **Fallback groups**: ``request(group, fallbacks=...)`` takes the
  first group of the chain with a choosable candidate (admitted or queued
  there); when none has one, the first group with any live candidate serves
  through its last resort; only when none has a live candidate does the
  request fail with the first group's error.
* **Attempts**: every grant carries the tracker's ticket; the request path
  reports its verdict (``attempt_succeeded/failed/saturated``, or
  ``attempt_caller_credentialed`` for an error answered to the caller's own
  provider credential), and a grant
  released without one is abandoned.
* **Node-reported load**: ``set_remote_load`` records what a
  node says the other edges hold and re-examines the provider's lanes when
  it has more room; ``provider_busy`` blocks a provider until the node's
  next report; ``waiting_providers`` is what the edge tells nodes it waits for.

The queue is bounded twice: by count (``max_queue``) and by the request-body
bytes its waiters hold (``max_queued_bytes``), because a queued request keeps
its body in memory for up to ``queue_timeout``.  Both are checked only when a
request would have to wait, so a request admitted at once is never refused.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from iopd.errors import GatewayError, NodeDispatchError
from iopd.vocabulary import HEALTH_STATES, Health

from .candidates import (
    CandidateIndex,
    Candidates,
    Grant,
    GroupPolicy,
    PoolSnapshot,
    PrincipalPolicy,
    ProviderSlot,
    WaitKey,
)
from .fair_queue import FairQueue, Lane, Waiter, WaiterState
from .load_view import ProviderLoad, provider_loads, waiting_providers
from .outliers import Attempt, EjectionStatus, OutlierTracker, Transition
from .routing import RouteAsk, Router
from .verdicts import NOTHING, AttemptOutcome, AttemptVerdicts

#: How far behind a lane's head a re-examination looks for a waiter that can
#: take a freed slot while the head waits for its own provider (``routing``).
LOOK_BEHIND = 32

__all__ = [
    "AttemptOutcome",
    "Grant",
    "GroupPolicy",
    "PoolSnapshot",
    "PrincipalPolicy",
    "ProviderLoad",
    "ProviderSlot",
    "Scheduler",
    "WaitKey",
    "Waiter",
    "WaiterState",
]


class Scheduler(AttemptVerdicts):
    """The pool's state machine.  Every mutating call returns the waiters it resolved.

    The caller (the trio layer) wakes each returned waiter; it reads
    ``waiter.grant`` (admitted) or ``waiter.error`` (failed).  Nodes start
    disconnected; providers start with health ``unknown``, which counts as
    available.  ``now`` (seconds, one monotonic clock) matters only to the
    outlier tracker; a call without it uses the latest ``now`` seen.
    """

    def __init__(self, snapshot: PoolSnapshot) -> None:
        self._index = CandidateIndex(snapshot)
        self._queue = FairQueue()
        #: Grants not yet released, each with its attempt ticket until a verdict is in.
        self._active: dict[Grant, Attempt | None] = {}
        self._running: dict[str, int] = {}  # principal -> grants held
        #: Waiters declining a free provider for a busy one, by when they stop.
        self._patience: list[tuple[float, int, Waiter]] = []
        self._due_lanes: set[Lane] = set()
        self._now = 0.0

    # ------------------------------------------------------------------ queries

    @property
    def snapshot(self) -> PoolSnapshot:
        return self._index.snapshot

    @property
    def router(self) -> Router:
        """The cache-aware routing: its prefix index, sessions and counts (read-only use)."""
        return self._index.router

    @property
    def outliers(self) -> OutlierTracker:
        """The passive-ejection tracker (read-only use: status, tests)."""
        return self._index.outliers

    @property
    def queue_depth(self) -> int:
        """Number of waiters in the global queue."""
        return self._queue.depth

    @property
    def queued_bytes(self) -> int:
        """Request-body bytes held by the waiters in the global queue."""
        return self._queue.bytes

    @property
    def active_grants(self) -> frozenset[Grant]:
        """Grants not yet released."""
        return frozenset(self._active)

    def pending_waiters(self) -> list[Waiter]:
        """All waiting requests in enqueue order (O(n log n); for tests and status)."""
        return self._queue.pending()

    @property
    def virtual_time(self) -> float:
        """The fair queue's virtual time (tests check tags against it)."""
        return self._queue.vtime

    def running(self, principal: str) -> int:
        """Grants a principal holds now (what ``max_concurrent`` counts)."""
        return self._running.get(principal, 0)

    def principal_loads(self) -> dict[str, tuple[int, int]]:
        """``(running, queued)`` of every principal holding or waiting for a slot."""
        queued = self._queue.waiting_by_principal()
        return {
            p: (self._running.get(p, 0), queued.get(p, 0))
            for p in sorted(self._running.keys() | queued.keys())
        }

    def in_flight(self, provider_id: str) -> tuple[int, int]:
        """(in_flight, long_in_flight) of a provider; (0, 0) when it holds nothing."""
        return self._index.in_flight(provider_id)

    def health(self, provider_id: str) -> Health:
        return self._index.health(provider_id)

    def ejection(self, provider_id: str, now: float | None = None) -> EjectionStatus | None:
        """The provider's passive ejection, or None."""
        return self.outliers.ejection(provider_id, self._clock(now))

    def next_outlier_change(self) -> float | None:
        """When ``outliers_due`` next has something to do (None: never, until an attempt
        ends); also when a waiter's patience for its busy provider ends (``routing``)."""
        when = self.outliers.next_change(self._now)
        patience = self._patience_due(self._now) if self._patience else None
        if self._due_lanes:
            return self._now
        return patience if when is None else when if patience is None else min(when, patience)

    def queued_by_group(self) -> dict[str, int]:
        """Waiters per model group (the group each asked for), for the status view."""
        depth: dict[str, int] = {}
        for (key, _), q in self._queue.lanes.items():
            depth[key.group_id] = depth.get(key.group_id, 0) + len(q)
        return depth

    def provider_loads(self) -> dict[str, ProviderLoad]:
        """Load of every provider in the current snapshot."""
        return provider_loads(self._index, self._queue)

    def waiting_providers(self) -> set[str]:
        """Providers some waiter could run on (what this edge tells their nodes)."""
        return waiting_providers(self._index, self._queue)

    # ------------------------------------------------------------ admissions

    def request(
        self,
        group_id: str,
        *,
        long: bool = False,
        requires: frozenset[str] = frozenset(),
        exclude: frozenset[str] = frozenset(),
        queue_timeout: float | None = None,
        body_bytes: int = 0,
        principal: str = "",
        fallbacks: Sequence[str] = (),
        now: float | None = None,
        ask: RouteAsk | None = None,
    ) -> Grant | Waiter:
        """Admit at once (a ``Grant``) or enqueue (a pending ``Waiter``).

        ``exclude``: providers this request must not use (they failed it).
        ``fallbacks``: group ids tried in order when ``group_id`` has no
        choosable candidate (see the module doc).  ``body_bytes`` is the size
        of the request body the caller keeps while it waits.  Raises
        ``NodeDispatchError`` when no group of the chain has a live candidate
        (or the group is unknown), ``QueueFull`` when it would have to wait
        and the queue is full (``max_queue`` waiters, or no room for
        ``body_bytes`` under ``max_queued_bytes``).
        """
        if body_bytes < 0:
            raise ValueError(f"body_bytes must be >= 0 (got {body_bytes})")
        now = self._clock(now)
        key, cands = self._index.route(group_id, fallbacks, long, frozenset(requires), exclude, now)
        if self._may_start(principal):
            grant = self._take(key, cands, principal, now, ask)
            if grant is not None:
                return grant
        self._queue.check_room(group_id, body_bytes, self.snapshot)
        waiter = self._queue.new_waiter(
            key,
            principal,
            self.snapshot.principal(principal).share,
            self.snapshot.queue_timeout_of(group_id, queue_timeout),
            body_bytes,
        )
        if ask is not None:
            waiter.route = ask
            self._index.router.enqueued(ask)
            self._watch(waiter)
        return waiter

    def try_now(
        self,
        group_id: str,
        *,
        long: bool = False,
        requires: frozenset[str] = frozenset(),
        exclude: frozenset[str] = frozenset(),
        principal: str = "",
        now: float | None = None,
        ask: RouteAsk | None = None,
    ) -> Grant | None:
        """A grant if ``group_id`` can take the request at once, else None (never queues).

        For a fallback when a request's own wait ran out.
        """
        now = self._clock(now)
        key = WaitKey(group_id, long, frozenset(requires), exclude)
        cands = self._index.candidates(key)
        if cands is None or not self._may_start(principal):
            return None
        return self._take(key, cands, principal, now, ask)

    def release(self, grant: Grant, now: float | None = None) -> list[Waiter]:
        """Give a grant's slots back (idempotent) and admit waiters that now fit.

        A grant whose attempt got no verdict is abandoned (a probe's slot frees).
        """
        if grant not in self._active:
            return []
        now = self._clock(now)
        attempt = self._active.pop(grant)
        if attempt is not None and attempt.probe:
            self.outliers.attempt_abandoned(attempt)
            self._index.refresh_flag(grant.provider_id, now)
        left = self._running[grant.principal] - 1
        if left:
            self._running[grant.principal] = left
        else:
            del self._running[grant.principal]
        self._index.give_back(grant)
        if not self._queue.lanes:
            self._index.drop_counters_if_gone(grant.provider_id)
            return []
        if self._index.drop_counters_if_gone(grant.provider_id):
            capped = self.snapshot.principal(grant.principal).max_concurrent
            return self._reexamine(self._queue.lanes_of(grant.principal) if capped else [], now)
        lanes = self._lanes_listing(grant.provider_id)
        if self.snapshot.principal(grant.principal).max_concurrent:
            listed = set(lanes)  # each lane once: a pass must not see a lane twice
            lanes.extend(x for x in self._queue.lanes_of(grant.principal) if x not in listed)
        return self._reexamine(lanes, now)

    def cancel(self, waiter: Waiter) -> None:
        """Take a pending waiter out of the queue (timeout or caller cancel).

        A waiter that was already resolved is left alone: if it was admitted
        the caller owns ``waiter.grant`` and must release it.
        """
        if waiter.state is not WaiterState.PENDING:
            return
        self._queue.pop(waiter)
        waiter.state = WaiterState.CANCELLED
        self._unroute(waiter)

    def outliers_due(self, now: float | None = None) -> list[Waiter]:
        """Re-examine the waiters of providers that became choosable by time."""
        now = self._clock(now)
        lanes: dict[Lane, None] = {}  # each lane once
        for pid in self.outliers.due(now):
            self._index.refresh_flag(pid, now)
            lanes.update(dict.fromkeys(self._lanes_listing(pid)))
        if self._patience:
            self._patience_due(now)
        lanes.update(dict.fromkeys(self._due_lanes))
        self._due_lanes.clear()
        return self._reexamine(lanes, now) if lanes else []

    # ------------------------------------------------------------ state changes

    def set_node_connected(
        self, node_id: str, connected: bool, now: float | None = None
    ) -> list[Waiter]:
        """A node session came up or went away (then its load reports are forgotten)."""
        if not connected:
            self._index.clear_remote(node_id)
        changed = self._index.set_connected(node_id, connected)
        return self._liveness_changed(changed, self._clock(now)) if changed else []

    def set_remote_load(
        self,
        node_id: str,
        provider_id: str,
        in_flight: int,
        long_in_flight: int,
        offered: int,
        now: float | None = None,
    ) -> list[Waiter]:
        """``node_id`` reported the other edges' streams (long ones too) and the
        slots held for them on its ``provider_id``; ends a ``provider_busy``
        block and admits the waiters that now fit (another node's: ignored)."""
        roomier = self._index.set_remote(
            provider_id, node_id, in_flight, long_in_flight, offered, blocked=False
        )
        if not roomier or not self._queue.lanes:
            return []
        return self._reexamine(self._lanes_listing(provider_id), self._clock(now))

    def provider_busy(
        self, node_id: str, provider_id: str, in_flight: int, long_in_flight: int, offered: int
    ) -> None:
        """``node_id`` refused ``provider_id`` (its load then): blocked till its next report."""
        self._index.set_remote(provider_id, node_id, in_flight, long_in_flight, offered, blocked=True)

    def set_provider_health(
        self, provider_id: str, health: Health, now: float | None = None
    ) -> list[Waiter]:
        """The node's probe reported a provider's health.

        ``healthy`` also ends an ejection caused by connect failures (every
        time it is reported, changed or not).
        """
        if health not in HEALTH_STATES:
            raise ValueError(f"unknown health value {health!r}")
        now = self._clock(now)
        restored = None
        if health == "healthy":
            restored = self.outliers.health_probe_succeeded(provider_id)
            self._index.refresh_flag(provider_id, now)
        if self._index.set_health(provider_id, health):
            return self._liveness_changed((provider_id,), now)
        if restored is not None:
            return self._reexamine(self._lanes_listing(provider_id), now)
        return []

    def apply_snapshot(self, snapshot: PoolSnapshot, now: float | None = None) -> list[Waiter]:
        """Swap the static config and re-examine every waiter.

        Leases taken before keep counting against their provider and release
        normally; a lower capacity, ``max_concurrent``, ``max_queue`` or
        ``max_queued_bytes`` only affects new admissions (nobody already
        waiting is evicted, nobody running is stopped).  Waiters keep the
        timeout and fair-queue tag they were enqueued with.
        """
        now = self._clock(now)
        self._index.apply_snapshot(snapshot, now)
        return self._reexamine(None, now)

    def fail_all_waiters(self, error: GatewayError | BaseException | None = None) -> list[Waiter]:
        """Empty the queue (shutdown).  Each waiter gets ``error`` (the caller may set its own)."""
        waiters = self._queue.drain()
        for w in waiters:
            w.state = WaiterState.FAILED
            w.error = error
            self._unroute(w)
        return waiters

    # ------------------------------------------------------------ internals

    def _clock(self, now: float | None) -> float:
        if now is not None and now > self._now:
            self._now = now
        return self._now

    def _may_start(self, principal: str) -> bool:
        snap = self.snapshot
        if not snap.principals and not snap.default_principal.max_concurrent:
            return True  # no cap configured: the common case, kept cheap
        limit = snap.principal(principal).max_concurrent
        return limit == 0 or self._running.get(principal, 0) < limit

    def _take(
        self,
        key: WaitKey,
        cands: Candidates,
        principal: str,
        now: float,
        ask: RouteAsk | None = None,
    ) -> Grant | None:
        grant = self._index.take(key, cands, principal, now, ask)
        if grant is not None:
            self._active[grant] = grant.attempt
            self._running[principal] = self._running.get(principal, 0) + 1
        return grant

    def _claim_verdict(self, grant: Grant) -> Attempt | None:
        """The grant's attempt ticket if its verdict is still open (then closes it)."""
        attempt = self._active.get(grant)
        if attempt is not None:
            self._active[grant] = None
        return attempt

    def _outlier_changed(
        self, provider_id: str, transition: Transition | None, now: float
    ) -> AttemptOutcome:
        """A tracker transition can make waiters fit (restored) or move them (excluded)."""
        self._index.refresh_flag(provider_id, now)
        if transition is None:
            return NOTHING
        return AttemptOutcome(transition, self._reexamine(self._lanes_listing(provider_id), now))

    def _lanes_listing(self, provider_id: str) -> list[Lane]:
        """Lanes whose live candidates include ``provider_id``."""
        candidates = self._index.candidates
        return [
            lane
            for lane in self._queue.lanes
            if (c := candidates(lane[0])) is not None and provider_id in c.provider_ids
        ]

    def _liveness_changed(self, provider_ids: Sequence[str], now: float) -> list[Waiter]:
        """Some providers became (un)available: recheck only the groups that list them.

        Losing a candidate can fail waiters (no live candidate left) and can
        also admit some (a long request falls back to normal slots when the
        last provider with long slots goes away; the last resort changes), so
        those lanes are re-examined.
        """
        groups = self._index.groups_of(provider_ids)
        if not groups:
            return []
        self._index.forget_groups(groups)
        return self._reexamine(
            [lane for lane in self._queue.lanes if lane[0].group_id in groups], now
        )

    def _fail_lane(self, lane: Lane) -> list[Waiter]:
        key = lane[0]
        waiters = self._queue.drain_lane(lane)
        for w in waiters:
            w.state = WaiterState.FAILED
            self._unroute(w)
            w.error = (
                self._index.unavailable_error(key)
                if key.group_id in self.snapshot.groups
                else NodeDispatchError(
                    f"model group '{key.group_id}' was removed from the configuration"
                )
            )
        return waiters

    def _reexamine(self, lanes: Iterable[Lane] | None, now: float) -> list[Waiter]:
        """Admit every waiter that fits, in fair order; fail those with no candidate.

        The rule is the walk "repeatedly admit the pending waiter with the
        smallest (tag of its principal, seq) among those that fit, until none
        fits".  Merging lane heads gives the same admissions without visiting
        every waiter, because:

        * Waiters of one lane share key and principal, so they fit or not
          alike, and the lane is FIFO: only its head can be next.
        * Within a pass fitting only gets harder: an admission takes a slot
          and raises a running count, nothing is freed.  A lane whose head
          does not fit, or a principal at ``max_concurrent``, stays out for
          the rest of the pass.
        * Tags only grow (an admission moves its principal's tag on), so an
          entry's tag is a lower bound: an entry popped with an old tag is
          pushed again with the current one, and pops come in current order.
        * ``lanes``: between events no pending waiter fits (a request that
          fits is admitted on arrival, and every event that frees room calls
          this), so only the lanes the event could make fit (the caller's
          list) need a look; ``None`` means all.

        Cost: one heap entry per lane and per admission, not per waiter.
        """
        resolved: list[Waiter] = []
        heap: list[tuple[float, int, Lane, Candidates]] = []
        by_lane = self._queue.lanes
        tag_of = self._queue.tag_of
        pairs = list(by_lane.items()) if lanes is None else [(x, by_lane.get(x)) for x in lanes]
        for lane, q in pairs:
            if not q:
                continue
            head = next(iter(q.values()))
            cands = self._index.candidates(lane[0])
            if cands is None:
                resolved.extend(self._fail_lane(lane))
                continue
            heap.append((tag_of(lane[1]), head.seq, lane, cands))
        heapq.heapify(heap)
        blocked: set[str] = set()  # principals at their max_concurrent in this pass
        while heap:
            tag, seq, lane, cands = heapq.heappop(heap)
            q = by_lane.get(lane)
            if not q or next(iter(q)) != seq:
                continue  # a lane listed twice: its entry is stale
            principal = lane[1]
            if principal in blocked:
                continue
            if tag != tag_of(principal):  # another lane of it was admitted: now due later
                heapq.heappush(heap, (tag_of(principal), seq, lane, cands))
                continue
            if not self._may_start(principal):
                blocked.add(principal)
                continue
            waiter = q[seq]
            grant = self._take(lane[0], cands, principal, now, waiter.route)
            if grant is None and waiter.route is not None and waiter.route.home is not None:
                waiter, grant = self._look_behind(q, cands, principal, now)
            if grant is None:
                continue  # admissions only take slots: this lane cannot fit again this pass
            self._queue.admit(waiter)
            waiter.state = WaiterState.ADMITTED
            waiter.grant = grant
            self._unroute(waiter)
            resolved.append(waiter)
            if q:
                nxt = next(iter(q.values()))
                heapq.heappush(heap, (tag_of(principal), nxt.seq, lane, cands))
        # Failures were collected first; report everything in enqueue order.
        resolved.sort(key=lambda w: w.seq)
        return resolved

    # ------------------------------------------------------------ routing

    def _look_behind(
        self, q: dict[int, Waiter], cands: Candidates, principal: str, now: float
    ) -> tuple[Waiter, Grant | None]:
        """The lane's head waits for its busy provider (``routing``): the first of the
        next ``LOOK_BEHIND`` waiters of its lane that takes a slot now goes first."""
        waiters = iter(q.values())
        head = next(waiters)
        for waiter, _ in zip(waiters, range(LOOK_BEHIND), strict=False):
            grant = self._take(waiter.key, cands, principal, now, waiter.route)
            if grant is not None:
                return waiter, grant
        self._watch(head)
        return head, None

    def _watch(self, waiter: Waiter) -> None:
        """A waiter declining a free provider for its busy one: the timer looks again
        when its patience ends (``next_outlier_change``)."""
        ask = waiter.route
        if ask is not None and ask.deadline is not None and ask.watched != ask.deadline:
            ask.watched = ask.deadline
            heapq.heappush(self._patience, (ask.deadline, waiter.seq, waiter))

    def _unroute(self, waiter: Waiter) -> None:  # it waits no more
        if waiter.route is not None:
            self._index.router.left(waiter.route)

    def _patience_due(self, now: float) -> float | None:
        """Pop the waiters whose patience ended; the next deadline still ahead."""
        heap = self._patience
        while heap:
            when, _, waiter = heap[0]
            if waiter.state is WaiterState.PENDING and when > now:
                return when
            heapq.heappop(heap)
            if waiter.state is WaiterState.PENDING:
                self._due_lanes.add(waiter.lane)
        return None
