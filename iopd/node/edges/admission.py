"""The node's admission: the one authority for its providers' slots.

Why it lives on the node: with several edges each one counting its own
slots, a provider would run up to ``capacity`` times the number of edges.
The node sees every stream of every edge, so it admits each one against the
provider's ``capacity`` and ``long_context_capacity`` (of the config it
applied) and answers ``Busy`` at once when the provider is full.  Edges keep
admitting locally first (no round trip on the hot path) and route by what the
node reports; the node's check is the one that may refuse.

Why pure and synchronous: like the edge's scheduler, every decision is made
here without I/O or clock (callers pass ``now``); ``AdmissionView`` is the
thin per-edge face the link uses, and ``EdgeSessions`` pushes the reports.

What an edge is told (``SlotLoad``): the load it cannot see itself -- the
other edges' streams and the slots held for their waiters.  It adds its own
streams, which it knows exactly and sooner, so its own opens in transit never
make it over-count or under-count.  A report for an edge is due when another
edge changes a provider's load, or after the edge was answered ``Busy`` (it
then holds back from the provider until its next report: "owed").

Offers: an edge says which providers it has waiters for (``Waiting``).  When
a slot frees and edges wait for that provider, the slot is held for one
waiting edge -- the first in the order they registered, which then moves to
the back -- so the other edges see it taken and nobody stampedes.  At most
one offer per edge is out at a time; the held edge's next open takes it.  An
offer lapses after ``OFFER_HOLD`` seconds (an edge that cannot use it), or
``WITHDRAW_GRACE`` after the edge said it stopped waiting (that message can
overtake the open that uses the offer, so it is not withdrawn at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from wire.messages import SlotLoad

__all__ = ["OFFER_HOLD", "WITHDRAW_GRACE", "AdmissionView", "Slot", "SlotTable"]

#: Seconds a slot held for a waiting edge stays held if that edge does not use it.
OFFER_HOLD = 1.0
#: Seconds an offer stays held after its edge said it no longer waits.
WITHDRAW_GRACE = 0.05

#: ``limits(provider_id) -> (capacity, long_context_capacity)``, None for a provider
#: the node does not serve (then nothing is counted: the executor refuses it).
Limits = Callable[[str], tuple[int, int] | None]


@dataclass(eq=False, slots=True)
class Slot:
    """One admitted stream's hold on a provider; released exactly once."""

    edge: str
    provider_id: str
    long: bool  # holds a long-context slot too
    released: bool = False


@dataclass(slots=True)
class _EdgeLoad:
    """One edge's share of one provider."""

    in_flight: int = 0
    long_in_flight: int = 0
    offered: int = 0  # slots held for this edge (0 or 1)
    offer_until: float = math.inf


@dataclass(slots=True)
class _ProviderLoad:
    """One provider's totals, its edges' shares and its waiting edges in order."""

    in_flight: int = 0
    long_in_flight: int = 0
    offered: int = 0
    edges: dict[str, _EdgeLoad] = field(default_factory=dict)
    waiting: dict[str, None] = field(default_factory=dict)  # edges, in registration order

    def edge(self, edge: str) -> _EdgeLoad:
        load = self.edges.get(edge)
        if load is None:
            load = self.edges[edge] = _EdgeLoad()
        return load


class SlotTable:
    """Every provider's slots across the node's edges (see the module doc)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._providers: dict[str, _ProviderLoad] = {}
        #: Edges with a session now -> providers whose report to that edge is due.
        self._pending: dict[str, set[str]] = {}
        #: Edge -> providers it was answered Busy for: reported at their next change.
        self._owed: dict[str, set[str]] = {}
        self._offers_out = 0

    # ------------------------------------------------------------ queries

    def view(self, edge: str, provider_id: str) -> SlotLoad:
        """What ``edge`` must count on ``provider_id`` besides its own streams."""
        p = self._providers.get(provider_id)
        if p is None:
            return SlotLoad(provider_id=provider_id)
        own = p.edges.get(edge)
        if own is None:
            own = _EdgeLoad()
        return SlotLoad(
            provider_id=provider_id,
            in_flight=p.in_flight - own.in_flight,
            long_in_flight=p.long_in_flight - own.long_in_flight,
            offered=p.offered - own.offered,
        )

    def totals(self, provider_id: str) -> tuple[int, int]:
        """``(in_flight, long_in_flight)`` of a provider across every edge."""
        p = self._providers.get(provider_id)
        return (p.in_flight, p.long_in_flight) if p is not None else (0, 0)

    @property
    def dirty(self) -> bool:
        """Some edge has a report due."""
        return any(self._pending.values())

    def take_reports(self, edge: str) -> list[SlotLoad]:
        """The reports due to ``edge`` (then none is due), in provider-id order."""
        due = self._pending.get(edge)
        if not due:
            return []
        self._pending[edge] = set()
        return [self.view(edge, pid) for pid in sorted(due)]

    def next_expiry(self) -> float | None:
        """When the earliest offer lapses (None: no offer is out)."""
        if not self._offers_out:
            return None
        return min(
            (
                e.offer_until
                for p in self._providers.values()
                for e in p.edges.values()
                if e.offered
            ),
            default=None,
        )

    # ------------------------------------------------------------ edges

    def add_edge(self, edge: str) -> None:
        """``edge`` has a session: it gets the load of every provider others use."""
        self._pending[edge] = {
            pid for pid, p in self._providers.items() if p.in_flight or p.offered
        }
        self._owed[edge] = set()

    def remove_edge(self, edge: str, now: float) -> None:
        """``edge``'s session ended: its waits and offers go (its streams release
        their slots as they are cancelled)."""
        self._pending.pop(edge, None)
        self._owed.pop(edge, None)
        for pid, p in self._providers.items():
            p.waiting.pop(edge, None)
            load = p.edges.get(edge)
            if load is not None and load.offered:
                self._drop_offer(pid, p, edge, load)
                self._offer(pid, p, now)

    # ------------------------------------------------------------ streams

    def admit(self, edge: str, provider_id: str, long: bool, now: float) -> Slot | SlotLoad | None:
        """Take a slot for ``edge``'s new stream, or the load to answer ``Busy`` with.

        None: the node does not serve ``provider_id`` (nothing counted; the
        executor answers the stream).  ``long``: the edge leased a long-context
        slot; it is counted only where the provider has ``long_context_capacity``.
        """
        limits = self._limits(provider_id)
        if limits is None:
            return None
        capacity, long_capacity = limits
        p = self._providers.get(provider_id)
        if p is None:
            p = self._providers[provider_id] = _ProviderLoad()
        own = p.edge(edge)
        held = own.offered > 0
        long = long and long_capacity > 0
        if (p.in_flight >= capacity if held else p.in_flight + p.offered >= capacity) or (
            long and p.long_in_flight >= long_capacity
        ):
            owed = self._owed.get(edge)
            if owed is not None:
                owed.add(provider_id)
            return self.view(edge, provider_id)
        if held:  # the slot held for this edge: taken now
            p.offered -= 1
            self._offers_out -= 1
            own.offered = 0
            own.offer_until = math.inf
        p.in_flight += 1
        own.in_flight += 1
        if long:
            p.long_in_flight += 1
            own.long_in_flight += 1
        self._touched(provider_id, edge)
        return Slot(edge, provider_id, long)

    def release(self, slot: Slot, now: float) -> None:
        """Give a stream's slot back (idempotent); offer it to a waiting edge."""
        if slot.released:
            return
        slot.released = True
        p = self._providers[slot.provider_id]
        own = p.edges[slot.edge]
        p.in_flight -= 1
        own.in_flight -= 1
        if slot.long:
            p.long_in_flight -= 1
            own.long_in_flight -= 1
        if not (own.in_flight or own.offered):
            del p.edges[slot.edge]
        self._touched(slot.provider_id, slot.edge)
        self._offer(slot.provider_id, p, now)

    # ------------------------------------------------------------ waiting and offers

    def set_waiting(self, edge: str, provider_id: str, waiting: bool, now: float) -> None:
        """``edge`` has (or no longer has) waiters ``provider_id`` could serve."""
        if edge not in self._pending or self._limits(provider_id) is None:
            return  # no session, or not a provider of this node: nothing is kept
        p = self._providers.get(provider_id)
        if p is None:
            p = self._providers[provider_id] = _ProviderLoad()
        if waiting:
            if edge not in p.waiting:
                p.waiting[edge] = None
                self._offer(provider_id, p, now)
            return
        p.waiting.pop(edge, None)
        own = p.edges.get(edge)
        if own is not None and own.offered:
            own.offer_until = min(own.offer_until, now + WITHDRAW_GRACE)

    def expire(self, now: float) -> None:
        """Withdraw the offers whose time ran out and offer those slots again."""
        if not self._offers_out:
            return
        for pid, p in self._providers.items():
            lapsed = [e for e, load in p.edges.items() if load.offered and load.offer_until <= now]
            for edge in lapsed:
                self._drop_offer(pid, p, edge, p.edges[edge])
            if lapsed:
                self._offer(pid, p, now)

    def reconfigured(self, now: float) -> None:
        """The node applied a config: a capacity may have grown; offer what is free."""
        for pid, p in self._providers.items():
            self._offer(pid, p, now)

    # ------------------------------------------------------------ internals

    def _offer(self, provider_id: str, p: _ProviderLoad, now: float) -> None:
        """Hold free slots for waiting edges, one each, in registration order."""
        if not p.waiting:
            return
        limits = self._limits(provider_id)
        if limits is None:
            return
        free = limits[0] - p.in_flight - p.offered
        for edge in list(p.waiting):
            if free <= 0:
                return
            own = p.edge(edge)
            if own.offered:
                continue
            own.offered = 1
            own.offer_until = now + OFFER_HOLD
            p.offered += 1
            self._offers_out += 1
            del p.waiting[edge]  # to the back: the next freed slot goes to the next edge
            p.waiting[edge] = None
            free -= 1
            self._touched(provider_id, edge)

    def _drop_offer(self, provider_id: str, p: _ProviderLoad, edge: str, own: _EdgeLoad) -> None:
        p.offered -= own.offered
        self._offers_out -= own.offered
        own.offered = 0
        own.offer_until = math.inf
        if not own.in_flight:
            del p.edges[edge]
        self._touched(provider_id, edge)

    def _touched(self, provider_id: str, by: str) -> None:
        """``by`` changed ``provider_id``'s load: every other edge's view changed,
        and an edge owed a report for it gets one now."""
        for edge, due in self._pending.items():
            owed = self._owed[edge]
            if edge != by or provider_id in owed:
                due.add(provider_id)
                owed.discard(provider_id)


class AdmissionView:
    """One edge's face of the node's ``SlotTable`` (what its ``NodeLink`` calls).

    ``clock`` gives ``now``; ``changed`` is called when a report became due,
    so the sessions' push task wakes.
    """

    def __init__(
        self,
        table: SlotTable,
        edge: str,
        *,
        clock: Callable[[], float],
        changed: Callable[[], None],
    ) -> None:
        self.table = table
        self.edge = edge
        self._clock = clock
        self._changed = changed

    def connected(self) -> None:
        self.table.add_edge(self.edge)
        self._notify()

    def disconnected(self) -> None:
        self.table.remove_edge(self.edge, self._clock())
        self._notify()

    def admit(self, provider_id: str, long: bool) -> Slot | SlotLoad | None:
        verdict = self.table.admit(self.edge, provider_id, long, self._clock())
        self._notify()
        return verdict

    def release(self, slot: Slot) -> None:
        self.table.release(slot, self._clock())
        self._notify()

    def set_waiting(self, provider_id: str, waiting: bool) -> None:
        self.table.set_waiting(self.edge, provider_id, waiting, self._clock())
        self._notify()

    def reconfigured(self) -> None:
        self.table.reconfigured(self._clock())
        self._notify()

    def _notify(self) -> None:
        if self.table.dirty:
            self._changed()
