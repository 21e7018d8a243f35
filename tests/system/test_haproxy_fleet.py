"""Two edges and two nodes behind a real HAProxy, all real processes.

The deployment of ``docs/operations.md`` ("Several edges behind a load
balancer"): HAProxy round-robins callers over two ``iopd edge`` processes and
health-checks each on the public listener's ``GET /healthz``; two ``iopd node``
processes dial both edges (``node.edges``).  What must hold: requests are
spread over both edges; when one edge is SIGKILLed, only the requests in
flight on it fail, and every later request succeeds through the other.

Debian's ``haproxy`` is started by the test on a free loopback port with a
generated config; without it the test is skipped, unless ``CI`` is set (then
it fails).  Real clock (subprocesses), outcomes only, every wait bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from tests.support.configs import edge_yaml, model
from tests.support.daemons import (
    NODE_TOKEN,
    Daemon,
    Response,
    chat_body,
    host_port,
    http_request,
    node_verifier,
    run_daemon,
)
from tests.support.gateway import free_port

GUARD = 60.0
HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
#: The echo provider waits this long before each word: a request of WORDS
#: words is in flight for about WORDS x DELAY_MS.
DELAY_MS = 250
WORDS = 8

NODE_YAML = """\
node:
  id: {node_id}
  edges: [{edges}]
  token: ${{IOP_NODE_TOKEN}}
  reconnect_initial_backoff: 0.1
  reconnect_max_backoff: 1
"""

HAPROXY_CFG = """\
global
    maxconn 256
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    retries 3
    option redispatch 1
    retry-on conn-failure
frontend openai
    bind 127.0.0.1:{port}
    default_backend edges
backend edges
    balance roundrobin
    option httpchk
    http-check send meth GET uri /healthz ver HTTP/1.1 hdr Host localhost
    http-check expect status 200
    default-server inter 200ms fall 1 rise 2
{servers}
"""


def _haproxy_or_skip() -> str:
    if HAPROXY is None:
        if os.environ.get("CI"):
            pytest.fail("haproxy is missing (CI is set: .ci/run installs it)")
        pytest.skip("haproxy is not installed (Debian: apt-get install haproxy)")
    return HAPROXY


async def _wait_listening(port: int) -> None:
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            await trio.sleep(0.05)
            continue
        await stream.aclose()
        return


@asynccontextmanager
async def haproxy(binary: str, cfg: Path, port: int) -> AsyncIterator[trio.Process]:
    proc = await trio.lowlevel.open_process(
        [binary, "-f", str(cfg), "-db", "-q"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(10):
            await _wait_listening(port)
        yield proc
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


def served(edge: Daemon) -> int:
    """How many chat requests ``edge`` has finished (its ``event=request`` lines)."""
    return sum(1 for f in edge.events("request") if f.get("endpoint") == "chat_completions")


async def wait_served(edge: Daemon, n: int) -> None:
    """Until ``edge`` logged ``n`` chat requests (its log line follows the reply)."""
    await edge.wait_for(lambda _line: served(edge) >= n)


async def in_flight(admin: tuple[str, int]) -> int:
    """The streams this edge runs: its own share (the ``iop_provider_in_flight``
    gauges; ``/status`` shows each node's total across edges)."""
    text = (await http_request(admin, "GET", "/metrics")).body.decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("iop_provider_in_flight{")
    )


async def chat(lb: tuple[str, int], words: int = 1) -> Response:
    text = " ".join(f"w{i}" for i in range(words))
    try:
        return await http_request(lb, "POST", "/v1/chat/completions", chat_body(text))
    except (OSError, trio.BrokenResourceError, AssertionError):
        return Response(0, {})  # the connection broke before a response head


async def test_two_edges_behind_haproxy_survive_one_edge_killed(tmp_path: Path) -> None:
    binary = _haproxy_or_skip()
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            edges: list[Daemon] = []
            wires: list[str] = []
            publics: list[tuple[str, int]] = []
            admins: list[tuple[str, int]] = []
            async with (
                run_daemon(nursery, "edge-1", "edge", _edge_cfg(tmp_path, "edge-1")) as e1,
                run_daemon(nursery, "edge-2", "edge", _edge_cfg(tmp_path, "edge-2")) as e2,
            ):
                for edge in (e1, e2):
                    started = await edge.wait_event("edge_started")
                    edges.append(edge)
                    wires.append(started["wire"])
                    publics.append(host_port(started["openai"]))
                    admins.append(host_port(started["admin"]))
                n1_cfg = _node_cfg(tmp_path, "node-1", wires)
                n2_cfg = _node_cfg(tmp_path, "node-2", wires)
                async with (
                    run_daemon(nursery, "node-1", "node", n1_cfg),
                    run_daemon(nursery, "node-2", "node", n2_cfg),
                ):
                    for edge in edges:
                        await edge.wait_for(lambda ln: "event=node_connected node=node-1" in ln)
                        await edge.wait_for(lambda ln: "event=node_connected node=node-2" in ln)
                    port = free_port()
                    cfg = tmp_path / "haproxy.cfg"
                    servers = "\n".join(
                        f"    server {name} {host}:{p} check"
                        for name, (host, p) in zip(("edge-1", "edge-2"), publics, strict=True)
                    )
                    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers))
                    async with haproxy(binary, cfg, port):
                        await _scenario(("127.0.0.1", port), edges, admins)
            nursery.cancel_scope.cancel()


async def _scenario(
    lb: tuple[str, int], edges: list[Daemon], admins: list[tuple[str, int]]
) -> None:
    # 1. Requests are spread over both edges.
    async with trio.open_nursery() as n:
        for _ in range(6):
            n.start_soon(chat, lb)
    results = [await chat(lb) for _ in range(2)]
    assert all(r.status == 200 for r in results), results
    # Round robin: each edge served half of the 8 (each logs its own).
    await wait_served(edges[0], 4)
    await wait_served(edges[1], 4)

    # 2. Requests in flight on both edges; edge-1 is SIGKILLed mid-way.
    answers: list[Response] = []

    async def call() -> None:
        answers.append(await chat(lb, WORDS))

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(call)
        while True:  # every request reached an edge and runs there
            counts = [await in_flight(a) for a in admins]
            if sum(counts) == 8:
                break
            await trio.sleep(0.02)
        assert counts[0] > 0 and counts[1] > 0, counts
        edges[0].proc.send_signal(signal.SIGKILL)

    failed = [r for r in answers if r.status != 200 or r.truncated]
    assert len(failed) == counts[0], (counts, [r.status for r in answers])

    # 3. Every later request succeeds, through edge-2.
    await wait_served(edges[1], 4 + counts[1])
    before = served(edges[1])
    later = [await chat(lb) for _ in range(10)]
    assert [r.status for r in later] == [200] * 10
    await wait_served(edges[1], before + 10)


def _edge_cfg(tmp_path: Path, edge_id: str) -> Path:
    """Edge ``edge_id``: nodes node-1 and node-2 (one echo provider each, 16 slots, words
    DELAY_MS apart) behind model ``echo``; heartbeats 1/3 s, a 5 s drain."""
    verifier = node_verifier(NODE_TOKEN)
    nodes = [
        {
            "id": f"node-{n}",
            "token_verifier": verifier,
            "providers": [
                {
                    "id": f"echo-{n}",
                    "type": "echo",
                    "models": ["echo"],
                    "capacity": 16,
                    "delay_ms": DELAY_MS,
                }
            ],
        }
        for n in (1, 2)
    ]
    path = tmp_path / f"{edge_id}.yaml"
    path.write_text(
        edge_yaml(
            edge_id=edge_id,
            edge={"heartbeat_interval": 1, "heartbeat_timeout": 3, "drain_timeout": 5},
            provider_pool={"max_queue": 64, "queue_timeout": 30},
            models=[model("echo", {"echo-1": "echo", "echo-2": "echo"})],
            nodes=nodes,
        )
    )
    return path


def _node_cfg(tmp_path: Path, node_id: str, wires: list[str]) -> Path:
    path = tmp_path / f"{node_id}.yaml"
    path.write_text(NODE_YAML.format(node_id=node_id, edges=", ".join(wires)))
    return path
