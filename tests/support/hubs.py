"""A NodeHub on a free port with its recorder, the node tokens it knows, a run request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from iopd.edge.nodes.hub import HubSettings, NodeHub
from iopd.edge.nodes.node_session import NodeSession
from iopd.transport.listen import serve_wire
from tests.support.wire_peers import FakeNode, HubRecorder, wait_until
from wire.messages import (
    RunRequest,
)


def make_hub(
    rec: HubRecorder,
    *,
    edge_id: str = "edge-1",
    heartbeat_interval: float = 5.0,
    heartbeat_timeout: float = 15.0,
    handshake_timeout: float = 10.0,
    **settings: int,
) -> NodeHub:
    """A NodeHub owned by ``rec``: 1 MiB frames; ``settings`` are further ``HubSettings``."""
    hub_settings = HubSettings(
        edge_id=edge_id,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        handshake_timeout=handshake_timeout,
        max_frame_bytes=1024 * 1024,
        **settings,
    )
    return NodeHub(hub_settings, owner=rec)


TOKENS = {"node-a": "token-a-secret", "node-b": "token-b-secret"}


@asynccontextmanager
async def running_hub(
    rec: HubRecorder | None = None, *, edge_id: str = "edge-1", **overrides: float
) -> AsyncIterator[tuple[NodeHub, int, HubRecorder]]:
    """A hub on port 0 owned by ``rec`` (by default one knowing ``TOKENS``)."""
    rec = rec if rec is not None else HubRecorder(TOKENS)
    hub = make_hub(rec, edge_id=edge_id, **overrides)
    async with trio.open_nursery() as nursery:
        _host, port = await nursery.start(serve_wire, hub.handle_connection, "127.0.0.1", 0)
        yield hub, port, rec
        await hub.aclose("test over")
        nursery.cancel_scope.cancel()


def run_req(window: int = 64) -> RunRequest:
    return RunRequest(stream_id=0, provider_id="echo-1", adapter="echo", target="m", window=window)


@asynccontextmanager
async def node_with_session(
    hub: NodeHub, port: int, node_id: str = "node-a", **node_options: Any
) -> AsyncIterator[tuple[FakeNode, NodeSession]]:
    """A ``FakeNode`` connected to ``hub`` with its known token, and its session once the hub has it."""
    async with FakeNode.connect(
        "127.0.0.1", port, node_id=node_id, token=TOKENS[node_id], **node_options
    ) as fake:
        await wait_until(lambda: hub.session(node_id) is not None)
        session = hub.session(node_id)
        assert session is not None
        yield fake, session
