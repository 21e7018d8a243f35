"""The contract between the node's wire link (``link.py``) and its executor (``run.py``).

The link owns the connection: it dials, handshakes, reads frames, enforces
credit, and for every RunRequest/ProviderTunnelRequest calls ``start_early``
from its reader (which may already send a passthrough request on an idle
provider connection) and spawns ``serve_stream`` with the result in the
session's nursery.  The executor owns what runs: adapters, cancel scopes,
usage and the terminal message of every stream.
"""

from __future__ import annotations

from typing import Protocol

from iopd.http.client import EarlyStart
from wire.messages import (
    ControlState,
    ControlUpdate,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
)


class StreamSender(Protocol):
    """Sends the replies of one stream to the edge.

    ``send`` waits while the stream has no credit left (backpressure) and
    raises ``trio.BrokenResourceError`` / ``trio.ClosedResourceError`` when
    the link is gone.
    """

    async def send(self, msg: RunEvent | ProviderTunnelFrame) -> None: ...


class StatusSink(Protocol):
    """Where health changes go; a no-op while disconnected."""

    def send_status(self, msg: ProviderStatus) -> None: ...


class NodeHandler(Protocol):
    async def on_config(self, msg: NodeConfig) -> NodeConfigAck:
        """Build (or swap in) the adapter registry for ``msg``; answer with the ack."""
        ...

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> EarlyStart | None:
        """Called from the link's reader for each request, before ``serve_stream``
        is spawned: begin it at once if that needs no waiting (the provider gets
        it a scheduler round sooner), else None.  Never blocks, never raises.
        The result goes to ``serve_stream``, which owns it from then on (the
        link abandons it only when it cannot spawn the task)."""
        ...

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None,
    ) -> None:
        """Run one request to completion, sending every reply incl. exactly one terminal.

        ``early``: what ``start_early`` returned for ``req``; abandon it when done.
        """
        ...

    def cancel(self, stream_id: int, reason: str) -> None:
        """The edge sent Cancel: stop the stream's work at once (terminal still sent)."""
        ...

    def current_status(self) -> ProviderStatus:
        """Health of every provider; sent after each (re)connect."""
        ...

    def on_controls(self, msg: ControlUpdate) -> None:
        """An operator's runtime control from this edge (kept node-wide; never blocks)."""
        ...

    def config_state(self) -> NodeConfigState:
        """The config revision in force; sent to the edge after each ``NodeConfigAck``."""
        ...

    def control_state(self) -> ControlState:
        """Every runtime control held; sent before a session's first ``NodeConfigAck``."""
        ...
