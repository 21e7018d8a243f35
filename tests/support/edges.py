"""An edge run by the tests of refresh and drain: its runtime, its config file, its nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from tests.support.configs import echo_entry, provider_entry, two_node_yaml
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    node_token,
    running_gateway,
    wait_until,
)
from tests.support.wire_peers import FakeNode

REPORT_KEYS = {
    "mode",
    "applied",
    "changed_nodes",
    "changed_providers",
    "changed_models",
    "restart_required",
    "errors",
}


DEFAULTS: dict[str, Any] = {
    "edge_id": "edge-r",
    "openai_listen": "127.0.0.1:0",
    "threshold": 100000,
    "strict": "false",
    "principal": "",
    "max_queue": 256,
    "queue_timeout": 60,
    "models": "  - id: echo\n    providers: {echo-1: echo, echo-2: echo}\n",
    "cap1": 2,
    "cap2": 2,
    "prio1": 0,
    "prio2": 1,
    "en1": "true",
    "en2": "true",
    "long2": 0,
    "delay1": 0,
    "delay2": 0,
    "remote_base": "http://127.0.0.1:9",
    "extra_nodes": "",
}


def edge_yaml(**over: Any) -> str:
    """The test config: node-a (echo-1, remote-1) and node-b (echo-2)."""
    unknown = set(over) - set(DEFAULTS)
    assert not unknown, unknown
    v = {**DEFAULTS, **over}
    node_a = echo_entry(
        capacity=v["cap1"], priority=v["prio1"], enabled=v["en1"], delay_ms=v["delay1"]
    ) + provider_entry(
        "remote-1", "openai", category="api", base_url=v["remote_base"], models=["remote"]
    )
    node_b = echo_entry(
        "echo-2",
        category="local_inference",
        capacity=v["cap2"],
        priority=v["prio2"],
        enabled=v["en2"],
        long_context_capacity=v["long2"],
        delay_ms=v["delay2"],
    )
    openai = (
        f"  long_context_threshold_tokens: {v['threshold']}\n"
        f"  strict_output: {v['strict']}\n{v['principal']}"
    )
    return two_node_yaml(
        edge_id=v["edge_id"],
        openai_listen=v["openai_listen"],
        openai_extra=openai,
        max_queue=v["max_queue"],
        queue_timeout=v["queue_timeout"],
        models=v["models"],
        node_a=node_a,
        node_b=node_b,
        alias_b="box-b",
        extra_nodes=v["extra_nodes"],
    )


class Edge:
    """A running gateway plus the config file it reloads."""

    def __init__(self, gw: Gateway, path: Path) -> None:
        self.gw = gw
        self.path = path

    def write(self, **over: Any) -> None:
        self.path.write_text(edge_yaml(**over))

    async def refresh(self, mode: str = "apply") -> dict[str, Any]:
        r = await http_request(self.gw.handle.admin, "POST", "/refresh", body={"mode": mode})
        assert r.status == 200, r.body
        doc: dict[str, Any] = r.json()
        assert set(doc) == REPORT_KEYS
        assert doc["mode"] == mode
        for key in REPORT_KEYS - {"mode", "applied"}:
            assert isinstance(doc[key], list), key
        return doc

    async def apply(self, **over: Any) -> dict[str, Any]:
        """Rewrite the file with ``over`` and apply it; asserts it was applied."""
        self.write(**over)
        doc = await self.refresh("apply")
        assert doc["applied"] is True, doc
        return doc

    async def status(self) -> dict[str, Any]:
        r = await http_request(self.gw.handle.admin, "GET", "/status")
        assert r.status == 200
        doc: dict[str, Any] = r.json()
        return doc

    async def provider(self, pid: str) -> dict[str, Any]:
        doc = await self.status()
        return next(p for p in doc["providers"] if p["id"] == pid)

    async def chat(self, content: str, model: str = "echo", **extra: Any) -> RawResponse:
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return await http_request(self.gw.host_port, "POST", "/v1/chat/completions", body=body)

    def in_flight(self) -> dict[str, int]:
        return {pid: load.in_flight for pid, load in self.gw.runtime.pool.provider_loads().items()}

    def fake_node(
        self, node_id: str = "node-b", cls: type[FakeNode] = FakeNode, **kw: Any
    ) -> AbstractAsyncContextManager[FakeNode]:
        """A scripted ``cls`` dialling this edge's wire port as ``node_id``, with its token."""
        host, port = self.gw.handle.wire
        return cls.connect(host, port, node_id=node_id, token=node_token(node_id), **kw)

    async def idle(self) -> None:
        """Wait until no lease is held and nobody queues."""
        await wait_until(
            lambda: not any(self.in_flight().values()) and self.gw.runtime.pool.queue_depth == 0
        )


@asynccontextmanager
async def running_edge(
    tmp_path: Path, *, nodes: list[str] | None = None, **over: Any
) -> AsyncIterator[Edge]:
    """Write ``edge_yaml(**over)`` to a file and run a gateway from it."""
    path = tmp_path / "edge.yaml"
    path.write_text(edge_yaml(**over))
    async with running_gateway(path.read_text(), nodes=nodes, config_path=str(path)) as gw:
        yield Edge(gw, path)
