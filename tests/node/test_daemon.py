"""The node daemon end to end: run_node + NodeLink against a FakeEdge, drain, node_main."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from iopd.cli import main as cli_main
from iopd.node.run import NodeHandle, node_main, run_node
from tests.support.configs import echo_entry, gateway_yaml, node_entry
from tests.support.gateway import http_request, running_gateway
from tests.support.mock_providers import MockOpenAIServer, MockReply
from tests.support.node_parts import echo_config, node_cfg
from tests.support.wire_peers import FakeEdge, FakeEdgeSession, wait_until
from wire.messages import (
    Cancel,
    NodeConfig,
    ProviderSpec,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    is_terminal,
)

CANARY = "sk-canary-93be7d10"


def echo_req(session: FakeEdgeSession, text: str) -> RunRequest:
    return RunRequest(
        stream_id=session.next_stream_id(),
        provider_id="echo",
        adapter="echo",
        target="echo",
        messages=[{"role": "user", "content": text}],
    )


async def collect(session: FakeEdgeSession, kind: type[Any], stream_id: int) -> list[Any]:
    msgs: list[Any] = []
    while True:
        msg = await session.receive(kind)
        if msg.stream_id != stream_id:
            continue
        msgs.append(msg)
        if is_terminal(msg):
            return msgs


async def test_node_serves_echo_over_the_wire_and_reports_status() -> None:
    with trio.fail_after(10):
        async with (
            FakeEdge.serve(node_config=echo_config()) as edge,
            trio.open_nursery() as nursery,
        ):
            handle: NodeHandle = await nursery.start(run_node, node_cfg(edge))
            session = await edge.accept()
            assert session.config_ack is not None and session.config_ack.ok
            status = await session.receive(ProviderStatus)
            assert [p.provider_id for p in status.providers] == ["echo"]
            req = echo_req(session, "hello wire world")
            await session.send(req)
            msgs = await collect(session, RunEvent, req.stream_id)
            assert [m.kind for m in msgs] == ["text", "text", "text", "usage", "complete"]
            assert "".join(m.text for m in msgs) == "hello wire world"
            # health: echo turns healthy after its first probe (reported to the edge)
            await wait_until(
                lambda: any(
                    p.health == "healthy"
                    for m in session.received
                    if isinstance(m, ProviderStatus)
                    for p in m.providers
                )
            )
            assert handle.executor.current_status().providers[0].health == "healthy"
            nursery.cancel_scope.cancel()


async def test_cancel_over_the_wire_reports_usage_and_cancelled() -> None:
    with trio.fail_after(10):
        async with (
            FakeEdge.serve(node_config=echo_config(delay_ms=20)) as edge,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(run_node, node_cfg(edge))
            session = await edge.accept()
            req = echo_req(session, " ".join(["w"] * 500))
            await session.send(req)
            first = await session.receive(RunEvent)
            assert first.kind == "text"
            await session.send(Cancel(stream_id=req.stream_id, reason="caller left"))
            msgs = [first, *await collect(session, RunEvent, req.stream_id)]
            assert msgs[-1].kind == "error" and msgs[-1].code == "cancelled"
            assert msgs[-2].kind == "usage"
            assert msgs[-2].usage.output_tokens == sum(1 for m in msgs if m.kind == "text")
            nursery.cancel_scope.cancel()


async def test_drain_lets_short_runs_finish_and_cancels_long_ones(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeEdge.in_memory(node_config=echo_config(delay_ms=1000)) as edge:
        monkeypatch.setattr("iopd.node.edges.link.dial", edge.dial)
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                handle: NodeHandle = await nursery.start(
                    functools.partial(run_node, node_cfg(edge, drain_timeout=10.0))
                )
                session = await edge.accept()
                short = echo_req(session, "a b c")  # 3 s
                long = echo_req(session, " ".join(["x"] * 100))  # 100 s
                await session.send(short)
                await session.send(long)
                await session.receive(RunEvent)
                start = trio.current_time()
                handle.request_drain()
                await trio.sleep(0.5)
                late = echo_req(session, "too late")
                await session.send(late)
                late_msgs = await collect(session, RunEvent, late.stream_id)
                assert [m.kind for m in late_msgs] == ["error"]
                short_msgs = await collect(session, RunEvent, short.stream_id)
                assert short_msgs[-1].kind == "complete"
                long_msgs = await collect(session, RunEvent, long.stream_id)
                assert long_msgs[-1].kind == "error" and long_msgs[-1].code == "cancelled"
                assert long_msgs[-2].kind == "usage"
                assert 10.0 <= trio.current_time() - start < 12.0
            # the nursery closed: run_node returned by itself after the drain


async def test_provider_credentials_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with trio.open_nursery() as outer:
        mock = await outer.start(MockOpenAIServer().serve)
        # a provider that echoes the credential it got back in its error body
        mock.handler = lambda req: MockReply(
            status=500,
            body=json.dumps({"error": f"bad key {req.header('authorization')}"}).encode(),
        )
        config = NodeConfig(
            stream_id=1,
            version=1,
            providers=[
                ProviderSpec(
                    id="up",
                    type="openai",
                    base_url=mock.base_url,
                    api_key=CANARY,
                    health_interval=0.05,
                ),
                ProviderSpec(
                    id="down",
                    type="openai",
                    base_url="http://127.0.0.1:1",
                    api_key=CANARY,
                    health_interval=0.05,
                ),
            ],
        )
        with trio.fail_after(10):
            async with FakeEdge.serve(node_config=config) as edge, trio.open_nursery() as nursery:
                await nursery.start(run_node, node_cfg(edge))
                session = await edge.accept()
                for provider in ("up", "down"):
                    run = RunRequest(
                        stream_id=session.next_stream_id(),
                        provider_id=provider,
                        adapter="openai",
                        target="m",
                        messages=[{"role": "user", "content": "hi"}],
                    )
                    await session.send(run)
                    msgs = await collect(session, RunEvent, run.stream_id)
                    # "down" was never reached: its own code (the edge may retry it).
                    code = "provider_error" if provider == "up" else "provider_unreachable"
                    assert msgs[-1].kind == "error" and msgs[-1].code == code
                    assert CANARY not in msgs[-1].message
                    if provider == "up":
                        assert "bad key Bearer ***" in msgs[-1].message
                    tunnel = ProviderTunnelRequest(
                        stream_id=session.next_stream_id(),
                        provider_id=provider,
                        method="POST",
                        path="/v1/chat/completions",
                        body=b"{}",
                    )
                    await session.send(tunnel)
                    frames = await collect(session, ProviderTunnelFrame, tunnel.stream_id)
                    if provider == "up":  # passthrough relays the provider's 500 as it is
                        assert [f.kind for f in frames] == ["whole"]  # one frame: a JSON body
                        assert frames[0].status == 500
                    else:
                        assert [f.kind for f in frames] == ["error"]
                        assert CANARY not in frames[0].message
                await wait_until(
                    lambda: (
                        {
                            p.provider_id
                            for m in session.received
                            if isinstance(m, ProviderStatus)
                            for p in m.providers
                            if p.health == "unhealthy"
                        }
                        == {"up", "down"}
                    )
                )
                nursery.cancel_scope.cancel()
        assert mock.requests and mock.requests[0].header("authorization") == f"Bearer {CANARY}"
        outer.cancel_scope.cancel()
    assert "provider_error" in caplog.text  # the failures were logged...
    assert CANARY not in caplog.text  # ...without the credential


def test_node_main_config_error_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "node.yaml"
    bad.write_text("node:\n  id: n\n  edge: 127.0.0.1:7070\n  tokn: x\n")
    assert node_main(str(bad), log_level=None) == 1
    err = capsys.readouterr().err
    assert "node.token" in err or "node.tokn" in err
    # An unreadable file is a start-up failure: one line from the CLI boundary.
    assert cli_main(["node", "--config", str(tmp_path / "missing.yaml")]) == 1
    assert capsys.readouterr().err.startswith("iopd node: cannot read config ")


async def test_node_process_drains_on_sigterm_and_exits_0(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with FakeEdge.serve(token="secret-node-token", node_config=echo_config()) as edge:
            cfg = tmp_path / "node.yaml"
            cfg.write_text(
                "node:\n"
                "  id: node-a\n"
                f"  edge: {edge.address}\n"
                "  token: ${IOP_NODE_TOKEN}\n"
                "  drain_timeout: 5\n"
                "  log_format: json\n"
            )
            env = {**os.environ, "IOP_NODE_TOKEN": "secret-node-token"}
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "iopd", "node", "--config", str(cfg)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            try:
                session = await edge.accept()
                assert session.hello.node_id == "node-a"
                req = echo_req(session, "still works")
                await session.send(req)
                assert (await collect(session, RunEvent, req.stream_id))[-1].kind == "complete"
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0
                assert proc.stdout is not None
                output = b""
                async for chunk in proc.stdout:
                    output += chunk
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    text = output.decode()
    assert "node_drain_done" in text
    assert "secret-node-token" not in text


async def test_second_signal_exits_without_waiting_for_the_drain(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with FakeEdge.serve(token="t", node_config=echo_config(delay_ms=1000)) as edge:
            cfg = tmp_path / "node.yaml"
            cfg.write_text(
                f"node:\n  id: node-a\n  edge: {edge.address}\n  token: t\n  drain_timeout: 600\n"
            )
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "iopd", "node", "--config", str(cfg)],
                stdout=subprocess.PIPE,
            )
            try:
                session = await edge.accept()
                req = echo_req(session, " ".join(["slow"] * 100))  # would take 100 s
                await session.send(req)
                await session.receive(RunEvent)
                proc.send_signal(signal.SIGTERM)
                assert proc.stdout is not None
                output = b""
                while b"node_drain_start" not in output:  # the first signal started the drain
                    output += await proc.stdout.receive_some(65536)
                assert proc.returncode is None  # draining: the run is still going
                proc.send_signal(signal.SIGINT)
                assert await proc.wait() == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


def _two_echo_nodes_yaml() -> str:
    def node(node_id: str, provider_id: str, priority: int) -> str:
        echo = echo_entry(provider_id, priority=priority, delay_ms=300, health_interval=0.05)
        return node_entry(node_id, echo)

    return gateway_yaml(
        edge_id="edge-test",
        models="  - id: echo\n    providers: {echo-a: echo, echo-b: echo}",
        nodes=node("node-a", "echo-a", 0) + node("node-b", "echo-b", 1),
    )


async def test_a_draining_node_takes_no_new_work_from_the_edge() -> None:
    # Rolling restart: node-a drains (SIGTERM) while it still finishes a run.
    # It refused every new stream with a provider_error, but the edge kept
    # picking it (it looked healthy and preferred), so callers got 502s while
    # node-b had free slots.  A draining node now reports its providers
    # unhealthy, and the edge routes around it.
    with trio.fail_after(30):
        async with running_gateway(_two_echo_nodes_yaml(), nodes=[]) as gw:
            handles: dict[str, NodeHandle] = {}
            for node_id in ("node-a", "node-b"):
                cfg = gw.node_config(node_id, drain_timeout=20.0)
                handles[node_id] = await gw.nursery.start(run_node, cfg)
            await wait_until(lambda: len(gw.runtime.hub.connected_node_ids()) == 2)
            await wait_until(
                lambda: all(
                    gw.runtime.health.get(p) is not None
                    and gw.runtime.health[p].health == "healthy"
                    for p in ("echo-a", "echo-b")
                )
            )
            statuses: list[int] = []

            async def chat(words: int) -> None:
                text = " ".join(["w"] * words)
                body = {"model": "echo", "messages": [{"role": "user", "content": text}]}
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=json.dumps(body).encode()
                )
                statuses.append(resp.status)

            async with trio.open_nursery() as requests:
                requests.start_soon(chat, 30)  # 9 s -> echo-a (tie, lower priority number)
                await wait_until(lambda: handles["node-a"].executor.active_streams == 1)
                requests.start_soon(chat, 30)  # -> echo-b (lower load)
                await wait_until(lambda: handles["node-b"].executor.active_streams == 1)
                handles["node-a"].request_drain()
                await wait_until(lambda: handles["node-a"].executor.draining)
                with trio.move_on_after(2):
                    await wait_until(lambda: gw.runtime.health["echo-a"].health == "unhealthy")
                # Loads tie again (1/4 each): priority would pick the draining echo-a.
                await chat(1)
                assert statuses == [200], statuses
                requests.cancel_scope.cancel()
