"""``EdgeSessions``: the node's sessions, one ``NodeLink`` per edge it dials.

Why one object: a node serves every edge of ``node.edges`` (or the one
``node.edge``) at once, each through an independent session (its own dial
loop, backoff, heartbeats and nursery; the TLS settings and the token are
the node's).  An edge lost ends only its own session, and with it only that
edge's streams (``iopd.node.executor.EdgeStreams`` keeps each edge's streams
apart); the others keep serving.  Health reports go to every connected edge.

Everything that is per edge but node-wide in scope (today: the sessions, the
derived keys of the handshake, and the broadcast of what every edge must
agree on: ``iopd.node.shared_state``) lives here, so that per-edge state added
later (e.g. admission per edge) has one owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from iopd.config.schema import NodeSection, node_edge_addresses
from iopd.node.executor import NodeExecutor
from iopd.node.handshake import SaltedPasswords
from iopd.node.link import NodeLink
from wire.messages import Message, ProviderStatus

log = logging.getLogger(__name__)


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
        salted = SaltedPasswords()  # one derivation per edge verifier, node-wide
        self.links: list[NodeLink] = [
            link_factory(
                cfg,
                executor.for_edge(address),
                software_version=software_version,
                edge=address,
                salted=salted,
            )
            for address in node_edge_addresses(cfg)
        ]
        # The config in force and the runtime controls are the node's, for
        # every edge: their changes go to all (iopd.node.shared_state).
        executor.shared.broadcast = self.broadcast

    def link(self, edge: str) -> NodeLink:
        """The session with ``edge`` (an address of the config); ``KeyError`` if none."""
        for link in self.links:
            if link.edge == edge:
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
            for link in self.links:
                await nursery.start(link.run)
            task_status.started()

    async def shutdown(self, timeout: float = 2.0) -> None:
        """End every session cleanly, together (see ``NodeLink.shutdown``)."""
        async with trio.open_nursery() as nursery:
            for link in self.links:
                nursery.start_soon(link.shutdown, timeout)


__all__ = ["EdgeSessions"]
