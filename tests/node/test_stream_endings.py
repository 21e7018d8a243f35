"""How a node's streams end: a Cancel that arrives with its request stops the run, a stream
already complete survives the node hanging up, a CLI answer ends when the command exits (even
if a child still holds its stdout), and a reasoning delta sent under both field names is
relayed once."""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import trio
import trio.testing

from iopd.node.adapters.base import CollectedRunOutput
from iopd.node.adapters.cli import CliAdapter
from iopd.node.adapters.openai import OpenAIAdapter
from iopd.node.run import run_node
from iopd.node.usage_extract import SseUsageScanner
from tests.support.gateway import wait_until
from tests.support.hubs import node_with_session, run_req, running_hub
from tests.support.mock_providers import MockOpenAIServer, MockReply
from tests.support.node_parts import echo_config, node_cfg
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
        monkeypatch.setattr("iopd.node.edges.link.dial", edge.dial)
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
