"""The contract between the node's wire link (``link.py``) and its executor (``run.py``).

The link owns the connection: it dials, handshakes, reads frames, enforces
credit, and spawns ``serve_stream`` for every RunRequest/ProviderTunnelRequest
in the session's nursery (after ``start_early``, which may already send a
passthrough request on an idle provider connection).  The executor owns what runs: adapters, cancel
scopes, usage and the terminal message of every stream.
"""

from __future__ import annotations

from typing import Protocol

from iopd.node.adapters.base import EarlyStart
from wire.messages import (
    NodeConfig,
    NodeConfigAck,
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
        The result is passed to ``serve_stream``, which owns it.  Optional: the
        link calls ``serve_stream(req, sender)`` alone for a handler without it."""
        ...

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None = None,
    ) -> None:
        """Run one request to completion, sending every reply incl. exactly one terminal."""
        ...

    def cancel(self, stream_id: int, reason: str) -> None:
        """The edge sent Cancel: stop the stream's work at once (terminal still sent)."""
        ...

    def current_status(self) -> ProviderStatus:
        """Health of every provider; sent after each (re)connect."""
        ...
