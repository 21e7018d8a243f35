"""Retries on the normalized path, end to end, streams included.

A real edge and a real node, two mock Ollama providers in one group: the
preferred one (``priority: 0``) is told to fail, the other answers.  A
normalized run that fails before any event is retried whether the caller
asked for a stream or not: a streamed answer's head waits for the run's
first event, so nothing has reached the caller yet.  Real sockets: the real
clock with a ``fail_after`` guard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import trio

from tests.support.gateway import (
    assert_no_lease_held,
    http_request,
    node_token,
    running_gateway,
    token_hash,
)
from tests.support.mock_providers import MockOllamaServer, MockReply

EDGE_YAML = """
edge:
  id: edge-retry-norm
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
provider_pool:
  retry_attempts: {attempts}
  eject_after_failures: 5
models:
  - id: m
    providers: {{p-bad: "mock:latest", p-good: "mock:latest"}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - id: p-bad
        type: ollama
        base_url: {bad}
        models: ["mock:latest"]
        priority: 0
        capacity: 4
        health_interval: 3600
      - id: p-good
        type: ollama
        base_url: {good}
        models: ["mock:latest"]
        priority: 1
        capacity: 4
        health_interval: 3600
"""

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}


def _yaml(bad: str, good: str, *, attempts: int = 2) -> str:
    return EDGE_YAML.format(
        hash=token_hash(node_token("node-a")), bad=bad, good=good, attempts=attempts
    )


def _on_chat(reply: MockReply) -> Callable[[Any], MockReply | None]:
    """A handler answering ``reply`` to ``/api/chat`` only (the probe still passes)."""
    return lambda req: reply if req.path == "/api/chat" else None


def _status(status: int, headers: list[tuple[str, str]] | None = None) -> MockReply:
    return MockReply(
        status=status,
        headers=[("content-type", "application/json"), *(headers or [])],
        body=b'{"error":"unavailable"}',
    )


def _runs(mock: MockOllamaServer) -> int:
    return sum(1 for r in mock.requests if r.path == "/api/chat")


def _sse_data(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


async def _with_mocks(test: Callable[[MockOllamaServer, MockOllamaServer], Any]) -> None:
    async with trio.open_nursery() as nursery:
        bad = await nursery.start(MockOllamaServer().serve)
        good = await nursery.start(MockOllamaServer().serve)
        await test(bad, good)
        nursery.cancel_scope.cancel()


async def test_a_stream_whose_run_failed_before_any_event_is_retried() -> None:
    """Chat and Responses streams: the 503 before any event goes to p-good."""

    async def run(bad: MockOllamaServer, good: MockOllamaServer) -> None:
        bad.handler = _on_chat(_status(503))
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url)) as gw:
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=dict(CHAT, stream=True)
                )
                assert resp.status == 200, resp.body
                assert resp.header("content-type") == "text/event-stream"
                data = _sse_data(resp.body)
                assert data[-1] == "[DONE]"
                text = "".join(
                    json.loads(d)["choices"][0]["delta"].get("content") or ""
                    for d in data[:-1]
                    if json.loads(d)["choices"]
                )
                assert text == good.reply_text
                assert not any('"error"' in d for d in data)
                assert (_runs(bad), _runs(good)) == (1, 1)

                resp = await http_request(
                    gw.host_port, "POST", "/v1/responses", body=dict(RESPONSES, stream=True)
                )
                assert resp.status == 200, resp.body
                assert b"event: response.completed" in resp.body
                assert (
                    b"event: response.failed" not in resp.body and b"event: error" not in resp.body
                )
                assert (_runs(bad), _runs(good)) == (2, 2)

                metrics, _ = gw.runtime.metrics.exposition()
                assert b'provider="p-bad",reason="run_error"} 2.0' in metrics
                assert (
                    b'iop_request_retries_total{edge_id="edge-retry-norm",model_group="m"} 2.0'
                    in metrics
                )
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_a_stream_not_retried_ends_with_an_http_error_not_an_open_stream() -> None:
    """``retry_attempts: 0``: the run's error before any event is a plain 502,
    because no head went out before it (and p-good sees nothing)."""

    async def run(bad: MockOllamaServer, good: MockOllamaServer) -> None:
        bad.handler = _on_chat(_status(503))
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url, attempts=0)) as gw:
                for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSES)):
                    resp = await http_request(
                        gw.host_port, "POST", path, body=dict(body, stream=True)
                    )
                    assert resp.status == 502, resp.body
                    assert resp.json()["error"]["code"] == "provider_error"
                assert (_runs(bad), _runs(good)) == (2, 0)
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_a_stream_that_failed_after_its_first_event_is_not_retried() -> None:
    async def run(bad: MockOllamaServer, good: MockOllamaServer) -> None:
        line = {
            "model": "mock:latest",
            "done": False,
            "message": {"role": "assistant", "content": "Hel"},
        }
        bad.handler = _on_chat(
            MockReply(
                headers=[("content-type", "application/x-ndjson")],
                chunks=[json.dumps(line).encode() + b"\n"],
                reset_after_chunks=True,
            )
        )
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url)) as gw:
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=dict(CHAT, stream=True)
                )
                assert resp.status == 200  # the stream had started: it ends with its error
                data = _sse_data(resp.body)
                assert "Hel" in "".join(data)
                assert json.loads(data[-1])["error"]["code"] == "provider_error"
                assert (_runs(bad), _runs(good)) == (1, 0)
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_a_429_from_an_ollama_provider_rests_it_and_is_no_failure() -> None:
    """The ollama adapter reports the 429 as ``provider_saturated`` with its
    Retry-After: retried, the provider is saturated (not chosen), not ejected."""

    async def run(bad: MockOllamaServer, good: MockOllamaServer) -> None:
        bad.handler = _on_chat(_status(429, [("retry-after", "30")]))
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url)) as gw:
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=dict(CHAT, stream=True)
                )
                assert resp.status == 200, resp.body
                assert _sse_data(resp.body)[-1] == "[DONE]"
                # Saturated for its Retry-After: the next request goes straight to p-good.
                resp = await http_request(gw.host_port, "POST", "/v1/chat/completions", body=CHAT)
                assert resp.status == 200, resp.body
                assert (_runs(bad), _runs(good)) == (1, 2)
                outliers = gw.runtime.pool.scheduler.outliers
                until = outliers.saturated_until("p-bad", trio.current_time())
                assert until is not None and until - trio.current_time() > 20  # its 30 s
                assert not outliers.is_ejected("p-bad")
                metrics, _ = gw.runtime.metrics.exposition()
                assert b'provider="p-bad",reason="status_429"} 1.0' in metrics
                assert b'provider="p-bad",reason="run_error"' not in metrics
                assert_no_lease_held(gw)

    await _with_mocks(run)
