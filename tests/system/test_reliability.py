"""Reliability under faults and load (leases, heartbeats, daemons).

Two kinds of test live here:

* **Real daemons** (``python -m iopd edge|node`` subprocesses on loopback,
  mock providers served from this process): a node killed or frozen
  mid-stream, hanging or broken providers, an edge restart, a node
  reconnecting while requests wait, a burst of 500 requests.  These use the
  real clock, so they wait for the event under a ``fail_after`` of at least
  ten times the configured bound and *print* the measured figure (run with
  ``-s`` to see it; docs/reliability.md records them) instead of asserting it.
* **In process** (``run_edge`` + ``run_node`` in this trio run): a storm of
  2,000 stream open-then-cancel cycles, after which every counter that could
  leak (leases, queue, hub streams, HTTP connections, node streams, trio
  tasks) is back at its baseline.

The CI-sized soak (``scripts/soak.py`` for ~20 s) runs here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.configs import echo_entry, gateway_yaml, node_entry
from tests.support.daemons import (
    CALLER_TOKEN,
    NODE_TOKEN,
    Daemon,
    Response,
    chat_body,
    host_port,
    http_request,
    node_verifier,
    run_daemon,
    sse_payloads,
)
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer
from tests.support.paths import ROOT, load_script

REPO = ROOT

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 2.0
NODE2_TOKEN = "iop_reliability_node2_5c3a1e"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def free_port() -> int:
    """A loopback port that was free a moment ago (for daemons that must restart on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def report(name: str, **figures: Any) -> None:
    """Print a measured figure (docs/reliability.md records them)."""
    print(f"\nMEASURED {name}: " + " ".join(f"{k}={v}" for k, v in figures.items()))


def edge_yaml(
    *,
    providers: str,
    models: str,
    wire_port: int = 0,
    openai_port: int = 0,
    max_queue: int = 16,
    queue_timeout: float = 10,
    second_node: str = "",
) -> str:
    return f"""\
edge:
  id: rel-edge
  node_listen: 127.0.0.1:{wire_port}
  admin_listen: 127.0.0.1:0
  heartbeat_interval: {HEARTBEAT_INTERVAL}
  heartbeat_timeout: {HEARTBEAT_TIMEOUT}
  drain_timeout: 2
openai:
  listen: 127.0.0.1:{openai_port}
  principal_tokens:
    - token_ref: rel-ref
      token_hash_sha256: {_sha256(CALLER_TOKEN)}
      principal_ref: rel-user
provider_pool: {{max_queue: {max_queue}, queue_timeout: {queue_timeout}}}
models:
{models}
nodes:
  - id: rel-node
    token_verifier: "{node_verifier(NODE_TOKEN)}"
    providers:
{providers}
{second_node}"""


def echo_provider(pid: str = "echo-1", *, capacity: int = 2, delay_ms: int = 100) -> str:
    return echo_entry(pid, capacity=capacity, delay_ms=delay_ms)


ECHO_MODEL = "  - id: echo\n    providers: {echo-1: echo}\n"


def node_yaml(node_id: str, wire_port: int, token: str = "${IOP_NODE_TOKEN}") -> str:
    return f"""\
node:
  id: {node_id}
  edge: 127.0.0.1:{wire_port}
  token: {token}
  reconnect_initial_backoff: 0.2
  reconnect_max_backoff: 1
  drain_timeout: 1
"""


@dataclass
class Cluster:
    edge: Daemon
    nodes: dict[str, Daemon]
    openai: tuple[str, int]
    admin: tuple[str, int]
    wire: tuple[str, int]
    nursery: trio.Nursery
    tmp: Path

    async def status(self) -> dict[str, Any]:
        resp = await http_request(self.admin, "GET", "/status")
        assert resp.status == 200
        doc = json.loads(resp.body)
        assert isinstance(doc, dict)
        return doc

    async def wait_status(self, pred: Any) -> dict[str, Any]:
        while True:
            doc = await self.status()
            if pred(doc):
                return doc
            await trio.sleep(0.02)

    async def chat(self, text: str, *, model: str = "echo", stream: bool = False) -> Response:
        return await http_request(
            self.openai,
            "POST",
            "/v1/chat/completions",
            chat_body(text, stream=stream, model=model),
            token=CALLER_TOKEN,
        )


def in_flight(doc: dict[str, Any]) -> int:
    return sum(int(p["in_flight"]) for p in doc["providers"])


async def start_edge(nursery: trio.Nursery, tmp: Path, yaml_text: str, name: str = "edge") -> Any:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml_text)
    return run_daemon(nursery, name, "edge", cfg)


@asynccontextmanager
async def node_process(
    nursery: trio.Nursery, tmp: Path, node_id: str, wire_port: int, token: str | None = None
) -> AsyncIterator[Daemon]:
    cfg = tmp / f"{node_id}-{time.monotonic_ns()}.yaml"
    cfg.write_text(node_yaml(node_id, wire_port, token or "${IOP_NODE_TOKEN}"))
    async with run_daemon(nursery, node_id, "node", cfg) as node:
        yield node


@asynccontextmanager
async def cluster(tmp: Path, yaml_text: str, node_ids: tuple[str, ...] = ("rel-node",)) -> Any:
    """An edge subprocess and its node subprocesses, every node connected."""
    async with trio.open_nursery() as nursery:
        async with await start_edge(nursery, tmp, yaml_text) as edge:
            started = await edge.wait_event("edge_started")
            wire = host_port(started["wire"])
            nodes: dict[str, Daemon] = {}
            async with node_process(nursery, tmp, node_ids[0], wire[1]) as node:
                nodes[node_ids[0]] = node
                c = Cluster(
                    edge=edge,
                    nodes=nodes,
                    openai=host_port(started["openai"]),
                    admin=host_port(started["admin"]),
                    wire=wire,
                    nursery=nursery,
                    tmp=tmp,
                )
                await c.wait_status(
                    lambda d: all(n["connected"] for n in d["nodes"] if n["id"] in node_ids[:1])
                )
                yield c
        nursery.cancel_scope.cancel()


async def stream_in_background(
    c: Cluster, text: str, nursery: trio.Nursery, *, model: str = "echo"
) -> tuple[dict[str, Any], trio.Event]:
    """Start a streaming request; returns (result box, event set at its first chunk)."""
    box: dict[str, Any] = {}
    first = trio.Event()

    def seen(piece: bytes) -> None:
        if b"data: " in piece:
            first.set()

    async def run() -> None:
        box["resp"] = await http_request(
            c.openai,
            "POST",
            "/v1/chat/completions",
            chat_body(text, stream=True, model=model),
            token=CALLER_TOKEN,
            on_data=seen,
        )
        box["ended_at"] = trio.current_time()

    nursery.start_soon(run)
    return box, first


def _terminal_error(resp: Response) -> str | None:
    """The error code a stream ended with (or 'truncated'); None if it completed."""
    if resp.status != 200:
        return str(json.loads(resp.body)["error"]["code"])
    if resp.body.lstrip().startswith(b"{"):  # a whole (non-streamed) completion
        return None if "choices" in json.loads(resp.body) else "not_a_completion"
    payloads = sse_payloads(resp.body)
    if payloads and payloads[-1] == "[DONE]":
        return None
    for p in reversed(payloads):
        if p.startswith("{") and "error" in json.loads(p):
            return str(json.loads(p)["error"]["code"])
    return "truncated"


# ----------------------------------------------------------------- node faults


async def test_node_sigkill_mid_stream_ends_the_stream_and_frees_the_lease(
    tmp_path: Path,
) -> None:
    text = " ".join(f"w{i}" for i in range(100))  # 100 x 100 ms: far longer than the test
    yaml_text = edge_yaml(providers=echo_provider(), models=ECHO_MODEL)
    with trio.fail_after(10 * HEARTBEAT_TIMEOUT + 20):
        async with cluster(tmp_path, yaml_text) as c:
            async with trio.open_nursery() as nursery:
                box, first = await stream_in_background(c, text, nursery)
                await first.wait()
                assert in_flight(await c.status()) == 1
                killed_at = trio.current_time()
                c.nodes["rel-node"].proc.kill()
                with trio.fail_after(10 * HEARTBEAT_TIMEOUT):
                    while "resp" not in box:  # noqa: ASYNC110
                        await trio.sleep(0.005)
            detect = box["ended_at"] - killed_at
            code = _terminal_error(box["resp"])
            assert code is not None, "the stream cannot complete without its node"
            doc = await c.wait_status(lambda d: not d["nodes"][0]["connected"])
            assert in_flight(doc) == 0
            assert doc["queue"]["depth"] == 0
            report("node_sigkill", caller_terminal_s=f"{detect:.3f}", error=code)


async def test_node_sigstop_is_detected_by_heartbeat(tmp_path: Path) -> None:
    text = " ".join(f"w{i}" for i in range(200))
    bound = HEARTBEAT_INTERVAL + HEARTBEAT_TIMEOUT
    yaml_text = edge_yaml(providers=echo_provider(), models=ECHO_MODEL)
    with trio.fail_after(10 * bound + 20):
        async with cluster(tmp_path, yaml_text) as c:
            node = c.nodes["rel-node"]
            async with trio.open_nursery() as nursery:
                box, first = await stream_in_background(c, text, nursery)
                await first.wait()
                stopped_at = trio.current_time()
                node.proc.send_signal(signal.SIGSTOP)
                try:
                    with trio.fail_after(10 * bound):
                        await c.edge.wait_event("node_disconnected")
                        detected = trio.current_time() - stopped_at
                        while "resp" not in box:  # noqa: ASYNC110
                            await trio.sleep(0.005)
                finally:
                    node.proc.send_signal(signal.SIGCONT)
            caller = box["ended_at"] - stopped_at
            assert _terminal_error(box["resp"]) is not None
            doc = await c.status()
            assert in_flight(doc) == 0
            # Resumed, the node notices its dead connection and reconnects.
            with trio.fail_after(10 * bound):
                await c.wait_status(lambda d: d["nodes"][0]["connected"])
            ok = await c.chat("after the freeze")
            assert ok.status == 200
            report(
                "node_sigstop",
                detected_s=f"{detected:.3f}",
                caller_terminal_s=f"{caller:.3f}",
                bound_s=bound,
            )


# ------------------------------------------------------------ provider faults

READ_TIMEOUT = 1.0


def mock_providers_yaml(oa_base: str, ol_base: str) -> tuple[str, str]:
    providers = f"""\
      - id: oa-1
        type: openai
        base_url: {oa_base}
        models: [mock-model]
        capacity: 2
        read_timeout: {READ_TIMEOUT}
        health_interval: 60
      - id: ol-1
        type: ollama
        base_url: {ol_base}
        models: ["mock:latest"]
        capacity: 2
        read_timeout: {READ_TIMEOUT}
        health_interval: 60
"""
    models = """\
  - id: pt
    providers: {oa-1: mock-model}
  - id: ol
    providers: {ol-1: "mock:latest"}
"""
    return providers, models


@asynccontextmanager
async def mocks() -> AsyncIterator[tuple[MockOpenAIServer, MockOllamaServer]]:
    async with trio.open_nursery() as nursery:
        oa = await nursery.start(MockOpenAIServer().serve)
        ol = await nursery.start(MockOllamaServer().serve)
        yield oa, ol
        nursery.cancel_scope.cancel()


async def test_hanging_provider_times_out_per_read_timeout(tmp_path: Path) -> None:
    with trio.fail_after(10 * READ_TIMEOUT * 4 + 30):
        async with mocks() as (oa, ol):
            providers, models = mock_providers_yaml(oa.base_url, ol.base_url)
            async with cluster(tmp_path, edge_yaml(providers=providers, models=models)) as c:
                # The first health probes must be done before the mocks misbehave
                # (a probe caught by a hanging mock would mark the provider unhealthy).
                await c.wait_status(lambda d: all(p["health"] == "healthy" for p in d["providers"]))
                figures = {}
                for mode in ("hang", "hang_after_head"):
                    oa.mode = ol.mode = mode
                    for model, stream in (("ol", False), ("ol", True), ("pt", False)):
                        start = trio.current_time()
                        with trio.fail_after(10 * READ_TIMEOUT):
                            resp = await c.chat("hello", model=model, stream=stream)
                        elapsed = trio.current_time() - start
                        code = _terminal_error(resp)
                        if resp.status != 200:
                            assert resp.status == 504, resp.body
                        if model == "pt" and mode == "hang_after_head":
                            # The provider's head was relayed: passthrough adds no
                            # envelope, the body is cut.
                            assert resp.status == 200 and code == "truncated", resp.body
                        else:
                            assert code == "provider_timeout", (mode, model, resp.body)
                        figures[f"{mode}_{model}{'_stream' if stream else ''}"] = (
                            f"{elapsed:.2f}s/{code}"
                        )
                doc = await c.status()
                assert in_flight(doc) == 0
                report("provider_hang", read_timeout=READ_TIMEOUT, **figures)


async def test_broken_provider_gives_a_clear_error_and_frees_the_slot(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mocks() as (oa, ol):
            providers, models = mock_providers_yaml(oa.base_url, ol.base_url)
            async with cluster(tmp_path, edge_yaml(providers=providers, models=models)) as c:
                # The first health probes must be done before the mocks misbehave
                # (a probe caught by a hanging mock would mark the provider unhealthy).
                await c.wait_status(lambda d: all(p["health"] == "healthy" for p in d["providers"]))
                seen = {}
                for mode in ("error500", "garbage", "drop"):
                    oa.mode = ol.mode = mode
                    for model, stream in (("ol", False), ("ol", True), ("pt", False)):
                        resp = await c.chat("hello", model=model, stream=stream)
                        assert resp.status < 600
                        if model == "pt" and mode == "error500":
                            assert resp.status == 500  # relayed as is
                            assert json.loads(resp.body)["error"]["message"] == "boom"
                        else:
                            code = _terminal_error(resp)
                            assert code == "provider_error", (mode, model, resp.body)
                            if resp.status != 200:
                                assert resp.status == 502
                        seen[f"{mode}_{model}{'_s' if stream else ''}"] = resp.status
                        assert b"Traceback" not in resp.body
                oa.mode = ol.mode = "ok"
                assert (await c.chat("fine again", model="ol")).status == 200
                doc = await c.status()
                assert in_flight(doc) == 0
                report("provider_broken", **seen)


# ------------------------------------------------------------ edge restarts


async def test_edge_restart_nodes_reconnect_with_backoff_and_serve(tmp_path: Path) -> None:
    wire_port = free_port()
    yaml_text = edge_yaml(
        providers=echo_provider(delay_ms=0), models=ECHO_MODEL, wire_port=wire_port
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            async with await start_edge(nursery, tmp_path, yaml_text, "edge1") as edge1:
                started = await edge1.wait_event("edge_started")
                async with node_process(nursery, tmp_path, "rel-node", wire_port) as node:
                    await edge1.wait_event("node_connected")
                    edge1.proc.send_signal(signal.SIGTERM)
                    assert await edge1.wait_exit() == 0
                    down_at = trio.current_time()
                    # The node keeps retrying (with backoff) while the edge is down.
                    await trio.sleep(1.5)
                    async with await start_edge(nursery, tmp_path, yaml_text, "edge2") as edge2:
                        started = await edge2.wait_event("edge_started")
                        up_at = trio.current_time()
                        with trio.fail_after(10 * 1.0 + 10):  # 10 x reconnect_max_backoff
                            await edge2.wait_event("node_connected")
                        reconnected = trio.current_time() - up_at
                        openai = host_port(started["openai"])
                        resp = await http_request(
                            openai,
                            "POST",
                            "/v1/chat/completions",
                            chat_body("back again"),
                            token=CALLER_TOKEN,
                        )
                        assert resp.status == 200
                        assert json.loads(resp.body)["choices"][0]["message"]["content"] == (
                            "back again"
                        )
                        assert node.proc.returncode is None
                        report(
                            "edge_restart",
                            edge_down_s=f"{up_at - down_at:.2f}",
                            reconnect_after_edge_up_s=f"{reconnected:.3f}",
                            max_backoff_s=1,
                        )
            nursery.cancel_scope.cancel()


async def test_node_reconnecting_while_requests_wait_admits_the_waiters(tmp_path: Path) -> None:
    """Two nodes, one slot each, both busy, requests queued: node 2 is killed and
    restarted; the waiters are admitted on node 2 while node 1 is still busy."""
    long_text = " ".join(f"L{i}" for i in range(80))  # 80 x 100 ms = 8 s on node 1
    second = f"""\
  - id: rel-node2
    token_verifier: "{node_verifier(NODE2_TOKEN)}"
    providers:
      - id: echo-2
        type: echo
        category: api
        models: [echo]
        capacity: 1
        delay_ms: 100
"""
    yaml_text = edge_yaml(
        providers=echo_provider(capacity=1),
        models="  - id: echo\n    providers: {echo-1: echo, echo-2: echo}\n",
        queue_timeout=60,
        second_node=second,
    )
    with trio.fail_after(90):
        async with cluster(tmp_path, yaml_text) as c:
            async with node_process(c.nursery, tmp_path, "rel-node2", c.wire[1], NODE2_TOKEN) as n2:
                await c.wait_status(lambda d: all(n["connected"] for n in d["nodes"]))
                async with trio.open_nursery() as nursery:
                    long1, first1 = await stream_in_background(c, long_text, nursery)
                    long2, first2 = await stream_in_background(c, long_text, nursery)
                    await first1.wait()
                    await first2.wait()
                    waiters: list[dict[str, Any]] = []
                    for i in range(3):
                        box: dict[str, Any] = {}
                        waiters.append(box)

                        async def wait_one(box: dict[str, Any] = box, i: int = i) -> None:
                            box["resp"] = await c.chat(f"waiter {i}")
                            box["at"] = trio.current_time()

                        nursery.start_soon(wait_one)
                    await c.wait_status(lambda d: d["queue"]["depth"] == 3)
                    n2.proc.kill()
                    await c.wait_status(
                        lambda d: (
                            not [n for n in d["nodes"] if n["id"] == "rel-node2"][0]["connected"]
                        )
                    )
                    # Node 1 still busy: the waiters keep waiting (no live candidate lost).
                    assert (await c.status())["queue"]["depth"] == 3
                    async with node_process(
                        c.nursery, tmp_path, "rel-node2", c.wire[1], NODE2_TOKEN
                    ):
                        back_at = trio.current_time()
                        with trio.fail_after(20):
                            while not all("resp" in w for w in waiters):  # noqa: ASYNC110
                                await trio.sleep(0.01)
                        admitted = max(w["at"] for w in waiters) - back_at
                        for i, w in enumerate(waiters):
                            assert w["resp"].status == 200
                            body = json.loads(w["resp"].body)
                            assert body["choices"][0]["message"]["content"] == f"waiter {i}"
                        # One long stream died with node 2; the other is still
                        # running on node 1, so node 2 served the waiters.
                        ended = [b for b in (long1, long2) if "resp" in b]
                        assert len(ended) == 1, "node 1 must still be busy"
                        assert _terminal_error(ended[0]["resp"]) is not None
                        nursery.cancel_scope.cancel()
            report(
                "node_reconnect_with_waiters", all_waiters_done_after_reconnect_s=f"{admitted:.3f}"
            )


# --------------------------------------------------------------------- load


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_burst_of_500_requests_gets_answers_never_hangs(tmp_path: Path) -> None:
    yaml_text = edge_yaml(
        providers=echo_provider(capacity=2, delay_ms=50),
        models=ECHO_MODEL,
        max_queue=20,
        queue_timeout=1,
    )
    n = 500
    with trio.fail_after(120):
        async with cluster(tmp_path, yaml_text) as c:
            pid = c.edge.proc.pid
            assert (await c.chat("warm up")).status == 200
            rss_before, fds_before = rss_kib(pid), open_fds(pid)
            outcomes: Counter[str] = Counter()
            truncated: list[bytes] = []
            start = trio.current_time()

            async def one(i: int) -> None:
                try:
                    resp = await c.chat(f"b{i} x y z", stream=bool(i % 2))
                except OSError as exc:  # the test process ran out of something
                    outcomes[f"client_{type(exc).__name__}"] += 1
                    return
                if resp.status == 200:
                    code = _terminal_error(resp)
                    if code == "truncated":
                        truncated.append(resp.body[-300:])
                    outcomes["ok" if code is None else f"stream_{code}"] += 1
                else:
                    outcomes[json.loads(resp.body)["error"]["code"]] += 1

            with trio.fail_after(60):  # 10 x (queue_timeout + a full drain of 20 waiters)
                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)
            elapsed = trio.current_time() - start
            assert sum(outcomes.values()) == n
            edge_statuses = Counter(e["status"] for e in c.edge.events("request"))
            assert set(outcomes) <= {"ok", "queue_full", "queue_timeout"}, (
                outcomes,
                edge_statuses,
                truncated,
            )
            assert outcomes["ok"] >= 2 and outcomes["queue_full"] > 0
            assert outcomes["queue_timeout"] > 0  # 20 waiters cannot all fit in 1 s
            doc = await c.wait_status(lambda d: in_flight(d) == 0 and d["queue"]["depth"] == 0)
            assert doc["queue"]["depth"] == 0
            await trio.sleep(0.5)  # connections close
            rss_after, fds_after = rss_kib(pid), open_fds(pid)
            assert rss_after < rss_before + 200 * 1024, (rss_before, rss_after)
            report(
                "burst_500",
                elapsed_s=f"{elapsed:.2f}",
                outcomes=dict(outcomes),
                edge_rss_kib=f"{rss_before}->{rss_after}",
                edge_fds=f"{fds_before}->{fds_after}",
            )


# ------------------------------------------------------------- cancel storm


KINDS = os.environ.get("IOPD_STORM_KINDS", "before_response,after_head,after_chunk,partial").split(
    ","
)


def _count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return walk(root)


STORM_YAML = gateway_yaml(
    edge_id="storm-edge",
    pool="provider_pool: {max_queue: 512, queue_timeout: 30}",
    models="  - id: echo\n    providers: {echo-1: echo}",
    nodes=node_entry(
        "storm-node",
        echo_entry(category=None, capacity=8, delay_ms=5),
        verifier=node_verifier("storm-token"),
    ),
)


async def test_cancel_storm_leaks_nothing() -> None:
    """2,000 streams opened and abandoned (before the response, after the head, after
    the first chunk): afterwards leases, queue, streams, connections and tasks are
    back to baseline."""
    from iopd.config.load import parse_edge_config
    from iopd.config.schema import NodeConfigFile, NodeSection
    from iopd.edge.daemon import run_edge
    from iopd.node.run import run_node

    cycles = int(os.environ.get("IOPD_STORM_CYCLES", "2000"))
    rng = random.Random(7)
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(run_edge, parse_edge_config(STORM_YAML, env={}))
            host, port = handle.wire
            node_cfg = NodeConfigFile(
                node=NodeSection(id="storm-node", edge=f"{host}:{port}", token="storm-token")
            )
            node = await nursery.start(run_node, node_cfg)
            rt = handle.runtime
            while rt.hub.connected_since("storm-node") is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert handle.openai is not None and handle.openai_server is not None
            addr = handle.openai
            server = handle.openai_server
            body = json.dumps(chat_body(" ".join(f"w{i}" for i in range(50)), stream=True))
            request = (
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}"
            ).encode()

            async def settle() -> None:
                def busy() -> bool:
                    return bool(
                        server.open_connections
                        or node.executor.active_streams
                        or any(p["in_flight"] for p in rt.status()["providers"])
                    )

                while busy():  # noqa: ASYNC110 - state owned by other tasks
                    await trio.sleep(0.01)
                await trio.sleep(0.2)

            # Baseline after one complete request.
            stream = await trio.open_tcp_stream(*addr)
            await stream.send_all(
                request.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nconnection: close\r\n", 1)
            )
            while await stream.receive_some(65536):
                pass
            await stream.aclose()
            await settle()
            baseline_tasks = _count_tasks()
            session_before = rt.hub.session("storm-node")
            outcomes_not_streamed: list[bytes] = []
            kinds: Counter[str] = Counter()
            started = time.monotonic()

            kind_time: dict[str, float] = {}

            async def cycle(i: int) -> None:
                kind = rng.choice(KINDS)
                t0 = time.monotonic()
                kinds[kind] += 1
                s = await trio.open_tcp_stream(*addr)
                try:
                    if kind == "partial":
                        await s.send_all(request[: rng.randrange(1, len(request))])
                    else:
                        await s.send_all(request)
                        if kind != "before_response":
                            want = b"data: " if kind == "after_chunk" else b"\r\n\r\n"
                            got = b""
                            while want not in got:
                                piece = await s.receive_some(65536)
                                if not piece:
                                    break
                                got += piece
                                if b"\r\n\r\n" in got and not got.startswith(b"HTTP/1.1 200"):
                                    outcomes_not_streamed.append(got.split(b"\r\n", 1)[0])
                                    break
                finally:
                    await trio.aclose_forcefully(s)
                    kind_time[kind] = kind_time.get(kind, 0.0) + time.monotonic() - t0

            limiter = trio.CapacityLimiter(32)

            async def limited(i: int) -> None:
                async with limiter:
                    await cycle(i)

            async with trio.open_nursery() as storm:
                for i in range(cycles):
                    storm.start_soon(limited, i)
            with trio.fail_after(30):
                await settle()
            elapsed = time.monotonic() - started
            status = rt.status()
            assert all(p["in_flight"] == 0 for p in status["providers"])
            assert status["queue"]["depth"] == 0
            assert server.open_connections == 0
            assert server.in_flight == 0
            assert node.executor.active_streams == 0
            # The node session survived the storm (no overflow, no reconnect)
            # and every stream that got an answer got a stream.
            assert rt.hub.session("storm-node") is session_before
            assert outcomes_not_streamed == []
            assert _count_tasks() <= baseline_tasks, (baseline_tasks, _count_tasks())
            report(
                "cancel_storm",
                cycles=cycles,
                elapsed_s=f"{elapsed:.1f}",
                kinds=dict(kinds),
                kind_seconds={k: round(v, 1) for k, v in kind_time.items()},
                tasks=f"{baseline_tasks}->{_count_tasks()}",
            )
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------- soak


@pytest.mark.slow
async def test_soak_short_run_has_no_violations() -> None:
    with trio.fail_after(120):
        result = await trio.run_process(
            [
                sys.executable,
                str(REPO / "scripts" / "soak.py"),
                "--streams",
                "4",
                "--seconds",
                "15",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode() + result.stderr.decode()
    print(out)
    assert result.returncode == 0, out
    assert "violations=0" in out


def _sse(*deltas: str, finish: str | None = "stop", done: bool = True) -> bytes:
    out = b""
    for d in deltas:
        out += b"data: " + json.dumps({"choices": [{"delta": {"content": d}}]}).encode() + b"\n\n"
    if finish:
        out += (
            b"data: " + json.dumps({"choices": [{"delta": {}, "finish_reason": finish}]}).encode()
        )
        out += b"\n\n"
    return out + (b"data: [DONE]\n\n" if done else b"")


def test_soak_sequence_check_catches_lost_duplicated_reordered_chunks() -> None:
    check = load_script("soak").check_stream
    words = ["s0-1-0", "s0-1-1", "s0-1-2"]
    assert check(_sse("s0-1-0 ", "s0-1-1 ", "s0-1-2"), words) is None
    assert "lost" in check(_sse("s0-1-0 ", "s0-1-2"), words)
    assert "duplicated=1" in check(_sse("s0-1-0 ", "s0-1-1 ", "s0-1-1 ", "s0-1-2"), words)
    assert "reordered=True" in check(_sse("s0-1-1 ", "s0-1-0 ", "s0-1-2"), words)
    assert check(_sse("s0-1-0 ", "s0-1-1 ", "s0-1-2", done=False), words) is not None
    assert check(_sse("s0-1-0 ", "s0-1-1 ", "s0-1-2", finish=None), words) is not None
