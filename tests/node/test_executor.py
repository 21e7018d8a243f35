"""NodeExecutor through the NodeHandler protocol, with a list-collecting StreamSender."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from iopd.http.client import EarlyStart
from iopd.node.adapters.base import Adapter, AdapterError, RunOutput, TunnelOutput
from iopd.node.executor import NodeExecutor
from iopd.node.handler import NodeHandler
from iopd.node.registry import AdapterRegistry
from tests.support.node_parts import ListSender, run_req
from wire.messages import (
    NodeConfig,
    ProviderSpec,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)


async def make_executor(*specs: ProviderSpec) -> NodeExecutor:
    executor = NodeExecutor()
    ack = await executor.on_config(NodeConfig(stream_id=0, version=1, providers=list(specs)))
    assert ack.ok, ack.error
    return executor


class ScriptedAdapter(Adapter):
    """Emits a little output, then fails / crashes / blocks as told."""

    def __init__(self, spec: ProviderSpec, behaviour: str) -> None:
        super().__init__(spec)
        self.behaviour = behaviour

    async def run(self, req: RunRequest, out: RunOutput) -> None:
        await out.text("partial")
        out.usage.input_tokens = 5
        if self.behaviour == "adapter_error":
            raise AdapterError("provider_timeout", "too slow")
        if self.behaviour == "crash":
            raise RuntimeError("bug with secret sk-canary")
        if self.behaviour == "group":
            async with trio.open_nursery():
                raise AdapterError("provider_error", "inside a nursery")
        await trio.sleep_forever()

    async def tunnel(
        self, req: ProviderTunnelRequest, out: TunnelOutput, early: EarlyStart | None = None
    ) -> None:
        await out.head(200, [("content-type", "text/event-stream")])
        await out.body(b"data: 1\n\n")
        out.usage = Usage(input_tokens=3)
        out.reasoning_chars = 4
        if self.behaviour == "adapter_error":
            raise AdapterError("provider_error", "connection lost")
        await trio.sleep_forever()


def scripted_executor(behaviour: str) -> NodeExecutor:
    executor = NodeExecutor()
    spec = ProviderSpec(id="p", type="openai", base_url="http://127.0.0.1:1")
    executor.registry = AdapterRegistry({"p": ScriptedAdapter(spec, behaviour)})
    return executor


def test_executor_satisfies_protocol() -> None:
    handler: NodeHandler = NodeExecutor()
    assert handler.current_status().providers == []


async def test_echo_run_sends_text_usage_complete() -> None:
    executor = await make_executor(ProviderSpec(id="echo", type="echo"))
    sender = ListSender()
    with trio.fail_after(5):
        await executor.serve_stream(run_req(), sender)
    assert sender.kinds == ["text", "text", "text", "usage", "complete"]
    assert "".join(m.text for m in sender.msgs if m.kind == "text") == "alpha beta gamma"
    usage_event = sender.msgs[3]
    assert isinstance(usage_event, RunEvent) and usage_event.usage is not None
    assert usage_event.usage.output_tokens == 3
    assert usage_event.usage.input_tokens == 4  # ceil(16 / 4)
    assert sender.msgs[-1].finish_reason == "stop"  # type: ignore[union-attr]
    assert all(m.stream_id == 1 for m in sender.msgs)
    assert executor.active_streams == 0


async def test_unknown_provider_is_bad_request() -> None:
    executor = await make_executor(ProviderSpec(id="echo", type="echo"))
    sender = ListSender()
    await executor.serve_stream(run_req(provider="nope"), sender)
    assert sender.kinds == ["error"]
    assert sender.msgs[0].code == "bad_request"
    tunnel_sender = ListSender()
    await executor.serve_stream(
        ProviderTunnelRequest(stream_id=2, provider_id="nope", method="GET", path="/"),
        tunnel_sender,
    )
    assert isinstance(tunnel_sender.msgs[0], ProviderTunnelFrame)
    assert tunnel_sender.kinds == ["error"]


async def test_cancel_sends_usage_so_far_then_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executor = await make_executor(ProviderSpec(id="echo", type="echo", delay_ms=100))
    sender = ListSender()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.serve_stream, run_req("a b c d e f"), sender)
            while sender.kinds.count("text") < 2:
                await sender.sent.wait()
            executor.cancel(1, "client disconnected")
            executor.cancel(1, "twice is harmless")
    assert sender.kinds == ["text", "text", "usage", "error"]
    assert sender.msgs[2].usage.output_tokens == 2  # type: ignore[union-attr]
    assert sender.msgs[3].code == "cancelled"
    assert sender.msgs[3].message == "client disconnected"
    assert executor.active_streams == 0


async def test_cancel_of_unknown_stream_is_ignored() -> None:
    executor = NodeExecutor()
    executor.cancel(42, "nothing there")


@pytest.mark.parametrize(
    ("behaviour", "code"),
    [
        ("adapter_error", "provider_timeout"),
        ("crash", "provider_error"),
        ("group", "provider_error"),
    ],
)
async def test_adapter_failure_sends_usage_then_error(
    behaviour: str, code: str, caplog: Any
) -> None:
    executor = scripted_executor(behaviour)
    sender = ListSender()
    with trio.fail_after(5):
        await executor.serve_stream(run_req(provider="p"), sender)
    assert sender.kinds == ["text", "usage", "error"]
    assert sender.msgs[-1].code == code
    assert "sk-canary" not in sender.msgs[-1].message
    assert "sk-canary" not in caplog.text
    # the node keeps serving
    sender2 = ListSender()
    with trio.fail_after(5):
        await executor.serve_stream(run_req(provider="p", sid=2), sender2)
    assert sender2.kinds[-1] == "error"


async def test_outside_cancellation_propagates_and_sends_no_terminal() -> None:
    executor = scripted_executor("block")
    sender = ListSender()
    with trio.fail_after(5):
        with trio.CancelScope() as outer:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor.serve_stream, run_req(provider="p"), sender)
                await sender.sent.wait()
                outer.cancel()
        assert outer.cancelled_caught
    assert sender.kinds == ["text"]
    assert executor.active_streams == 0
    assert executor.registry is not None and executor.registry.active_runs == 0


async def test_broken_link_ends_stream_quietly() -> None:
    executor = await make_executor(ProviderSpec(id="echo", type="echo"))
    sender = ListSender()
    sender.broken = True
    with trio.fail_after(5):
        await executor.serve_stream(run_req(), sender)
    assert sender.msgs == []
    assert executor.active_streams == 0


async def test_tunnel_frames_success_error_and_cancel() -> None:
    executor = scripted_executor("adapter_error")
    sender = ListSender()
    req = ProviderTunnelRequest(stream_id=7, provider_id="p", method="POST", path="/v1/x")
    with trio.fail_after(5):
        await executor.serve_stream(req, sender)
    assert sender.kinds == ["head", "body", "usage", "error"]
    usage = sender.msgs[2]
    assert isinstance(usage, ProviderTunnelFrame)
    assert usage.body_usage == Usage(input_tokens=3) and usage.reasoning_chars == 4

    executor = scripted_executor("block")
    sender = ListSender()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.serve_stream, req, sender)
            while len(sender.msgs) < 2:
                await sender.sent.wait()
            executor.cancel(7, "caller gone")
    assert sender.kinds == ["head", "body", "usage", "error"]
    assert sender.msgs[-1].code == "cancelled"


async def test_drain_rejects_new_streams_and_waits_for_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    executor = await make_executor(ProviderSpec(id="echo", type="echo", delay_ms=100))
    running = ListSender()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.serve_stream, run_req("a b c"), running)
            await running.sent.wait()
            executor.begin_drain()
            late = ListSender()
            await executor.serve_stream(run_req(sid=2), late)
            assert late.kinds == ["error"]
            await executor.wait_idle()
            assert running.kinds[-1] == "complete"


async def test_on_config_rejects_bad_provider_sets() -> None:
    executor = NodeExecutor()
    ack = await executor.on_config(
        NodeConfig(
            stream_id=3,
            version=2,
            providers=[ProviderSpec(id="a", type="echo"), ProviderSpec(id="a", type="echo")],
        )
    )
    assert not ack.ok and "twice" in ack.error and ack.stream_id == 3 and ack.version == 2
    ack = await executor.on_config(
        NodeConfig(stream_id=4, version=3, providers=[ProviderSpec(id="c", type="cli")])
    )
    assert not ack.ok and "command" in ack.error
    ack = await executor.on_config(
        NodeConfig(stream_id=5, version=4, providers=[ProviderSpec(id="o", type="openai")])
    )
    assert not ack.ok and "base_url" in ack.error
    assert executor.registry is None


async def test_status_lists_providers_unknown_before_first_probe() -> None:
    executor = await make_executor(
        ProviderSpec(id="echo", type="echo"),
        ProviderSpec(id="vllm", type="openai", base_url="http://127.0.0.1:9"),
    )
    status = executor.current_status()
    assert [(p.provider_id, p.health) for p in status.providers] == [
        ("echo", "unknown"),
        ("vllm", "unknown"),
    ]


async def test_same_config_twice_keeps_registry() -> None:
    spec = ProviderSpec(id="echo", type="echo")
    executor = await make_executor(spec)
    first = executor.registry
    ack = await executor.on_config(NodeConfig(stream_id=9, version=1, providers=[spec]))
    assert ack.ok and executor.registry is first


# ------------------------------------------------------------ early start


def _tunnel(sid: int, provider: str = "p") -> ProviderTunnelRequest:
    return ProviderTunnelRequest(
        stream_id=sid,
        provider_id=provider,
        method="POST",
        path="/v1/chat/completions",
        headers=[("content-type", "application/json")],
        body=b'{"model": "m", "messages": []}',
    )


async def test_start_early_sends_a_passthrough_request_before_serve_stream() -> None:
    from tests.support.mock_providers import MockOpenAIServer

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            mock = await nursery.start(MockOpenAIServer().serve)
            executor = await make_executor(
                ProviderSpec(id="p", type="openai", base_url=mock.base_url),
                ProviderSpec(id="echo", type="echo"),
            )
            # Not for runs, unknown providers, or with no idle provider connection yet.
            assert executor.start_early(run_req()) is None
            assert executor.start_early(_tunnel(1, provider="nope")) is None
            assert executor.start_early(_tunnel(1)) is None
            first = ListSender()
            await executor.serve_stream(_tunnel(1), first)
            assert first.kinds == ["whole"]  # a whole JSON reply: one frame

            early = executor.start_early(_tunnel(2))  # an idle connection now: sent at once
            assert early is not None
            sender = ListSender()
            await executor.serve_stream(_tunnel(2), sender, early)
            assert sender.kinds == first.kinds
            assert b"".join(m.data for m in sender.msgs if m.kind == "body") == b"".join(
                m.data for m in first.msgs if m.kind == "body"
            )
            assert mock.connections_opened == 1 and len(mock.requests) == 2

            # A stream that never gets to use its early start abandons it: the
            # provider sees that connection close (here: the node is draining).
            early = executor.start_early(_tunnel(3))
            assert early is not None
            executor.draining = True
            refused = ListSender()
            await executor.serve_stream(_tunnel(3), refused, early)
            assert refused.terminals()[0].code == "provider_error"
            await mock.wait_connections_ended(1)
            assert executor.start_early(_tunnel(4)) is None  # draining: nothing starts
            nursery.cancel_scope.cancel()
