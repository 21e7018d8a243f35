"""A provider pool's load as ``/status``, the metrics and the nodes see it.

Why apart from the scheduler: these are read-only views over its candidate
index and queue, computed when asked (a scrape, a status call, a change of
the queue), never on the admission path.  With several edges a
provider's ``in_flight`` is every edge's streams -- this edge's leases plus
what the node reported of the others -- while ``own_in_flight`` stays this
edge's share, which its metrics gauges carry so that sums across edges do not
count a stream twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from iopd.vocabulary import load_ratio

from .candidates import CandidateIndex
from .fair_queue import FairQueue

__all__ = ["ProviderLoad", "provider_loads", "waiting_providers"]


@dataclass(frozen=True)
class ProviderLoad:
    """A provider's current load, for the status view and metrics."""

    in_flight: int  # every edge's streams: this edge's leases + the node's report of others
    long_in_flight: int
    queued: int  # waiters whose live candidates include this provider
    capacity: int
    long_context_capacity: int
    load_ratio: float  # ``iopd.vocabulary.load_ratio`` of ``in_flight``
    own_in_flight: int = 0  # this edge's leases only (its metrics gauges)
    own_long_in_flight: int = 0


def provider_loads(index: CandidateIndex, queue: FairQueue) -> dict[str, ProviderLoad]:
    """Load of every provider in the index's snapshot."""
    queued: dict[str, int] = {}
    for (key, _), q in queue.lanes.items():
        cands = index.candidates(key)
        if cands is None:
            continue
        for pid in cands.provider_ids:
            queued[pid] = queued.get(pid, 0) + len(q)
    loads: dict[str, ProviderLoad] = {}
    for pid, slot in index.snapshot.providers.items():
        own, own_long = index.in_flight(pid)
        others, others_long = index.others_in_flight(pid)
        loads[pid] = ProviderLoad(
            in_flight=own + others,
            long_in_flight=own_long + others_long,
            queued=queued.get(pid, 0),
            capacity=slot.capacity,
            long_context_capacity=slot.long_context_capacity,
            load_ratio=load_ratio(own + others, slot.capacity),
            own_in_flight=own,
            own_long_in_flight=own_long,
        )
    return loads


def waiting_providers(index: CandidateIndex, queue: FairQueue) -> set[str]:
    """Providers some waiter of ``queue`` could run on."""
    waiting: set[str] = set()
    for key, _ in queue.lanes:
        cands = index.candidates(key)
        if cands is not None:
            waiting |= cands.provider_ids
    return waiting
