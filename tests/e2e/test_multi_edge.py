"""Several edges, one node dialing them all (``node.edges``): real edges, a real node, loopback.

Each edge holds its own ``token_verifier`` of the node's token (its own
salt).  What must hold: every edge serves through the node; when one edge's
link closes mid-stream the node cancels that edge's streams at once (the
model server sees its request aborted) while the other edge's stream
completes untouched.  The node is the authority for its providers' slots:
load spread over both edges never runs a provider past its
``capacity``, and the slots of an edge that is lost go to the other edge's
waiters.
"""

from __future__ import annotations

import json

import h11
import trio

from iopd.edge.nodes.hub import NodeHub
from tests.support.configs import HEARTBEAT, gateway_yaml, node_entry, provider_entry
from tests.support.gateway import EdgeFleet, http_request, node_token, running_edges, wait_until
from tests.support.mock_providers import MockOpenAIServer
from tests.support.wire_peers import TEST_ITERATIONS
from wire import scram

WORDS = 40


def edge_yaml(edge_id: str, base_url: str, capacity: int = 4) -> str:
    verifier = scram.Verifier.create(node_token("node-a"), iterations=TEST_ITERATIONS).encode()
    local = provider_entry(
        "local-1", "openai", base_url=base_url, models=["served"], capacity=capacity
    )
    return gateway_yaml(
        edge_id=edge_id,
        edge_extra=HEARTBEAT,
        models="  - id: m\n    providers: {local-1: served}",
        nodes=node_entry("node-a", local, verifier=verifier),
    )


def chat(stream: bool) -> dict[str, object]:
    return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def _fleet_with_mock(
    nursery: trio.Nursery, capacity: int = 4
) -> tuple[MockOpenAIServer, list[str]]:
    mock = MockOpenAIServer()
    await nursery.start(mock.serve)
    return mock, [
        edge_yaml("edge-1", mock.base_url, capacity),
        edge_yaml("edge-2", mock.base_url, capacity),
    ]


async def test_a_node_with_two_edges_serves_both() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            mock, yamls = await _fleet_with_mock(nursery)
            async with running_edges(yamls, nodes=["node-a"]) as fleet:
                links = fleet.node_handles["node-a"].sessions.links
                assert [link.edge for link in links] == fleet.wire_addresses()
                assert all(link.connected for link in links)
                for gw in fleet.edges:
                    resp = await http_request(
                        gw.host_port, "POST", "/v1/chat/completions", body=chat(False)
                    )
                    assert resp.status == 200, resp.body
                    assert resp.json()["choices"][0]["message"]["content"] == mock.reply_text
                assert len(mock.requests) >= 2
            nursery.cancel_scope.cancel()


def _edge_session_channel(fleet: EdgeFleet, i: int) -> object:
    hub: NodeHub = fleet.edges[i].runtime.hub
    session = hub.session("node-a")
    assert session is not None
    return session._channel  # the edge's end of its link with the node


async def test_an_edge_link_lost_mid_stream_cancels_only_that_edges_streams() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mock, yamls = await _fleet_with_mock(nursery)
            mock.reply_text = " ".join(f"w{i}" for i in range(WORDS))
            mock.chunk_delay = 0.05  # about 2 s of streaming
            async with running_edges(yamls, nodes=["node-a"]) as fleet:
                executor = fleet.node_handles["node-a"].executor
                results: dict[int, object] = {}

                async def call(i: int) -> None:
                    try:
                        results[i] = await http_request(
                            fleet.edges[i].host_port,
                            "POST",
                            "/v1/chat/completions",
                            body=chat(True),
                        )
                    except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError) as exc:
                        results[i] = exc

                async with trio.open_nursery() as callers:
                    callers.start_soon(call, 0)
                    callers.start_soon(call, 1)
                    await wait_until(lambda: executor.active_streams == 2)
                    await wait_until(lambda: len(mock.requests) >= 2)
                    # Edge 1's end of the link goes away, as when its process dies.
                    channel = _edge_session_channel(fleet, 0)
                    closed_at = trio.current_time()
                    await trio.aclose_forcefully(channel.stream)  # type: ignore[attr-defined]
                    # The node cancels edge 1's stream: its model-server request is aborted
                    await mock.wait_client_close(1)
                    aborted_after = mock.client_closed_at[0] - closed_at
                    print(f"edge link closed -> provider request aborted: {aborted_after:.3f} s")
                    await wait_until(lambda: executor.active_streams == 1)
                    link2 = fleet.node_handles["node-a"].sessions.links[1]
                    assert link2.connected  # the other session is untouched
                # ... while edge 2's stream ran to its end.
                done = results[1]
                assert getattr(done, "status", None) == 200, done
                body = done.body.decode()  # type: ignore[attr-defined]
                events = [
                    json.loads(ln[6:]) for ln in body.splitlines() if ln.startswith("data: {")
                ]
                texts = [
                    e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
                ]
                assert "".join(texts).split() == mock.reply_text.split()
                assert body.rstrip().endswith("data: [DONE]")
                assert mock.client_closes == 1  # only edge 1's request was aborted
                # The node dials edge 1 again and serves it.
                await wait_until(
                    lambda: fleet.edges[0].runtime.hub.connected_since("node-a") is not None
                )
            nursery.cancel_scope.cancel()


async def test_load_over_two_edges_never_runs_a_provider_past_its_capacity() -> None:
    """Capacity 2, 12 streaming callers split over both edges: every call
    succeeds and the model server never sees more than 2 at once (each edge
    alone would have admitted 2: 4 without the node's admission)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mock, yamls = await _fleet_with_mock(nursery, capacity=2)
            mock.reply_text = "one two three four five"
            mock.chunk_delay = 0.02
            async with running_edges(yamls, nodes=["node-a"]) as fleet:
                statuses: list[int] = []

                async def call(i: int) -> None:
                    resp = await http_request(
                        fleet.edges[i % 2].host_port, "POST", "/v1/chat/completions", body=chat(True)
                    )
                    assert resp.body.decode().rstrip().endswith("data: [DONE]"), resp.body
                    statuses.append(resp.status)

                async with trio.open_nursery() as callers:
                    for i in range(12):
                        callers.start_soon(call, i)
                assert statuses == [200] * 12
                assert mock.peak_in_flight == 2, mock.peak_in_flight
                print(f"12 callers over 2 edges, capacity 2: peak {mock.peak_in_flight}")
                slots = fleet.node_handles["node-a"].sessions.slots
                await wait_until(lambda: slots.totals("local-1") == (0, 0))  # nothing leaked
                for gw in fleet.edges:
                    assert gw.runtime.pool.scheduler.active_grants == frozenset()
            nursery.cancel_scope.cancel()


async def test_an_edge_lost_frees_its_node_slots_for_the_other_edges_waiters() -> None:
    """Capacity 1: edge 1 streams, edge 2's caller waits for the slot; edge 1's
    link closes abruptly (as when its process is killed) and edge 2's caller
    gets the slot the node freed, and succeeds."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mock, yamls = await _fleet_with_mock(nursery, capacity=1)
            mock.reply_text = " ".join(f"w{i}" for i in range(WORDS))
            mock.chunk_delay = 0.05  # about 2 s of streaming for edge 1's call
            async with running_edges(yamls, nodes=["node-a"]) as fleet:
                slots = fleet.node_handles["node-a"].sessions.slots
                results: dict[int, object] = {}

                async def call(i: int) -> None:
                    try:
                        results[i] = await http_request(
                            fleet.edges[i].host_port, "POST", "/v1/chat/completions", body=chat(True)
                        )
                    except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError) as exc:
                        results[i] = exc

                async with trio.open_nursery() as callers:
                    callers.start_soon(call, 0)
                    await wait_until(lambda: mock.in_flight == 1)
                    callers.start_soon(call, 1)
                    pool2 = fleet.edges[1].runtime.pool
                    await wait_until(lambda: pool2.queue_depth == 1)  # waits: the node is full
                    channel = _edge_session_channel(fleet, 0)
                    closed_at = trio.current_time()
                    await trio.aclose_forcefully(channel.stream)  # type: ignore[attr-defined]
                    await mock.wait_client_close(1)  # edge 1's stream was cancelled
                    await wait_until(lambda: sum(r.method == "POST" for r in mock.requests) == 2)
                    print(
                        "edge link closed -> the other edge's waiter at the provider: "
                        f"{trio.current_time() - closed_at:.3f} s"
                    )
                assert getattr(results[1], "status", None) == 200, results[1]
                assert mock.peak_in_flight == 1
                assert sum(r.method == "POST" for r in mock.requests) == 2
                await wait_until(lambda: slots.totals("local-1") == (0, 0))
            nursery.cancel_scope.cancel()
