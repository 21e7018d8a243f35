"""The contract between ``NodeHub`` and the edge that runs it.

``HubOwner`` is every call the hub makes into its owner (``EdgeRuntime``):
node registry, node config, and the events of node sessions.  ``HubSettings``
is the hub's fixed settings.  Apart from ``hub.py`` so that the contract
reads on one page and the hub's module stays about sessions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from iopd.config.schema import EdgeSection, NodeEntry
from iopd.vocabulary import FrameDirection, WireErrorReason
from wire.messages import (
    Busy,
    ControlState,
    LoadReport,
    NodeConfig,
    NodeConfigState,
    ProviderStatus,
)

__all__ = ["HubOwner", "HubSettings"]


class HubOwner(Protocol):
    """What ``NodeHub`` needs from the edge that runs it (``EdgeRuntime``).

    Every method is called synchronously from the hub (never awaited), so it
    must not block; an exception is logged and the hub goes on.
    """

    def known_nodes(self) -> Mapping[str, NodeEntry]:
        """The configured nodes by id, as of now (read at every Hello)."""
        ...

    def node_config(self, node_id: str) -> NodeConfig:
        """The ``NodeConfig`` to push to ``node_id`` now (its stream id is replaced)."""
        ...

    def node_connected(self, node_id: str) -> None:
        """``node_id``'s session is ready: requests may be routed to it."""
        ...

    def node_disconnected(self, node_id: str) -> None:
        """``node_id``'s session ended.  Told *before* its streams fail: when this
        returns the node must be out of routing (the leases those streams free
        re-examine the queue, which must not admit a waiter to the dead node)."""
        ...

    def provider_status(self, node_id: str, msg: ProviderStatus) -> int:
        """``node_id`` reported the health of its providers; returns how many
        entries were ignored (not a provider of ``node_id``'s)."""
        ...

    def provider_load(self, node_id: str, msg: LoadReport) -> None:
        """``node_id`` reported what the other edges hold of some of its providers."""
        ...

    def provider_busy(self, node_id: str, msg: Busy) -> None:
        """``node_id`` did not admit a stream (told before the stream ends with it)."""
        ...

    def node_config_state(self, node_id: str, msg: NodeConfigState) -> None:
        """``node_id`` told the config revision in force on it."""
        ...

    def node_controls(self, node_id: str, msg: ControlState) -> None:
        """``node_id``'s runtime controls (the first precede ``node_connected``)."""
        ...

    def wire_frames(self, direction: FrameDirection, n: int) -> None:
        """``n`` frames went ``out`` to or came ``in`` from nodes."""
        ...

    def wire_error(self, reason: WireErrorReason, detail: str) -> None:
        """A connection closed for a wire problem; ``detail`` says what, for a log."""
        ...

    def scrub(self, text: str) -> str:
        """``text`` without any piece of the edge's secrets (a node's error text)."""
        ...


@dataclass(frozen=True)
class HubSettings:
    """The hub's fixed settings (the ``edge`` section; restart-only)."""

    edge_id: str
    heartbeat_interval: float
    heartbeat_timeout: float
    handshake_timeout: float
    max_frame_bytes: int
    #: Caps of the unauthenticated connections of one wire listener.
    max_pending: int = 256
    max_pending_per_address: int = 16

    @classmethod
    def from_config(cls, edge: EdgeSection) -> HubSettings:
        return cls(
            edge_id=edge.id,
            heartbeat_interval=edge.heartbeat_interval,
            heartbeat_timeout=edge.heartbeat_timeout,
            handshake_timeout=edge.handshake_timeout,
            max_frame_bytes=edge.max_frame_bytes,
            max_pending=edge.node_listen_max_pending,
            max_pending_per_address=edge.node_listen_max_pending_per_address,
        )
