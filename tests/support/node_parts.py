"""Parts for tests of the node's side: a node daemon's config for a ``FakeEdge`` and the echo
provider it is pushed, a scripted NodeHandler, a list sender, request builders."""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing

from iopd.config.schema import NodeConfigFile, NodeSection
from iopd.http.client import EarlyStart
from iopd.node.adapters.base import Adapter, AdapterError, TunnelOutput
from iopd.node.handler import StreamSender
from tests.support.wire_peers import FakeEdge
from wire.messages import (
    ControlState,
    ControlUpdate,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    ProviderHealth,
    ProviderSpec,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
    is_terminal,
)


def node_cfg(edge: FakeEdge, **kw: Any) -> NodeConfigFile:
    """A node daemon's config dialling ``edge``: ``node-a``, reconnects from 50 ms up to 0.5 s,
    a 2 s drain; ``kw`` overrides ``node`` fields."""
    fields: dict[str, Any] = dict(
        id="node-a",
        edge=edge.address,
        token="node-token",
        reconnect_initial_backoff=0.05,
        reconnect_max_backoff=0.5,
        drain_timeout=2.0,
    )
    fields.update(kw)
    return NodeConfigFile(node=NodeSection(**fields))


def echo_config(delay_ms: int = 0, *extra: ProviderSpec, capacity: int = 8) -> NodeConfig:
    """The first ``NodeConfig``: an echo provider ``echo`` (then ``extra``)."""
    return NodeConfig(
        stream_id=1,
        version=1,
        providers=[
            ProviderSpec(id="echo", type="echo", delay_ms=delay_ms, capacity=capacity),
            *extra,
        ],
    )


class ScriptedHandler:
    """A NodeHandler: sends ``req.metadata['n']`` text events then complete."""

    def __init__(self) -> None:
        self.configs: list[NodeConfig] = []
        self.cancels: list[tuple[int, str]] = []
        self.sent: dict[int, int] = {}
        self.cancelled_tasks: list[int] = []
        self.scopes: dict[int, trio.CancelScope] = {}
        self.started = trio.Event()
        self.fail_config = False
        self.control_updates: list[ControlUpdate] = []

    async def on_config(self, msg: NodeConfig) -> NodeConfigAck:
        if self.fail_config:
            raise RuntimeError("bad provider set")
        self.configs.append(msg)
        return NodeConfigAck(stream_id=msg.stream_id, version=msg.version)

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> None:
        return None

    def on_controls(self, msg: ControlUpdate) -> None:
        self.control_updates.append(msg)

    def config_state(self) -> NodeConfigState:
        return NodeConfigState(revision=0, digest="")

    def control_state(self) -> ControlState:
        return ControlState()

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: object = None,
    ) -> None:
        sid = req.stream_id
        self.sent[sid] = 0
        self.started.set()
        if isinstance(req, ProviderTunnelRequest):
            return  # a buggy executor: no terminal
        n = int(req.metadata.get("n", "0"))
        forever = req.metadata.get("forever") == "1"
        with trio.CancelScope() as scope:
            self.scopes[sid] = scope
            try:
                for i in range(n):
                    await sender.send(RunEvent(stream_id=sid, kind="text", text=str(i)))
                    self.sent[sid] += 1
                if forever:
                    await trio.sleep_forever()
            except trio.Cancelled:
                self.cancelled_tasks.append(sid)
                raise
        if scope.cancelled_caught:
            await sender.send(RunEvent(stream_id=sid, kind="error", code="cancelled"))
        else:
            await sender.send(RunEvent(stream_id=sid, kind="complete"))

    def cancel(self, stream_id: int, reason: str) -> None:
        self.cancels.append((stream_id, reason))
        if stream_id in self.scopes:
            self.scopes[stream_id].cancel()

    def current_status(self) -> ProviderStatus:
        return ProviderStatus(providers=[ProviderHealth(provider_id="echo-1", health="healthy")])


class ListSender:
    """A StreamSender that collects messages; ``broken`` makes send fail like a lost link."""

    def __init__(self) -> None:
        self.msgs: list[RunEvent | ProviderTunnelFrame] = []
        self.broken = False
        self.sent = trio.Event()

    async def send(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        await trio.lowlevel.checkpoint()
        if self.broken:
            raise trio.BrokenResourceError("link lost")
        self.msgs.append(msg)
        self.sent.set()
        self.sent = trio.Event()

    @property
    def kinds(self) -> list[str]:
        return [m.kind for m in self.msgs]

    def terminals(self) -> list[RunEvent | ProviderTunnelFrame]:
        return [m for m in self.msgs if is_terminal(m)]


def adapter_req(
    provider_id: str,
    adapter: str,
    target: str,
    messages: list[dict[str, Any]],
    *,
    stream_id: int = 1,
    **fields: Any,
) -> RunRequest:
    """A ``RunRequest`` for one adapter: ``target`` on ``provider_id``, the rest as given."""
    return RunRequest(
        stream_id=stream_id,
        provider_id=provider_id,
        adapter=adapter,
        target=target,
        messages=messages,
        **fields,
    )


def run_req(text: str = "alpha beta gamma", provider: str = "echo", sid: int = 1) -> RunRequest:
    return adapter_req(provider, "echo", "echo", [{"role": "user", "content": text}], stream_id=sid)


def tunnel_req(
    path: str, body: dict[str, Any], headers: list[tuple[str, str]] | None = None
) -> ProviderTunnelRequest:
    return ProviderTunnelRequest(
        stream_id=1,
        provider_id="vllm",
        method="POST",
        path=path,
        headers=headers or [("content-type", "application/json")],
        body=json.dumps(body).encode(),
    )


class _ReplyAdapter(Adapter):
    def __init__(
        self, spec: ProviderSpec, content_type: str, pieces: list[bytes], fail: bool = False
    ) -> None:
        super().__init__(spec)
        self.content_type = content_type
        self.pieces = pieces
        self.fail = fail

    async def run(self, req: RunRequest, out: Any) -> None:  # pragma: no cover - unused
        raise NotImplementedError

    async def tunnel(
        self, req: ProviderTunnelRequest, out: TunnelOutput, early: EarlyStart | None = None
    ) -> None:
        await out.head(200, [("content-type", self.content_type)])
        for piece in self.pieces:
            await out.body(piece)
        out.usage = Usage(input_tokens=3, output_tokens=2)
        out.reasoning_chars = 4
        if self.fail:
            raise AdapterError("provider_timeout", "the provider stopped sending")
