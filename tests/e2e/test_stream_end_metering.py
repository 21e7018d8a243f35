"""A stream whose terminal event reached the caller is metered ``ok`` with its
usage, however soon the caller closes afterwards.

Coding agents close their connection the moment they have the terminal
event (Codex on ``response.completed``).  A raw socket client here does the
same: it reads until the terminal event, then closes at once.  The
passthrough provider (the mock) waits a moment between its last event and
the end of its body, as a real server finishing its response does, so the
close always comes before the node's end and its usage frame.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.support.configs import echo_yaml, remote_yaml
from tests.support.gateway import metric, running_gateway, wait_until
from tests.support.mock_providers import MockOpenAIServer, MockReply, RecordedRequest

TERMINAL = {
    "/v1/chat/completions": b"data: [DONE]",
    "/v1/responses": b"response.completed",
}


def _body(path: str, model: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {
            "model": model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "one two three"}],
        }
    return {"model": model, "stream": True, "input": "one two three"}


async def _close_on_terminal(host_port: tuple[str, int], path: str, body: dict[str, Any]) -> bytes:
    """Send the request; read until the terminal event; close the socket at once."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host_port[0]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream(*host_port)
    got = b""
    try:
        await stream.send_all(head + data)
        while TERMINAL[path] not in got:
            chunk = await stream.receive_some(65536)
            assert chunk, got
            got += chunk
    finally:
        await stream.aclose()
    return got


def _passthrough_yaml(base_url: str) -> str:
    return remote_yaml(base_url)


def _requests(gw: Any) -> float:
    return metric(gw, "iop_openai_requests_total")


@pytest.mark.parametrize("path", sorted(TERMINAL))
async def test_passthrough_stream_closed_on_its_terminal_event_is_ok(
    openai_mock: MockOpenAIServer, path: str
) -> None:
    def handler(req: RecordedRequest) -> MockReply | None:
        reply = openai_mock.route(req)
        reply.end_delay = 0.3  # the provider's end comes after the caller left
        return reply

    openai_mock.handler = handler
    with trio.fail_after(30):
        async with running_gateway(_passthrough_yaml(openai_mock.base_url)) as gw:
            got = await _close_on_terminal(gw.host_port, path, _body(path, "remote"))
            assert b"200" in got.split(b"\r\n", 1)[0]
            await wait_until(lambda: _requests(gw) == 1)
            assert metric(gw, "iop_openai_requests_total", status="ok") == 1
            assert metric(gw, "iop_openai_requests_total", status="cancelled") == 0
            usage = openai_mock.usage
            assert (
                metric(gw, "iop_openai_usage_tokens_total", token_type="input")
                == usage["prompt_tokens"]
            )
            assert (
                metric(gw, "iop_openai_usage_tokens_total", token_type="output")
                == usage["completion_tokens"]
            )


@pytest.mark.parametrize("path", sorted(TERMINAL))
async def test_normalized_stream_closed_on_its_terminal_event_is_ok(path: str) -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            for _ in range(5):  # the close lands at a different point each time
                await _close_on_terminal(gw.host_port, path, _body(path, "echo"))
            await wait_until(lambda: _requests(gw) == 5)
            assert metric(gw, "iop_openai_requests_total", status="ok") == 5
            assert metric(gw, "iop_openai_usage_tokens_total", token_type="output") == 15
