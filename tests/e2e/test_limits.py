"""Per-principal limits through a real edge and node.

The limiter's clock is driven directly (``runtime.limits_clock``): windows
move only when a test moves them, so nothing here waits on the real 60 s
window and nothing depends on how fast the machine is.  The sockets run on
the real clock (autojump would jump timeouts while tasks wait on I/O).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio

from iopd.admin_client import format_principals
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from tests.support.configs import echo_yaml, remote_yaml
from tests.support.gateway import (
    Gateway,
    admin_host_port,
    get_json,
    http_request,
    in_thread,
    running_gateway,
    token_hash,
    wait_until,
)
from tests.support.mock_providers import MockOpenAIServer, MockReply, RecordedRequest
from tests.support.streams import NO_USAGE_PIECES, no_usage_stream

TEAM_A = "sk-limits-team-a-0001"
TEAM_B = "sk-limits-team-b-0002"
CHAT = "/v1/chat/completions"
T0 = 1_800_000_000.0  # a fixed wall-clock second, mid-day UTC


def principals_block() -> str:
    return f"""  principal_tokens:
    - {{token_ref: a-1, token_hash_sha256: {token_hash(TEAM_A)}, principal_ref: team-a}}
    - {{token_ref: b-1, token_hash_sha256: {token_hash(TEAM_B)}, principal_ref: team-b}}
"""


def limits_block(a: str, b: str = "", default: str = "") -> str:
    out = "limits:\n"
    if default:
        out += f"  default: {{{default}}}\n"
    out += f"  principals:\n    - {{principal_ref: team-a, {a}}}\n"
    if b:
        out += f"    - {{principal_ref: team-b, {b}}}\n"
    return out


class Clock:
    """The limiter's wall clock, moved by the test."""

    def __init__(self, rt: EdgeRuntime) -> None:
        self.now = T0
        rt.limits_clock = self

    def __call__(self) -> float:
        return self.now


def chat(text: str = "one two three", **extra: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}], **extra}


def auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


async def post(gw: Gateway, body: dict[str, Any], token: str) -> None:
    await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(token))


async def settled(gw: Gateway) -> None:
    """Until no request is in flight: a caller can have a whole answer before
    its handler settles the limits (in its ``finally``)."""
    server = gw.handle.openai_server
    assert server is not None
    await wait_until(lambda: server.in_flight == 0)


def window(rt: EdgeRuntime, ref: str, name: str, clock: Clock) -> tuple[int, int | None]:
    st = rt.limiter.status_of(ref, clock())
    w = getattr(st, name)
    return w.used, w.remaining


def assert_nothing_held(gw: Gateway, clock: Clock) -> None:
    """Every request ended: no admission, no slot, no waiter left anywhere."""
    rt = gw.runtime
    assert rt.pool.principal_loads() == {}
    for st in rt.limiter.status(clock()).values():
        assert (st.admitted, st.in_flight) == (0, 0), st
    # A day and a minute later every window is empty and no state is left.
    clock.now += 86_400 + 61
    assert rt.limiter.forget_idle(clock()) is not None
    for st in rt.limiter.status(clock()).values():
        assert st.requests_per_minute.used == st.tokens_per_minute.used == 0, st
        assert st.tokens_per_day.used == 0, st


# ------------------------------------------------------------------ the SDK


async def test_sdk_sees_rate_limit_error_with_headers_and_remaining_counts_this_request() -> (
    None
):
    yaml = echo_yaml(
        auth=principals_block(),
        pool=limits_block("requests_per_minute: 3, tokens_per_minute: 100000"),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            clock = Clock(gw.runtime)
            client = gw.sdk(api_key=TEAM_A)
            msgs = [{"role": "user", "content": "hello there"}]

            def create() -> Any:
                return client.chat.completions.with_raw_response.create(
                    model="echo", messages=msgs, max_tokens=10
                )

            remaining = []
            for _ in range(3):
                raw = await in_thread(create)
                assert raw.headers["x-ratelimit-limit-requests"] == "3"
                assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
                assert raw.headers["x-ratelimit-reset-requests"] == "1m0s"
                remaining.append(raw.headers["x-ratelimit-remaining-requests"])
            assert remaining == ["2", "1", "0"]  # after the first of 3, 2 are left

            def refused() -> openai.RateLimitError:
                try:
                    client.chat.completions.create(model="echo", messages=msgs, max_tokens=10)
                except openai.RateLimitError as exc:
                    return exc
                raise AssertionError("not refused")

            exc = await in_thread(refused)
            assert exc.status_code == 429
            assert exc.code == "rate_limit_exceeded"
            assert exc.type == "requests"
            assert exc.response.headers["retry-after"] == "60"
            assert exc.response.headers["x-ratelimit-remaining-requests"] == "0"
            assert "requests per minute" in exc.message
            # The refused request did not count; the window slides.
            assert window(gw.runtime, "team-a", "requests_per_minute", clock) == (3, 0)
            clock.now += 60
            raw = await in_thread(create)
            assert raw.headers["x-ratelimit-remaining-requests"] == "2"

            metrics = (await http_request(admin_host_port(gw), "GET", "/metrics")).body.decode()
            assert (
                'iop_limit_rejections_total{edge_id="edge-test",limit="requests_per_minute",'
                'principal_ref="team-a"} 1.0' in metrics
            )
            assert 'status="rate_limited"' in metrics
            assert 'iop_principal_in_flight{edge_id="edge-test",principal_ref="team-a"} 0.0' in (
                metrics
            )


async def test_tokens_429_while_a_reservation_is_held_then_settled_with_usage() -> None:
    yaml = echo_yaml(
        delay_ms=40, auth=principals_block(), pool=limits_block("tokens_per_minute: 300")
    )
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            rt = gw.runtime
            clock = Clock(rt)
            body = chat("a b c d e f g h", max_tokens=200, stream=True)
            async with trio.open_nursery() as n:
                n.start_soon(post, gw, body, TEAM_A)
                await wait_until(lambda: rt.pool.principal_loads().get("team-a") == (1, 0))
                used, _ = window(rt, "team-a", "tokens_per_minute", clock)
                assert used > 200  # input estimate + 200 reserved
                second = await http_request(
                    gw.host_port, "POST", CHAT, body=chat(max_tokens=200), headers=auth(TEAM_A)
                )
                assert second.status == 429, second.body
                err = second.json()["error"]
                assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
                assert second.header("retry-after") == "60"
                # team-b has no limits: it passes, with no rate-limit headers.
                other = await http_request(
                    gw.host_port, "POST", CHAT, body=chat(max_tokens=200), headers=auth(TEAM_B)
                )
                assert other.status == 200
                assert other.header("x-ratelimit-limit-tokens") is None
            # Settled with the metered usage: the unused reservation is back.
            await settled(gw)
            used, remaining = window(rt, "team-a", "tokens_per_minute", clock)
            done = await http_request(
                gw.host_port, "POST", CHAT, body=chat("x y", max_tokens=20), headers=auth(TEAM_A)
            )
            usage = done.json()["usage"]
            await settled(gw)
            after, _ = window(rt, "team-a", "tokens_per_minute", clock)
            assert after - used == usage["prompt_tokens"] + usage["completion_tokens"]
            assert done.header("x-ratelimit-remaining-tokens") is not None
            assert_nothing_held(gw, clock)


async def test_reservation_larger_than_the_limit_is_400_without_retry_after() -> None:
    yaml = echo_yaml(auth=principals_block(), pool=limits_block("tokens_per_minute: 100"))
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            clock = Clock(gw.runtime)
            resp = await http_request(
                gw.host_port,
                "POST",
                CHAT,
                body=chat(max_completion_tokens=1000),
                headers=auth(TEAM_A),
            )
            assert resp.status == 400, resp.body
            err = resp.json()["error"]
            assert err["param"] == "max_completion_tokens"
            assert resp.header("retry-after") is None
            assert resp.header("x-ratelimit-remaining-tokens") == "100"
            # Without max_tokens the default is cut to the limit: admitted.
            ok = await http_request(gw.host_port, "POST", CHAT, body=chat(), headers=auth(TEAM_A))
            assert ok.status == 200, ok.body
            assert window(gw.runtime, "team-a", "requests_per_minute", clock)[0] == 1


async def test_not_admitted_requests_do_not_count() -> None:
    """A 404 model, a 400 body, or no live candidate (502) never reaches the limits."""
    yaml = echo_yaml(auth=principals_block(), pool=limits_block("requests_per_minute: 1"))
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            clock = Clock(gw.runtime)
            for body in (chat(model="nope"), {"model": "echo", "messages": "no"}):
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                assert resp.status in (400, 404)
                assert resp.header("x-ratelimit-remaining-requests") == "1"
            gw.kill_node("node-a")
            await wait_until(lambda: gw.runtime.hub.connected_since("node-a") is None)
            resp = await http_request(gw.host_port, "POST", CHAT, body=chat(), headers=auth(TEAM_A))
            assert resp.status == 502, resp.body
            assert window(gw.runtime, "team-a", "requests_per_minute", clock) == (0, 1)
            assert_nothing_held(gw, clock)


# ------------------------------------------------------------------ accounting


async def test_exact_accounting_under_a_cancel_storm() -> None:
    """Half the streams are cut by their callers mid-way: every reservation is settled."""
    yaml = echo_yaml(
        delay_ms=20,
        capacity=3,
        auth=principals_block(),
        pool=limits_block(
            "requests_per_minute: 1000, tokens_per_minute: 1000000, tokens_per_day: 10000000,"
            " max_concurrent: 2"
        ),
    )
    text = " ".join(f"w{i}" for i in range(20))
    with trio.fail_after(60):
        async with running_gateway(yaml) as gw:
            rt = gw.runtime
            clock = Clock(rt)
            statuses: list[int] = []
            cuts: dict[int, trio.CancelScope] = {}

            async def one(i: int) -> None:
                body = chat(text, stream=True, max_tokens=50)
                if i % 2:
                    with cuts.setdefault(i, trio.CancelScope()):
                        await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                else:
                    resp = await http_request(
                        gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A)
                    )
                    statuses.append(resp.status)

            async with trio.open_nursery() as n:
                for i in range(16):
                    n.start_soon(one, i)
                # Cut once every request is admitted (a caller gone before the edge
                # read its request was never one), some streaming, most queued.
                await wait_until(lambda: window(rt, "team-a", "requests_per_minute", clock)[0] == 16)
                for i, scope in cuts.items():
                    scope.deadline = trio.current_time() + 0.01 * (i % 5)
            await wait_until(lambda: rt.pool.principal_loads() == {})
            await wait_until(lambda: rt.limiter.status_of("team-a", clock()).admitted == 0)
            assert statuses == [200] * 8
            # Each request counted once, the cut ones too.
            assert window(rt, "team-a", "requests_per_minute", clock)[0] == 16
            assert_nothing_held(gw, clock)


async def test_exact_accounting_when_the_node_is_lost() -> None:
    yaml = echo_yaml(
        delay_ms=50,
        auth=principals_block(),
        pool=limits_block("requests_per_minute: 100, tokens_per_minute: 1000000"),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            rt = gw.runtime
            clock = Clock(rt)
            statuses: list[int] = []

            async def one() -> None:
                body = chat("a b c d e f g h i j k l", max_tokens=30)
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                statuses.append(resp.status)

            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(one)
                await wait_until(lambda: rt.pool.principal_loads().get("team-a") == (4, 0))
                held, _ = window(rt, "team-a", "tokens_per_minute", clock)
                gw.kill_node("node-a")
            assert sorted(statuses) == [502] * 4
            # No usage was metered: the full reservations stay in the window.
            assert window(rt, "team-a", "tokens_per_minute", clock)[0] == held
            assert window(rt, "team-a", "requests_per_minute", clock)[0] == 4
            assert_nothing_held(gw, clock)


# ------------------------------------------------------------------ concurrency


async def test_a_principal_at_max_concurrent_waits_without_holding_a_slot() -> None:
    yaml = echo_yaml(
        delay_ms=30,
        capacity=4,
        auth=principals_block(),
        pool=limits_block("max_concurrent: 1, requests_per_minute: 100"),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            rt = gw.runtime
            clock = Clock(rt)
            body = chat("a b c d e f g h i j", max_tokens=20)
            done: list[str] = []

            async def a(tag: str) -> None:
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                assert resp.status == 200, resp.body
                done.append(tag)

            async with trio.open_nursery() as n:
                n.start_soon(a, "a1")
                await wait_until(lambda: rt.pool.principal_loads().get("team-a") == (1, 0))
                n.start_soon(a, "a2")
                await wait_until(lambda: rt.pool.principal_loads().get("team-a") == (1, 1))
                # The waiter holds no provider slot; another principal runs at once.
                assert rt.pool.provider_loads()["echo-1"].in_flight == 1
                status = await get_json(admin_host_port(gw), "/status")
                row = next(p for p in status["principals"] if p["principal_ref"] == "team-a")
                assert (row["in_flight"], row["queued"], row["max_concurrent"]) == (1, 1, 1)
                assert row["requests_per_minute"]["remaining"] == 98
                assert "team-a" in format_principals(status)
                other = await http_request(
                    gw.host_port, "POST", CHAT, body=chat("x"), headers=auth(TEAM_B)
                )
                assert other.status == 200 and done == []
            assert done == ["a1", "a2"]
            assert_nothing_held(gw, clock)


# ------------------------------------------------------------------ refresh


async def test_refresh_keeps_the_counters_and_applies_the_new_limit() -> None:
    yaml = echo_yaml(auth=principals_block(), pool=limits_block("requests_per_minute: 5"))
    with trio.fail_after(30):
        async with running_gateway(yaml) as gw:
            rt = gw.runtime
            clock = Clock(rt)
            for _ in range(2):
                ok = await http_request(gw.host_port, "POST", CHAT, body=chat(), headers=auth(TEAM_A))
                assert ok.status == 200
            lowered = echo_yaml(auth=principals_block(), pool=limits_block("requests_per_minute: 2"))
            from tests.support.gateway import edge_config

            rt._swap(edge_config(lowered), changed=True)
            resp = await http_request(gw.host_port, "POST", CHAT, body=chat(), headers=auth(TEAM_A))
            assert resp.status == 429
            assert resp.header("x-ratelimit-limit-requests") == "2"
            assert window(rt, "team-a", "requests_per_minute", clock) == (2, 0)


# ------------------------------------------------------------------ passthrough


@pytest.mark.parametrize("stream", [False, True])
async def test_passthrough_edge_values_replace_the_providers_headers(stream: bool) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)

            def handler(req: RecordedRequest) -> MockReply | None:
                if req.method != "POST":
                    return None
                reply = mock.route(req)
                reply.headers = [
                    ("x-ratelimit-limit-requests", "9999"),
                    ("x-ratelimit-remaining-requests", "9998"),
                    ("x-ratelimit-remaining-tokens", "123"),
                    *reply.headers,
                ]
                return reply

            mock.handler = handler
            yaml = remote_yaml(
                mock.base_url,
                openai_extra=principals_block(),
                pool=limits_block("requests_per_minute: 4"),
            )
            async with running_gateway(yaml) as gw:
                Clock(gw.runtime)
                body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}]}
                if stream:
                    body["stream"] = True
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                assert resp.status == 200, resp.body
                names = [k.lower() for k, _ in resp.headers]
                assert names.count("x-ratelimit-limit-requests") == 1
                assert resp.header("x-ratelimit-limit-requests") == "4"
                assert resp.header("x-ratelimit-remaining-requests") == "3"
                # Tokens are not limited for team-a: the provider's own value passes.
                assert resp.header("x-ratelimit-remaining-tokens") == "123"
                # Unlimited principal: the provider's headers pass untouched.
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_B))
                assert resp.header("x-ratelimit-limit-requests") == "9999"
            n.cancel_scope.cancel()


# ------------------------------------------------------------------ settled by what was relayed

def _remote_yaml(url: str, limits: str) -> str:
    return remote_yaml(url, openai_extra=principals_block(), pool=limits_block(limits))


async def test_a_stream_without_usage_settles_the_output_it_relayed() -> None:
    """TPM 2000, no max_tokens: the reservation is cut to 2000, but the 3,000
    tokens relayed are what the window records (the overshoot as debt)."""
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.handler = lambda req: no_usage_stream() if req.method == "POST" else None
            async with running_gateway(_remote_yaml(mock.base_url, "tokens_per_minute: 2000")) as gw:
                clock = Clock(gw.runtime)
                body = {"model": "remote", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                assert resp.status == 200 and resp.body.count(b'"content"') == NO_USAGE_PIECES
                await settled(gw)
                used, remaining = window(gw.runtime, "team-a", "tokens_per_minute", clock)
                assert used == 1 + NO_USAGE_PIECES * 10 and remaining == 0  # input "hi" + output
                # In debt: the next request waits, whatever it asks for.
                resp = await http_request(gw.host_port, "POST", CHAT, body=body, headers=auth(TEAM_A))
                assert resp.status == 429
                assert_nothing_held(gw, clock)
            n.cancel_scope.cancel()


async def test_a_caller_that_hangs_up_is_settled_with_what_was_relayed() -> None:
    """The caller reads part of a stream without usage and leaves: at least what
    reached it counts, never less than the reservation."""
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            mock.handler = lambda req: no_usage_stream(0.005) if req.method == "POST" else None
            async with running_gateway(_remote_yaml(mock.base_url, "tokens_per_minute: 500")) as gw:
                clock = Clock(gw.runtime)
                body = json.dumps(
                    {"model": "remote", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                ).encode()
                host, port = gw.host_port
                sock = await trio.open_tcp_stream(host, port)
                await sock.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    + f"authorization: Bearer {TEAM_A}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                got = b""
                while got.count(b'"content"') < 120:
                    data = await sock.receive_some(65536)
                    assert data
                    got += data
                await sock.aclose()
                rt = gw.runtime
                await wait_until(lambda: not rt.limiter.status_of("team-a", clock()).admitted)
                used, _ = window(rt, "team-a", "tokens_per_minute", clock)
                assert used >= 1 + got.count(b'"content"') * 10 > 500
                assert used < 1 + NO_USAGE_PIECES * 10  # the caller left before the end
                assert_nothing_held(gw, clock)
            n.cancel_scope.cancel()


async def test_tpm_4096_admits_every_request_without_max_tokens_after_a_small_one() -> None:
    with trio.fail_after(30):
        async with running_gateway(
            echo_yaml(openai_extra=principals_block(), pool=limits_block("tokens_per_minute: 4096"))
        ) as gw:
            clock = Clock(gw.runtime)
            resp = await http_request(
                gw.host_port, "POST", CHAT, body=chat("hi", max_tokens=3), headers=auth(TEAM_A)
            )
            assert resp.status == 200
            for _ in range(5):
                resp = await http_request(gw.host_port, "POST", CHAT, body=chat("hi"), headers=auth(TEAM_A))
                assert resp.status == 200, resp.body
            assert_nothing_held(gw, clock)
