"""An edge lost mid-stream, with real processes.

Two ``iopd edge`` processes and one ``iopd node`` process dialing both
(``node.edges``); a stream in flight through each edge, each to its own mock
model server in this process (edge 1's callers ask model ``a``, served by
mock A; edge 2's ask ``b``, mock B), so a connection closed at a mock tells
which edge's stream the node cancelled.  Edge 1 is then lost:

* SIGKILLed: the kernel closes its link, the node sees EOF and cancels
  edge 1's stream at once;
* SIGSTOPped: the link stays open but silent; the node's heartbeat watchdog
  must cancel edge 1's stream within ``heartbeat_timeout``.

Either way edge 2's stream completes with every chunk and ``[DONE]``.

Real clock (subprocesses); every wait is bounded.  The one timed bound is
"the mock sees edge 1's request closed within ``heartbeat_timeout`` +
``MARGIN``" after the signal: the node needs at most ``heartbeat_timeout``
to declare a silent edge lost, and ``MARGIN`` (4 s, four times the timeout)
absorbs a loaded 2-core machine descheduling the node and the test for a
while.  Without a cancel the mock's stream would run for ``A_SECONDS``
(long past that bound), and with a stopped edge the node would stall on
flow-control credit forever, so the bound still tells the two apart.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from tests.support.daemons import (
    NODE_TOKEN,
    Daemon,
    Response,
    chat_body,
    host_port,
    http_request,
    node_verifier,
    run_daemon,
    sse_payloads,
    streamed_text,
)
from tests.support.mock_providers import MockOpenAIServer

GUARD = 60.0
HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.0
MARGIN = 4.0  # see the module docstring
CHUNK_DELAY = 0.05
A_WORDS = 400  # mock A: 20 s of streaming, far beyond the bound
B_WORDS = 80  # mock B: 4 s, so edge 2's stream spans edge 1's loss
A_SECONDS = A_WORDS * CHUNK_DELAY

EDGE_YAML = """\
edge:
  id: {edge_id}
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  heartbeat_interval: {interval}
  heartbeat_timeout: {timeout}
openai:
  listen: 127.0.0.1:0
models:
  - id: a
    providers: {{prov-a: served}}
  - id: b
    providers: {{prov-b: served}}
nodes:
  - id: node-1
    token_verifier: "{node_verifier}"
    providers:
      - {{id: prov-a, type: openai, base_url: "{url_a}", models: [served], capacity: 4}}
      - {{id: prov-b, type: openai, base_url: "{url_b}", models: [served], capacity: 4}}
"""

NODE_YAML = """\
node:
  id: node-1
  edges: [{edges}]
  token: ${{IOP_NODE_TOKEN}}
  reconnect_initial_backoff: 0.1
  reconnect_max_backoff: 1
"""


@dataclass
class Fleet:
    edges: list[Daemon]
    publics: list[tuple[str, int]]
    wires: list[str]
    node: Daemon
    mock_a: MockOpenAIServer
    mock_b: MockOpenAIServer


def _mock(words: int) -> MockOpenAIServer:
    mock = MockOpenAIServer()
    mock.reply_text = " ".join(f"w{i}" for i in range(words))
    mock.chunk_delay = CHUNK_DELAY
    return mock


@asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    """Mocks A and B, edges 1 and 2, the node connected to both."""
    async with trio.open_nursery() as nursery:
        mock_a = await nursery.start(_mock(A_WORDS).serve)
        mock_b = await nursery.start(_mock(B_WORDS).serve)
        cfgs = []
        for edge_id in ("edge-1", "edge-2"):
            path = tmp_path / f"{edge_id}.yaml"
            path.write_text(
                EDGE_YAML.format(
                    edge_id=edge_id,
                    interval=HEARTBEAT_INTERVAL,
                    timeout=HEARTBEAT_TIMEOUT,
                    node_verifier=node_verifier(NODE_TOKEN),
                    url_a=mock_a.base_url,
                    url_b=mock_b.base_url,
                )
            )
            cfgs.append(path)
        async with (
            run_daemon(nursery, "edge-1", "edge", cfgs[0]) as e1,
            run_daemon(nursery, "edge-2", "edge", cfgs[1]) as e2,
        ):
            started = [await e.wait_event("edge_started") for e in (e1, e2)]
            node_cfg = tmp_path / "node.yaml"
            node_cfg.write_text(NODE_YAML.format(edges=", ".join(s["wire"] for s in started)))
            async with run_daemon(nursery, "node-1", "node", node_cfg) as node:
                for edge in (e1, e2):
                    await edge.wait_for(lambda ln: "event=node_connected node=node-1" in ln)
                try:
                    yield Fleet(
                        edges=[e1, e2],
                        publics=[host_port(s["openai"]) for s in started],
                        wires=[s["wire"] for s in started],
                        node=node,
                        mock_a=mock_a,
                        mock_b=mock_b,
                    )
                finally:
                    for edge in (e1, e2):  # a stopped edge must take its SIGKILL
                        if edge.proc.returncode is None:
                            edge.proc.send_signal(signal.SIGCONT)
        nursery.cancel_scope.cancel()


async def _stream(
    addr: tuple[str, int],
    model: str,
    out: dict[str, Response | BaseException],
    key: str,
    first: trio.Event,
) -> None:
    def seen(piece: bytes) -> None:
        if b"data: " in piece:
            first.set()

    try:
        out[key] = await http_request(
            addr,
            "POST",
            "/v1/chat/completions",
            chat_body("hi", stream=True, model=model),
            on_data=seen,
        )
    except (OSError, trio.BrokenResourceError, AssertionError) as exc:
        out[key] = exc  # edge 1's caller: its connection dies with the edge


async def _request_closed(mock: MockOpenAIServer) -> None:
    """Until ``mock``'s streaming request ended with its connection closed by
    the node (mid-stream: the reply runs for ``A_SECONDS``).  Its health
    probes' connections do not count."""
    closes = mock.client_closes
    while mock.in_flight:
        await mock.wait_connections_ended(mock.connections_ended + 1)
    assert mock.client_closes > closes


async def _lose_edge_1_mid_stream(f: Fleet, sig: signal.Signals) -> None:
    """Both streams running, ``sig`` to edge 1: mock A must see its request
    closed by the node within the bound (printed: how long after the signal),
    and edge 2's stream must arrive whole."""
    results: dict[str, Response | BaseException] = {}
    first_a, first_b = trio.Event(), trio.Event()
    async with trio.open_nursery() as callers:
        callers.start_soon(_stream, f.publics[0], "a", results, "a", first_a)
        callers.start_soon(_stream, f.publics[1], "b", results, "b", first_b)
        await first_a.wait()
        await first_b.wait()
        assert f.mock_a.in_flight == 1 and f.mock_b.in_flight == 1
        b_closes = f.mock_b.client_closes
        f.edges[0].proc.send_signal(sig)
        lost_at = trio.current_time()
        with trio.fail_after(HEARTBEAT_TIMEOUT + MARGIN):
            await _request_closed(f.mock_a)
        aborted_after = trio.current_time() - lost_at
        if sig == signal.SIGSTOP:
            # A stopped edge's caller hangs until the edge resumes: not ours to wait on.
            f.edges[0].proc.send_signal(signal.SIGKILL)
    # The node says why it cancelled: the link closed under a killed edge (EOF,
    # or a reset when the edge died with bytes unread), silence from a stopped one.
    lost = await f.node.wait_event("edge_link_lost")
    assert lost["edge"] == f.wires[0], lost
    expected = {"heartbeat"} if sig == signal.SIGSTOP else {"eof", "broken"}
    assert lost["kind"] in expected, lost
    b = results["b"]
    assert isinstance(b, Response), b
    assert b.status == 200 and not b.truncated
    payloads = sse_payloads(b.body)
    assert payloads[-1] == "[DONE]"
    assert streamed_text(payloads) == f.mock_b.reply_text  # every chunk
    assert f.mock_b.client_closes == b_closes  # (health probes may close theirs earlier)
    a = results["a"]
    assert not (isinstance(a, Response) and a.status == 200 and not a.truncated), a
    print(f"{sig.name}: mock A's request closed {aborted_after:.3f} s after the signal")


async def test_an_edge_sigkilled_mid_stream_is_cancelled_at_the_provider(tmp_path: Path) -> None:
    with trio.fail_after(GUARD):
        async with fleet(tmp_path) as f:
            await _lose_edge_1_mid_stream(f, signal.SIGKILL)


async def test_an_edge_stopped_mid_stream_is_cancelled_within_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    with trio.fail_after(GUARD):
        async with fleet(tmp_path) as f:
            await _lose_edge_1_mid_stream(f, signal.SIGSTOP)
