"""The edge's side of what a node holds for all its edges.

Why a module of its own: with several edges each node is the one authority
for two things every edge must agree on (``iopd.node.edges.shared_state``), and
the edge only follows it:

* **Config revision.**  The node tells which revision and provider set it
  runs (``NodeConfigState``).  ``NodeConfigStates`` compares that with what
  this edge would push the node; a difference is the node's
  ``config_mismatch`` in ``/status`` (one log line at each change).  The
  edge keeps serving: the node runs its own config either way.
* **Runtime controls.**  ``send_controls`` hands an operator's change to the
  provider's node (409 ``node_disconnected`` without a session);
  ``apply_node_controls`` applies the node's whole table to this edge's pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from iopd.config.catalog import Catalog, node_config_for
from iopd.config.schema import EdgeConfig
from iopd.edge.nodes.hub import NodeHub
from iopd.edge.pool import ProviderControl, ProviderPool
from iopd.errors import NodeDisconnected, NodeDispatchError
from wire.messages import ControlState, ControlUpdate, NodeConfigState, node_config_digest

log = logging.getLogger("iopd.edge")


@dataclass
class NodeConfigStates:
    """Each connected node's config in force, as it last told this edge."""

    states: dict[str, NodeConfigState] = field(default_factory=dict)
    _logged: dict[str, bool] = field(default_factory=dict)  # mismatch as last logged

    def update(self, node_id: str, msg: NodeConfigState, cfg: EdgeConfig) -> None:
        """Keep ``msg``; log when ``node_id``'s mismatch with ``cfg`` appears or ends."""
        self.states[node_id] = msg
        mismatch = self.mismatch(node_id, cfg)
        if self._logged.get(node_id, False) != mismatch:
            self._logged[node_id] = mismatch
            log.log(
                logging.WARNING if mismatch else logging.INFO,
                "event=node_config_%s node=%s node_revision=%d edge_revision=%d",
                "mismatch" if mismatch else "match",
                node_id,
                msg.revision,
                cfg.edge.config_revision,
            )

    def forget(self, node_id: str) -> None:
        """``node_id`` is gone: nothing is known of it until it tells again."""
        self.states.pop(node_id, None)
        self._logged.pop(node_id, None)

    def revision(self, node_id: str) -> int | None:
        """The revision in force on ``node_id`` (None until it told)."""
        state = self.states.get(node_id)
        return state.revision if state is not None else None

    def mismatch(self, node_id: str, cfg: EdgeConfig) -> bool:
        """True when ``node_id`` runs another config than ``cfg`` would push it:
        a higher revision, or another provider set at the same one."""
        state = self.states.get(node_id)
        if state is None or all(n.id != node_id for n in cfg.nodes):
            return False
        mine = node_config_for(cfg, node_id, 0)
        return (state.revision, state.digest) != (mine.revision, node_config_digest(mine.providers))


def send_controls(hub: NodeHub, node_id: str, msg: ControlUpdate) -> None:
    """Queue an operator's control change for ``node_id``, which holds it.

    Raises ``NodeDisconnected`` (409) when the node has no ready session:
    nothing can be set while it is away.
    """
    session = hub.session(node_id)
    try:
        if session is None:
            raise NodeDispatchError(f"node {node_id} is not connected")
        session.send_controls(msg)
    except NodeDispatchError:
        raise NodeDisconnected(
            f"node {node_id[:80]!r} is not connected to this edge: runtime controls are "
            "held by the node, so they can be changed only while it is connected",
            param="node_id",
        ) from None


def apply_node_controls(
    pool: ProviderPool, catalog: Catalog, node_id: str, msg: ControlState
) -> list[str]:
    """Set the controls ``node_id`` holds on its providers in ``pool`` (one it
    does not name goes back to the default); returns the ids that changed."""
    held = {c.provider_id: c for c in msg.controls}
    changed = []
    for pid, ref in catalog.providers.items():
        if ref.node_id != node_id:
            continue
        spec = held.get(pid)
        control = (
            ProviderControl(spec.state, spec.capacity, spec.priority)
            if spec is not None
            else ProviderControl()
        )
        if pool.control(pid) != control:
            pool.set_control(pid, control)
            changed.append(pid)
    if changed:
        log.info("event=controls_from_node node=%s providers=%s", node_id, ",".join(changed))
    return changed


__all__ = ["NodeConfigStates", "apply_node_controls", "send_controls"]
