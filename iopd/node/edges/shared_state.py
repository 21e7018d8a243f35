"""What a node holds for all of its edges: the config revision in force and the
runtime controls.

Why on the node: with several edges the node is the one place every edge
talks to, so it is where they can agree without a store of their own.

* **Config revision.**  Each edge pushes its ``NodeConfig`` with its
  ``edge.config_revision``.  ``ConfigInForce.admits`` decides whether a push
  replaces the config in force: a higher revision always does; at the same
  revision only the edge whose push is in force may change it (so one edge
  refreshing without raising the revision behaves as it always did); a lower
  revision, or another edge's different config at the same revision, is
  acknowledged but not applied, and that edge learns from ``NodeConfigState``
  that it disagrees (its ``/status`` shows ``config_mismatch``).
* **Runtime controls.**  An operator's drain, disable or override reaches the
  node as a ``ControlUpdate`` from whichever edge it was made on; the node
  keeps the last one per provider (last write wins) and sends the whole
  table (``ControlState``) to every edge.  It lives in memory only: a node
  restart starts from no controls, an edge restart gets them back at its
  next session.

Pure and synchronous: the link and the executor call it and send what it
returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from wire.messages import (
    ControlState,
    ControlUpdate,
    Message,
    NodeConfig,
    NodeConfigState,
    ProviderControlSpec,
    node_config_digest,
)

log = logging.getLogger("iopd.node.shared_state")


@dataclass
class ConfigInForce:
    """The revision, digest and source edge of the config the node runs."""

    revision: int = -1  # -1: nothing applied yet
    digest: str = ""
    source: str = ""  # the edge whose push is in force

    def admits(self, edge: str, msg: NodeConfig) -> bool:
        """True when ``edge``'s push ``msg`` should replace the config in force."""
        if self.revision < 0 or msg.revision > self.revision:
            return True
        return msg.revision == self.revision and edge == self.source

    def applied(self, edge: str, msg: NodeConfig) -> bool:
        """``msg`` from ``edge`` is now in force; True when revision or digest changed."""
        digest = node_config_digest(msg.providers)
        changed = (msg.revision, digest) != (self.revision, self.digest)
        self.revision, self.digest, self.source = msg.revision, digest, edge
        return changed

    def state(self) -> NodeConfigState:
        return NodeConfigState(revision=max(self.revision, 0), digest=self.digest)


@dataclass
class NodeControls:
    """The operator's controls of this node's providers, the last write of any edge."""

    _controls: dict[str, ProviderControlSpec] = field(default_factory=dict)

    def apply(self, update: ControlUpdate, providers: Collection[str]) -> list[str]:
        """Set each named control; returns the ids refused (not a provider of this node)."""
        unknown = []
        for spec in update.controls:
            if spec.provider_id not in providers:
                unknown.append(spec.provider_id)
            elif spec == ProviderControlSpec(provider_id=spec.provider_id):
                self._controls.pop(spec.provider_id, None)  # back to the default
            else:
                self._controls[spec.provider_id] = spec
        return unknown

    def get(self, provider_id: str) -> ProviderControlSpec | None:
        """``provider_id``'s control, None when it is active with no override."""
        return self._controls.get(provider_id)

    def retain(self, providers: Collection[str]) -> None:
        """A new config: forget the controls of providers it no longer has."""
        for pid in [p for p in self._controls if p not in providers]:
            del self._controls[pid]

    def state(self) -> ControlState:
        return ControlState(controls=[self._controls[p] for p in sorted(self._controls)])


class SharedState:
    """The node's ``ConfigInForce`` and ``NodeControls``, and where their changes go.

    ``broadcast`` sends a message to every connected edge
    (``EdgeSessions.broadcast`` sets it; nowhere until then);
    ``controls_changed`` tells the node's admission that a capacity or a
    state may have changed (``EdgeSessions`` sets it too).
    """

    def __init__(self) -> None:
        self.config = ConfigInForce()
        self.controls = NodeControls()
        self.broadcast: Callable[[Message], None] = lambda msg: None
        self.controls_changed: Callable[[], None] = lambda: None

    def set_controls(self, msg: ControlUpdate, providers: Collection[str], edge: str) -> None:
        """An operator's control change, via ``edge``: kept, then sent to every edge."""
        refused = self.controls.apply(msg, providers)
        for spec in msg.controls:
            if spec.provider_id not in refused:
                log.info(
                    "event=control_set edge=%s provider=%s state=%s capacity=%s priority=%s",
                    edge,
                    spec.provider_id,
                    spec.state,
                    spec.capacity,
                    spec.priority,
                )
        if refused:
            log.warning(
                "event=control_refused edge=%s providers=%s reason=not_on_this_node",
                edge,
                ",".join(p[:64] for p in refused[:10]),
            )
        self.controls_changed()
        self.broadcast(self.controls.state())


__all__ = ["ConfigInForce", "NodeControls", "SharedState"]
