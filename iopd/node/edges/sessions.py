"""``EdgeSessions``: the node's sessions, one ``NodeLink`` per edge it dials.

Why one object: a node serves every edge of ``node.edges`` (or the one
``node.edge``) at once, each through an independent session (its own dial
loop, backoff, heartbeats and nursery; the TLS settings and the token are
the node's).  An edge lost ends only its own session, and with it only that
edge's streams (``iopd.node.executor.EdgeStreams`` keeps each edge's streams
apart); the others keep serving.  Health reports go to every connected edge.

Everything that is per edge but node-wide in scope lives here: the
sessions, the derived keys of the handshake, the broadcast of what every edge
must agree on (``iopd.node.edges.shared_state``: the config revision in force, the
runtime controls), and the providers' slots across edges.
Admission (``iopd.node.edges.admission``): one ``SlotTable`` for the node, one
``AdmissionView`` per link; the load reports it makes due are pushed by one
task (``_push_loads``), coalesced: every change of one scheduler round goes
in one ``LoadReport`` per edge.  With one edge nothing is ever due but after
a ``Busy`` (the edge counts its own streams itself).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from iopd.config.schema import NodeSection, node_edge_addresses
from iopd.node.edges.admission import AdmissionView, SlotTable
from iopd.node.edges.handshake import SaltedPasswords
from iopd.node.edges.link import NodeLink
from iopd.node.executor import NodeExecutor
from wire.messages import LoadReport, Message, ProviderStatus

log = logging.getLogger("iopd.node.sessions")  # (its name before the package moved)


class EdgeSessions:
    """Every edge session of the node; the ``StatusSink`` of its health monitor."""

    def __init__(
        self,
        cfg: NodeSection,
        executor: NodeExecutor,
        *,
        software_version: str,
        link_factory: Callable[..., NodeLink] = NodeLink,
    ) -> None:
        self._salted = SaltedPasswords()  # one derivation per edge verifier, node-wide
        self.slots = SlotTable(_limits_of(executor))
        self._loads_changed = trio.Event()
        self._cfg, self._executor = cfg, executor
        self._software_version, self._link_factory = software_version, link_factory
        self._generation = 0
        self._nursery: trio.Nursery | None = None
        self.links: list[NodeLink] = [
            self._new_link(address) for address in node_edge_addresses(cfg)
        ]
        # The config in force and the runtime controls are the node's, for
        # every edge: their changes go to all (iopd.node.edges.shared_state).
        executor.shared.broadcast = self.broadcast
        executor.shared.controls_changed = self._controls_changed

    def _new_link(self, address: str, key: str | None = None) -> NodeLink:
        key = key or address
        link = self._link_factory(
            self._cfg,
            self._executor.for_edge(key, source=address),
            software_version=self._software_version,
            edge=address,
            key=key,
            salted=self._salted,
            admission=AdmissionView(
                self.slots, key, clock=trio.current_time, changed=self._wake_push
            ),
        )
        link.on_go_away = self._go_away
        return link

    def _go_away(self, retiring: NodeLink) -> None:
        """``retiring``'s edge hands over: dial its address again with a new session.

        The old session keeps its streams (under its own key: the new session's
        stream ids start over) until the old edge process closes it; the new
        one, accepted by the successor process, serves everything new.
        """
        if self._nursery is None:
            return
        self._generation += 1
        successor = self._new_link(retiring.edge, f"{retiring.edge}#{self._generation}")
        self.links.append(successor)
        self._nursery.start_soon(self._run_link, successor)

    async def _run_link(self, link: NodeLink) -> None:
        """Run ``link`` until it retires (a successor took over), then forget it."""
        try:
            await link.run()
        finally:
            if link in self.links:
                self.links.remove(link)

    def link(self, edge: str) -> NodeLink:
        """The session with ``edge`` (an address of the config); ``KeyError`` if none."""
        for link in self.links:
            if link.edge == edge and not link.retiring:
                return link
        raise KeyError(edge)

    @property
    def connected(self) -> int:
        """How many edges the node has a session with now."""
        return sum(1 for link in self.links if link.connected)

    def send_status(self, msg: ProviderStatus) -> None:
        """Report provider health to every connected edge (a no-op for the others)."""
        self.broadcast(msg)

    def broadcast(self, msg: Message) -> None:
        """Send ``msg`` to every connected edge (a no-op for the others)."""
        for link in self.links:
            link.post(msg)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every session until cancelled; reported started at once (no edge needed)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._push_loads)
            for link in list(self.links):
                nursery.start_soon(self._run_link, link)
            task_status.started()

    def _controls_changed(self) -> None:
        """A control changed a capacity or a state: offer what is now free."""
        self.slots.reconfigured(trio.current_time())
        self._wake_push()

    def _wake_push(self) -> None:
        self._loads_changed.set()

    async def _push_loads(self) -> None:
        """Send each edge the load reports due to it; lapse offers on time."""
        slots = self.slots
        while True:
            expiry = slots.next_expiry()
            with trio.move_on_at(math.inf if expiry is None else expiry):
                await self._loads_changed.wait()
            # Coalesce: the changes of this scheduler round leave together.
            await trio.lowlevel.checkpoint()
            self._loads_changed = trio.Event()
            slots.expire(trio.current_time())
            for link in self.links:
                due = slots.take_reports(link.key)
                if due:
                    link.send_status(LoadReport(providers=due))

    async def shutdown(self, timeout: float = 2.0) -> None:
        """End every session cleanly, together (see ``NodeLink.shutdown``)."""
        async with trio.open_nursery() as nursery:
            for link in list(self.links):
                nursery.start_soon(link.shutdown, timeout)


def _limits_of(executor: NodeExecutor) -> Callable[[str], tuple[int, int] | None]:
    """A provider's ``(capacity, long_context_capacity)`` in the executor's current
    registry under the operator's controls (None: not served here).

    The node admits against what every edge must see: a capacity override in
    force replaces the configured capacity, and a provider ``draining`` or
    ``disabled`` admits nothing new (a stream in flight finishes).
    """

    def limits(provider_id: str) -> tuple[int, int] | None:
        registry = executor.registry
        adapter = registry.get(provider_id) if registry is not None else None
        if adapter is None:
            return None
        capacity, long_capacity = adapter.spec.capacity, adapter.spec.long_context_capacity
        control = executor.shared.controls.get(provider_id)
        if control is not None:
            if control.state != "active":
                return 0, 0
            if control.capacity is not None:
                capacity = control.capacity
        return capacity, long_capacity

    return limits


__all__ = ["EdgeSessions"]
