"""The prefix index: chained blocks, the bounded LRU per provider, lookups, drops,
and a stateful test against a plain reference model."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from iopd.edge.pool.prefix_index import PrefixIndex, block_chain


def test_a_block_hash_names_its_whole_prefix() -> None:
    a = block_chain(b"x" * 8 + b"y" * 8 + b"z" * 8, "g", 8, 100)
    b = block_chain(b"x" * 8 + b"y" * 8 + b"w" * 8, "g", 8, 100)
    c = block_chain(b"q" * 8 + b"y" * 8 + b"z" * 8, "g", 8, 100)
    assert len(a) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # same later blocks, another head: nothing shared


def test_the_chain_is_seeded_partial_blocks_left_out_and_bounded() -> None:
    data = b"abcdefgh" * 10 + b"tail"
    assert block_chain(data, "g1", 8, 100) != block_chain(data, "g2", 8, 100)
    assert len(block_chain(data, "g", 8, 100)) == 10
    assert len(block_chain(data, "g", 8, 4)) == 4
    assert block_chain(b"short", "g", 8, 100) == ()


def test_match_walks_to_the_first_miss_per_candidate() -> None:
    idx = PrefixIndex(100)
    chain = tuple(range(1, 11))
    idx.record("a", chain)
    idx.record("b", chain[:4])
    idx.record("c", (99,) + chain[1:])
    got = idx.match(chain, ["a", "b", "c", "d"])
    assert got == {"a": 10, "b": 4}
    real = block_chain(b"p" * 64, "g", 8, 100)
    idx.record("a", real)
    other = block_chain(b"q" * 8 + b"p" * 56, "g", 8, 100)  # same tail, another head
    assert idx.match(other, ["a"]) == {}


def test_eviction_takes_the_oldest_tails_first() -> None:
    idx = PrefixIndex(6)
    shared = (1, 2, 3)
    idx.record("a", shared + (10, 11))
    idx.record("a", shared + (20, 21))  # the head touched last: freshest
    assert idx.blocks("a") == 6
    idx.record("a", shared + (30,))
    assert idx.blocks("a") == 6
    assert idx.match(shared + (30,), ["a"]) == {"a": 4}
    assert idx.match(shared + (20, 21), ["a"]) == {"a": 5}
    assert idx.match(shared + (10, 11), ["a"]) == {"a": 3}  # its tail went first


def test_a_chain_longer_than_the_bound_keeps_its_head() -> None:
    idx = PrefixIndex(3)
    idx.record("a", (1, 2, 3, 4, 5))
    assert idx.blocks("a") == 3
    assert idx.match((1, 2, 3, 4, 5), ["a"]) == {"a": 3}


def test_drop_forgets_one_provider_and_frees_its_memory() -> None:
    idx = PrefixIndex(100)
    idx.record("a", (1, 2, 3))
    idx.record("b", (1, 2))
    idx.drop("a")
    assert idx.match((1, 2, 3), ["a", "b"]) == {"b": 2}
    assert idx.blocks("a") == 0 and idx.distinct_blocks == 2
    idx.drop("b")
    assert idx.distinct_blocks == 0 and idx.total_blocks == 0
    idx.record("c", (7,))  # a freed bit is reused without mixing owners
    assert idx.match((1, 7), ["a", "b", "c"]) == {}
    assert idx.match((7,), ["a", "b", "c"]) == {"c": 1}


def test_stats_count_lookups_and_hits() -> None:
    idx = PrefixIndex(100)
    idx.record("a", (1, 2))
    idx.match((1, 2), ["a"])
    idx.match((3,), ["a"])
    stats = idx.stats("a")
    assert (stats.blocks, stats.lookups, stats.hits) == (2, 2, 1)
    assert stats.hit_rate == 0.5


def test_a_lower_bound_evicts_and_zero_records_nothing() -> None:
    idx = PrefixIndex(10)
    idx.record("a", tuple(range(10)))
    idx.set_max_blocks(4)
    assert idx.blocks("a") == 4 and idx.distinct_blocks == 4
    idx.set_max_blocks(0)
    idx.record("a", (50,))
    assert idx.total_blocks == 0 and idx.distinct_blocks == 0


class IndexMachine(RuleBasedStateMachine):
    """The index against a reference: per provider an ordered list of hashes,
    the most recent last, cut to the bound; a match is the longest head held."""

    def __init__(self) -> None:
        super().__init__()
        self.bound = 5
        self.idx = PrefixIndex(self.bound)
        self.ref: dict[str, list[int]] = {}

    providers = st.sampled_from(["a", "b", "c"])
    chains = st.lists(st.integers(0, 8), min_size=0, max_size=7).map(tuple)

    @rule(pid=providers, chain=chains)
    def record(self, pid: str, chain: tuple[int, ...]) -> None:
        self.idx.record(pid, chain)
        if not chain:
            return
        lru = self.ref.setdefault(pid, [])
        for h in reversed(chain[: self.bound]):
            if h in lru:
                lru.remove(h)
            lru.append(h)
        del lru[: max(0, len(lru) - self.bound)]

    @rule(pid=providers)
    def drop(self, pid: str) -> None:
        self.idx.drop(pid)
        self.ref.pop(pid, None)

    @rule(chain=chains)
    def match(self, chain: tuple[int, ...]) -> None:
        want = {}
        for pid, held in self.ref.items():
            n = 0
            while n < len(chain) and chain[n] in held:
                n += 1
            if n:
                want[pid] = n
        assert self.idx.match(chain, ["a", "b", "c"]) == want

    @invariant()
    def bounded_and_consistent(self) -> None:
        for pid in ("a", "b", "c"):
            assert self.idx.blocks(pid) == len(self.ref.get(pid, ()))
            assert self.idx.blocks(pid) <= self.bound
        assert self.idx.distinct_blocks == len({h for v in self.ref.values() for h in v})


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
