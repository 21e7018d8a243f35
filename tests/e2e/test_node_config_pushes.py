"""Four correctness gaps found in review, each pinned by an end-to-end test.

1. ``openai.request_timeout`` running out while a request is still *queued*
   (no provider lease yet) is a queue timeout — 503 ``queue_timeout`` with
   ``Retry-After``, counted as one — not the provider's 504.  A request that
   holds a lease when its time is up keeps the 504 ``provider_timeout``.
2. Once the edge drains, ``GET /healthz`` answers 503 ``shutting_down`` (and
   the connection closes), so a load balancer takes the instance out.
3. A node that rejects its *first* ``NodeConfig`` (its adapters could not be
   built) is not announced: the edge closes its session, logs why, and
   ``/status`` shows it disconnected.
4. A refresh whose push a node rejects (or never acknowledges) stays
   ``applied: true`` — the edge's own swap is done — but says so in the
   report's ``errors`` (never with a secret in it), and ``iopd refresh``
   exits 1.

Everything runs a real edge (``tests/support/gateway.py``) over loopback; scripted
nodes are ``FakeNode`` subclasses that answer config pushes as told.
"""

from __future__ import annotations

from pathlib import Path

import h11
import pytest
import trio
import trio.testing

from iopd.admin_client import refresh_main
from iopd.edge.nodes.node_text import safe_node_reason
from tests.support.configs import echo_provider, edge_yaml, node
from tests.support.edges import running_edge
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    metric,
    node_token,
    read_response,
    running_gateway,
    wait_until,
)
from tests.support.wire_peers import FakeNode
from wire.messages import Message, NodeConfig, NodeConfigAck, ProviderSpec

REQUEST_TIMEOUT = 5


def one_slot_yaml() -> str:
    """One echo provider with one slot; a request may wait far longer than it may run."""
    return edge_yaml(
        edge_id="edge-open",
        edge={"drain_timeout": 30},
        openai={"request_timeout": REQUEST_TIMEOUT},
        provider_pool={"max_queue": 8, "queue_timeout": 60},
        nodes=[node(providers=[echo_provider(capacity=1, delay_ms=1000)])],
    )


async def chat(gw: Gateway, content: str) -> RawResponse:
    body = {"model": "echo", "messages": [{"role": "user", "content": content}]}
    return await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body)


# --------------------------------------------- 1. request_timeout while queued


async def test_request_timeout_while_queued_is_a_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(300):
        async with running_gateway(one_slot_yaml()) as gw:
            # The test holds the only slot, so the request can only wait.
            async with gw.runtime.pool.lease("echo"):
                queued = await chat(gw, "hello")
            assert queued.status == 503, queued.body
            err = queued.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "queue_timeout")
            # It waited its whole request_timeout (< queue_timeout): that is the hint.
            assert queued.header("retry-after") == str(REQUEST_TIMEOUT)
            assert metric(gw, "iop_openai_requests_total", status="queue_timeout") == 1
            assert metric(gw, "iop_openai_requests_total", status="provider_error") == 0
            assert metric(gw, "iop_dispatch_wait_seconds_count", outcome="queue_timeout") == 1
            assert metric(gw, "iop_queue_waiters_timed_out_total") == 1
            assert gw.runtime.pool.queue_depth == 0

            # With a lease, running out of time is still the provider's 504:
            # 20 chunks at 1 s each cannot finish within 5 s.
            running = await chat(gw, "w " * 20)
            assert running.status == 504, running.body
            assert running.json()["error"]["code"] == "provider_timeout"
            assert metric(gw, "iop_openai_requests_total", status="provider_error") == 1
            assert metric(gw, "iop_openai_requests_total", status="queue_timeout") == 1
            await wait_until(lambda: gw.runtime.pool.provider_loads()["echo-1"].in_flight == 0)


# ------------------------------------------------------ 2. /healthz when draining


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


# ---------------------------------------- config pushes a node rejects or ignores


class ScriptedAckNode(FakeNode):
    """A FakeNode answering its n-th NodeConfig with ``ACKS[n]`` (the last one repeats):
    ``True`` = ok, a string = rejected with that reason, ``None`` = never answered."""

    ACKS: tuple[bool | str | None, ...] = (True,)
    pushes = 0

    def _dispatch(self, msg: Message) -> None:
        if not isinstance(msg, NodeConfig):
            super()._dispatch(msg)
            return
        answer = self.ACKS[min(self.pushes, len(self.ACKS) - 1)]
        self.pushes += 1
        self.config = msg
        self.received.append(msg)
        if answer is None:
            return
        ok = answer is True
        error = "" if ok else str(answer)
        self.channel.post(
            NodeConfigAck(stream_id=msg.stream_id, version=msg.version, ok=ok, error=error)
        )


BUILD_ERROR = "provider 'echo-2': cannot build the adapter"


class RejectsEverything(ScriptedAckNode):
    ACKS = (BUILD_ERROR,)


class RejectsLaterPushes(ScriptedAckNode):
    ACKS = (True, BUILD_ERROR)


class IgnoresLaterPushes(ScriptedAckNode):
    ACKS = (True, None)


# ------------------------------------- 3. a node that rejects its first config


async def test_node_rejecting_its_first_config_is_closed_and_not_connected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(60):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            host, port = edge.gw.handle.wire
            caplog.clear()
            async with RejectsEverything.connect(
                host, port, node_id="node-b", token=node_token("node-b")
            ) as fake:
                await fake.wait_closed()  # the edge ends the session
                assert isinstance(fake, ScriptedAckNode) and fake.pushes == 1
                assert fake.config is not None
            assert (
                "event=node_config_push node=node-b outcome=rejected "
                f"reason={BUILD_ERROR!r}" in caplog.text
            )
            assert "event=node_connected node=node-b" not in caplog.text
            assert edge.gw.runtime.hub.session("node-b") is None
            [node_b] = [n for n in (await edge.status())["nodes"] if n["id"] == "node-b"]
            assert node_b["connected"] is False and node_b["connected_since"] is None
            assert metric(edge.gw, "iop_connected_nodes") == 1  # node-a only
            # Not routable: echo-2 never takes a lease (node-a's echo-1 serves all).
            for _ in range(4):
                assert (await edge.chat("hi")).status == 200
            assert "echo-2" not in {
                pid for pid, load in edge.gw.runtime.pool.provider_loads().items() if load.in_flight
            }


# ------------------------------ 4. a refresh whose push is rejected or unanswered


async def test_refresh_reports_a_rejected_push_and_the_cli_exits_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(60):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            host, port = edge.gw.handle.wire
            async with RejectsLaterPushes.connect(
                host, port, node_id="node-b", token=node_token("node-b")
            ) as fake:
                await wait_until(lambda: edge.gw.runtime.hub.session("node-b") is not None)
                caplog.clear()
                edge.write(cap1=3, cap2=4)  # node-a (a real node) and node-b change
                doc = await edge.refresh("apply")
                assert doc["applied"] is True  # the edge's own swap stands
                assert doc["changed_nodes"] == ["node-a", "node-b"]
                assert doc["errors"] == [f"nodes.node-b: config push rejected: {BUILD_ERROR}"]
                assert isinstance(fake, ScriptedAckNode) and fake.pushes == 2
                assert fake.config is not None
                assert fake.config.version == edge.gw.runtime.snapshot.version
                assert "event=node_config_push node=node-b outcome=rejected" in caplog.text

                # `iopd refresh` prints the line and exits 1 although applied: yes.
                edge.write(cap1=3, cap2=5)
                capsys.readouterr()
                code = await trio.to_thread.run_sync(refresh_main, edge.gw.admin_url)
                out = capsys.readouterr().out
                assert code == 1
                assert "applied: yes" in out
                assert f"errors: nodes.node-b: config push rejected: {BUILD_ERROR}" in out

                # A clean apply (only node-a changes) exits 0 again.
                edge.write(cap1=4, cap2=5)
                code = await trio.to_thread.run_sync(refresh_main, edge.gw.admin_url)
                assert code == 0 and "errors: -" in capsys.readouterr().out


async def test_refresh_reports_an_unanswered_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("iopd.edge.runtime.edge_runtime.NODE_PUSH_TIMEOUT", 0.5)
    with trio.fail_after(60):
        async with running_edge(tmp_path, nodes=["node-a"]) as edge:
            host, port = edge.gw.handle.wire
            async with IgnoresLaterPushes.connect(
                host, port, node_id="node-b", token=node_token("node-b")
            ):
                await wait_until(lambda: edge.gw.runtime.hub.session("node-b") is not None)
                doc = await edge.apply(cap2=4)
                version = edge.gw.runtime.snapshot.version
                assert doc["errors"] == [
                    f"nodes.node-b: config push failed: node node-b did not acknowledge "
                    f"config version {version} within 0.5s"
                ]


def test_a_push_reason_never_carries_a_secret() -> None:
    """What a node echoes back is cleaned before it reaches a report or a log."""
    pushed = NodeConfig(
        stream_id=1,
        version=2,
        providers=[
            ProviderSpec(id="api-1", type="openai", api_key="sk-live-SECRET-1"),
            ProviderSpec(id="echo-1", type="echo"),
        ],
    )
    echoed = (
        "provider 'api-1': bad key sk-live-SECRET-1 for https://user:hunter2@api.example\n"
        "bearer edge-bearer-SECRET"
    )
    reason = safe_node_reason(echoed, pushed, known_secrets=["edge-bearer-SECRET", ""])
    for secret in ("sk-live-SECRET-1", "hunter2", "edge-bearer-SECRET"):
        assert secret not in reason
    assert "\n" not in reason and reason.startswith("provider 'api-1': bad key <redacted>")
    assert len(safe_node_reason("x" * 1000, pushed)) == 200
    assert safe_node_reason("", pushed) == "no reason given"
