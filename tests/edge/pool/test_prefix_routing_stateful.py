"""The cache-aware choice under random admissions, releases, cancels, time and
liveness: the waiters' homes always count exactly the pending waiters that
wait for each provider, the index stays in its bound, and everything returns
to zero once every waiter is gone and every grant released."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iopd.edge.pool.routing import RouteAsk, RoutingPolicy
from iopd.edge.pool.scheduler import (
    Grant,
    GroupPolicy,
    PoolSnapshot,
    ProviderSlot,
    Scheduler,
    Waiter,
    WaiterState,
)
from iopd.errors import NodeDispatchError, QueueFull

BLOCK = 64
PROMPTS = [b"S" * BLOCK * 2 + bytes([65 + i]) * BLOCK * (1 + i % 3) for i in range(5)]


class RoutingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        snap = PoolSnapshot(
            providers={p: ProviderSlot(p, f"n{p}", "echo", 1 + (p == "b")) for p in "abc"},
            groups={"m": GroupPolicy("m", tuple((p, "t") for p in "abc"))},
            routing=RoutingPolicy(
                block_bytes=BLOCK,
                index_blocks=6,
                wait_min_tokens=8,
                prefill_tokens_per_second=50.0,
            ),
            max_queue=50,
        )
        self.s = Scheduler(snap)
        for p in "abc":
            self.s.set_node_connected(f"n{p}", True, now=0.0)
        self.now = 0.0
        self.grants: list[Grant] = []
        self.waiters: list[Waiter] = []

    def _collect(self, resolved: list[Waiter]) -> None:
        for w in resolved:
            if w.grant is not None:
                self.grants.append(w.grant)

    @rule(i=st.integers(0, len(PROMPTS) - 1), session=st.sampled_from([None, "x", "y"]))
    def request(self, i: int, session: str | None) -> None:
        try:
            out = self.s.request("m", ask=RouteAsk(PROMPTS[i], session), now=self.now)
        except (NodeDispatchError, QueueFull):
            return
        if isinstance(out, Grant):
            self.grants.append(out)
        else:
            self.waiters.append(out)

    @precondition(lambda self: self.grants)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        g = self.grants.pop(data.draw(st.integers(0, len(self.grants) - 1)))
        self._collect(self.s.release(g, now=self.now))

    @precondition(lambda self: self.waiters)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self.s.cancel(self.waiters[data.draw(st.integers(0, len(self.waiters) - 1))])

    @rule(dt=st.floats(0.01, 5.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        if self.s.next_outlier_change() is not None:
            self._collect(self.s.outliers_due(now=self.now))

    @rule(node=st.sampled_from(["na", "nb", "nc"]), up=st.booleans())
    def liveness(self, node: str, up: bool) -> None:
        self._collect(self.s.set_node_connected(node, up, now=self.now))

    @invariant()
    def homes_count_exactly_the_pending_waiters(self) -> None:
        want: dict[str, int] = {}
        for w in self.s.pending_waiters():
            if w.route is not None and w.route.home is not None and w.route.counted:
                want[w.route.home] = want.get(w.route.home, 0) + 1
        assert self.s.router.homed == want
        for w in self.waiters:
            if w.state is not WaiterState.PENDING and w.route is not None:
                assert not w.route.counted and w.route.home is None

    @invariant()
    def index_in_bound(self) -> None:
        for p in "abc":
            assert self.s.router.index.blocks(p) <= 6

    def teardown(self) -> None:
        for w in list(self.s.pending_waiters()):
            self.s.cancel(w)
        for g in self.grants:
            self.s.release(g, now=self.now)
        assert self.s.router.homed == {}
        assert not self.s.active_grants and self.s.queue_depth == 0


TestRoutingMachine = RoutingMachine.TestCase
TestRoutingMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
