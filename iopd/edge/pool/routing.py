"""Cache-aware choice among a request's eligible providers (``models[].routing: prefix``).

Why: where a coding agent's turn lands decides its cost -- a provider that
still caches the turn's prefix prefills only the new tokens.  Eligibility,
ejection, saturation, fair share and limits are decided before this module
is asked (``candidates``, ``scheduler``); it only picks among the eligible
providers, and says when a request should rather wait for one that is busy.

The rule, for a request of a ``prefix`` group (``choose``):

1. **Load guard.**  A provider's pressure is ``(slots in use + waiters that
   wait for it) / capacity``.  A provider is *within bound* when its
   pressure exceeds the least pressure among the eligible ones by at most
   ``max(max_load_gap, max_load_gap_ratio × least)``: a hot session or a
   popular system prompt cannot pile onto one replica.
2. **Prefix.**  A request of a session this edge has placed before, or
   without a session key, goes to the provider holding the longest head of
   its block chain (``prefix_index``) when that head is at least
   ``min_match`` of the chain and the provider is within bound.
3. **Session.**  Otherwise a request with a session key goes to the first
   provider within bound in the session's rendezvous ranking (below):
   every edge places a session's first turn on the same provider.
4. **Load.**  Otherwise (no target, or ``least_load`` groups) today's rule:
   the lowest load ratio, then priority, then round-robin.

**A busy target.**  When the target has no free slot but another provider
has one and no waiter waits for it, the request waits for the target only while that is cheaper than
prefilling elsewhere: the tokens it would prefill there in excess
(estimated: prompt bytes / 4 × the difference of the matched fractions; a
session's first turn: × the fraction the other one lacks, since its later
turns would repeat it) must be at least ``wait_min_tokens``, and it waits at
most those tokens / ``prefill_tokens_per_second`` (the prefill time saved),
counted from its arrival.  Past that it goes to the least-loaded such
provider (``fallback``): never to one another waiter waits for.  When every provider is full it waits as any request does,
for its target first: a waiter that waits for one provider lets a later
waiter of its own line take a slot that frees elsewhere (``scheduler``).

**Session placement** (rendezvous hashing, the same on every edge).  Edges
behind a load balancer share no routing state, yet a session's turns should
meet the cache its first turn filled.  Rendezvous (highest random weight)
hashing ranks a group's providers for a session by a hash of (key, provider
id): every edge computes the same ranking from the key alone, a provider
joining takes only the sessions it now ranks first for, and one leaving
moves only its own.  The hash is BLAKE2b (stable across processes and
machines, unlike Python's ``hash``); the load guard walks the ranking past a
provider too far above the least-loaded one (bounded load).  ``SessionTable``
holds the sessions this edge placed (a bounded LRU of hashed keys, never a
key itself): a session it has seen follows the prefix index.

Every grant is counted by reason (``prefix``, ``session``, ``load``,
``fallback``: a target existed but was over the bound or busy too long) and
its matched fraction, for ``iop_routing_decisions_total`` and its histogram.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol, TypeVar, get_args

from .prefix_index import PrefixIndex, block_chain


class _GroupView(Protocol):
    @property
    def providers(self) -> tuple[tuple[str, str], ...]: ...


class _SnapshotView(Protocol):
    """What ``routing_changed`` reads of a ``candidates.PoolSnapshot``."""

    @property
    def providers(self) -> Mapping[str, object]: ...

    @property
    def groups(self) -> Mapping[str, _GroupView]: ...


__all__ = [
    "MATCH_BUCKETS",
    "ROUTING_MODES",
    "ROUTING_REASONS",
    "RouteAsk",
    "Router",
    "RoutingMode",
    "RoutingPolicy",
    "RoutingReason",
    "SessionTable",
    "rendezvous_order",
    "routing_changed",
    "session_digest",
]

RoutingMode = Literal["prefix", "least_load"]
ROUTING_MODES: Final = frozenset(get_args(RoutingMode))
RoutingReason = Literal["prefix", "session", "load", "fallback"]
ROUTING_REASONS: Final = get_args(RoutingReason)
#: Upper bounds of the matched-fraction histogram's buckets.
MATCH_BUCKETS: Final = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)
#: The prompt bytes one token is estimated at (as ``iopd.tokens``: 4 code points).
BYTES_PER_TOKEN: Final = 4


@dataclass(frozen=True)
class RoutingPolicy:
    """``provider_pool.routing``: the index's bounds and the choice's thresholds."""

    block_bytes: int = 512
    max_prompt_bytes: int = 256 * 1024
    index_blocks: int = 16384  # per provider
    max_sessions: int = 65536
    min_match: float = 0.5
    max_load_gap: float = 1.0
    max_load_gap_ratio: float = 0.5
    wait_min_tokens: int = 512
    prefill_tokens_per_second: float = 2000.0


def session_digest(group_id: str, session_key: str) -> bytes:
    """A session's stable identity in a group (16 bytes; the key itself is not kept)."""
    h = hashlib.blake2b(digest_size=16, person=b"iopd-session")
    h.update(group_id.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(session_key.encode("utf-8", "surrogatepass"))
    return h.digest()


def _weight(digest: bytes, provider_id: str) -> int:
    h = hashlib.blake2b(digest, digest_size=8)
    h.update(provider_id.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "big")


def rendezvous_order(digest: bytes, provider_ids: Iterable[str]) -> list[str]:
    """``provider_ids`` ranked for a session, first choice first (ties: by id)."""
    return sorted(provider_ids, key=lambda pid: (-_weight(digest, pid), pid))


class SessionTable:
    """The sessions placed recently (at most ``max_sessions``, least recent out)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._seen

    def note(self, digest: bytes) -> None:
        """The session was placed now."""
        seen = self._seen
        if digest in seen:
            seen.move_to_end(digest)
            return
        seen[digest] = None
        while len(seen) > self.max_sessions:
            seen.popitem(last=False)

    def resize(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        while len(self._seen) > max_sessions:
            self._seen.popitem(last=False)


class RouteAsk:
    """What a request brings to the choice: its prompt bytes and session key.

    Also its state while it waits: since when, and the provider it waits
    for (``home``, counted in that provider's pressure while it is queued).
    """

    __slots__ = (
        "prompt",
        "session",
        "since",
        "home",
        "deadline",
        "watched",
        "counted",
        "_chains",
        "_matched",
    )

    def __init__(self, prompt: bytes = b"", session: str | None = None) -> None:
        self.prompt = prompt
        self.session = session or None
        self.since: float | None = None
        self.home: str | None = None
        #: When it stops declining a free provider for its busy home (None: it does not).
        self.deadline: float | None = None
        self.watched: float | None = None  # the deadline the scheduler's timer knows
        self.counted = False
        self._chains: dict[str, tuple[int, ...]] = {}
        #: The last lookup: (group, the index's version, the candidates; its result).
        self._matched: tuple[tuple[str, int, frozenset[str]], dict[str, int]] | None = None

    def routable(self, group_id: str, policy: RoutingPolicy) -> bool:
        """Whether there is anything to route by: a session key or one whole block
        (else the least-load rule, at no cost)."""
        return bool(self.session) or len(self.prompt) >= policy.block_bytes

    def chain(self, group_id: str, policy: RoutingPolicy) -> tuple[int, ...]:
        """The prompt's block chain in ``group_id`` (computed once per group)."""
        chain = self._chains.get(group_id)
        if chain is None:
            cap = max(0, policy.max_prompt_bytes) // policy.block_bytes
            chain = self._chains[group_id] = block_chain(
                self.prompt, group_id, policy.block_bytes, cap
            )
        return chain


class Pick:
    """One candidate as the choice sees it (built by the candidate index)."""

    __slots__ = ("provider_id", "used", "capacity", "free")

    def __init__(self, provider_id: str, used: int, capacity: int, free: bool) -> None:
        self.provider_id = provider_id
        self.used = used
        self.capacity = capacity
        self.free = free


class Router:
    """The prefix index, the sessions placed, the waiters' homes and the decision counts."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self.index = PrefixIndex(policy.index_blocks)
        self.sessions = SessionTable(policy.max_sessions)
        self.homed: dict[str, int] = {}  # provider -> queued waiters waiting for it
        self.decisions: dict[tuple[str, str], int] = {}  # (group, reason) -> grants
        #: Per group: counts per ``MATCH_BUCKETS`` bucket, then the sum of fractions.
        self.matched: dict[str, list[float]] = {}

    def set_policy(self, policy: RoutingPolicy) -> None:
        if policy.block_bytes != self.policy.block_bytes:
            self.index = PrefixIndex(policy.index_blocks)  # old hashes mean nothing now
        elif policy.index_blocks != self.policy.index_blocks:
            self.index.set_max_blocks(policy.index_blocks)
        self.sessions.resize(policy.max_sessions)
        self.policy = policy

    # ------------------------------------------------------------------ choice

    def choose(
        self,
        group_id: str,
        picks: Sequence[Pick],
        ask: RouteAsk,
        now: float,
        least_load: Callable[[], str | None],
    ) -> tuple[str | None, RoutingReason, float]:
        """The provider to take now (None: wait) with the reason and matched fraction."""
        policy = self.policy
        if ask.since is None:
            ask.since = now
        chain = ask.chain(group_id, policy)
        total = len(chain)
        homed = self.homed
        own = ask.home if ask.counted else None  # a waiter's own wait is not load on it
        pressure = {
            p.provider_id: (p.used + homed.get(p.provider_id, 0) - (p.provider_id == own))
            / p.capacity
            if p.capacity > 0
            else math.inf
            for p in picks
        }
        least = min(pressure.values(), default=0.0)
        bound = least + max(policy.max_load_gap, policy.max_load_gap_ratio * least)
        matches = self._match(group_id, chain, ask, pressure)
        digest = session_digest(group_id, ask.session) if ask.session else None
        target: str | None = None
        reason: RoutingReason = "load"
        wanted = False
        if matches and (digest is None or digest in self.sessions):
            best = max(matches, key=lambda pid: (matches[pid], -pressure[pid]))
            if matches[best] >= policy.min_match * total:
                wanted = True
                if pressure[best] <= bound:
                    target, reason = best, "prefix"
        if target is None and digest is not None:
            wanted = True
            for pid in rendezvous_order(digest, pressure):
                if pressure[pid] <= bound:
                    target, reason = pid, "session"
                    break
        fraction = matches.get(target, 0) / total if target is not None and total else 0.0
        if target is None:
            return least_load(), "fallback" if wanted else "load", 0.0
        if any(p.free for p in picks if p.provider_id == target):
            return target, reason, fraction
        # Prefill elsewhere only on a provider nobody waits for: another waiter's
        # home that frees is that waiter's to take.
        idle = [
            p for p in picks if p.free and homed.get(p.provider_id, 0) <= (p.provider_id == own)
        ]
        alt = min(idle, key=lambda p: p.used / p.capacity).provider_id if idle else None
        if alt is None:
            self._rehome(ask, target)  # every provider full or awaited: wait, for the target
            return None, reason, fraction
        alt_fraction = matches.get(alt, 0) / total if total else 0.0
        lacking = fraction - alt_fraction if reason == "prefix" else 1.0 - alt_fraction
        saved_tokens = lacking * total * policy.block_bytes / BYTES_PER_TOKEN
        patience = saved_tokens / max(policy.prefill_tokens_per_second, 1e-9)
        if saved_tokens >= policy.wait_min_tokens and now - ask.since < patience:
            self._rehome(ask, target)
            ask.deadline = ask.since + patience
            return None, reason, fraction
        return alt, "fallback", alt_fraction

    def _match(
        self, group_id: str, chain: tuple[int, ...], ask: RouteAsk, candidates: Iterable[str]
    ) -> dict[str, int]:
        """The index's lookup, kept while the index does not change: a waiter
        re-examined at every release walks its chain once per change, not per look."""
        if not chain:
            return {}
        key = (group_id, self.index.version, frozenset(candidates))
        if ask._matched is not None and ask._matched[0] == key:
            return ask._matched[1]
        matches = self.index.match(chain, key[2])
        ask._matched = (key, matches)
        return matches

    # ------------------------------------------------------------------ bookkeeping

    def routes(self, ask: RouteAsk | None, group_id: str, mode: str | None) -> bool:
        """Whether ``ask`` is routed by this module (a ``prefix`` group, something to
        route by), or by the least-load rule."""
        return ask is not None and mode == "prefix" and ask.routable(group_id, self.policy)

    def took(
        self,
        group_id: str,
        provider_id: str,
        ask: RouteAsk,
        routed: bool,
        reason: RoutingReason,
        fraction: float,
    ) -> None:
        """A grant was taken for ``ask``: recorded (when routed) and counted."""
        if routed:
            self.granted(group_id, provider_id, ask, reason, fraction)
        else:
            self.count(group_id, "load", None)

    def forget(self, provider_ids: Iterable[str]) -> None:
        """The index forgets these providers (their caches are gone or unknown)."""
        for pid in provider_ids:
            self.index.drop(pid)

    def granted(
        self,
        group_id: str,
        provider_id: str,
        ask: RouteAsk,
        reason: RoutingReason,
        fraction: float,
    ) -> None:
        """A grant was taken: the provider holds the prompt now; count the decision."""
        chain = ask.chain(group_id, self.policy)
        if chain:
            self.index.record(provider_id, chain)
        if ask.session:
            self.sessions.note(session_digest(group_id, ask.session))
        self.count(group_id, reason, fraction if chain else None)

    def count(self, group_id: str, reason: str, fraction: float | None) -> None:
        key = (group_id, reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if fraction is None:
            return
        hist = self.matched.get(group_id)
        if hist is None:
            hist = self.matched[group_id] = [0.0] * (len(MATCH_BUCKETS) + 1)
        for i, upper in enumerate(MATCH_BUCKETS):
            if fraction <= upper:
                hist[i] += 1
                break
        hist[-1] += fraction

    def enqueued(self, ask: RouteAsk) -> None:
        """The request now waits: its home (if any) counts in that provider's pressure."""
        if not ask.counted:
            ask.counted = True
            if ask.home is not None:
                self.homed[ask.home] = self.homed.get(ask.home, 0) + 1

    def left(self, ask: RouteAsk) -> None:
        """The request no longer waits (admitted, failed, cancelled)."""
        if ask.counted:
            ask.counted = False
            self._unhome(ask.home)
        ask.home = ask.deadline = None

    def _rehome(self, ask: RouteAsk, provider_id: str) -> None:
        if ask.home == provider_id:
            return
        if ask.counted:
            self._unhome(ask.home)
            self.homed[provider_id] = self.homed.get(provider_id, 0) + 1
        ask.home = provider_id

    def _unhome(self, provider_id: str | None) -> None:
        if provider_id is None:
            return
        left = self.homed[provider_id] - 1
        if left:
            self.homed[provider_id] = left
        else:
            del self.homed[provider_id]


def routing_changed(old: _SnapshotView, new: _SnapshotView) -> list[str]:
    """Providers the prefix index forgets at a swap: gone, changed (a drain or
    a disable turns ``enabled`` false) or serving another target."""

    def targets(snap: _SnapshotView) -> dict[str, set[tuple[str, str]]]:
        out: dict[str, set[tuple[str, str]]] = {}
        for gid, group in snap.groups.items():
            for pid, target in group.providers:
                out.setdefault(pid, set()).add((gid, target))
        return out

    if old is new:
        return []
    before, after = targets(old), targets(new)
    return [
        pid
        for pid, slot in old.providers.items()
        if new.providers.get(pid) != slot or before.get(pid) != after.get(pid)
    ]


class _Counts(Protocol):
    in_flight: int
    others: int
    long_in_flight: int
    others_long: int
    blocked: bool


class _Slot(Protocol):
    @property
    def provider_id(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def long_context_capacity(self) -> int: ...


class _Entry(Protocol):
    """What ``route_entries`` reads of a ``candidates.Entry``."""

    @property
    def counters(self) -> _Counts: ...

    @property
    def slot(self) -> _Slot: ...


E = TypeVar("E", bound=_Entry)


def route_entries(
    router: Router,
    group_id: str,
    entries: Sequence[E],
    use_long: bool,
    ask: RouteAsk,
    now: float,
    least_load: Callable[[], E | None],
) -> tuple[E | None, RoutingReason, float]:
    """The router's choice among the eligible candidates (moved out of ``candidates``:
    each entry's slots as a ``Pick``, and the least-load rule as its fallback)."""
    picks: list[Pick] = []
    by_id: dict[str, E] = {}
    for e in entries:
        c, slot = e.counters, e.slot
        used = c.in_flight + c.others
        free = not (
            used >= slot.capacity
            or c.blocked
            or (use_long and c.long_in_flight + c.others_long >= slot.long_context_capacity)
        )
        picks.append(Pick(slot.provider_id, used, slot.capacity, free))
        by_id[slot.provider_id] = e

    def least() -> str | None:
        entry = least_load()
        return entry.slot.provider_id if entry is not None else None

    pid, reason, matched = router.choose(group_id, picks, ask, now, least)
    return (by_id[pid] if pid is not None else None), reason, matched
