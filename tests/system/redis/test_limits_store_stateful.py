"""The shared limits store's Lua scripts against a reference model of the in-memory limiter's rules.

A hypothesis state machine drives ``LimitsStore`` on a real ``redis-server``
from three simulated edges (one client each): admissions with and without a
concurrency slot, settlements below and above the reservation (debt),
withdrawals, settlements sent again (a recovery), slot takes, renewals, an
edge that dies holding leases, and time passing.  After every step the
windows the store reports must equal the model's; at the end every live
admission is ended, time passes, and every window, slot and reservation
must be back to zero.

Time: the scripts read the server's clock, so the test moves time by
*ageing* the principal's keys -- every stamp in them (admissions, token
entries, lease expiries, the ``done`` set, the monotonic ``last``) goes back
by ``d`` seconds, which is what the scripts see when ``d`` seconds pass.
The real clock advances only milliseconds meanwhile, and every step is a
whole number of seconds, so no boundary is ambiguous.  The calendar day is
the server's: the test is skipped within minutes of UTC midnight.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iopd.edge.principals.decisions import Limits
from iopd.edge.principals.store import DONE_TTL_S, Admitted, LimitsStore, StoreView
from tests.support.redis_server import RedisServer, running_redis

REF = "team-model"
LIMITS = Limits(max_concurrent=2, requests_per_minute=5, tokens_per_minute=300, tokens_per_day=1500)
TTL = 15.0
WINDOW = 60
EDGES = 3

#: Moves every stamp of one principal's keys back by ARGV[1] seconds (keys as ``LimitsStore.keys``).
_AGE = """
local d = tonumber(ARGV[1])
for _, i in ipairs({1, 2, 5, 6}) do
  local items = redis.call('ZRANGE', KEYS[i], 0, -1, 'WITHSCORES')
  for j = 1, #items, 2 do redis.call('ZADD', KEYS[i], tonumber(items[j + 1]) - d, items[j]) end
end
local last = redis.call('HGET', KEYS[4], 'last')
if last then redis.call('HSET', KEYS[4], 'last', string.format('%.6f', tonumber(last) - d)) end
return 1
"""

_T = TypeVar("_T")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    seconds_into_day = time.time() % 86_400
    if seconds_into_day < 600 or seconds_into_day > 86_400 - 600:
        pytest.skip("too close to UTC midnight: the store's day would turn during the test")
    with running_redis(Path(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@dataclass
class Held:
    """The model's record of one admission."""

    key: str
    edge: int
    reserved: int
    slot: bool = False
    asked: int = 0  # before the store cut it (what an edge that never heard back knows)


@dataclass
class Model:
    """The limiter's rules for one principal, on the test's own clock ``now`` (s)."""

    now: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # admission id -> time
    tokens: dict[str, tuple[int, int]] = field(default_factory=dict)  # entry id -> (time, amount)
    day_total: int = 0
    slots: dict[str, int] = field(default_factory=dict)  # admission id -> lease expiry
    done: dict[str, int] = field(default_factory=dict)  # ended id -> when it ended

    def advance(self) -> None:
        edge = self.now - WINDOW
        self.requests = {k: t for k, t in self.requests.items() if t > edge}
        self.tokens = {k: v for k, v in self.tokens.items() if v[0] > edge}
        self.slots = {k: e for k, e in self.slots.items() if e > self.now}
        self.done = {k: t for k, t in self.done.items() if t + DONE_TTL_S > self.now}

    def view(self) -> tuple[int, int, int]:
        self.advance()
        return len(self.requests), sum(a for _, a in self.tokens.values()), self.day_total

    def over(self, tokens: int) -> set[str]:
        """The limits an admission of ``tokens`` would pass (empty: it fits)."""
        requests, in_window, _ = self.view()
        over = set()
        if requests + 1 > LIMITS.requests_per_minute:
            over.add("requests_per_minute")
        if in_window + tokens > LIMITS.tokens_per_minute:
            over.add("tokens_per_minute")
        if self.day_total + tokens > LIMITS.tokens_per_day:
            over.add("tokens_per_day")
        return over

    def take(self, key: str) -> bool:
        self.advance()
        if key not in self.slots and len(self.slots) >= LIMITS.max_concurrent:
            return False
        self.slots[key] = self.now + int(TTL)
        return True

    def ended(self) -> list[str]:
        """Ids ended recently enough that the store still knows them as done."""
        self.advance()
        return sorted(self.done)

    def end(self, key: str) -> None:
        self.slots.pop(key, None)
        self.done[key] = self.now


def run(redis: RedisServer, edge: int, call: Callable[[LimitsStore], Awaitable[_T]]) -> _T:
    """One call from simulated edge ``edge`` (a client of its own), on a fresh trio run."""
    del edge  # each call opens its own connection, as each edge holds its own

    async def main() -> _T:
        store = LimitsStore(redis.url, timeout=5.0)
        async with store.client:
            with trio.fail_after(10):
                return await call(store)

    return trio.run(main)


class StoreMachine(RuleBasedStateMachine):
    server: RedisServer

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.live: dict[str, Held] = {}
        self.ids = itertools.count()
        self.last_view: tuple[int, int, int] | None = None
        run(self.server, 0, lambda s: s.client.delete(LimitsStore.keys(REF)))

    # ------------------------------------------------------------ helpers

    def saw(self, view: StoreView) -> None:
        self.last_view = (view.requests, view.tokens, view.day_total)
        assert self.last_view == self.model.view()

    def new_key(self) -> str:
        return f"k{next(self.ids)}"

    # ------------------------------------------------------------ rules

    @rule(
        edge=st.integers(0, EDGES - 1),
        tokens=st.integers(0, 320),
        slot=st.booleans(),
        floor=st.none() | st.integers(0, 60),
    )
    def admit(self, edge: int, tokens: int, slot: bool, floor: int | None) -> None:
        key = self.new_key()
        got = run(
            self.server,
            edge,
            lambda s: s.admit(REF, key, LIMITS, tokens, TTL, slot=slot, floor=floor),
        )
        assert got is not None
        asked = tokens
        if floor is not None and floor < tokens:  # no maximum output: cut to the room left
            _, in_window, _ = self.model.view()
            room = min(
                LIMITS.tokens_per_minute - in_window, LIMITS.tokens_per_day - self.model.day_total
            )
            tokens = max(floor, min(tokens, room))
        over = self.model.over(tokens)
        if over:
            assert not isinstance(got, Admitted), (over, got)
            assert got.limit in over
        else:
            assert isinstance(got, Admitted), got
            assert got.tokens == tokens
            self.model.requests[key] = self.model.now
            if tokens > 0:
                self.model.tokens[key] = (self.model.now, tokens)
            self.model.day_total += tokens
            held = Held(key, edge, tokens, asked=asked)
            held.slot = self.model.take(key) if slot else False
            assert got.slot == held.slot
            self.live[key] = held
        self.saw(got.view)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), used=st.integers(0, 400))
    def settle(self, data: st.DataObject, used: int) -> None:
        held = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        tpd, day = LIMITS.tokens_per_day, int(time.time() // 86_400)
        view = run(
            self.server, held.edge, lambda s: s.settle(REF, held.key, held.reserved, used, tpd, day)
        )
        self.model.advance()
        entry = self.model.tokens.get(held.key)
        if entry is not None and used < entry[1]:
            self.model.tokens[held.key] = (entry[0], used)
        if used > held.reserved:
            self.model.tokens[held.key + ":debt"] = (self.model.now, used - held.reserved)
        self.model.day_total += used - held.reserved
        self.model.end(held.key)
        self.saw(view)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), day_known=st.booleans())
    def withdraw(self, data: st.DataObject, day_known: bool) -> None:
        held = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        tpd = LIMITS.tokens_per_day
        day = int(time.time() // 86_400) if day_known else -1
        # With the day unknown the edge never heard back: it knows only what it asked for.
        sent = held.reserved if day_known else held.asked
        view = run(self.server, held.edge, lambda s: s.withdraw(REF, held.key, sent, tpd, day))
        self.model.advance()
        if day_known or held.key in self.model.requests:
            self.model.day_total -= held.reserved  # else the store cannot know it arrived
        self.model.requests.pop(held.key, None)
        self.model.tokens.pop(held.key, None)
        self.model.end(held.key)
        self.saw(view)

    @precondition(lambda self: self.model.ended())
    @rule(data=st.data(), used=st.integers(0, 400), as_withdrawal=st.booleans())
    def end_again(self, data: st.DataObject, used: int, as_withdrawal: bool) -> None:
        """A settlement or withdrawal sent again (at recovery) changes nothing."""
        key = data.draw(st.sampled_from(self.model.ended()))
        tpd, day = LIMITS.tokens_per_day, int(time.time() // 86_400)

        async def again(s: LimitsStore) -> StoreView:
            if as_withdrawal:
                return await s.withdraw(REF, key, 50, tpd, day)
            return await s.settle(REF, key, 50, used, tpd, day)

        self.saw(run(self.server, 0, again))

    @precondition(lambda self: any(not h.slot for h in self.live.values()))
    @rule(data=st.data())
    def take_slot(self, data: st.DataObject) -> None:
        held = self.live[
            data.draw(st.sampled_from(sorted(k for k, h in self.live.items() if not h.slot)))
        ]
        taken = run(
            self.server, held.edge, lambda s: s.take_slot(REF, held.key, LIMITS.max_concurrent, TTL)
        )
        held.slot = self.model.take(held.key)
        assert taken == (1 if held.slot else 0)

    @precondition(lambda self: any(h.slot for h in self.live.values()))
    @rule(data=st.data())
    def free_slot(self, data: st.DataObject) -> None:
        """The request queues for a provider again: its lease is given back, it stays admitted."""
        held = self.live[
            data.draw(st.sampled_from(sorted(k for k, h in self.live.items() if h.slot)))
        ]
        freed = run(self.server, held.edge, lambda s: s.free_slot(REF, held.key))
        self.model.advance()
        was_held = self.model.slots.pop(held.key, None) is not None
        held.slot = False
        assert freed == (1 if was_held else 0)

    @rule(edge=st.integers(0, EDGES - 1))
    def renew(self, edge: int) -> None:
        """The edge renews every lease it holds; one that expired meanwhile is put back."""
        keys = sorted(k for k, h in self.live.items() if h.edge == edge and h.slot)
        if not keys:
            return
        renewed = run(self.server, edge, lambda s: s.renew(REF, keys, TTL))
        self.model.advance()
        for key in keys:
            self.model.slots[key] = self.model.now + int(TTL)
        assert renewed == len(keys)

    @rule(edge=st.integers(0, EDGES - 1))
    def edge_dies(self, edge: int) -> None:
        """The edge vanishes: its admissions are never ended nor renewed again."""
        for key in [k for k, h in self.live.items() if h.edge == edge]:
            del self.live[key]

    @rule(seconds=st.sampled_from([1, 5, 14, 20, 45, 61]))
    def time_passes(self, seconds: int) -> None:
        run(
            self.server,
            0,
            lambda s: s.client.eval(_AGE, keys=LimitsStore.keys(REF), args=[seconds]),
        )
        self.model.now += seconds

    @invariant()
    def slots_agree(self) -> None:
        held = run(self.server, 0, lambda s: s.slots_held(REF))
        self.model.advance()
        assert held == len(self.model.slots)

    def teardown(self) -> None:
        """Every admission ends, a minute passes: windows, slots and reservations are empty."""
        try:
            for key in list(self.live):
                self.withdraw_or_settle(self.live.pop(key))
            self.time_passes(WINDOW + 1)
            self.time_passes(int(TTL))
            probe = self.new_key()
            view = run(self.server, 0, lambda s: s.withdraw(REF, probe, 0, 0, -1))
            assert (view.requests, view.tokens) == (0, 0)
            assert view.day_total == self.model.day_total
            assert run(self.server, 0, lambda s: s.slots_held(REF)) == 0
            keys = LimitsStore.keys(REF)

            async def sizes(s: LimitsStore) -> list[int]:
                return [await s.client.zcard(keys[0]), await s.client.zcard(keys[1])] + [
                    await s.client.hlen(keys[2])
                ]

            assert run(self.server, 0, sizes) == [0, 0, 0]
        finally:
            super().teardown()

    def withdraw_or_settle(self, held: Held) -> None:
        tpd, day = LIMITS.tokens_per_day, int(time.time() // 86_400)
        view = run(
            self.server, held.edge, lambda s: s.settle(REF, held.key, held.reserved, 0, tpd, day)
        )
        self.model.advance()
        entry = self.model.tokens.get(held.key)
        if entry is not None:
            self.model.tokens[held.key] = (entry[0], 0)
        self.model.day_total -= held.reserved
        self.model.end(held.key)
        self.saw(view)


def test_store_scripts_follow_the_reference_model(redis: RedisServer) -> None:
    StoreMachine.server = redis
    machine: Any = StoreMachine
    machine.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
