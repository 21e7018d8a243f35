"""The provider pool's scheduling decisions as pure synchronous logic (SPEC §2).

Why this module is shaped this way: every decision -- which provider a request
gets, who waits, who is admitted when a slot frees, who fails because its group
lost its last live provider -- happens here, synchronously, with no I/O and no
clock.  The trio layer (``pool.py``) only parks and wakes tasks.  Because an
admission is made in the same synchronous step that frees a slot, there is
never a moment where a slot is free while a waiter that fits it sleeps.

Data structures, chosen for large queues (see ``scripts/bench_pool.py``):

* Waiters with the same ``WaitKey`` (group, context class, requirements) are
  interchangeable: whether one fits depends only on its key and the pool
  state.  So waiters live in one FIFO per key (an insertion-ordered dict, for
  O(1) removal on cancel), each stamped with a global enqueue sequence number.
* Re-examination merges the heads of the per-key FIFOs by sequence number
  through a heap.  A key whose head does not fit is dropped for the rest of
  the pass: admissions only take slots, so it cannot fit later in that pass.
  This admits exactly the waiters a walk over the global queue in enqueue order
  would admit ("every waiter that fits, in enqueue order"), without touching
  waiters of keys that cannot fit.
* A release only re-examines keys whose candidates include the released
  provider: every other waiter did not fit before and still does not.
* Live candidate sets per key are cached and dropped on any liveness change
  (node connect/disconnect, health, snapshot).

The queue is bounded twice: by count (``max_queue``) and by the request-body
bytes its waiters hold (``max_queued_bytes``), because a queued request keeps
its body (and what was decoded from it) in memory for up to ``queue_timeout``:
256 waiters of 8 MiB each are 2 GiB.  Both are checked only when a request
would have to wait, so a request admitted at once is never refused by them.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from iopd.errors import GatewayError, NodeDispatchError, QueueFull
from iopd.vocabulary import HEALTH_STATES, Health, ProviderType, load_ratio, types_meeting

__all__ = [
    "GroupPolicy",
    "Grant",
    "PoolSnapshot",
    "ProviderLoad",
    "ProviderSlot",
    "Scheduler",
    "WaitKey",
    "Waiter",
    "WaiterState",
]


@dataclass(frozen=True)
class ProviderSlot:
    """One provider as the pool sees it (built by the edge from its config)."""

    provider_id: str
    node_id: str
    type: ProviderType
    capacity: int
    long_context_capacity: int = 0
    priority: int = 0
    enabled: bool = True


@dataclass(frozen=True)
class GroupPolicy:
    """One model group: its providers in config order, with the served target."""

    id: str
    providers: tuple[tuple[str, str], ...]  # (provider_id, served target)
    queue_timeout: float | None = None  # per-group override (legacy routes)


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything static the pool needs; swapped whole on config refresh."""

    providers: Mapping[str, ProviderSlot]
    groups: Mapping[str, GroupPolicy]
    max_queue: int = 256
    queue_timeout: float = 30.0
    #: Most request-body bytes held by waiters at once; 0 = never wait (as ``max_queue``).
    max_queued_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True)
class ProviderLoad:
    """A provider's current load, for the status view and metrics."""

    in_flight: int
    long_in_flight: int
    queued: int  # waiters whose live candidates include this provider
    capacity: int
    long_context_capacity: int
    load_ratio: float  # ``iopd.vocabulary.load_ratio``


@dataclass(frozen=True, eq=False)
class Grant:
    """A slot held on one provider.  Identity-hashed: each grant is released once."""

    group_id: str
    provider_id: str
    node_id: str
    provider_type: str
    target: str
    long: bool  # True when the grant holds a long-context slot (plus a normal one)


class WaitKey(NamedTuple):
    """What decides whether a waiter fits: waiters with equal keys are interchangeable."""

    group_id: str
    long: bool
    requires: frozenset[str]


class WaiterState(enum.Enum):
    PENDING = "pending"
    ADMITTED = "admitted"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Waiter:
    """A queued request.  The scheduler resolves it to a grant or an error."""

    seq: int
    key: WaitKey
    queue_timeout: float
    body_bytes: int = 0  # counted in the scheduler's queued bytes while pending
    state: WaiterState = WaiterState.PENDING
    grant: Grant | None = None
    error: BaseException | None = None

    @property
    def group_id(self) -> str:
        return self.key.group_id


class _Counters:
    """Per-provider slot usage; lives as long as the provider or its leases."""

    __slots__ = ("in_flight", "long_in_flight")

    def __init__(self) -> None:
        self.in_flight = 0
        self.long_in_flight = 0


@dataclass(frozen=True)
class _Entry:
    """One (provider, target) line of a group, with its config-order index."""

    index: int
    slot: ProviderSlot
    target: str
    counters: _Counters


@dataclass(frozen=True)
class _Candidates:
    """The live candidates of one WaitKey, in config order."""

    entries: tuple[_Entry, ...]
    indexes: tuple[int, ...]
    provider_ids: frozenset[str]
    use_long_slots: bool


def _no_candidate_error(key: WaitKey) -> NodeDispatchError:
    need = f" that supports {', '.join(sorted(key.requires))}" if key.requires else ""
    return NodeDispatchError(
        f"model group '{key.group_id}' has no available provider{need} "
        "(nodes disconnected, or providers disabled or unhealthy)"
    )


class Scheduler:
    """The pool's state machine.  Every mutating call returns the waiters it resolved.

    The caller (the trio layer) wakes each returned waiter; it reads
    ``waiter.grant`` (admitted) or ``waiter.error`` (failed).  Nodes start
    disconnected; providers start with health ``unknown``, which counts as
    available.
    """

    def __init__(self, snapshot: PoolSnapshot) -> None:
        self.snapshot = snapshot
        self._connected: set[str] = set()
        self._health: dict[str, Health] = {}
        self._unhealthy: set[str] = set()
        self._groups_by_provider: dict[str, set[str]] = {}
        self._allowed_types: dict[frozenset[str], frozenset[str] | None] = {}
        self._counters: dict[str, _Counters] = {}
        self._entries: dict[str, tuple[_Entry, ...]] = {}
        self._candidate_cache: dict[WaitKey, _Candidates | None] = {}
        self._cursor: dict[str, int] = {}
        self._queues: dict[WaitKey, dict[int, Waiter]] = {}
        self._queue_depth = 0
        self._queued_bytes = 0
        self._active: set[Grant] = set()
        self._seq = itertools.count()
        self._index_snapshot()

    # ------------------------------------------------------------------ queries

    @property
    def queue_depth(self) -> int:
        """Number of waiters in the global queue."""
        return self._queue_depth

    @property
    def max_queue(self) -> int:
        return self.snapshot.max_queue

    @property
    def queued_bytes(self) -> int:
        """Request-body bytes held by the waiters in the global queue."""
        return self._queued_bytes

    @property
    def max_queued_bytes(self) -> int:
        return self.snapshot.max_queued_bytes

    @property
    def active_grants(self) -> frozenset[Grant]:
        """Grants not yet released."""
        return frozenset(self._active)

    def pending_waiters(self) -> list[Waiter]:
        """All waiting requests in enqueue order (O(n log n); for tests and status)."""
        return sorted((w for q in self._queues.values() for w in q.values()), key=lambda w: w.seq)

    def queue_timeout_for(self, group_id: str, override: float | None = None) -> float:
        """The waiting bound of a request: explicit override, else group's, else default."""
        if override is not None:
            return override
        group = self.snapshot.groups.get(group_id)
        if group is not None and group.queue_timeout is not None:
            return group.queue_timeout
        return self.snapshot.queue_timeout

    def in_flight(self, provider_id: str) -> tuple[int, int]:
        """(in_flight, long_in_flight) of a provider; (0, 0) when it holds nothing."""
        c = self._counters.get(provider_id)
        return (c.in_flight, c.long_in_flight) if c is not None else (0, 0)

    def health(self, provider_id: str) -> Health:
        return self._health.get(provider_id, "unknown")

    def provider_loads(self) -> dict[str, ProviderLoad]:
        """Load of every provider in the current snapshot."""
        queued: dict[str, int] = {}
        for key, q in self._queues.items():
            cands = self._candidates(key)
            if cands is None:
                continue
            for pid in cands.provider_ids:
                queued[pid] = queued.get(pid, 0) + len(q)
        loads: dict[str, ProviderLoad] = {}
        for pid, slot in self.snapshot.providers.items():
            in_flight, long_in_flight = self.in_flight(pid)
            loads[pid] = ProviderLoad(
                in_flight=in_flight,
                long_in_flight=long_in_flight,
                queued=queued.get(pid, 0),
                capacity=slot.capacity,
                long_context_capacity=slot.long_context_capacity,
                load_ratio=load_ratio(in_flight, slot.capacity),
            )
        return loads

    # ------------------------------------------------------------ admissions

    def request(
        self,
        group_id: str,
        *,
        long: bool = False,
        requires: frozenset[str] = frozenset(),
        queue_timeout: float | None = None,
        body_bytes: int = 0,
    ) -> Grant | Waiter:
        """Admit at once (a ``Grant``) or enqueue (a pending ``Waiter``).

        ``body_bytes`` is the size of the request body the caller keeps while
        it waits.  Raises ``NodeDispatchError`` when the group is unknown or
        has no live candidate, ``QueueFull`` when it would have to wait and the
        queue is full (``max_queue`` waiters, or no room for ``body_bytes``
        under ``max_queued_bytes``).
        """
        if body_bytes < 0:
            raise ValueError(f"body_bytes must be >= 0 (got {body_bytes})")
        key = WaitKey(group_id, long, frozenset(requires))
        cands = self._candidates(key)
        if cands is None:
            if group_id not in self.snapshot.groups:
                raise NodeDispatchError(f"model group '{group_id}' is not configured")
            raise _no_candidate_error(key)
        grant = self._try_admit(key, cands)
        if grant is not None:
            return grant
        self._check_queue_room(group_id, body_bytes)
        waiter = Waiter(
            seq=next(self._seq),
            key=key,
            queue_timeout=self.queue_timeout_for(group_id, queue_timeout),
            body_bytes=body_bytes,
        )
        self._queues.setdefault(key, {})[waiter.seq] = waiter
        self._queue_depth += 1
        self._queued_bytes += body_bytes
        return waiter

    def release(self, grant: Grant) -> list[Waiter]:
        """Give a grant's slots back (idempotent) and admit waiters that now fit."""
        if grant not in self._active:
            return []
        self._active.remove(grant)
        counters = self._counters[grant.provider_id]
        counters.in_flight -= 1
        if grant.long:
            counters.long_in_flight -= 1
        if (
            counters.in_flight == 0
            and counters.long_in_flight == 0
            and grant.provider_id not in self.snapshot.providers
        ):
            del self._counters[grant.provider_id]
            return []
        pid = grant.provider_id
        keys = [k for k in self._queues if (c := self._candidates(k)) and pid in c.provider_ids]
        return self._reexamine(keys)

    def cancel(self, waiter: Waiter) -> None:
        """Take a pending waiter out of the queue (timeout or caller cancel).

        A waiter that was already resolved is left alone: if it was admitted
        the caller owns ``waiter.grant`` and must release it.
        """
        if waiter.state is not WaiterState.PENDING:
            return
        q = self._queues.get(waiter.key)
        if q is not None and q.pop(waiter.seq, None) is not None:
            self._queue_depth -= 1
            self._queued_bytes -= waiter.body_bytes
            if not q:
                del self._queues[waiter.key]
        waiter.state = WaiterState.CANCELLED

    # ------------------------------------------------------------ state changes

    def set_node_connected(self, node_id: str, connected: bool) -> list[Waiter]:
        """A node session came up or went away."""
        if connected == (node_id in self._connected):
            return []
        if connected:
            self._connected.add(node_id)
        else:
            self._connected.discard(node_id)
        return self._liveness_changed(
            pid for pid, slot in self.snapshot.providers.items() if slot.node_id == node_id
        )

    def set_provider_health(self, provider_id: str, health: Health) -> list[Waiter]:
        """The node's probe reported a provider's health."""
        if health not in HEALTH_STATES:
            raise ValueError(f"unknown health value {health!r}")
        if self._health.get(provider_id, "unknown") == health:
            return []
        self._health[provider_id] = health
        if health == "unhealthy":
            self._unhealthy.add(provider_id)
        else:
            self._unhealthy.discard(provider_id)
        return self._liveness_changed((provider_id,))

    def apply_snapshot(self, snapshot: PoolSnapshot) -> list[Waiter]:
        """Swap the static config and re-examine every waiter.

        Leases taken before keep counting against their provider and release
        normally; a lower capacity, ``max_queue`` or ``max_queued_bytes`` only
        affects new admissions (nobody already waiting is evicted).  Waiters
        keep the timeout they were enqueued with.
        """
        self.snapshot = snapshot
        for pid in [
            p
            for p, c in self._counters.items()
            if p not in snapshot.providers and c.in_flight == 0 and c.long_in_flight == 0
        ]:
            del self._counters[pid]
        self._index_snapshot()
        return self._reexamine(None)

    def fail_all_waiters(self, error: GatewayError | BaseException | None = None) -> list[Waiter]:
        """Empty the queue (shutdown).  Each waiter gets ``error`` (the caller may set its own)."""
        waiters = self.pending_waiters()
        self._queues.clear()
        self._queue_depth = 0
        self._queued_bytes = 0
        for w in waiters:
            w.state = WaiterState.FAILED
            w.error = error
        return waiters

    # ------------------------------------------------------------ internals

    def _check_queue_room(self, group_id: str, body_bytes: int) -> None:
        """Raise ``QueueFull`` unless one more waiter of ``body_bytes`` fits both bounds."""
        snap = self.snapshot
        if self._queue_depth >= snap.max_queue:
            raise QueueFull(
                f"all providers of model group '{group_id}' are busy and the request "
                f"queue is full ({snap.max_queue} waiting); retry later"
            )
        if snap.max_queued_bytes == 0 or self._queued_bytes + body_bytes > snap.max_queued_bytes:
            raise QueueFull(
                f"all providers of model group '{group_id}' are busy and the request "
                f"queue is full ({self._queued_bytes} of {snap.max_queued_bytes} body "
                f"bytes held by waiting requests; this one has {body_bytes}); retry later"
            )

    def _liveness_changed(self, provider_ids: Iterable[str]) -> list[Waiter]:
        """Some providers became (un)available: recheck only the groups that list them.

        Losing a candidate can fail waiters (no live candidate left) and can
        also admit some (a long request falls back to normal slots when the
        last provider with long slots goes away), so those keys are re-examined.
        """
        groups: set[str] = set()
        for pid in provider_ids:
            groups |= self._groups_by_provider.get(pid, set())
        if not groups:
            return []
        for key in [k for k in self._candidate_cache if k.group_id in groups]:
            del self._candidate_cache[key]
        return self._reexamine([k for k in self._queues if k.group_id in groups])

    def _index_snapshot(self) -> None:
        self._candidate_cache.clear()
        entries: dict[str, tuple[_Entry, ...]] = {}
        self._groups_by_provider = {}
        for gid, group in self.snapshot.groups.items():
            row: list[_Entry] = []
            for index, (pid, target) in enumerate(group.providers):
                slot = self.snapshot.providers.get(pid)
                if slot is None:
                    continue
                self._groups_by_provider.setdefault(pid, set()).add(gid)
                counters = self._counters.get(pid)
                if counters is None:
                    counters = self._counters[pid] = _Counters()
                row.append(_Entry(index, slot, target, counters))
            entries[gid] = tuple(row)
        self._entries = entries

    def _candidates(self, key: WaitKey) -> _Candidates | None:
        """Live candidates of a key, or None when there are none (SPEC §2.1, §2.4)."""
        try:
            return self._candidate_cache[key]
        except KeyError:
            pass
        if key.requires not in self._allowed_types:
            self._allowed_types[key.requires] = types_meeting(key.requires)
        allowed = self._allowed_types[key.requires]
        connected, unhealthy = self._connected, self._unhealthy
        live = [
            e
            for e in self._entries.get(key.group_id, ())
            if e.slot.enabled
            and e.slot.node_id in connected
            and e.slot.provider_id not in unhealthy
            and (allowed is None or e.slot.type in allowed)
        ]
        use_long = False
        if key.long:
            long_capable = [e for e in live if e.slot.long_context_capacity > 0]
            if long_capable:
                live, use_long = long_capable, True
        result = (
            _Candidates(
                entries=tuple(live),
                indexes=tuple([e.index for e in live]),
                provider_ids=frozenset([e.slot.provider_id for e in live]),
                use_long_slots=use_long,
            )
            if live
            else None
        )
        self._candidate_cache[key] = result
        return result

    def _select(self, group_id: str, cands: _Candidates) -> _Entry | None:
        """Lowest load ratio, then lower priority, then round-robin (SPEC §2.2)."""
        entries = cands.entries
        # Rotate the config-ordered candidates to start at the group's cursor;
        # strict "<" keeps the first one in rotation order among exact ties.
        cursor = self._cursor.get(group_id, 0)
        start = 0
        for i, idx in enumerate(cands.indexes):
            if idx >= cursor:
                start = i
                break
        best: _Entry | None = None
        best_ratio = 0.0
        best_priority = 0
        use_long = cands.use_long_slots
        n = len(entries)
        for i in range(n):
            e = entries[(start + i) % n]
            c = e.counters
            slot = e.slot
            if c.in_flight >= slot.capacity:
                continue
            if use_long and c.long_in_flight >= slot.long_context_capacity:
                continue
            ratio = c.in_flight / slot.capacity
            if (
                best is None
                or ratio < best_ratio
                or (ratio == best_ratio and slot.priority < best_priority)
            ):
                best, best_ratio, best_priority = e, ratio, slot.priority
        return best

    def _try_admit(self, key: WaitKey, cands: _Candidates) -> Grant | None:
        entry = self._select(key.group_id, cands)
        if entry is None:
            return None
        self._cursor[key.group_id] = entry.index + 1
        entry.counters.in_flight += 1
        if cands.use_long_slots:
            entry.counters.long_in_flight += 1
        slot = entry.slot
        grant = Grant(
            group_id=key.group_id,
            provider_id=slot.provider_id,
            node_id=slot.node_id,
            provider_type=slot.type,
            target=entry.target,
            long=cands.use_long_slots,
        )
        self._active.add(grant)
        return grant

    def _reexamine(self, keys: Iterable[WaitKey] | None) -> list[Waiter]:
        """Admit every waiter that fits, in enqueue order; fail those with no candidate."""
        resolved: list[Waiter] = []
        heap: list[tuple[int, WaitKey, _Candidates]] = []
        for key in list(self._queues) if keys is None else keys:
            q = self._queues.get(key)
            if not q:
                continue
            cands = self._candidates(key)
            if cands is None:
                del self._queues[key]
                self._queue_depth -= len(q)
                for w in q.values():
                    self._queued_bytes -= w.body_bytes
                    w.state = WaiterState.FAILED
                    w.error = (
                        _no_candidate_error(key)
                        if key.group_id in self.snapshot.groups
                        else NodeDispatchError(
                            f"model group '{key.group_id}' was removed from the configuration"
                        )
                    )
                    resolved.append(w)
                continue
            heap.append((next(iter(q)), key, cands))
        heapq.heapify(heap)
        while heap:
            seq, key, cands = heapq.heappop(heap)
            grant = self._try_admit(key, cands)
            if grant is None:
                continue  # admissions only take slots: this key cannot fit again this pass
            q = self._queues[key]
            waiter = q.pop(seq)
            self._queue_depth -= 1
            self._queued_bytes -= waiter.body_bytes
            waiter.state = WaiterState.ADMITTED
            waiter.grant = grant
            resolved.append(waiter)
            if q:
                heapq.heappush(heap, (next(iter(q)), key, cands))
            else:
                del self._queues[key]
        # Failures were collected first; report everything in enqueue order.
        resolved.sort(key=lambda w: w.seq)
        return resolved
