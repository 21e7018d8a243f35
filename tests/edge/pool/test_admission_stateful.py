"""Several edges sharing one node's slots, as a hypothesis state machine.

Each edge is a real ``Scheduler`` (the pool's pure core) with the glue the
trio layer adds (``ProviderPool._tell_waiting``: the providers it waits for);
the node is a real ``SlotTable``.  Between them the wire is modeled as one
in-order queue per direction and edge, delivered one message at a time in an
order hypothesis picks, so every race of the real links is reachable: an open
overtaking a load report, ``Waiting(false)`` overtaking the open that uses an
offer, a caller that leaves (``Cancel``) before the node ends its stream, a
``Busy`` after the slot already freed, an edge's link lost mid-stream.

Checked after every step: no provider ever runs more than its capacity at the
node (across edges), the node's counts equal the streams it runs; and when
everything is delivered and offers had time to lapse ("quiescent"): no edge
has a waiter a provider of the node could take (no lost wake-up), and once
every stream ends nothing is held anywhere (no leaked slot, no leaked lease).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from iopd.edge.pool import GroupPolicy, PoolSnapshot, ProviderSlot
from iopd.edge.pool.scheduler import Grant, Scheduler, Waiter, WaiterState
from iopd.node.edges.admission import OFFER_HOLD, Slot, SlotTable
from wire.messages import SlotLoad

EDGES = ["e0", "e1", "e2"]
CAPACITY = {"p0": 1, "p1": 2}
NODE = "n"


def snapshot() -> PoolSnapshot:
    providers = {
        pid: ProviderSlot(pid, NODE, "openai", capacity=cap) for pid, cap in CAPACITY.items()
    }
    groups = {
        "both": GroupPolicy("both", (("p0", "m"), ("p1", "m"))),
        "only0": GroupPolicy("only0", (("p0", "m"),)),
    }
    return PoolSnapshot(providers=providers, groups=groups, max_queue=64, queue_timeout=1e9)


@dataclass
class Open:  # edge -> node: a stream on the grant's provider
    grant: Grant


@dataclass
class Cancel:  # edge -> node: the caller left
    grant: Grant


@dataclass
class WaitingMsg:
    provider_id: str
    waiting: bool


@dataclass
class Busy:  # node -> edge
    grant: Grant
    load: SlotLoad


@dataclass
class Terminal:  # node -> edge: the stream ended
    grant: Grant


@dataclass
class Report:
    loads: list[SlotLoad]


@dataclass
class Edge:
    name: str
    sched: Scheduler
    to_node: deque[object] = field(default_factory=deque)
    to_edge: deque[object] = field(default_factory=deque)
    told: set[str] = field(default_factory=set)  # providers the node was told we wait for
    running: set[Grant] = field(default_factory=set)  # leases whose stream may run
    groups: dict[Grant, str] = field(default_factory=dict)


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.table = SlotTable(lambda pid: (CAPACITY[pid], 0) if pid in CAPACITY else None)
        self.edges: dict[str, Edge] = {}
        for name in EDGES:
            sched = Scheduler(snapshot())
            sched.set_node_connected(NODE, True, self.now)
            self.edges[name] = Edge(name, sched)
            self.table.add_edge(name)
        #: Streams the node runs: (edge, grant) -> its slot.
        self.streams: dict[tuple[str, Grant], Slot] = {}
        self.cancelled: set[tuple[str, Grant]] = set()
        self.seq: dict[Grant, int] = {}  # admission order: a deterministic sort key

    # ------------------------------------------------------------ edge glue

    def tell_waiting(self, edge: Edge) -> None:
        now = edge.sched.waiting_providers()
        for pid in sorted(now - edge.told):
            edge.to_node.append(WaitingMsg(pid, True))
        for pid in sorted(edge.told - now):
            edge.to_node.append(WaitingMsg(pid, False))
        edge.told = now

    def admitted(self, edge: Edge, grant: Grant) -> None:
        self.seq[grant] = len(self.seq)
        edge.running.add(grant)
        edge.to_node.append(Open(grant))

    def resolved(self, edge: Edge, waiters: list[Waiter]) -> None:
        for w in waiters:
            assert w.state is WaiterState.ADMITTED and w.grant is not None
            edge.groups[w.grant] = w.group_id
            self.admitted(edge, w.grant)
        self.tell_waiting(edge)

    def request(self, edge: Edge, group: str) -> None:
        outcome = edge.sched.request(group, now=self.now)
        if isinstance(outcome, Grant):
            edge.groups[outcome] = group
            self.admitted(edge, outcome)
        self.tell_waiting(edge)

    def release(self, edge: Edge, grant: Grant) -> None:
        edge.running.discard(grant)
        self.resolved(edge, edge.sched.release(grant, self.now))

    # ------------------------------------------------------------ node glue

    def push_reports(self) -> None:
        for name, edge in self.edges.items():
            loads = self.table.take_reports(name)
            if loads:
                edge.to_edge.append(Report(loads))

    def node_receive(self, edge: Edge) -> None:
        msg = edge.to_node.popleft()
        if isinstance(msg, Open):
            verdict = self.table.admit(edge.name, msg.grant.provider_id, False, self.now)
            if isinstance(verdict, SlotLoad):
                edge.to_edge.append(Busy(msg.grant, verdict))
            else:
                assert isinstance(verdict, Slot)
                self.streams[(edge.name, msg.grant)] = verdict
        elif isinstance(msg, Cancel):
            if (edge.name, msg.grant) in self.streams:
                self.cancelled.add((edge.name, msg.grant))
        else:
            assert isinstance(msg, WaitingMsg)
            self.table.set_waiting(edge.name, msg.provider_id, msg.waiting, self.now)

    def edge_receive(self, edge: Edge) -> None:
        msg = edge.to_edge.popleft()
        sched = edge.sched
        if isinstance(msg, Report):
            for load in msg.loads:
                self.resolved(
                    edge,
                    sched.set_remote_load(
                        NODE, load.provider_id, load.in_flight, 0, load.offered, self.now
                    ),
                )
        elif isinstance(msg, Busy):
            load = msg.load
            sched.provider_busy(NODE, load.provider_id, load.in_flight, 0, load.offered)
            if msg.grant in edge.running:  # the request leases again (no failure)
                group = edge.groups.pop(msg.grant)
                self.release(edge, msg.grant)
                self.request(edge, group)
        else:
            assert isinstance(msg, Terminal)
            if msg.grant in edge.running:
                edge.groups.pop(msg.grant, None)
                self.release(edge, msg.grant)

    def end_stream(self, key: tuple[str, Grant]) -> None:
        slot = self.streams.pop(key)
        self.cancelled.discard(key)
        self.table.release(slot, self.now)  # before the terminal is sent
        self.edges[key[0]].to_edge.append(Terminal(key[1]))

    def _key(self, k: tuple[str, Grant]) -> int:
        return self.seq[k[1]]

    # ------------------------------------------------------------ rules

    @rule(edge=st.sampled_from(EDGES), group=st.sampled_from(["both", "only0"]))
    def caller_arrives(self, edge: str, group: str) -> None:
        self.request(self.edges[edge], group)

    @precondition(lambda self: any(e.to_node for e in self.edges.values()))
    @rule(data=st.data())
    def deliver_to_node(self, data: st.DataObject) -> None:
        edge = data.draw(st.sampled_from([e for e in self.edges.values() if e.to_node]))
        self.node_receive(edge)

    @precondition(lambda self: any(e.to_edge for e in self.edges.values()))
    @rule(data=st.data())
    def deliver_to_edge(self, data: st.DataObject) -> None:
        edge = data.draw(st.sampled_from([e for e in self.edges.values() if e.to_edge]))
        self.edge_receive(edge)

    @rule()
    def node_pushes(self) -> None:
        self.push_reports()

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def stream_ends(self, data: st.DataObject) -> None:
        self.end_stream(data.draw(st.sampled_from(sorted(self.streams, key=self._key))))

    @precondition(lambda self: any(e.running for e in self.edges.values()))
    @rule(data=st.data())
    def caller_leaves(self, data: st.DataObject) -> None:
        """The edge frees its lease at once and sends Cancel (the node ends it later)."""
        edge = data.draw(st.sampled_from([e for e in self.edges.values() if e.running]))
        grant = data.draw(st.sampled_from(sorted(edge.running, key=self.seq.__getitem__)))
        edge.groups.pop(grant, None)
        self.release(edge, grant)
        edge.to_node.append(Cancel(grant))

    @precondition(lambda self: self.cancelled)
    @rule(data=st.data())
    def cancelled_stream_ends(self, data: st.DataObject) -> None:
        self.end_stream(data.draw(st.sampled_from(sorted(self.cancelled, key=self._key))))

    @rule(dt=st.sampled_from([0.01, OFFER_HOLD]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.table.expire(self.now)

    @rule(edge=st.sampled_from(EDGES))
    def edge_link_lost(self, edge: str) -> None:
        """The link drops and comes back: the node cancels that edge's streams and
        forgets its waits and offers; the edge fails its waiters for the node."""
        e = self.edges[edge]
        for key in [k for k in self.streams if k[0] == edge]:
            self.table.release(self.streams.pop(key), self.now)
            self.cancelled.discard(key)
        self.table.remove_edge(edge, self.now)
        e.to_node.clear()
        e.to_edge.clear()
        failed = e.sched.set_node_connected(NODE, False, self.now)
        assert all(w.state is WaiterState.FAILED for w in failed)
        for grant in list(e.running):  # their streams fail: the leases go back
            e.groups.pop(grant, None)
            self.release(e, grant)
        e.told = set()
        self.table.add_edge(edge)
        self.resolved(e, e.sched.set_node_connected(NODE, True, self.now))

    # ------------------------------------------------------------ invariants

    @invariant()
    def no_provider_over_capacity_across_edges(self) -> None:
        for pid, cap in CAPACITY.items():
            running = sum(1 for (_, g) in self.streams if g.provider_id == pid)
            assert self.table.totals(pid) == (running, 0)
            assert running <= cap, (pid, running, cap)

    def quiesce(self) -> None:
        """Deliver everything, let offers lapse, until nothing moves."""
        for _ in range(1000):
            self.push_reports()
            moved = False
            for e in self.edges.values():
                while e.to_node:
                    self.node_receive(e)
                    moved = True
                while e.to_edge:
                    self.edge_receive(e)
                    moved = True
            if not moved:
                expiry = self.table.next_expiry()
                if expiry is None or self.table.dirty:
                    if not self.table.dirty:
                        return
                    continue
                self.now = max(self.now, expiry)
                self.table.expire(self.now)
        raise AssertionError(
            "the edges and the node never settled: a slot offered to a waiting edge "
            "is never taken (a lost wake-up)"
        )

    def teardown(self) -> None:
        self.quiesce()
        # No lost wake-up: a waiter waits only while its providers are full at the node.
        for e in self.edges.values():
            for w in e.sched.pending_waiters():
                pids = ["p0"] if w.group_id == "only0" else ["p0", "p1"]
                for pid in pids:
                    assert self.table.totals(pid)[0] >= CAPACITY[pid], (e.name, pid, w)
        # Every stream ends, callers keep coming until the queues drain: nothing leaks.
        for _ in range(10_000):
            self.quiesce()
            if not self.streams:
                break
            self.end_stream(sorted(self.streams, key=self._key)[0])
        self.quiesce()
        for e in self.edges.values():
            assert not e.sched.pending_waiters(), e.name
            for grant in list(e.running):  # callers finish: their leases go back
                self.release(e, grant)
        self.quiesce()
        for pid in CAPACITY:
            assert self.table.totals(pid) == (0, 0)
        for e in self.edges.values():
            assert e.sched.active_grants == frozenset()


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
