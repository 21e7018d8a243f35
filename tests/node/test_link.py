"""NodeLink against a scripted edge: handshake, streams, credit, cancel, reconnect."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

import iopd.node.edges.link as link_mod
from iopd.config.schema import NodeSection
from iopd.node.edges.link import NodeLink, parse_host_port
from tests.support.node_parts import ScriptedHandler
from tests.support.wire_peers import FakeEdge, FakeEdgeSession, wait_until
from wire.messages import (
    Cancel,
    Credit,
    Hello,
    NodeConfig,
    ProviderHealth,
    ProviderSpec,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
)

TOKEN = "node-token-secret"


def node_cfg(edge: str, **kw: float) -> NodeSection:
    return NodeSection(id="node-a", edge=edge, token=TOKEN, **kw)  # type: ignore[arg-type]


def run_req(sid: int, n: int = 0, window: int = 64, **meta: str) -> RunRequest:
    return RunRequest(
        stream_id=sid,
        provider_id="echo-1",
        adapter="echo",
        target="m",
        metadata={"n": str(n), **meta},
        window=window,
    )


@asynccontextmanager
async def linked(
    edge: FakeEdge, handler: ScriptedHandler, **cfg: float
) -> AsyncIterator[tuple[NodeLink, FakeEdgeSession]]:
    link = NodeLink(node_cfg(edge.address, **cfg), handler, software_version="9.9", rng=lambda: 1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        session = await edge.accept()
        yield link, session
        nursery.cancel_scope.cancel()


def test_parse_host_port() -> None:
    assert parse_host_port("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert parse_host_port("[::1]:7070") == ("::1", 7070)
    with pytest.raises(ValueError):
        parse_host_port("nohost")


async def test_handshake_config_and_status() -> None:
    handler = ScriptedHandler()
    cfg = NodeConfig(stream_id=1, version=3, providers=[ProviderSpec(id="echo-1", type="echo")])
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN, node_config=cfg) as edge:
            async with linked(edge, handler) as (link, session):
                hello = session.hello
                assert isinstance(hello, Hello)
                assert (hello.node_id, hello.token, hello.software_version) == (
                    "node-a",
                    "",  # the token never crosses the wire
                    "9.9",
                )
                assert session.config_ack is not None and session.config_ack.version == 3
                assert handler.configs == [cfg]
                status = await session.receive(ProviderStatus)
                assert status.providers[0].health == "healthy"
                await link.wait_connected()
                assert link.connected and link.sessions == 1
                link.send_status(ProviderStatus(providers=[ProviderHealth(provider_id="x")]))
                status2 = await session.receive(ProviderStatus)
                assert status2.providers[0].provider_id == "x"


async def test_config_failure_is_acked_not_ok() -> None:
    handler = ScriptedHandler()
    handler.fail_config = True
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN) as edge:
            async with linked(edge, handler) as (_link, session):
                assert session.config_ack is not None
                assert not session.config_ack.ok
                assert "bad provider set" in session.config_ack.error


async def test_run_request_is_served() -> None:
    handler = ScriptedHandler()
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN) as edge:
            async with linked(edge, handler) as (_link, session):
                sid = session.next_stream_id()
                await session.send(run_req(sid, n=3))
                events = [await session.receive(RunEvent) for _ in range(4)]
                assert [e.kind for e in events] == ["text", "text", "text", "complete"]
                assert all(e.stream_id == sid for e in events)


async def test_cancel_reaches_handler() -> None:
    handler = ScriptedHandler()
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN) as edge:
            async with linked(edge, handler) as (_link, session):
                sid = session.next_stream_id()
                await session.send(run_req(sid, n=1, forever="1"))
                assert (await session.receive(RunEvent)).kind == "text"
                await session.send(Cancel(stream_id=sid, reason="client gone"))
                terminal = await session.receive(RunEvent)
                assert (terminal.kind, terminal.code) == ("error", "cancelled")
                assert handler.cancels == [(sid, "client gone")]


async def test_executor_without_terminal_gets_one() -> None:
    handler = ScriptedHandler()
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN) as edge:
            async with linked(edge, handler) as (_link, session):
                sid = session.next_stream_id()
                await session.send(
                    ProviderTunnelRequest(stream_id=sid, provider_id="p", method="GET", path="/")
                )
                frame = await session.receive(ProviderTunnelFrame)
                assert (frame.kind, frame.code) == ("error", "provider_error")


async def test_slow_consumer_blocks_sender_until_credit() -> None:
    handler = ScriptedHandler()
    window = 3
    with trio.fail_after(10):
        async with FakeEdge.in_memory(token=TOKEN) as edge, _patched_dial(edge):
            async with linked(edge, handler) as (_link, session):
                sid = session.next_stream_id()
                await session.send(run_req(sid, n=10, window=window))
                for _ in range(window):
                    assert (await session.receive(RunEvent)).kind == "text"
                await trio.testing.wait_all_tasks_blocked()
                assert handler.sent[sid] == window  # blocked on credit: memory bounded
                await session.send(Credit(stream_id=sid, frames=2))
                for _ in range(2):
                    assert (await session.receive(RunEvent)).kind == "text"
                await trio.testing.wait_all_tasks_blocked()
                assert handler.sent[sid] == window + 2
                await session.send(Credit(stream_id=sid, frames=100))
                kinds = [(await session.receive(RunEvent)).kind for _ in range(6)]
                assert kinds == ["text"] * 5 + ["complete"]


@asynccontextmanager
async def _patched_dial(edge: FakeEdge) -> AsyncIterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(link_mod, "dial", edge.dial)
        yield


async def test_reconnect_with_backoff(autojump_clock: trio.testing.MockClock) -> None:
    handler = ScriptedHandler()
    with trio.fail_after(1000):
        async with FakeEdge.in_memory(token=TOKEN) as edge, _patched_dial(edge):
            edge.down = True
            link = NodeLink(
                node_cfg("edge:7070", reconnect_initial_backoff=0.5, reconnect_max_backoff=4.0),
                handler,
                software_version="1",
                rng=lambda: 1.0,  # full jitter at its ceiling: deterministic delays
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                await wait_until(lambda: len(edge.dial_times) >= 6, poll=0.1, timeout=500)
                edge.down = False
                session = await edge.accept()
                gaps = [b - a for a, b in zip(edge.dial_times, edge.dial_times[1:], strict=False)]
                assert gaps[:6] == pytest.approx([0.5, 1.0, 2.0, 4.0, 4.0, 4.0])
                await link.wait_connected()
                # a session that got through resets the backoff
                await session.aclose()
                await link.wait_disconnected()
                lost_at = trio.current_time()
                await edge.accept()
                assert edge.dial_times[-1] - lost_at == pytest.approx(0.5)
                assert link.sessions == 2
                nursery.cancel_scope.cancel()


async def test_refused_bad_token_retries_at_max_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    handler = ScriptedHandler()
    with trio.fail_after(1000):
        async with FakeEdge.in_memory(token="the-right-one") as edge, _patched_dial(edge):
            link = NodeLink(
                node_cfg("edge:7070", reconnect_initial_backoff=0.5, reconnect_max_backoff=8.0),
                handler,
                software_version="1",
                rng=lambda: 1.0,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                await wait_until(lambda: len(edge.hellos) >= 3, poll=0.1, timeout=500)
                nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(edge.dial_times, edge.dial_times[1:], strict=False)]
    assert gaps[:2] == pytest.approx([8.0, 8.0])
    assert link.last_refused is not None and link.last_refused.code == "bad_token"
    assert not link.connected
    assert "bad_token" in caplog.text and TOKEN not in caplog.text


async def test_link_loss_cancels_runs(autojump_clock: trio.testing.MockClock) -> None:
    handler = ScriptedHandler()
    with trio.fail_after(100):
        async with FakeEdge.in_memory(token=TOKEN) as edge, _patched_dial(edge):
            async with linked(edge, handler) as (link, session):
                sid = session.next_stream_id()
                await session.send(run_req(sid, n=0, forever="1"))
                await handler.started.wait()
                assert link.connected
                await session.aclose()
                await link.wait_disconnected()
                await trio.testing.wait_all_tasks_blocked()
                assert handler.cancelled_tasks == [sid]
                link.send_status(ProviderStatus())  # no-op while disconnected
                await edge.accept()  # and it comes back


async def test_heartbeat_timeout_detects_silent_edge(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iopd.node.link")
    handler = ScriptedHandler()
    with trio.fail_after(100):
        async with (
            FakeEdge.in_memory(token=TOKEN, silent=True, heartbeat_interval=2.0, heartbeat_timeout=6.0) as edge,
            _patched_dial(edge),
        ):
            link = NodeLink(node_cfg("edge:7070"), handler, software_version="1", rng=lambda: 1.0)
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                await link.wait_connected()
                up_at = trio.current_time()
                await link.wait_disconnected()
                assert trio.current_time() - up_at == pytest.approx(6.0, abs=0.01)
                await wait_until(lambda: len(edge.dial_times) >= 2, poll=0.1, timeout=500)
                nursery.cancel_scope.cancel()
    assert "heartbeat timeout" in caplog.text


async def test_refused_other_code_uses_normal_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler = ScriptedHandler()
    refusal = Refused(reason="edge is shutting down", code="bad_handshake")
    with trio.fail_after(1000):
        async with FakeEdge.in_memory(token=TOKEN, refuse=refusal) as edge, _patched_dial(edge):
            link = NodeLink(
                node_cfg("edge:7070", reconnect_initial_backoff=1.0, reconnect_max_backoff=30.0),
                handler,
                software_version="1",
                rng=lambda: 1.0,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                await wait_until(lambda: len(edge.hellos) >= 3, poll=0.1, timeout=500)
                nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(edge.dial_times, edge.dial_times[1:], strict=False)]
    assert gaps[:2] == pytest.approx([1.0, 2.0])


async def test_shutdown_ends_the_session_with_a_clean_eof_and_no_reconnect(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopping node half-closes and reads until the edge closes: the edge
    sees EOF (not a reset that could destroy the last frames in flight), and
    the link does not dial again."""
    handler = ScriptedHandler()
    caplog.set_level(logging.INFO, logger="iopd.node.link")
    with trio.fail_after(10):
        async with FakeEdge.serve(token=TOKEN) as edge:
            async with linked(edge, handler) as (link, session):
                sid = session.next_stream_id()
                await session.send(run_req(sid, n=2))
                events = [await session.receive(RunEvent) for _ in range(3)]
                assert events[-1].kind == "complete"
                await link.shutdown()
                assert await session.wait_closed() == "peer closed the connection"
                assert not link.connected
                await trio.sleep(0.2)  # a reconnect would dial now (backoff is 0.0-ish)
                assert len(edge.hellos) == 1
                assert "event=edge_link_closed" in caplog.text
                assert "event=edge_reconnect" not in caplog.text
                await link.shutdown()  # idempotent, nothing to close
