"""Embedded nodes: ``nodes[].embedded: true`` runs that node inside the edge process.

Why over the wire rather than a shortcut: an embedded node is the same
``run_node`` a node daemon runs, speaking the same protocol to the same
``NodeHub``, so health probes, config pushes, cancel, credit and drain behave
exactly as for a node on another machine (``iopd demo`` proved the shape).
Only the process is shared.

How it connects: the edge opens a wire listener of its own for embedded nodes
on 127.0.0.1 (a free port, plain TCP: the bytes never leave the machine) and
each embedded node dials it with the token ``EdgeRuntime`` minted for it at
start.  That listener admits embedded node ids only, so it is never a way
around ``edge.tls`` (and its client certificates) for nodes that dial
``edge.node_listen``.  The token is never written to a file, a log or
``/status``.

What it consents to run: exactly what the edge's config, at each push, lists
for it (``Consent.listed`` of the edge's own push).  Its operator wrote
those commands and URLs in the file the edge runs, in the same process; a
node on another machine consents only to what its own config allows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from iopd.config.schema import EdgeConfig, NodeConfigFile, NodeSection
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.node.consent import Consent
from iopd.transport.listen import serve_wire

log = logging.getLogger("iopd.edge")

#: The embedded nodes' listener: loopback, any free port.
EMBEDDED_LISTEN = ("127.0.0.1", 0)


def embedded_node_ids(cfg: EdgeConfig) -> list[str]:
    """Ids of the nodes the edge runs itself, in config order."""
    return [n.id for n in cfg.nodes if n.embedded]


def embedded_node_config(
    cfg: EdgeConfig, node_id: str, token: str, wire: tuple[str, int]
) -> NodeConfigFile:
    """The node config an embedded node runs with: dial ``wire`` with ``token``.

    Its providers come from the edge's config push, as for any node; the frame
    cap is the edge's, so both ends agree.
    """
    host, port = wire
    return NodeConfigFile(
        node=NodeSection(
            id=node_id,
            edge=f"{host}:{port}",
            token=token,
            max_frame_bytes=cfg.edge.max_frame_bytes,
            drain_timeout=cfg.edge.drain_timeout,
            # The edge holds the hash of a token it minted in memory at start:
            # no copy of that hash exists outside this process to be replayed.
            accept_legacy_proof=True,
        )
    )


@dataclass
class EmbeddedNodes:
    """What ``serve_embedded_nodes`` reports: its listener, and how to stop it all."""

    wire: tuple[str, int]
    _scope: trio.CancelScope

    def stop(self) -> None:
        """End the embedded nodes and their listener (the edge's drain, once requests are done).

        Before the hub closes its sessions, so a node is stopped rather than
        seeing its edge go away (no reconnect, no warning in the log).
        """
        self._scope.cancel()


async def serve_embedded_nodes(
    rt: EdgeRuntime,
    cfg: EdgeConfig,
    *,
    task_status: trio.TaskStatus[EmbeddedNodes] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run every embedded node of ``cfg`` until stopped or cancelled.

    Reports ``EmbeddedNodes`` once each node has connected and acknowledged
    its config, so the edge says it is ready only when its own providers can
    take requests; a node that does not get there within
    ``edge.handshake_timeout`` is logged and keeps dialling (like any node).
    """
    from iopd.node.run import run_node  # the node side, only when there is one

    ids = embedded_node_ids(cfg)
    admitted = frozenset(ids)
    gate = rt.hub.listener_gate()  # its own: a flood of edge.node_listen does not count here
    handler = functools.partial(rt.hub.handle_connection, admits=admitted.__contains__, gate=gate)
    async with trio.open_nursery() as nursery:
        wire: tuple[str, int] = await nursery.start(
            functools.partial(serve_wire, gate=gate), handler, *EMBEDDED_LISTEN
        )
        for node_id in ids:
            node_cfg = embedded_node_config(cfg, node_id, rt.embedded_tokens[node_id], wire)
            await nursery.start(
                functools.partial(run_node, node_cfg, consent=_listed_by(rt, node_id))
            )
        with trio.move_on_after(cfg.edge.handshake_timeout):
            await _all_connected(rt, ids)
        pending = [n for n in ids if rt.hub.connected_since(n) is None]
        if pending:
            log.warning("event=embedded_nodes_not_ready nodes=%s", ",".join(pending))
        log.info("event=embedded_nodes_started nodes=%s wire=%s:%d", ",".join(ids), *wire)
        task_status.started(EmbeddedNodes(wire, nursery.cancel_scope))


def _listed_by(rt: EdgeRuntime, node_id: str) -> Callable[[], Consent]:
    """The embedded node's consent: what the edge's current config lists for it."""
    return lambda: Consent.listed(rt.node_config(node_id).providers)


async def _all_connected(rt: EdgeRuntime, ids: list[str]) -> None:
    """Until every node in ``ids`` has a ready session (start-up only: a short poll)."""
    while any(rt.hub.connected_since(n) is None for n in ids):  # noqa: ASYNC110 - hub state
        await trio.sleep(0.005)
