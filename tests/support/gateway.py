"""A whole gateway in the test process: a real edge and real nodes over loopback.

``running_gateway(edge_yaml, nodes={...})`` starts ``run_edge`` on port 0
(wire, admin and OpenAI listeners) and one ``run_node`` per node id, waits
until every node has completed its handshake and config ack, and yields a
``Gateway`` with the URLs.  Callers use real sockets: the official ``openai``
SDK in a worker thread (``trio.to_thread``) or the raw helpers below.
"""

from __future__ import annotations

import functools
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import trio

from iopd.config.load import parse_edge_config
from iopd.config.schema import NodeConfigFile, NodeSection
from iopd.edge.daemon import EdgeHandle, run_edge
from iopd.edge.runtime.edge_runtime import EdgeRuntime

T = TypeVar("T")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def node_token(node_id: str) -> str:
    """The deterministic test token of ``node_id`` (its hash goes in the edge YAML)."""
    return f"test-token-{node_id}"


def quick_node_config(
    node_id: str, dials: dict[str, Any], section: dict[str, Any]
) -> NodeConfigFile:
    """``node_id``'s config, dialling per ``dials`` (its ``edge`` or ``edges``), with
    quick reconnects and drain; ``section`` overrides any field."""
    fields: dict[str, Any] = dict(
        id=node_id,
        token=node_token(node_id),
        reconnect_initial_backoff=0.05,
        reconnect_max_backoff=0.5,
        drain_timeout=1.0,
    )
    fields.update(dials)
    fields.update(section)
    return NodeConfigFile(node=msgspec.convert(fields, NodeSection))


def consent_of(cfgs: list[Any], node_id: str) -> dict[str, Any]:
    """What ``node_id``'s own config would allow, as its operator would write it for
    the edge configs ``cfgs``: the commands and origins they list for it, and the
    legacy proof when an edge holds only the hash of its token."""
    from iopd.config.addresses import url_origin

    commands: list[list[str]] = []
    origins: list[str] = []
    legacy = False
    for cfg in cfgs:
        for entry in (n for n in cfg.nodes if n.id == node_id):
            legacy = legacy or bool(entry.token_hash_sha256)
            for p in entry.providers:
                commands += [list(c) for c in (p.command, p.health_command) if c]
                if p.base_url:
                    scheme, host, port = url_origin(p.base_url)
                    host = f"[{host}]" if ":" in host else host
                    origins.append(f"{scheme}://{host}:{port}")
    return dict(
        allowed_commands=commands,
        allowed_provider_origins=sorted(set(origins)),
        accept_legacy_proof=legacy,
    )


@dataclass
class Gateway:
    handle: EdgeHandle
    nursery: trio.Nursery
    node_scopes: dict[str, trio.CancelScope]
    #: ``iopd.node.run.NodeHandle`` of each running node (its executor and link).
    node_handles: dict[str, Any] = field(default_factory=dict)

    @property
    def runtime(self) -> EdgeRuntime:
        return self.handle.runtime

    @property
    def base_url(self) -> str:
        return self.handle.base_url

    @property
    def host_port(self) -> tuple[str, int]:
        assert self.handle.openai is not None
        return self.handle.openai

    @property
    def admin_url(self) -> str:
        host, port = self.handle.admin
        return f"http://{host}:{port}"

    def kill_node(self, node_id: str) -> None:
        """Stop a node's task at once (its connection drops, like a crash)."""
        self.node_scopes.pop(node_id).cancel()
        self.node_handles.pop(node_id, None)

    async def start_node(self, node_id: str, **section: Any) -> None:
        scope, handle = await self.nursery.start(
            functools.partial(_run_node_scoped, self.node_config(node_id, **section))
        )
        self.node_scopes[node_id] = scope
        self.node_handles[node_id] = handle
        await wait_until(lambda: self.runtime.hub.connected_since(node_id) is not None)

    def node_config(self, node_id: str, **section: Any) -> NodeConfigFile:
        host, port = self.handle.wire
        dials: dict[str, Any] = {"edge": f"{host}:{port}"}
        dials.update(consent_of([self.runtime.snapshot.config], node_id))
        return quick_node_config(node_id, dials, section)

    def sdk(self, **kwargs: Any) -> Any:
        """A sync ``openai.OpenAI`` client (use it inside ``trio.to_thread.run_sync``)."""
        import openai

        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, timeout=30, **kwargs)


async def _run_node_scoped(
    cfg: NodeConfigFile, *, task_status: trio.TaskStatus[tuple[trio.CancelScope, Any]]
) -> None:
    from iopd.node.run import run_node

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(run_node, cfg)
            task_status.started((scope, handle))


def assert_no_lease_held(gw: Gateway) -> None:
    """Every provider slot (and long-context slot) is free and nobody queues."""
    loads = gw.runtime.pool.provider_loads()
    assert all(load.in_flight == 0 and load.long_in_flight == 0 for load in loads.values())
    assert gw.runtime.pool.queue_depth == 0


async def wait_until(pred: Callable[[], bool], *, interval: float = 0.005) -> None:
    """Poll ``pred`` until true (callers bound it with ``fail_after``)."""
    while not pred():  # noqa: ASYNC110 - polling state owned by other tasks
        await trio.sleep(interval)


def edge_config(yaml_text: str) -> Any:
    cfg = parse_edge_config(yaml_text, env={})
    edge = msgspec.structs.replace(cfg.edge, node_listen="127.0.0.1:0", admin_listen="127.0.0.1:0")
    openai = msgspec.structs.replace(cfg.openai, listen="127.0.0.1:0")
    return msgspec.structs.replace(cfg, edge=edge, openai=openai)


@asynccontextmanager
async def running_gateway(
    yaml_text: str, *, nodes: list[str] | None = None, config_path: str | None = None
) -> AsyncIterator[Gateway]:
    """Start an edge from ``yaml_text`` (ports forced to 0) and the given nodes."""
    cfg = edge_config(yaml_text)
    if nodes is None:
        nodes = [n.id for n in cfg.nodes]
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(functools.partial(run_edge, cfg, config_path))
        gw = Gateway(handle=handle, nursery=nursery, node_scopes={})
        for node_id in nodes:
            await gw.start_node(node_id)
        try:
            yield gw
        finally:
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ raw HTTP


@dataclass
class RawResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)


async def http_request(
    host_port: tuple[str, int],
    method: str,
    path: str,
    *,
    body: bytes | dict[str, Any] | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> RawResponse:
    """One request on a fresh connection with h11; reads the whole response."""
    import h11

    if isinstance(body, dict):
        body = json.dumps(body).encode()
    hdrs = [("host", f"{host_port[0]}:{host_port[1]}"), ("connection", "close")]
    if body is not None:
        hdrs.append(("content-length", str(len(body))))
        hdrs.append(("content-type", "application/json"))
    hdrs += headers or []
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(*host_port)
    async with stream:
        data = conn.send(h11.Request(method=method, target=path, headers=hdrs))
        if body is not None:
            data += conn.send(h11.Data(data=body))
        data += conn.send(h11.EndOfMessage())
        await stream.send_all(data)
        return await read_response(stream, conn)


async def read_response(stream: trio.abc.ReceiveStream, conn: Any) -> RawResponse:
    """The next response on an h11 client connection, read to its end (or the connection's)."""
    import h11

    status, rheaders, chunks = 0, [], []
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(ev, h11.Response):
            status = ev.status_code
            rheaders = [(k.decode(), v.decode()) for k, v in ev.headers]
        elif isinstance(ev, h11.Data):
            chunks.append(bytes(ev.data))
        elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
            return RawResponse(status, rheaders, b"".join(chunks))


async def get_json(url_host_port: tuple[str, int], path: str) -> Any:
    resp = await http_request(url_host_port, "GET", path)
    return resp.json()


def admin_host_port(gw: Gateway) -> tuple[str, int]:
    return gw.handle.admin


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


async def first_provider_status(gw: Gateway) -> dict[str, Any]:
    """The first provider row of the edge's ``GET /status``."""
    doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
    provider: dict[str, Any] = doc["providers"][0]
    return provider


async def wait_provider_health(gw: Gateway, want: str) -> dict[str, Any]:
    """Poll ``/status`` until the first provider shows ``health == want`` (callers bound it)."""
    while (p := await first_provider_status(gw))["health"] != want:  # noqa: ASYNC110
        await trio.sleep(0.02)
    return p


async def provider_health_gauge(gw: Gateway) -> float:
    """The first ``iop_provider_health`` sample of the edge's ``/metrics``."""
    text = (await http_request(gw.handle.admin, "GET", "/metrics")).body.decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("iop_provider_health{"))
    return float(line.rsplit(" ", 1)[1])


# ------------------------------------------------------------- several edges


@dataclass
class EdgeFleet:
    """Several edges in the test process, and nodes that dial every one of them
    (``node.edges``).  ``edges[i]`` is a ``Gateway`` without nodes of its own."""

    edges: list[Gateway]
    nursery: trio.Nursery
    edge_scopes: list[trio.CancelScope]
    node_scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    node_handles: dict[str, Any] = field(default_factory=dict)
    #: edge index -> set when that edge's task has ended
    _stopped: dict[int, trio.Event] = field(default_factory=dict)

    def wire_addresses(self) -> list[str]:
        return [f"{gw.handle.wire[0]}:{gw.handle.wire[1]}" for gw in self.edges]

    def node_config(self, node_id: str, **section: Any) -> NodeConfigFile:
        dials: dict[str, Any] = {"edges": self.wire_addresses()}
        dials.update(consent_of([gw.runtime.snapshot.config for gw in self.edges], node_id))
        return quick_node_config(node_id, dials, section)

    async def restart_edge(self, i: int, yaml_text: str) -> Gateway:
        """Stop edge ``i`` at once (its in-memory state is gone, like a crash) and
        start it again from ``yaml_text`` on the same wire address, which its
        nodes redial; returns the new edge (also ``edges[i]``)."""
        host, port = self.edges[i].handle.wire
        self.edge_scopes[i].cancel()
        await self._stopped.pop(i).wait()
        cfg = edge_config(yaml_text)
        cfg = msgspec.structs.replace(
            cfg, edge=msgspec.structs.replace(cfg.edge, node_listen=f"{host}:{port}")
        )
        stopped = trio.Event()
        scope, handle = await self.nursery.start(_run_edge_scoped, cfg, stopped)
        self._stopped[i] = stopped
        self.edges[i] = Gateway(handle=handle, nursery=self.nursery, node_scopes={})
        self.edge_scopes[i] = scope
        return self.edges[i]

    async def start_node(self, node_id: str, **section: Any) -> None:
        """Start ``node_id`` dialing every edge; returns once every edge has it."""
        scope, handle = await self.nursery.start(
            functools.partial(_run_node_scoped, self.node_config(node_id, **section))
        )
        self.node_scopes[node_id] = scope
        self.node_handles[node_id] = handle
        for gw in self.edges:
            await wait_until(lambda gw=gw: gw.runtime.hub.connected_since(node_id) is not None)


async def _run_edge_scoped(
    cfg: Any,
    stopped: trio.Event | None = None,
    *,
    task_status: trio.TaskStatus[tuple[trio.CancelScope, EdgeHandle]],
) -> None:
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(functools.partial(run_edge, cfg, None))
                task_status.started((scope, handle))
    finally:
        if stopped is not None:
            stopped.set()


@asynccontextmanager
async def running_edges(yaml_texts: list[str], *, nodes: list[str]) -> AsyncIterator[EdgeFleet]:
    """Start one edge per YAML text (ports forced to 0), then ``nodes`` dialing them all."""
    async with trio.open_nursery() as nursery:
        edges: list[Gateway] = []
        scopes: list[trio.CancelScope] = []
        stopped: dict[int, trio.Event] = {}
        for i, text in enumerate(yaml_texts):
            stopped[i] = trio.Event()
            scope, handle = await nursery.start(_run_edge_scoped, edge_config(text), stopped[i])
            edges.append(Gateway(handle=handle, nursery=nursery, node_scopes={}))
            scopes.append(scope)
        fleet = EdgeFleet(edges=edges, nursery=nursery, edge_scopes=scopes, _stopped=stopped)
        for node_id in nodes:
            await fleet.start_node(node_id)
        try:
            yield fleet
        finally:
            nursery.cancel_scope.cancel()


def metric(gw: Gateway, name: str, **labels: str) -> float:
    """Sum of the edge's samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in gw.runtime.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released): for a refused
    connection, or a listener that cannot be told port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port
