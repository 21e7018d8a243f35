"""The edge's drain, end to end: SIGTERM starts it at once even behind a SIGHUP refresh that
waits for a silent node; a request whose body was still arriving at the drain cut is cut too;
``GET /healthz`` answers 503 ``shutting_down`` (and closes) once the edge drains, so a load
balancer takes the instance out."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
from pathlib import Path

import h11
import pytest
import trio
import trio.testing

from iopd.config.load import load_edge_config
from iopd.edge.daemon import EdgeHandle, run_edge
from iopd.edge.openai.app import OpenAIApp
from tests.support.configs import echo_provider, echo_yaml, edge_yaml, node, one_slot_yaml
from tests.support.gateway import node_token, read_response, running_gateway, wait_until
from tests.support.wire_peers import FakeNode
from wire.messages import NodeConfig


def _signal_edge_yaml(capacity: int) -> str:
    return edge_yaml(edge_id="edge-sig", nodes=[node(providers=[echo_provider(capacity=capacity)])])


async def test_sigterm_during_a_sighup_refresh_drains_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM starts the drain at once, even while a SIGHUP refresh is still
    waiting for a silent node's config ack (up to NODE_PUSH_TIMEOUT).

    The signal loop used to await the refresh inline, so every later signal
    (the drain, and the "second signal exits at once") waited behind it.
    """
    path = tmp_path / "edge.yaml"
    path.write_text(_signal_edge_yaml(2))
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            handle: EdgeHandle = await nursery.start(
                functools.partial(run_edge, load_edge_config(path), str(path), handle_signals=True)
            )
            rt = handle.runtime
            server = handle.openai_server
            assert server is not None
            host, port = handle.wire
            async with FakeNode.connect(
                host, port, node_id="node-a", token=node_token("node-a")
            ) as fake:
                await wait_until(lambda: rt.hub.connected_since("node-a") is not None)
                fake._ack_config = False  # from now on, config pushes go unanswered
                path.write_text(_signal_edge_yaml(3))  # a live change for node-a
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_until(
                    lambda: any(
                        isinstance(m, NodeConfig) and m.version == 2 for m in fake.received
                    )
                )
                assert rt._refresh_lock.locked()  # the push waits for an ack
                os.kill(os.getpid(), signal.SIGTERM)
                await wait_until(lambda: server.closing)
        events = [
            r.getMessage().split()[0]
            for r in caplog.records
            if r.getMessage().startswith(("event=drain_started", "event=node_config_push"))
        ]
        # The drain began while the push still waited; the push ended with the node.
        assert events == ["event=drain_started", "event=node_config_push"], events


async def test_a_request_that_starts_after_the_drain_cut_is_cut_too() -> None:
    """After drain_timeout the rest is cancelled with a terminal error.
    A request whose body was still arriving at the cut starts its handler after
    ``cut_all()``; it used to run uncut until the node sessions were closed
    under it (502 node_dispatch_error after the whole grace), not 503."""
    yaml = echo_yaml(delay_ms=200).replace(
        "  heartbeat_timeout: 3\n", "  heartbeat_timeout: 3\n  drain_timeout: 0.2\n"
    )
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            app = gw.handle.openai_server.handler if gw.handle.openai_server else None
            assert isinstance(app, OpenAIApp)
            text = " ".join(f"w{i}" for i in range(100))  # 20 s of echo
            body = json.dumps(
                {"model": "echo", "messages": [{"role": "user", "content": text}]}
            ).encode()
            conn = h11.Connection(h11.CLIENT)
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                head = h11.Request(
                    method="POST",
                    target="/v1/chat/completions",
                    headers=[("host", "x"), ("content-length", str(len(body)))],
                )
                await stream.send_all(conn.send(head) + conn.send(h11.Data(data=body[:10])))
                await wait_until(lambda: gw.handle.openai_server.in_flight == 1)  # type: ignore[union-attr]
                gw.handle.drain()
                await wait_until(lambda: app._cut)
                await stream.send_all(
                    conn.send(h11.Data(data=body[10:])) + conn.send(h11.EndOfMessage())
                )
                assert (await read_response(stream, conn)).status == 503


async def test_healthz_answers_503_and_closes_once_the_edge_drains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(120):
        async with running_gateway(one_slot_yaml()) as gw:
            server = gw.handle.openai_server
            assert server is not None
            stream = await trio.open_tcp_stream(*gw.host_port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                probe = h11.Request(method="GET", target="/healthz", headers=[("host", "edge")])
                await stream.send_all(conn.send(probe) + conn.send(h11.EndOfMessage()))
                first = await read_response(stream, conn)
                assert first.status == 200 and first.header("connection") != "close"

                # A second probe on the same keep-alive connection is under way
                # (its head half sent) when the drain begins.
                conn.start_next_cycle()
                head = conn.send(probe) + conn.send(h11.EndOfMessage())
                await stream.send_all(head[:10])
                await wait_until(lambda: server.in_flight == 1)
                gw.handle.drain()
                await wait_until(lambda: server.closing)
                await stream.send_all(head[10:])

                second = await read_response(stream, conn)
                assert second.status == 503, second.body
                err = second.json()["error"]
                assert (err["type"], err["code"]) == ("server_error", "shutting_down")
                assert second.header("connection") == "close"
                assert await stream.receive_some(1024) == b""  # and the edge hung up
