"""The passthrough relay end to end: a ``/v1/responses`` stream relayed raw with fields the
gateway does not know, and a caller's cancel closes the provider connection."""

from __future__ import annotations

import json
import statistics
from typing import Any

import trio

from tests.support.configs import gateway_yaml, http_provider, node_entry, remote_yaml
from tests.support.gateway import Gateway, http_request, running_gateway, wait_until
from tests.support.mock_providers import MockOpenAIServer
from tests.support.replies import chat_body, sse_events

CHAT = "/v1/chat/completions"


async def test_responses_stream_relayed_raw_with_unknown_fields() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.reasoning_text = "thinking hard"
            yaml_text = gateway_yaml(
                models="  - id: codex\n    providers: {oa-1: mock-model}\n",
                nodes=node_entry(
                    "node-a", http_provider("oa-1", "openai", mock.base_url, models="[mock-model]")
                ),
            )
            body = {
                "model": "codex",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                "stream": True,
                "store": False,
                "reasoning": {"effort": "high", "summary": "auto"},
                "include": ["reasoning.encrypted_content"],
                "parallel_tool_calls": False,
                "x_codex_future": {"a": [1, 2]},
            }
            async with running_gateway(yaml_text) as gw:
                r = await http_request(gw.host_port, "POST", "/v1/responses", body=body)
                assert r.status == 200, r.body
                assert r.header("content-type") == "text/event-stream"
                assert r.header("x-accel-buffering") == "no"
                sent = mock.requests[-1]
                assert sent.path == "/v1/responses"
                sent_body = sent.json()
                assert sent_body == {**body, "model": "mock-model"}
                # The exact bytes the provider produces for the same request.
                expected = b"".join(mock._responses(sent_body).chunks or [])
                assert r.body == expected
                kinds = [ev["type"] for ev in sse_events(r.body)]
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                assert "response.reasoning_text.delta" in kinds

            n.cancel_scope.cancel()


# ------------------------------------------------------ passthrough cancel


async def _open_stream_and_close(gw: Gateway, body: dict[str, Any]) -> float:
    """Start a streaming request, read until the first SSE event, then close.

    Returns the trio time of the close.
    """
    import h11

    conn = h11.Connection(h11.CLIENT)
    payload = json.dumps(body).encode()
    stream = await trio.open_tcp_stream(*gw.host_port)
    try:
        await stream.send_all(
            conn.send(
                h11.Request(
                    method="POST",
                    target=CHAT,
                    headers=[
                        ("host", "edge"),
                        ("content-type", "application/json"),
                        ("content-length", str(len(payload))),
                    ],
                )
            )
            + conn.send(h11.Data(data=payload))
            + conn.send(h11.EndOfMessage())
        )
        got = b""
        while b"data: " not in got:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                assert data, "the edge closed before the first event"
                conn.receive_data(data)
            elif isinstance(ev, h11.Response):
                assert ev.status_code == 200
            elif isinstance(ev, h11.Data):
                got += bytes(ev.data)
            else:
                raise AssertionError(f"unexpected {ev!r}")
    finally:
        closed_at = trio.current_time()
        await trio.aclose_forcefully(stream)
    return closed_at


async def test_passthrough_cancel_closes_the_provider_connection() -> None:
    runs = 20
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.reply_text = " ".join(f"w{i}" for i in range(100))
            mock.chunk_delay = 0.05  # 100 chunks x 50 ms: only a cancel ends it early
            yaml_text = remote_yaml(mock.base_url)
            async with running_gateway(yaml_text) as gw:
                pool = gw.runtime.pool
                delays: list[float] = []
                for i in range(runs):
                    closed_at = await _open_stream_and_close(
                        gw, chat_body("remote", "stream please", stream=True)
                    )
                    await mock.wait_client_close(i + 1)
                    delays.append(mock.client_closed_at[i] - closed_at)
                    await wait_until(lambda: pool.provider_loads()["oa-1"].in_flight == 0)
                # Every cancelled stream was cut well before its natural end.
                assert all(d < 100 * 0.05 for d in delays)
                delays_ms = sorted(d * 1000 for d in delays)
                print(
                    f"\npassthrough cancel -> provider close over {runs} runs: "
                    f"p50={statistics.median(delays_ms):.2f} ms max={delays_ms[-1]:.2f} ms"
                )
            n.cancel_scope.cancel()
