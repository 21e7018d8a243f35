"""The echo provider: exact chunks, usage, delay and cancel."""

from __future__ import annotations

import re
from typing import Any

import trio
import trio.testing

from iopd.node.adapters.base import CollectedRunOutput
from iopd.node.adapters.echo import EchoAdapter, last_user_text
from iopd.tokens import estimate_input_tokens
from wire.messages import ProviderSpec, ProviderTunnelRequest, RunRequest


def make_req(messages: list[dict[str, Any]]) -> RunRequest:
    return RunRequest(
        stream_id=1, provider_id="echo", adapter="echo", target="echo", messages=messages
    )


async def test_echo_chunks_and_usage() -> None:
    adapter = EchoAdapter(ProviderSpec(id="echo", type="echo"))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "  hello   big\nworld! "},
    ]
    out = CollectedRunOutput()
    await adapter.run(make_req(messages), out)
    chunks = [v for k, v in out.events if k == "text"]
    assert chunks == ["hello   ", "big\n", "world! "]
    assert chunks == re.findall(r"\S+\s*", messages[-1]["content"])
    assert out.usage.output_tokens == 3
    assert out.usage.input_tokens == estimate_input_tokens(messages)
    assert out.finish_reason == "stop"


def test_last_user_text_joins_text_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "old"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "b"},
            ],
        },
        {"role": "assistant", "content": "reply"},
    ]
    assert last_user_text(messages) == "a b"
    assert last_user_text([{"role": "system", "content": "x"}]) == ""


async def test_echo_waits_delay_before_each_chunk(autojump_clock: trio.testing.MockClock) -> None:
    adapter = EchoAdapter(ProviderSpec(id="echo", type="echo", delay_ms=250))
    times: list[float] = []

    class Timed(CollectedRunOutput):
        async def text(self, delta: str) -> None:
            times.append(trio.current_time())
            await super().text(delta)

    start = trio.current_time()
    await adapter.run(make_req([{"role": "user", "content": "a b c"}]), Timed())
    assert [round(t - start, 3) for t in times] == [0.25, 0.5, 0.75]


async def test_echo_cancel_reports_only_sent_chunks(autojump_clock: trio.testing.MockClock) -> None:
    adapter = EchoAdapter(ProviderSpec(id="echo", type="echo", delay_ms=100))
    out = CollectedRunOutput()
    with trio.move_on_after(0.25):  # chunk 1 at 0.1, chunk 2 at 0.2, cancelled before 0.3
        await adapter.run(make_req([{"role": "user", "content": "one two three four"}]), out)
    assert out.joined_text == "one two "
    assert out.usage.output_tokens == 2
    assert out.finish_reason is None


async def test_echo_probe_healthy_and_tunnel_unsupported() -> None:
    adapter = EchoAdapter(ProviderSpec(id="echo", type="echo"))
    assert await adapter.probe() == ("healthy", "")
    from iopd.node.adapters.base import AdapterError, CollectedTunnelOutput

    try:
        await adapter.tunnel(
            ProviderTunnelRequest(stream_id=1, provider_id="echo", method="GET", path="/"),
            CollectedTunnelOutput(),
        )
    except AdapterError as exc:
        assert exc.code == "bad_request"
    else:
        raise AssertionError("tunnel should be unsupported")
