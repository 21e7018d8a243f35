"""Review findings on the node and the wire: each test pins one defect that was fixed."""

from __future__ import annotations

import functools
import json
import socket
import struct
import sys
from typing import Any

import pytest
import trio
import trio.testing

from iopd.http.client import ProviderHTTPClient
from iopd.node.adapters.base import CollectedRunOutput
from iopd.node.adapters.cli import CliAdapter
from iopd.node.adapters.openai import OpenAIAdapter
from iopd.node.run import NodeHandle, run_node
from iopd.node.usage_extract import SseUsageScanner
from tests.support.configs import echo_entry, gateway_yaml, node_entry
from tests.support.gateway import http_request, running_gateway, wait_until
from tests.support.hubs import node_with_session, run_req, running_hub
from tests.support.mock_providers import MockOpenAIServer, MockReply
from tests.support.node_parts import echo_config, node_cfg
from tests.support.streams import read_head
from tests.support.wire_peers import FakeEdge, FakeEdgeSession
from wire.messages import Cancel, ProviderSpec, RunEvent, RunRequest


async def _collect(session: FakeEdgeSession, stream_id: int) -> list[Any]:
    msgs: list[Any] = []
    while True:
        msg = await session.receive(RunEvent)
        if msg.stream_id == stream_id:
            msgs.append(msg)
            if msg.kind in ("complete", "error"):
                return msgs


async def test_cancel_arriving_with_its_request_stops_the_run(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A caller that leaves at once: the edge's RunRequest and Cancel reach the
    # node in one read.  The link used to hand the Cancel to the executor
    # before the stream's task had registered it, so the Cancel was lost and
    # the run went on to the end (the provider kept working for nobody).
    async with FakeEdge.in_memory(node_config=echo_config(delay_ms=1000, capacity=1)) as edge:
        monkeypatch.setattr("iopd.node.link.dial", edge.dial)
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(run_node, node_cfg(edge)))
                session = await edge.accept()
                req = RunRequest(
                    stream_id=session.next_stream_id(),
                    provider_id="echo",
                    adapter="echo",
                    target="echo",
                    messages=[{"role": "user", "content": " ".join(["w"] * 50)}],
                )
                session.channel.queue(req)  # leaves in the same write as the Cancel
                await session.send(Cancel(stream_id=req.stream_id, reason="caller left"))
                start = trio.current_time()
                msgs = await _collect(session, req.stream_id)
                assert msgs[-1].kind == "error" and msgs[-1].code == "cancelled"
                assert not any(m.kind == "text" for m in msgs)
                assert trio.current_time() - start < 5.0
                nursery.cancel_scope.cancel()


async def test_reused_connection_reset_before_any_response_is_retried() -> None:
    # The keep-alive race: the provider closes an idle connection just as the
    # client reuses it, and the kernel answers the request with a RST.  A
    # clean EOF in that spot was retried on a fresh connection, a reset was
    # not: the run failed with "connection lost" (a 502 to the caller).
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    connections = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        first_connection = connections == 1
        try:
            await read_head(stream)
            await stream.send_all(ok)
            if first_connection:
                await read_head(stream)  # the reused request: answer with a reset
                stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                stream.socket.close()
                return
            await read_head(stream)
        finally:
            await trio.aclose_forcefully(stream)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            assert (await client.request("POST", "/v1/chat/completions", body=b"{}")).status == 200
            assert client.idle_connections == 1
            resp = await client.request("POST", "/v1/chat/completions", body=b"{}")
            assert resp.status == 200
            assert client.connections_opened == 2
            await client.aclose()
            nursery.cancel_scope.cancel()


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


# vLLM between renaming ``reasoning_content`` to ``reasoning`` and dropping the
# old name sent both fields, with the same text, in every reasoning delta.
_BOTH_REASONING_FIELDS = [
    b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"think","reasoning":"think"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"answer"},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


async def test_reasoning_sent_under_both_field_names_is_relayed_once() -> None:
    # The normalized path emitted the reasoning delta once per field name (the
    # caller saw every thought twice) and the passthrough usage scanner counted
    # its characters twice (doubling the estimated reasoning tokens).
    scanner = SseUsageScanner()
    for chunk in _BOTH_REASONING_FIELDS:
        scanner.feed(chunk)
    scanner.finish()
    assert scanner.reasoning_chars == len("think")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            mock = await nursery.start(MockOpenAIServer().serve)
            mock.handler = lambda req: MockReply(
                headers=[("content-type", "text/event-stream")], chunks=_BOTH_REASONING_FIELDS
            )
            adapter = OpenAIAdapter(ProviderSpec(id="vllm", type="openai", base_url=mock.base_url))
            out = CollectedRunOutput()
            req = RunRequest(stream_id=1, provider_id="vllm", adapter="openai", target="m")
            await adapter.run(req, out)
            assert out.events == [("reasoning", "think"), ("text", "answer")]
            await adapter.aclose()
            nursery.cancel_scope.cancel()


async def test_a_stream_already_complete_survives_the_node_hanging_up() -> None:
    # A draining node sends its last frames and the terminal, then exits.  If
    # the edge's consumer had not read them all yet (a slow caller on a
    # stream), the disconnect failed the finished stream too: the caller lost
    # the tail of a run that had completed.  Only streams still waiting for
    # their terminal fail when the session ends.
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req()) as replies:
                    req = await node.receive(RunRequest)
                    for msg in (
                        RunEvent(stream_id=req.stream_id, kind="text", text="x"),
                        RunEvent(stream_id=req.stream_id, kind="complete"),
                    ):
                        await node.send(msg)
                    await wait_until(lambda: replies.buffered() == 2)  # type: ignore[attr-defined]
                    await node.aclose()
                    await wait_until(lambda: not session.alive)
                    kinds = [m.kind async for m in replies]  # type: ignore[union-attr]
                assert kinds == ["text", "complete"]


async def test_cli_answer_ends_when_the_command_exits_though_a_child_holds_stdout() -> None:
    # A CLI agent that leaves a helper running in the background (it inherits
    # stdout) answered, exited 0 - and the run waited for stdout's EOF until
    # read_timeout, then failed with provider_timeout.  The command's exit now
    # ends the answer (after what is already in the pipe); the helper is
    # killed with the process group, as on any other exit.
    script = "import subprocess, sys; subprocess.Popen(['sleep', '30']); print('hello')"
    adapter = CliAdapter(
        ProviderSpec(
            id="agent",
            type="cli",
            command=[sys.executable, "-c", script],
            read_timeout=20,
            kill_grace=1,
        )
    )
    req = RunRequest(
        stream_id=1,
        provider_id="agent",
        adapter="cli",
        target="agent",
        messages=[{"role": "user", "content": "hi"}],
    )
    out = CollectedRunOutput()
    with trio.fail_after(10):
        await adapter.run(req, out)
    assert out.joined_text == "hello\n"
    assert out.finish_reason == "stop"
