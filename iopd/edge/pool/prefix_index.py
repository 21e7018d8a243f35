"""Which provider most likely still holds a prompt's prefix in its cache.

Why: an inference server keeps the prompt it last processed (its KV or
prompt cache) and reuses the longest prefix a new prompt shares with it, so
a coding agent's turn, which resends the conversation so far plus a few
hundred new tokens, costs a fraction of a cold prefill where its previous
turn ran.  The edge cannot see the providers' caches; it remembers what it
sent where.  No tokenizer: the prompt's bytes
(``iopd.edge.openai.incoming.prompt_blocks``) are cut into fixed blocks and
each block's hash is chained on the previous one (``block_chain``), so a
block's hash names the whole prefix up to it, and two prompts share the
first ``k`` hashes exactly when they share their first ``k`` blocks.  The
chain is seeded with the model group, so groups never share a block.
Python's ``hash`` is used (fast, process-local: the index never leaves the
process; what must agree across edges is session placement, ``routing``).

``PrefixIndex``: per provider a bounded LRU of the block hashes recently
routed there, and a reverse map from a block to the providers holding it
(a bit mask: one bit per provider).  ``record`` touches a chain's blocks
from the last to the first, so the shared head of many prompts stays
freshest and eviction takes tails first.  ``match`` walks a chain to the
first block no candidate holds and gives each candidate's matched block
count.  ``drop`` forgets a provider (its node reconnected, it restarted,
drained, was disabled or its config changed).  Memory: at most
``max_blocks`` hashes per provider; cost: ``record`` and ``match`` are
linear in the chain, which the caller bounds (``RoutingPolicy``).  Pure
and synchronous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["IndexStats", "PrefixIndex", "block_chain"]


def block_chain(data: bytes, seed: str, block_bytes: int, max_blocks: int) -> tuple[int, ...]:
    """The chained hashes of ``data``'s whole blocks (a partial last block is left out)."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0 (got {block_bytes})")
    n = min(len(data) // block_bytes, max_blocks)
    h = hash(seed)
    out: list[int] = []
    for off in range(0, n * block_bytes, block_bytes):
        h = hash((h, data[off : off + block_bytes]))
        out.append(h)
    return tuple(out)


@dataclass(frozen=True)
class IndexStats:
    """One provider's entry in ``/status``: its index size and how often lookups found it."""

    blocks: int
    lookups: int  # lookups it was a candidate of (with a non-empty chain)
    hits: int  # of them, lookups where it held at least the first block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class _Provider:
    __slots__ = ("bit", "lru", "lookups", "hits")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.lookups = 0
        self.hits = 0


class PrefixIndex:
    """Block hashes by provider (bounded LRU each) and providers by block."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0 (got {max_blocks})")
        self.max_blocks = max_blocks
        self._providers: dict[str, _Provider] = {}
        self._where: dict[int, int] = {}  # block hash -> bit mask of the providers holding it
        self._free_bits: list[int] = []
        self._next_bit = 0
        #: Moves on at every change, so a caller may keep a lookup until it does.
        self.version = 0

    # ------------------------------------------------------------------ updates

    def record(self, provider_id: str, chain: Sequence[int]) -> None:
        """``chain`` was routed to ``provider_id``: it holds these blocks now."""
        if not chain or self.max_blocks == 0:
            return
        self.version += 1
        p = self._providers.get(provider_id)
        if p is None:
            p = self._providers[provider_id] = _Provider(self._take_bit())
        lru, where, bit = p.lru, self._where, 1 << p.bit
        for i in range(min(len(chain), self.max_blocks) - 1, -1, -1):  # the head last: freshest
            h = chain[i]
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                where[h] = where.get(h, 0) | bit
        while len(lru) > self.max_blocks:
            self._unset(lru.popitem(last=False)[0], bit)

    def drop(self, provider_id: str) -> None:
        """Forget everything ``provider_id`` holds (its cache is gone or unknown)."""
        p = self._providers.pop(provider_id, None)
        if p is None:
            return
        self.version += 1
        bit = 1 << p.bit
        for h in p.lru:
            self._unset(h, bit)
        self._free_bits.append(p.bit)

    def drop_all_but(self, keep: Iterable[str]) -> None:
        """Forget every provider not in ``keep`` (removed from the config)."""
        kept = set(keep)
        for pid in [p for p in self._providers if p not in kept]:
            self.drop(pid)

    def set_max_blocks(self, max_blocks: int) -> None:
        """A new bound (refresh): a lower one evicts each provider's oldest blocks."""
        self.max_blocks = max_blocks
        self.version += 1
        for p in self._providers.values():
            bit = 1 << p.bit
            while len(p.lru) > max_blocks:
                self._unset(p.lru.popitem(last=False)[0], bit)

    # ------------------------------------------------------------------ lookups

    def match(self, chain: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """Each candidate's matched blocks: the length of the chain's head it holds.

        Candidates the index knows nothing of are left out (they match 0).
        Stops at the first block no remaining candidate holds.
        """
        providers = self._providers
        bits: dict[int, str] = {}
        alive = 0
        for pid in candidates:
            p = providers.get(pid)
            if p is not None and chain:
                p.lookups += 1
                bits[p.bit] = pid
                alive |= 1 << p.bit
        out: dict[str, int] = {}
        if not alive:
            return out
        where = self._where
        for i, h in enumerate(chain):
            held = where.get(h, 0) & alive
            gone = alive & ~held
            if gone:
                self._settle(out, bits, gone, i)
                alive = held
                if not alive:
                    return out
        self._settle(out, bits, alive, len(chain))
        return out

    def _settle(self, out: dict[str, int], bits: dict[int, str], mask: int, n: int) -> None:
        while mask:
            low = mask & -mask
            pid = bits[low.bit_length() - 1]
            mask ^= low
            if n:
                out[pid] = n
                self._providers[pid].hits += 1

    # ------------------------------------------------------------------ status

    def blocks(self, provider_id: str) -> int:
        p = self._providers.get(provider_id)
        return len(p.lru) if p is not None else 0

    @property
    def total_blocks(self) -> int:
        """Hashes held over every provider (each bounded by ``max_blocks``)."""
        return sum(len(p.lru) for p in self._providers.values())

    @property
    def distinct_blocks(self) -> int:
        return len(self._where)

    def stats(self, provider_id: str) -> IndexStats:
        p = self._providers.get(provider_id)
        if p is None:
            return IndexStats(0, 0, 0)
        return IndexStats(len(p.lru), p.lookups, p.hits)

    def holds(self, provider_id: str, block: int) -> bool:
        p = self._providers.get(provider_id)
        return p is not None and block in p.lru

    # ------------------------------------------------------------------ internals

    def _take_bit(self) -> int:
        if self._free_bits:
            return self._free_bits.pop()
        self._next_bit += 1
        return self._next_bit - 1

    def _unset(self, h: int, bit: int) -> None:
        mask = self._where.get(h, 0) & ~bit
        if mask:
            self._where[h] = mask
        else:
            self._where.pop(h, None)
