"""A failing provider is routed around, end to end.

A real edge and a real node, two mock OpenAI providers in one group: the
preferred one (``priority: 0``) is told to fail, the other answers.  The
waits here involve real sockets, so they run on the real clock with a
``fail_after`` guard (``autojump_clock`` would jump over the I/O).
"""

from __future__ import annotations

from typing import Any

import h11
import trio

from tests.support.gateway import (
    Gateway,
    assert_no_lease_held,
    http_request,
    node_token,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer, MockReply, closed_port_url, sse

EDGE_YAML = """
edge:
  id: edge-retry
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
provider_pool:
  retry_attempts: {attempts}
  eject_after_failures: {eject}
  eject_seconds: 30
models:
  - id: m
    providers: {{p-bad: served-bad, p-good: served-good}}
    fallbacks: {fallbacks}
    fallback_on_queue_timeout: {fq}
  - id: spare
    providers: {{p-spare: served-spare}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - id: p-bad
        type: openai
        base_url: {bad}
        models: [served-bad]
        priority: 0
        capacity: {bad_capacity}
        health_interval: 3600
      - id: p-good
        type: openai
        base_url: {good}
        models: [served-good]
        priority: 1
        capacity: 4
        health_interval: 3600
      - id: p-spare
        type: openai
        base_url: {spare}
        models: [served-spare]
        health_interval: 3600
"""

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _yaml(
    bad: str,
    good: str,
    spare: str,
    *,
    attempts: int = 2,
    eject: int = 5,
    fallbacks: str = "[]",
    fq: str = "false",
    bad_capacity: int = 4,
) -> str:
    return EDGE_YAML.format(
        hash=token_hash(node_token("node-a")),
        bad=bad,
        good=good,
        spare=spare,
        attempts=attempts,
        eject=eject,
        fallbacks=fallbacks,
        fq=fq,
        bad_capacity=bad_capacity,
    )


def _fail_chat(mock: MockOpenAIServer, status: int, retry_after: str | None = None) -> None:
    """Answer ``status`` to completions only (the health probe still passes)."""
    headers = [("content-type", "application/json")]
    if retry_after is not None:
        headers.append(("retry-after", retry_after))
    reply = MockReply(status=status, headers=headers, body=b'{"error":{"message":"no"}}')
    mock.handler = lambda req: reply if req.path.endswith("/chat/completions") else None


def _chat_requests(mock: MockOpenAIServer) -> int:
    return sum(1 for r in mock.requests if r.path.endswith("/chat/completions"))


async def _first_probes_reported(gw: Gateway) -> None:
    """Wait until the node reported every provider's first health probe.

    The tests then change a mock (or the pool's view of a provider): a probe
    report arriving after that change would undo it, and the request would go
    elsewhere (seen under load as "p-bad never tried").
    """
    await wait_until(
        lambda: all(p["health"] not in ("unknown", "disconnected") for p in gw.runtime.status()["providers"])
    )


async def _chat(gw: Gateway, body: dict[str, Any] | None = None) -> Any:
    return await http_request(gw.host_port, "POST", "/v1/chat/completions", body=body or CHAT)


async def _with_mocks(test: Any, **yaml_kwargs: Any) -> None:
    async with trio.open_nursery() as nursery:
        bad = await nursery.start(MockOpenAIServer().serve)
        good = await nursery.start(MockOpenAIServer().serve)
        spare = await nursery.start(MockOpenAIServer().serve)
        await test(nursery, bad, good, spare, **yaml_kwargs)
        nursery.cancel_scope.cancel()


async def test_retried_on_the_second_provider_after_503_and_the_first_saw_one_attempt() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 503)
        body = dict(CHAT, extra_field=[1, 2.50, "é"])
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url)) as gw:
                resp = await _chat(gw, body)
                assert resp.status == 200, resp.body
                assert resp.header("x-iopd-upstream-status") is None  # errors only
                assert resp.header("x-iopd-model-group") == "m"
                assert _chat_requests(bad) == 1
                assert _chat_requests(good) == 1
                # Byte-exact replay: the second provider got the same body as the first.
                assert bad.requests[-1].json() == dict(body, model="served-bad")
                assert good.requests[-1].json() == dict(body, model="served-good")
                metrics, _ = gw.runtime.metrics.exposition()
                assert b'iop_request_retries_total{edge_id="edge-retry",model_group="m"} 1.0' in metrics
                assert b'reason="status_5xx"' in metrics
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_refused_connection_and_429_are_retried() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        with trio.fail_after(20):
            async with running_gateway(_yaml(closed_port_url(), good.base_url, spare.base_url)) as gw:
                # Its first health probe failed: make it a candidate as the
                # probe had passed (a provider that went down since).
                await _first_probes_reported(gw)
                gw.runtime.pool.set_provider_health("p-bad", "healthy")
                resp = await _chat(gw)
                assert resp.status == 200, resp.body
                metrics, _ = gw.runtime.metrics.exposition()
                assert b'provider="p-bad",reason="connect"' in metrics
                assert_no_lease_held(gw)

    await _with_mocks(run)

    async def run429(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 429, retry_after="30")
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url)) as gw:
                assert (await _chat(gw)).status == 200
                # Saturated for its Retry-After: the next request goes straight to p-good.
                assert (await _chat(gw)).status == 200
                assert _chat_requests(bad) == 1
                assert _chat_requests(good) == 2
                sched = gw.runtime.pool.scheduler
                assert sched.outliers.saturated_until("p-bad", trio.current_time()) is not None
                assert not sched.outliers.is_ejected("p-bad")  # a 429 is not a failure
                assert_no_lease_held(gw)

    await _with_mocks(run429)


async def test_500_and_retry_attempts_zero_are_relayed_not_retried() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 500)
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url)) as gw:
                resp = await _chat(gw)
                assert resp.status == 500  # the provider may have acted on it: relayed
                assert _chat_requests(good) == 0
                assert_no_lease_held(gw)

    await _with_mocks(run)

    async def run_off(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 503)
        yaml = _yaml(bad.base_url, good.base_url, spare.base_url, attempts=0)
        with trio.fail_after(20):
            async with running_gateway(yaml) as gw:
                assert (await _chat(gw)).status == 503
                assert _chat_requests(good) == 0
                assert_no_lease_held(gw)

    await _with_mocks(run_off)


async def test_a_stream_that_failed_after_its_first_chunk_is_not_retried() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        bad.handler = lambda req: (
            MockReply(
                headers=[("content-type", "text/event-stream")],
                chunks=[sse({"choices": [{"delta": {"content": "Hel"}}]})],
                reset_after_chunks=True,
            )
            if req.path.endswith("/chat/completions")
            else None
        )
        body = dict(CHAT, stream=True)
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url)) as gw:
                try:
                    resp = await _chat(gw, body)
                    assert b"Hel" in resp.body  # what arrived, then the cut
                except (trio.BrokenResourceError, OSError, h11.RemoteProtocolError):
                    pass  # the cut may come first: nothing else is relayed either way
                assert _chat_requests(bad) == 1
                assert _chat_requests(good) == 0
                await trio.sleep(0.05)  # the edge's side of the cut ends its request
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_done_when_one_failing_provider_callers_see_no_error_and_it_is_ejected() -> None:
    """Two providers, one failing every request: callers see no error and it is ejected."""

    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 502)
        with trio.fail_after(30):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url, eject=3)) as gw:
                start = trio.current_time()
                errors = 0
                for _ in range(20):
                    resp = await _chat(gw)
                    errors += resp.status != 200
                    assert resp.status == 200, resp.body
                elapsed = trio.current_time() - start
                print(
                    f"\nMEASURED retry_done_when: requests=20 caller_errors={errors} "
                    f"failing_provider_requests={_chat_requests(bad)} eject_after_failures=3 "
                    f"healthy_provider_requests={_chat_requests(good)} "
                    f"mean_request_ms={elapsed / 20 * 1000:.1f}"
                )
                assert _chat_requests(bad) == 3  # at most eject_after_failures, then ejected
                assert gw.runtime.pool.scheduler.outliers.is_ejected("p-bad")
                status = gw.runtime.status()
                row = next(p for p in status["providers"] if p["id"] == "p-bad")
                assert row["health"] == "ejected" and row["ejected_until"] is not None
                metrics, _ = gw.runtime.metrics.exposition()
                assert b'iop_provider_ejections_total{edge_id="edge-retry",provider="p-bad"} 1.0' in metrics
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_an_all_ejected_group_still_serves() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 503)
        _fail_chat(good, 503)
        yaml = _yaml(bad.base_url, good.base_url, spare.base_url, eject=1, attempts=1)
        with trio.fail_after(20):
            async with running_gateway(yaml) as gw:
                assert (await _chat(gw)).status == 503  # both failed once: both ejected
                outliers = gw.runtime.pool.scheduler.outliers
                assert outliers.is_ejected("p-bad") and outliers.is_ejected("p-good")
                good.handler = bad.handler = None
                resp = await _chat(gw)  # a last resort, not a dead end
                assert resp.status == 200, resp.body
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_fallback_group_serves_when_the_group_has_no_candidate() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        yaml = _yaml(bad.base_url, good.base_url, spare.base_url, fallbacks="[spare]")
        yaml = yaml.replace("        priority: 0\n", "        priority: 0\n        enabled: false\n")
        yaml = yaml.replace("        priority: 1\n", "        priority: 1\n        enabled: false\n")
        with trio.fail_after(20):
            async with running_gateway(yaml) as gw:
                resp = await _chat(gw)
                assert resp.status == 200, resp.body
                assert resp.header("x-iopd-model-group") == "spare"
                assert spare.requests[-1].json()["model"] == "served-spare"
                metrics, _ = gw.runtime.metrics.exposition()
                assert b'fallback_group="spare",model_group="m"' in metrics
                assert b'model_group="spare",principal' in metrics or b'model_group="spare"' in metrics
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_fallback_on_queue_timeout_is_opt_in() -> None:
    async def run(nursery: Any, bad: Any, good: Any, spare: Any, fq: str) -> None:
        bad.mode = "hang"
        good.mode = "hang"
        yaml = _yaml(bad.base_url, good.base_url, spare.base_url, fallbacks="[spare]", fq=fq)
        yaml = yaml.replace("capacity: 4", "capacity: 1").replace(
            "  retry_attempts:", "  queue_timeout: 0.3\n  retry_attempts:"
        )
        with trio.fail_after(20):
            async with running_gateway(yaml) as gw:
                async with trio.open_nursery() as inner:
                    inner.start_soon(_chat, gw)  # hold p-bad
                    inner.start_soon(_chat, gw)  # hold p-good
                    loads = gw.runtime.pool.provider_loads
                    await wait_until(lambda: sum(x.in_flight for x in loads().values()) >= 2)
                    resp = await _chat(gw)
                    if fq == "true":
                        assert resp.status == 200, resp.body
                        assert resp.header("x-iopd-model-group") == "spare"
                    else:
                        assert resp.status == 503
                        assert resp.json()["error"]["code"] == "queue_timeout"
                    inner.cancel_scope.cancel()

    for fq in ("true", "false"):
        async with trio.open_nursery() as nursery:
            bad = await nursery.start(MockOpenAIServer().serve)
            good = await nursery.start(MockOpenAIServer().serve)
            spare = await nursery.start(MockOpenAIServer().serve)
            await run(nursery, bad, good, spare, fq)
            nursery.cancel_scope.cancel()


PROVIDER_AUTH = [("x-provider-authorization", "Bearer caller-key")]


async def test_the_callers_provider_key_never_goes_to_another_origin() -> None:
    """p-bad and p-good listen on different ports: different ``base_url`` origins."""

    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        _fail_chat(bad, 503)
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url)) as gw:
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=CHAT, headers=PROVIDER_AUTH
                )
                assert resp.status == 503  # the failure, relayed: no other origin may see the key
                assert _chat_requests(bad) == 1 and _chat_requests(good) == 0
                assert bad.requests[-1].header("authorization") == "Bearer caller-key"
                assert all(r.header("authorization") is None for r in good.requests)
                assert_no_lease_held(gw)
                # Without the caller's key the same failure is routed around.
                assert (await _chat(gw)).status == 200
                assert _chat_requests(bad) == 2 and _chat_requests(good) == 1
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_the_callers_provider_key_is_retried_on_the_same_origin() -> None:
    """Both providers on one mock (one origin): the key may go to the second."""

    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        reply = MockReply(status=503, headers=[("content-type", "application/json")], body=b"{}")
        bad.handler = lambda req: (
            reply if req.path.endswith("/chat/completions") and b"served-bad" in req.body else None
        )
        with trio.fail_after(20):
            async with running_gateway(_yaml(bad.base_url, bad.base_url, spare.base_url)) as gw:
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=CHAT, headers=PROVIDER_AUTH
                )
                assert resp.status == 200, resp.body
                served = [
                    r.json()["model"] for r in bad.requests if r.path.endswith("/completions")
                ]
                assert served == ["served-bad", "served-good"]
                assert bad.requests[-1].header("authorization") == "Bearer caller-key"
                assert_no_lease_held(gw)

    await _with_mocks(run)


async def test_a_reset_while_the_request_is_written_is_retried_as_reset() -> None:
    """The provider resets the connection before reading the request: the node's
    write of the (large) body breaks, ``provider_reset``, retried with reason ``reset``."""

    async def run(nursery: Any, bad: Any, good: Any, spare: Any) -> None:
        # Larger than the loopback socket buffers, so the write is what breaks.
        body = dict(CHAT, messages=[{"role": "user", "content": "x" * (6 * 1024 * 1024)}])
        with trio.fail_after(30):
            async with running_gateway(_yaml(bad.base_url, good.base_url, spare.base_url)) as gw:
                await _first_probes_reported(gw)
                bad.mode = "reset_unread"  # after the health probe passed
                resp = await _chat(gw, body)
                assert resp.status == 200, resp.body[:200]
                assert _chat_requests(bad) == 0  # never read a whole request
                assert _chat_requests(good) == 1
                assert good.requests[-1].json() == dict(body, model="served-good")
                metrics, _ = gw.runtime.metrics.exposition()
                assert b'provider="p-bad",reason="reset"} 1.0' in metrics
                assert (
                    b'iop_request_retries_total{edge_id="edge-retry",model_group="m"} 1.0'
                    in metrics
                )
                assert_no_lease_held(gw)

    await _with_mocks(run)
