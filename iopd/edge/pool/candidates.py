"""Which providers a request may run on, and which one it gets.

Why this module is separate from the queue: whether a request fits depends
only on its ``WaitKey`` and the pool's state -- the live candidates of its
group (connected, enabled, not unhealthy, meeting ``requires``, not in its
``exclude``) and their free slots -- never on who else waits.  This module
owns that half: the static snapshot, liveness, the candidate cache and the
choice among candidates.  ``fair_queue`` owns the other half (who waits, in
which order); ``scheduler`` joins them.

Choice with outliers: a provider the ``OutlierTracker`` does not
find choosable (ejected, saturated by a 429, or a half-open one whose single
probe is out) is not chosen while any other candidate of the key exists,
even a busy one -- the request then waits rather than going to an ejected
provider.  When every candidate is excluded, the tracker's ``last_resort``
picks the one to use, so ejection alone never leaves a request without a
provider.  Providers the tracker holds no exclusion for are never asked
(``flagged``), so the common path costs one set test.

Several edges: the node is the authority for a provider's slots.
A provider's counters hold this edge's own leases (exact, at once) plus what
its node last reported of the *other* edges (``others``: their streams and
the slots held for their waiters; ``others_long``).  A provider is full when
the two together reach its capacity.  After the node answered ``Busy`` the
provider is ``blocked`` until the node's next report for it, so a request
never bounces between the edge's stale view and the node's refusal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from iopd.errors import NodeDispatchError, ProviderDrained
from iopd.vocabulary import Health, ProviderType, types_meeting

from . import routing as cache_aware
from .outliers import Attempt, EjectionPolicy, OutlierTracker
from .routing import RouteAsk as Ask

__all__ = [
    "Candidates",
    "CandidateIndex",
    "Entry",
    "Grant",
    "GroupPolicy",
    "PoolSnapshot",
    "PrincipalPolicy",
    "ProviderSlot",
    "WaitKey",
    "no_candidate_error",
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
    #: The operator's runtime state (``controls.ControlState``): why it is not enabled.
    control: str = "active"


@dataclass(frozen=True)
class GroupPolicy:
    """One model group: its providers in config order, with the served target."""

    id: str
    providers: tuple[tuple[str, str], ...]  # (provider_id, served target)
    queue_timeout: float | None = None  # per-group override (legacy routes)
    routing: cache_aware.RoutingMode = "prefix"  # ``models[].routing`` (``routing.py``)


@dataclass(frozen=True)
class PrincipalPolicy:
    """A principal's place in the pool: its fair-queue weight and concurrency cap.

    From ``limits:`` (``share``, ``max_concurrent``; 0 = unlimited).
    """

    share: int = 1
    max_concurrent: int = 0


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything static the pool needs; swapped whole on config refresh."""

    providers: Mapping[str, ProviderSlot]
    groups: Mapping[str, GroupPolicy]
    max_queue: int = 256
    queue_timeout: float = 30.0
    #: Most request-body bytes held by waiters at once; 0 = never wait (as ``max_queue``).
    max_queued_bytes: int = 256 * 1024 * 1024
    #: ``limits.principals`` by ``principal_ref``; every other principal gets the default.
    principals: Mapping[str, PrincipalPolicy] = field(default_factory=dict)
    default_principal: PrincipalPolicy = PrincipalPolicy()
    ejection: EjectionPolicy = EjectionPolicy()
    routing: cache_aware.RoutingPolicy = cache_aware.RoutingPolicy()

    def queue_timeout_of(self, group_id: str, override: float | None = None) -> float:
        """The waiting bound of a request: explicit override, else group's, else default."""
        if override is not None:
            return override
        group = self.groups.get(group_id)
        if group is not None and group.queue_timeout is not None:
            return group.queue_timeout
        return self.queue_timeout

    def principal(self, ref: str) -> PrincipalPolicy:
        return self.principals.get(ref, self.default_principal)


@dataclass(eq=False, slots=True)
class Grant:
    """A slot held on one provider.  Identity-hashed: each grant is released once.

    Treat as read-only.  Not ``frozen``: a frozen dataclass sets each field
    through ``object.__setattr__``, which doubled the cost of an admission
    (``scripts/bench_pool.py``).
    """

    group_id: str
    provider_id: str
    node_id: str
    provider_type: ProviderType
    target: str
    long: bool  # True when the grant holds a long-context slot (plus a normal one)
    principal: str = ""
    #: The outlier tracker's ticket for this attempt (its verdict goes back with it).
    attempt: Attempt | None = None
    route: str = "load"  # why this provider (``routing.RoutingReason``)
    matched: float = 0.0  # the prompt's fraction the provider was found to hold


class WaitKey(NamedTuple):
    """What decides whether a waiter fits: waiters with equal keys are interchangeable."""

    group_id: str
    long: bool
    requires: frozenset[str]
    exclude: frozenset[str] = frozenset()  # providers that already failed this request


class _Counters:
    """Per-provider slot usage; lives as long as the provider or its leases.

    ``in_flight``/``long_in_flight``: this edge's leases.  ``others``,
    ``others_long``, ``others_running`` and ``blocked``: the node's last word
    on the other edges (see the module doc).
    """

    __slots__ = (
        "in_flight",
        "long_in_flight",
        "others",
        "others_long",
        "others_running",
        "blocked",
    )

    def __init__(self) -> None:
        self.in_flight = 0
        self.long_in_flight = 0
        self.others = 0  # slots other edges hold: their streams + offers held for them
        self.others_long = 0  # long-context slots other edges' streams hold
        self.others_running = 0  # other edges' streams (the node's total minus ours)
        self.blocked = False  # answered Busy; waits for the node's next report

    def clear_remote(self) -> None:
        self.others = self.others_long = self.others_running = 0
        self.blocked = False


@dataclass(frozen=True)
class Entry:
    """One (provider, target) line of a group, with its config-order index."""

    index: int
    slot: ProviderSlot
    target: str
    counters: _Counters


@dataclass(frozen=True)
class Candidates:
    """The live candidates of one WaitKey, in config order."""

    entries: tuple[Entry, ...]
    provider_ids: frozenset[str]
    use_long_slots: bool


def _need(key: WaitKey) -> str:
    need = f" that supports {', '.join(sorted(key.requires))}" if key.requires else ""
    if key.exclude:
        need += " that has not failed this request"
    return need


def no_candidate_error(key: WaitKey) -> NodeDispatchError:
    need = _need(key)
    return NodeDispatchError(
        f"model group '{key.group_id}' has no available provider{need} "
        "(nodes disconnected, or providers disabled or unhealthy)"
    )


#: Providers an error names one by one; the rest are counted.
MAX_NAMED_PROVIDERS = 8


class CandidateIndex:
    """Providers, liveness, slot counters, the candidate cache and the choice."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        self.snapshot = snapshot
        self.outliers = OutlierTracker(snapshot.ejection)
        self.router = cache_aware.Router(snapshot.routing)
        #: Providers the tracker may exclude (ejected or saturated); others are choosable.
        self.flagged: set[str] = set()
        self._connected: set[str] = set()
        self._health: dict[str, Health] = {}
        self._unhealthy: set[str] = set()
        self._groups_by_provider: dict[str, set[str]] = {}
        self._allowed_types: dict[frozenset[str], frozenset[str] | None] = {}
        self._counters: dict[str, _Counters] = {}
        self._entries: dict[str, tuple[Entry, ...]] = {}
        self._cache: dict[WaitKey, Candidates | None] = {}
        self._cursor: dict[str, int] = {}
        self.index_snapshot()

    # ------------------------------------------------------------------ state

    def in_flight(self, provider_id: str) -> tuple[int, int]:
        c = self._counters.get(provider_id)
        return (c.in_flight, c.long_in_flight) if c is not None else (0, 0)

    def others_in_flight(self, provider_id: str) -> tuple[int, int]:
        """The other edges' ``(in_flight, long_in_flight)`` as the node last reported."""
        c = self._counters.get(provider_id)
        return (c.others_running, c.others_long) if c is not None else (0, 0)

    def set_remote(
        self,
        provider_id: str,
        node_id: str,
        in_flight: int,
        long_in_flight: int,
        offered: int,
        *,
        blocked: bool,
    ) -> bool | None:
        """Record the node's report (or ``Busy``) for one of its providers.

        None: not a provider of ``node_id`` (ignored); True: the provider may
        have room it did not have (its waiters are worth a look).
        """
        slot = self.snapshot.providers.get(provider_id)
        c = self._counters.get(provider_id)
        if slot is None or slot.node_id != node_id or c is None:
            return None
        others = in_flight + offered
        roomier = (
            (c.blocked and not blocked) or others < c.others or long_in_flight < c.others_long
        )
        c.others, c.others_long, c.others_running = others, long_in_flight, in_flight
        c.blocked = blocked
        return roomier

    def clear_remote(self, node_id: str) -> None:
        """Forget what ``node_id`` reported (its session ended or began)."""
        for pid, slot in self.snapshot.providers.items():
            c = self._counters.get(pid)
            if slot.node_id == node_id and c is not None:
                c.clear_remote()

    def health(self, provider_id: str) -> Health:
        return self._health.get(provider_id, "unknown")

    def is_connected(self, node_id: str) -> bool:
        return node_id in self._connected

    def set_connected(self, node_id: str, connected: bool) -> list[str]:
        """Record a node's session; the ids of the providers it changes (empty: no change)."""
        if connected == (node_id in self._connected):
            return []
        if connected:
            self._connected.add(node_id)
        else:
            self._connected.discard(node_id)
        changed = [pid for pid, slot in self.snapshot.providers.items() if slot.node_id == node_id]
        self.router.forget(changed)  # a new session: the provider may have restarted meanwhile
        return changed

    def set_health(self, provider_id: str, health: Health) -> bool:
        """Record a probe result; True when it changed."""
        if self._health.get(provider_id, "unknown") == health:
            return False
        self._health[provider_id] = health
        if health == "unhealthy":
            self._unhealthy.add(provider_id)
            self.router.index.drop(provider_id)  # down, or restarting: its cache is gone
        else:
            self._unhealthy.discard(provider_id)
        return True

    def groups_of(self, provider_ids: Sequence[str]) -> set[str]:
        groups: set[str] = set()
        for pid in provider_ids:
            groups |= self._groups_by_provider.get(pid, set())
        return groups

    def forget_groups(self, groups: set[str]) -> None:
        """Drop the cached candidates of these groups (liveness changed)."""
        for key in [k for k in self._cache if k.group_id in groups]:
            del self._cache[key]

    def refresh_flag(self, provider_id: str, now: float) -> None:
        """Re-read whether the tracker may exclude ``provider_id``."""
        t = self.outliers
        if t.is_ejected(provider_id) or t.saturated_until(provider_id, now) is not None:
            self.flagged.add(provider_id)
        else:
            self.flagged.discard(provider_id)

    def apply_snapshot(self, snapshot: PoolSnapshot, now: float) -> list[str]:
        """Swap the static config; the providers whose ejection the new policy ended."""
        old, self.snapshot = self.snapshot, snapshot
        self.router.set_policy(snapshot.routing)
        self.router.forget(cache_aware.routing_changed(old, snapshot))  # drained or reconfigured
        for pid in [
            p
            for p, c in self._counters.items()
            if p not in snapshot.providers and c.in_flight == 0 and c.long_in_flight == 0
        ]:
            del self._counters[pid]
        self.index_snapshot()
        restored = self.outliers.set_policy(snapshot.ejection)
        self.outliers.retain(snapshot.providers)
        for pid in list(self.flagged):
            self.refresh_flag(pid, now)
        return restored

    def drop_counters_if_gone(self, provider_id: str) -> bool:
        """Forget a removed provider's counters once its last lease is back."""
        c = self._counters[provider_id]
        if (
            c.in_flight == 0
            and c.long_in_flight == 0
            and provider_id not in self.snapshot.providers
        ):
            del self._counters[provider_id]
            return True
        return False

    def index_snapshot(self) -> None:
        self._cache.clear()
        entries: dict[str, tuple[Entry, ...]] = {}
        self._groups_by_provider = {}
        for gid, group in self.snapshot.groups.items():
            row: list[Entry] = []
            for index, (pid, target) in enumerate(group.providers):
                slot = self.snapshot.providers.get(pid)
                if slot is None:
                    continue
                self._groups_by_provider.setdefault(pid, set()).add(gid)
                counters = self._counters.get(pid)
                if counters is None:
                    counters = self._counters[pid] = _Counters()
                row.append(Entry(index, slot, target, counters))
            entries[gid] = tuple(row)
        self._entries = entries

    def _why_not(self, entry: Entry, exclude: frozenset[str]) -> str:
        """Why ``entry`` is no candidate now, in the words of an error message."""
        slot = entry.slot
        if not slot.enabled:
            if slot.control == "draining":
                return "drained"
            return "disabled" if slot.control == "disabled" else "enabled: false"
        if slot.node_id not in self._connected:
            return f"node {slot.node_id} disconnected"
        if slot.provider_id in self._unhealthy:
            return "unhealthy"
        return "failed this request" if slot.provider_id in exclude else "unavailable"

    def unavailable_error(self, key: WaitKey) -> NodeDispatchError:
        """The error of a group without a live candidate, naming each provider's state;
        503 ``provider_drained`` when an operator drained every one."""
        allowed = types_meeting(key.requires)
        entries = [
            e
            for e in self._entries.get(key.group_id, ())
            if allowed is None or e.slot.type in allowed
        ]
        if not entries:
            return no_candidate_error(key)
        reasons = [self._why_not(e, key.exclude) for e in entries]
        named = ", ".join(
            f"{e.slot.provider_id} {why}"
            for e, why in zip(entries[:MAX_NAMED_PROVIDERS], reasons, strict=False)
        )
        if len(entries) > MAX_NAMED_PROVIDERS:
            named += f", and {len(entries) - MAX_NAMED_PROVIDERS} more"
        if all(why == "drained" for why in reasons):
            return ProviderDrained(
                f"model group '{key.group_id}' is drained: every provider of it is drained "
                f"by an operator ({named}); retry later, or `iopd provider enable ID`"
            )
        return NodeDispatchError(
            f"model group '{key.group_id}' has no available provider{_need(key)}: {named}"
        )

    # ------------------------------------------------------------------ candidates

    def candidates(self, key: WaitKey) -> Candidates | None:
        """Live candidates of a key, or None when there are none."""
        try:
            return self._cache[key]
        except KeyError:
            pass
        if key.requires not in self._allowed_types:
            self._allowed_types[key.requires] = types_meeting(key.requires)
        allowed = self._allowed_types[key.requires]
        connected, unhealthy, exclude = self._connected, self._unhealthy, key.exclude
        live = [
            e
            for e in self._entries.get(key.group_id, ())
            if e.slot.enabled
            and e.slot.node_id in connected
            and e.slot.provider_id not in unhealthy
            and e.slot.provider_id not in exclude
            and (allowed is None or e.slot.type in allowed)
        ]
        use_long = False
        if key.long:
            long_capable = [e for e in live if e.slot.long_context_capacity > 0]
            if long_capable:
                live, use_long = long_capable, True
        result = (
            Candidates(
                entries=tuple(live),
                provider_ids=frozenset([e.slot.provider_id for e in live]),
                use_long_slots=use_long,
            )
            if live
            else None
        )
        self._cache[key] = result
        return result

    def route(
        self,
        group_id: str,
        fallbacks: Sequence[str],
        long: bool,
        requires: frozenset[str],
        exclude: frozenset[str],
        now: float,
    ) -> tuple[WaitKey, Candidates]:
        """The group of the chain that takes the request, with its live candidates."""
        if not fallbacks:  # the common case: one group, its candidates whatever they are
            key = WaitKey(group_id, long, requires, exclude)
            cands = self.candidates(key)
            if cands is not None:
                return key, cands
        first_live: tuple[WaitKey, Candidates] | None = None
        for gid in (group_id, *fallbacks):
            key = WaitKey(gid, long, requires, exclude)
            cands = self.candidates(key)
            if cands is None:
                continue
            if self.has_choosable(cands, now):
                return key, cands
            if first_live is None:
                first_live = (key, cands)
        if first_live is not None:
            return first_live  # every candidate excluded: its last resort serves
        if group_id not in self.snapshot.groups:
            raise NodeDispatchError(f"model group '{group_id}' is not configured")
        raise self.unavailable_error(WaitKey(group_id, long, requires, exclude))

    def has_choosable(self, cands: Candidates, now: float) -> bool:
        """True when some candidate is not excluded by the outlier tracker."""
        flagged = self.flagged
        if not flagged:
            return True
        is_choosable = self.outliers.is_choosable
        return any(pid not in flagged or is_choosable(pid, now) for pid in cands.provider_ids)

    def eligible(self, cands: Candidates, now: float) -> Sequence[Entry]:
        """The candidates a request may go to now: the choosable ones, else the last resort."""
        entries = cands.entries
        flagged = self.flagged
        if not flagged or flagged.isdisjoint(cands.provider_ids):
            return entries
        is_choosable = self.outliers.is_choosable
        choosable = [
            e
            for e in entries
            if e.slot.provider_id not in flagged or is_choosable(e.slot.provider_id, now)
        ]
        if choosable:
            return choosable
        pick = self.outliers.last_resort([e.slot.provider_id for e in entries], now)
        return [e for e in entries if e.slot.provider_id == pick]

    def select(self, group_id: str, cands: Candidates, now: float) -> Entry | None:
        """Lowest load ratio, then lower priority, then round-robin."""
        flagged = self.flagged
        if flagged and not flagged.isdisjoint(cands.provider_ids):
            entries = self.eligible(cands, now)
        else:
            entries = cands.entries
        # Rotate the config-ordered candidates to start at the group's cursor;
        # strict "<" keeps the first one in rotation order among exact ties.
        cursor = self._cursor.get(group_id, 0)
        start = 0
        for i, e in enumerate(entries):
            if e.index >= cursor:
                start = i
                break
        best: Entry | None = None
        best_ratio = 0.0
        best_priority = 0
        use_long = cands.use_long_slots
        n = len(entries)
        for i in range(n):
            e = entries[(start + i) % n]
            c = e.counters
            slot = e.slot
            used = c.in_flight + c.others  # others: 0 with one edge
            if used >= slot.capacity or c.blocked:
                continue
            if use_long and c.long_in_flight + c.others_long >= slot.long_context_capacity:
                continue
            ratio = used / slot.capacity
            if (
                best is None
                or ratio < best_ratio
                or (ratio == best_ratio and slot.priority < best_priority)
            ):
                best, best_ratio, best_priority = e, ratio, slot.priority
        return best

    def take(
        self, key: WaitKey, cands: Candidates, principal: str, now: float, ask: Ask | None = None
    ) -> Grant | None:
        """Choose a provider and take its slot, or None when every eligible one is full
        (or, for a prefix-routed ``ask``, when it waits for its busy target)."""
        group = self.snapshot.groups.get(key.group_id)
        routed = self.router.routes(ask, key.group_id, group.routing if group else None)
        route: cache_aware.RoutingReason = "load"
        matched = 0.0
        if ask is None or not routed:
            entry = self.select(key.group_id, cands, now)
        else:
            entry, route, matched = cache_aware.route_entries(
                self.router, key.group_id, self.eligible(cands, now), cands.use_long_slots,
                ask, now, lambda: self.select(key.group_id, cands, now),
            )  # fmt: skip
        if entry is None:
            return None
        self._cursor[key.group_id] = entry.index + 1
        entry.counters.in_flight += 1
        if cands.use_long_slots:
            entry.counters.long_in_flight += 1
        slot = entry.slot
        attempt = self.outliers.attempt_started(slot.provider_id, now)
        if attempt.probe:
            self.flagged.add(slot.provider_id)  # not choosable while its probe runs
        if ask is not None:
            self.router.took(key.group_id, slot.provider_id, ask, routed, route, matched)
        return Grant(
            group_id=key.group_id,
            provider_id=slot.provider_id,
            node_id=slot.node_id,
            provider_type=slot.type,
            target=entry.target,
            long=cands.use_long_slots,
            principal=principal,
            attempt=attempt,
            route=route,
            matched=matched,
        )

    def give_back(self, grant: Grant) -> _Counters:
        counters = self._counters[grant.provider_id]
        counters.in_flight -= 1
        if grant.long:
            counters.long_in_flight -= 1
        return counters
