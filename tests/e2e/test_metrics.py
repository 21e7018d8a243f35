"""End to end: usage metering and gateway metrics as an operator scrapes them.

Every test runs a real edge (tests/support/gateway.py) with a real node, a mock model
server (tests/support/mock_providers.py) or a scripted ``FakeNode`` (tests/support/wire_peers.py),
sends requests over real sockets, then parses the admin ``/metrics`` with
``prometheus_client``'s own parser and checks the *exact* change of every
series between two scrapes: the numbers must be what the provider reported,
each counted once, under the right labels -- and no other series may move.

The last test drives ``NodeHub``'s metering hooks directly over memory streams
under ``autojump_clock`` (exact frame counts, heartbeat and handshake timeouts).
Where the real node cannot produce a case (a tunnel usage frame next to the
body usage; usage reported before a cancel), a scripted ``FakeNode`` does.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from iopd.edge.nodes.hub import NodeHub
from iopd.tokens import estimate_input_tokens
from tests.support.gateway import (
    Gateway,
    RawResponse,
    http_request,
    node_token,
    running_gateway,
    wait_until,
)
from tests.support.hubs import make_hub
from tests.support.metered import (
    ALICE,
    BOB,
    EDGE_ID,
    LEGACY_TOKEN,
    NO_ALIAS_TOKEN,
    PRINCIPAL_TOKEN,
    UNMAPPED,
    assert_no_reasoning,
    chat,
    gateway_with_fake_node,
    gateway_yaml,
    reasoning,
    req,
    tokens,
    wait_requests,
)
from tests.support.metrics import LabelSet, Scrape, changes, scrape
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer
from tests.support.replies import sse_events
from tests.support.wire_peers import FakeNode, HubRecorder
from wire import scram
from wire.connection import Connection, Role
from wire.framing import encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Challenge,
    Credit,
    Hello,
    NodeConfig,
    NodeConfigAck,
    Proof,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
    Usage,
)

# ------------------------------------------------------------------ echo (run_event)


async def test_echo_non_stream_and_stream_run_event_usage_per_principal() -> None:
    """Input = the input-token estimate over every text part the node receives; output = chunks."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first part, "},
                {"type": "text", "text": "hello  there world"},
            ],
        },
    ]
    # 14 + 12 + 18 = 44 code points -> 11 input tokens; the echo answers the last user
    # message's text parts joined, "first part, hello  there world": 5 chunks.
    chars = len("You are terse.") + len("first part, ") + len("hello  there world")
    assert estimate_input_tokens(messages) == math.ceil(chars / 4) == 11
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(auth=True)) as gw:
            before = await scrape(gw)
            r = await chat(gw, {"model": "echo", "messages": messages}, token=PRINCIPAL_TOKEN)
            assert r.status == 200
            doc = r.json()
            assert doc["choices"][0]["message"]["content"] == "first part, hello  there world"
            usage = doc["usage"]
            r = await chat(
                gw,
                {
                    "model": "echo",
                    "messages": [{"role": "user", "content": "one two three four"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                token=LEGACY_TOKEN,
            )
            assert r.status == 200
            stream_usage = [e["usage"] for e in sse_events(r.body) if e.get("usage")]
            # A principal without an alias: principal_alias shows its principal_ref.
            r = await chat(
                gw,
                {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
                token=NO_ALIAS_TOKEN,
            )
            assert r.status == 200
            after = await wait_requests(gw, before, 3)

    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (11, 5)
    assert [(u["prompt_tokens"], u["completion_tokens"]) for u in stream_usage] == [(5, 4)]
    alice = req(ALICE, group="echo")
    legacy = req(UNMAPPED, group="echo")
    bob = req(BOB, group="echo")
    assert changes(before, after, "iop_openai_requests_total") == {alice: 1, legacy: 1, bob: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(alice, "run_event", input=11, output=5),
        **tokens(legacy, "run_event", input=5, output=4),  # ceil(18/4), 4 chunks
        **tokens(bob, "run_event", input=1, output=1),
    }
    assert_no_reasoning(before, after)
    hist = changes(before, after, "iop_request_duration_seconds_count")
    assert hist == {
        frozenset(
            {
                "edge_id": EDGE_ID,
                "endpoint": "chat_completions",
                "response_mode": "normalized",
            }.items()
        ): 3
    }


async def test_open_caller_and_responses_endpoint_are_unmapped() -> None:
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml()) as gw:
            before = await scrape(gw)
            r = await chat(gw, {"model": "echo", "messages": [{"role": "user", "content": "a b"}]})
            assert r.status == 200
            r = await chat(gw, {"model": "echo", "input": "x y z"}, path="/v1/responses")
            assert r.status == 200
            after = await wait_requests(gw, before, 2)
    chat_l = req(UNMAPPED, group="echo")
    resp_l = req(UNMAPPED, group="echo", endpoint="responses")
    assert changes(before, after, "iop_openai_requests_total") == {chat_l: 1, resp_l: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(chat_l, "run_event", input=1, output=2),
        **tokens(resp_l, "run_event", input=2, output=3),
    }


# ------------------------------------------------------------------ passthrough (provider_body)


@asynccontextmanager
async def gateway_with_mocks(
    **kw: Any,
) -> AsyncIterator[tuple[Gateway, MockOpenAIServer, MockOllamaServer]]:
    """A gateway whose node-a also serves ``gpt`` (mock OpenAI) and ``llama`` (mock Ollama)."""
    async with trio.open_nursery() as nursery:
        oai = MockOpenAIServer()
        oll = MockOllamaServer()
        await nursery.start(oai.serve)
        await nursery.start(oll.serve)
        yaml_text = gateway_yaml(openai_base=oai.base_url, ollama_base=oll.base_url, **kw)
        async with running_gateway(yaml_text) as gw:
            yield gw, oai, oll
        nursery.cancel_scope.cancel()


async def test_passthrough_non_stream_counts_the_providers_body_usage() -> None:
    with trio.fail_after(30):
        async with gateway_with_mocks(auth=True) as (gw, oai, _):
            oai.usage = {
                "prompt_tokens": 23,
                "completion_tokens": 9,
                "total_tokens": 32,
                "prompt_tokens_details": {"cached_tokens": 4},
            }
            before = await scrape(gw)
            r = await chat(
                gw,
                {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]},
                token=PRINCIPAL_TOKEN,
            )
            assert r.status == 200 and r.json()["usage"] == oai.usage
            # /v1/responses: the mock reports reasoning 3 and cached 2 in *_details.
            r = await chat(
                gw, {"model": "gpt", "input": "hi"}, token=PRINCIPAL_TOKEN, path="/v1/responses"
            )
            assert r.status == 200
            assert r.json()["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
            after = await wait_requests(gw, before, 2)
    chat_l = req(ALICE, group="gpt", mode="passthrough")
    resp_l = req(ALICE, group="gpt", mode="passthrough", endpoint="responses")
    assert changes(before, after, "iop_openai_requests_total") == {chat_l: 1, resp_l: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(chat_l, "provider_body", input=23, output=9, cached_input=4),
        **tokens(resp_l, "provider_body", input=23, output=9, reasoning=3, cached_input=2),
    }
    # Reasoning tokens reported, no reasoning text seen: nothing observed or estimated.
    assert_no_reasoning(before, after)


async def test_passthrough_sse_usage_chunk_counted_once_and_no_usage_counts_nothing() -> None:
    with trio.fail_after(30):
        async with gateway_with_mocks() as (gw, oai, _):
            oai.usage = {"prompt_tokens": 31, "completion_tokens": 4, "total_tokens": 35}
            before = await scrape(gw)
            body = {
                "model": "gpt",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await chat(gw, body)
            assert r.status == 200
            assert [e["usage"] for e in sse_events(r.body) if e.get("usage")] == [oai.usage]
            mid = await wait_requests(gw, before, 1)
            # A stream without a usage chunk: the request counts, tokens do not (never guessed).
            r = await chat(gw, {**body, "stream_options": {"include_usage": False}})
            assert r.status == 200
            assert not [e for e in sse_events(r.body) if e.get("usage")]
            after = await wait_requests(gw, mid, 1)
    labels = req(UNMAPPED, group="gpt", mode="passthrough")
    assert changes(before, mid, "iop_openai_usage_tokens_total") == tokens(
        labels, "provider_body", input=31, output=4
    )
    assert changes(mid, after, "iop_openai_requests_total") == {labels: 1}
    assert changes(mid, after, "iop_openai_usage_tokens_total") == {}
    assert_no_reasoning(before, after)


async def test_provider_reported_reasoning_tokens_are_a_token_type_never_an_estimate() -> None:
    thought = "Let me think about it carefully."
    with trio.fail_after(30):
        async with gateway_with_mocks() as (gw, oai, _):
            oai.reasoning_text = thought
            oai.usage = {
                "prompt_tokens": 12,
                "completion_tokens": 20,
                "completion_tokens_details": {"reasoning_tokens": 6},
            }
            before = await scrape(gw)
            r = await chat(gw, {"model": "gpt", "messages": [{"role": "user", "content": "q"}]})
            assert r.status == 200
            assert r.json()["choices"][0]["message"]["reasoning_content"] == thought
            # A /v1/responses stream: reasoning_text deltas, and response.completed's usage
            # (the mock reports reasoning 3 and cached 2 there).
            r = await chat(gw, {"model": "gpt", "input": "q", "stream": True}, path="/v1/responses")
            assert r.status == 200
            after = await wait_requests(gw, before, 2)
    labels = req(UNMAPPED, group="gpt", mode="passthrough")
    resp_l = req(UNMAPPED, group="gpt", mode="passthrough", endpoint="responses")
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(labels, "provider_body", input=12, output=20, reasoning=6),
        **tokens(resp_l, "provider_body", input=12, output=20, reasoning=3, cached_input=2),
    }
    r_l = reasoning(UNMAPPED, "gpt")
    r_resp = reasoning(UNMAPPED, "gpt", "responses")
    assert changes(before, after, "iop_openai_reasoning_observed_total") == {r_l: 1, r_resp: 1}
    assert changes(before, after, "iop_openai_reasoning_chars_total") == {
        r_l: len(thought),
        r_resp: len(thought),
    }
    assert changes(before, after, "iop_openai_reasoning_estimated_tokens_total") == {}


async def test_reasoning_text_without_reported_tokens_is_observed_and_estimated() -> None:
    """Passthrough ``reasoning_content`` deltas, normalized ollama ``thinking`` and a raw
    ``/api/chat`` relay: observed/chars/estimated move, ``token_type=reasoning`` never."""
    thought = "pondering the question deeply"  # 29 code points -> estimate 8
    thinking = "hmm let me see"  # 14 -> 4
    with trio.fail_after(30):
        async with gateway_with_mocks() as (gw, oai, oll):
            oai.reasoning_text = thought
            oai.usage = {"prompt_tokens": 5, "completion_tokens": 17}
            oll.reasoning_text = thinking
            before = await scrape(gw)
            r = await chat(
                gw,
                {
                    "model": "gpt",
                    "messages": [{"role": "user", "content": "q"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            assert r.status == 200
            for stream in (False, True):
                r = await chat(
                    gw,
                    {
                        "model": "llama",
                        "messages": [{"role": "user", "content": "q"}],
                        "stream": stream,
                    },
                )
                assert r.status == 200
            r = await chat(
                gw,
                {"model": "llama", "messages": [{"role": "user", "content": "q"}]},
                path="/api/chat",
            )
            assert r.status == 200
            after = await wait_requests(gw, before, 4)
    gpt = req(UNMAPPED, group="gpt", mode="passthrough")
    llama = req(UNMAPPED, group="llama")
    api = req(UNMAPPED, group="llama", mode="passthrough", endpoint="api")
    assert changes(before, after, "iop_openai_requests_total") == {gpt: 1, llama: 2, api: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(gpt, "provider_body", input=5, output=17),
        **tokens(llama, "run_event", input=2 * 13, output=2 * 5),  # prompt_eval/eval_count
        **tokens(api, "provider_body", input=13, output=5),
    }
    r_gpt, r_llama, r_api = (
        reasoning(UNMAPPED, "gpt"),
        reasoning(UNMAPPED, "llama"),
        reasoning(UNMAPPED, "llama", "api"),
    )
    assert changes(before, after, "iop_openai_reasoning_observed_total") == {
        r_gpt: 1,
        r_llama: 2,
        r_api: 1,
    }
    assert changes(before, after, "iop_openai_reasoning_chars_total") == {
        r_gpt: len(thought),
        r_llama: 2 * len(thinking),
        r_api: len(thinking),
    }
    method = ("estimation_method", "chars_div_4")
    assert changes(before, after, "iop_openai_reasoning_estimated_tokens_total") == {
        r_gpt | {method}: math.ceil(len(thought) / 4),
        r_llama | {method}: 2 * math.ceil(len(thinking) / 4),
        r_api | {method}: math.ceil(len(thinking) / 4),
    }


# ------------------------------------------------------------------ scripted node


async def test_tunnel_frame_usage_supplements_body_usage_without_double_count() -> None:
    """The real node sends only ``body_usage`` today; a scripted node sends both kinds.

    Body input/output win over the frame's; the frame's reasoning/cached_input
    fill what the body lacked (source ``tunnel_frame``); a frame-only usage is
    counted as ``tunnel_frame``.
    """
    usages = [
        (
            Usage(input_tokens=10, output_tokens=6),
            Usage(input_tokens=99, output_tokens=99, reasoning_tokens=2, cached_input_tokens=3),
        ),
        (None, Usage(input_tokens=8, output_tokens=4)),
    ]

    def script(r: RunRequest | ProviderTunnelRequest) -> list[ProviderTunnelFrame]:
        assert isinstance(r, ProviderTunnelRequest)
        body_usage, frame_usage = usages.pop(0)
        sid = r.stream_id
        return [
            ProviderTunnelFrame(
                stream_id=sid,
                kind="head",
                status=200,
                headers=[("content-type", "application/json")],
            ),
            ProviderTunnelFrame(stream_id=sid, kind="body", data=b'{"ok": true}'),
            ProviderTunnelFrame(
                stream_id=sid, kind="usage", body_usage=body_usage, usage=frame_usage
            ),
            ProviderTunnelFrame(stream_id=sid, kind="end"),
        ]

    with trio.fail_after(30):
        async with gateway_with_fake_node(script) as (gw, _node):
            before = await scrape(gw)
            body = {"model": "fake-pt", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(2):
                r = await chat(gw, body)
                assert r.status == 200 and r.body == b'{"ok": true}'
            after = await wait_requests(gw, before, 2)
    labels = req(UNMAPPED, group="fake-pt", mode="passthrough")
    assert changes(before, after, "iop_openai_requests_total") == {labels: 2}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(labels, "provider_body", input=10, output=6),
        **tokens(labels, "tunnel_frame", input=8, output=4, reasoning=2, cached_input=3),
    }
    assert_no_reasoning(before, after)


async def _stream_until(
    gw: Gateway, body: dict[str, Any], marker: bytes, *, headers: Sequence[tuple[str, str]] = ()
) -> bytes:
    """POST a streaming chat request, read until ``marker`` shows up, then hang up."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n"
    ).encode()
    head += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers)
    stream = await trio.open_tcp_stream(*gw.host_port)
    seen = b""
    async with stream:
        await stream.send_all(head + b"\r\n" + payload)
        while marker not in seen:
            data = await stream.receive_some(65536)
            assert data, "the edge closed the stream before the marker"
            seen += data
    return seen


async def test_cancelled_stream_counts_usage_reported_before_the_cancel_once() -> None:
    with trio.fail_after(30):
        async with gateway_with_fake_node() as (gw, node):
            before = await scrape(gw)
            body = {
                "model": "fake",
                "messages": [{"role": "user", "content": "a b c"}],
                "stream": True,
            }

            async def play_node() -> None:
                run = await node.receive(RunRequest)
                sid = run.stream_id
                usage = Usage(input_tokens=7, output_tokens=2)
                for ev in (
                    RunEvent(stream_id=sid, kind="text", text="a "),
                    RunEvent(stream_id=sid, kind="usage", usage=usage),
                    RunEvent(stream_id=sid, kind="text", text="MARK "),  # usage fed by now
                ):
                    await node.send(ev)
                cancel = await node.receive(Cancel)
                assert cancel.stream_id == sid
                refund = await node.receive(Credit)  # the 3 frames it read, posted with Cancel
                assert (refund.stream_id, refund.frames) == (sid, 3)
                # Late usage after the cancel (a node's final count) must not count again.
                late = Usage(input_tokens=7, output_tokens=3)
                await node.send(RunEvent(stream_id=sid, kind="usage", usage=late))
                dropped = await node.receive(Credit)  # the edge read and dropped it
                assert (dropped.stream_id, dropped.frames) == (sid, 1)
                await node.send(RunEvent(stream_id=sid, kind="error", code="cancelled"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(play_node)
                await _stream_until(gw, body, b"MARK")
            after = await wait_requests(gw, before, 1)
    labels = req(UNMAPPED, group="fake", status="cancelled")
    assert changes(before, after, "iop_openai_requests_total") == {labels: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == tokens(
        labels, "run_event", input=7, output=2
    )


async def test_cancelled_echo_stream_is_cancelled_and_counts_no_unreported_usage() -> None:
    """The echo node reports its usage only in the terminal after the cancel, which the
    edge no longer reads: the request counts as ``cancelled`` with no tokens (what the
    edge was told before the cancel -- nothing -- is what it counts)."""
    words = " ".join(f"w{i}" for i in range(100))
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(delay_ms=100, capacity=1)) as gw:
            before = await scrape(gw)
            body = {
                "model": "echo",
                "messages": [{"role": "user", "content": words}],
                "stream": True,
            }
            await _stream_until(gw, body, b"w1 ")
            after = await wait_requests(gw, before, 1)
            pool = gw.runtime.pool
            await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 0)
    labels = req(UNMAPPED, group="echo", status="cancelled")
    assert changes(before, after, "iop_openai_requests_total") == {labels: 1}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {}


# ------------------------------------------------------------------ failures


async def test_auth_failure_is_auth_error_unmapped_and_model_unknown() -> None:
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(auth=True)) as gw:
            before = await scrape(gw)
            body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
            r = await chat(gw, body, token="sk-wrong-token")
            assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await chat(gw, body)  # no token at all
            assert r.status == 401
            after = await wait_requests(gw, before, 2)
    labels = req(UNMAPPED, group="unknown", status="auth_error")
    assert changes(before, after, "iop_openai_requests_total") == {labels: 2}
    assert changes(before, after, "iop_openai_usage_tokens_total") == {}
    assert changes(before, after, "iop_dispatch_wait_seconds_count") == {}


def wait_series(group: str, outcome: str) -> LabelSet:
    return frozenset({"edge_id": EDGE_ID, "model_group": group, "outcome": outcome}.items())


async def test_queue_timeout_and_health_gauges_at_scrape() -> None:
    """One slow request holds the only slot; a second waits (queue depth 1, gauges
    read live at scrape) and times out: 503, ``status=queue_timeout``, one timed-out
    waiter and one ``outcome=queue_timeout`` dispatch wait of at least its timeout."""
    pool_yaml = "provider_pool: {max_queue: 4, queue_timeout: 0.5}"
    words = " ".join(f"w{i}" for i in range(12))  # 12 chunks at 100 ms
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(delay_ms=100, capacity=2, pool=pool_yaml)) as gw:
            pool = gw.runtime.pool
            idle = await scrape(gw)
            assert idle.get("iop_connected_nodes") == 1
            assert idle.get("iop_queue_depth") == 0 and idle.get("iop_queue_max") == 4
            assert idle.get("iop_provider_in_flight", provider_id="echo-1") == 0
            assert idle.get("iop_provider_load_ratio", provider_id="echo-1") == 0
            assert idle.get("iop_provider_capacity", provider_id="echo-1") == 2
            slow = {"model": "echo", "messages": [{"role": "user", "content": words}]}
            replies: list[RawResponse] = []

            async def call(body: dict[str, Any]) -> None:
                replies.append(await chat(gw, body))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, slow)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                one = await scrape(gw)
                assert one.get("iop_provider_in_flight", provider_id="echo-1") == 1
                assert one.get("iop_provider_load_ratio", provider_id="echo-1") == 0.5
                nursery.start_soon(call, slow)
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 2)
                nursery.start_soon(call, {**slow, "messages": [{"role": "user", "content": "x"}]})
                await wait_until(lambda: pool.queue_depth == 1)
                full = await scrape(gw)
                assert full.get("iop_provider_in_flight", provider_id="echo-1") == 2
                assert full.get("iop_provider_load_ratio", provider_id="echo-1") == 1.0
                assert full.get("iop_queue_depth") == 1
                assert full.get("iop_connected_nodes") == 1
            after = await wait_requests(gw, idle, 3)
    statuses = sorted(r.status for r in replies)
    assert statuses == [200, 200, 503]
    timed_out = next(r for r in replies if r.status == 503)
    assert timed_out.json()["error"]["code"] == "queue_timeout"
    ok = req(UNMAPPED, group="echo")
    late = req(UNMAPPED, group="echo", status="queue_timeout")
    assert changes(idle, after, "iop_openai_requests_total") == {ok: 2, late: 1}
    assert changes(idle, after, "iop_openai_usage_tokens_total") == tokens(
        ok, "run_event", input=2 * math.ceil(len(words) / 4), output=2 * 12
    )
    assert changes(idle, after, "iop_queue_waiters_timed_out_total") == {
        frozenset({("edge_id", EDGE_ID)}): 1
    }
    assert changes(idle, after, "iop_dispatch_wait_seconds_count") == {
        wait_series("echo", "admitted"): 2,
        wait_series("echo", "queue_timeout"): 1,
    }
    # Waited its whole queue_timeout (0.5 s): not in any bucket below 0.5.
    buckets = changes(idle, after, "iop_dispatch_wait_seconds_bucket")
    timeout_buckets = {
        float(dict(ls)["le"]): n
        for ls, n in buckets.items()
        if dict(ls)["outcome"] == "queue_timeout"
    }
    assert min(timeout_buckets) >= 0.5 and timeout_buckets[math.inf] == 1


# ------------------------------------------------------------------ wire


async def _scrape_until(gw: Gateway, pred: Callable[[Scrape], bool]) -> Scrape:
    while True:
        s = await scrape(gw)
        if pred(s):
            return s
        await trio.sleep(0.01)


async def test_wire_frames_counted_and_bad_peers_count_protocol_errors() -> None:
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(fake_node=True), nodes=["node-a"]) as gw:
            host, port = gw.handle.wire
            before = await scrape(gw)
            r = await chat(
                gw, {"model": "echo", "messages": [{"role": "user", "content": "a b c"}]}
            )
            assert r.status == 200
            moved = await scrape(gw)
            frames = changes(before, moved, "iop_wire_frames_total")
            # Out: at least the RunRequest; in: 3 text events + usage + complete.
            assert frames[frozenset({("edge_id", EDGE_ID), ("direction", "out")})] >= 1
            assert frames[frozenset({("edge_id", EDGE_ID), ("direction", "in")})] >= 5
            assert changes(before, moved, "iop_wire_protocol_errors_total") == {}

            def errors(reason: str) -> LabelSet:
                return frozenset({("edge_id", EDGE_ID), ("reason", reason)})

            # An undecodable frame after a good handshake: malformed.
            async with FakeNode.connect(
                host, port, node_id="node-f", token=node_token("node-f")
            ) as node:
                await wait_until(lambda: gw.runtime.hub.session("node-f") is not None)
                await node.send_raw(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
                await node.wait_closed()
            s1 = await _scrape_until(gw, lambda s: s.get("iop_wire_protocol_errors_total") >= 1)
            assert changes(moved, s1, "iop_wire_protocol_errors_total") == {errors("malformed"): 1}
            # A length prefix over max_frame_bytes: frame_too_large, before any payload.
            async with FakeNode.connect(
                host, port, node_id="node-f", token=node_token("node-f")
            ) as node:
                await wait_until(lambda: gw.runtime.hub.session("node-f") is not None)
                await node.send_raw(struct.pack(">I", 16 * 1024 * 1024 + 1))
                await node.wait_closed()
            s2 = await _scrape_until(gw, lambda s: s.get("iop_wire_protocol_errors_total") >= 2)
            assert changes(s1, s2, "iop_wire_protocol_errors_total") == {
                errors("frame_too_large"): 1
            }
            # A wrong node token: refused at the handshake.
            async with FakeNode.connect(
                host, port, node_id="node-f", token="not-the-token"
            ) as node:
                assert isinstance(node.hello_reply, Refused)
            s3 = await _scrape_until(gw, lambda s: s.get("iop_wire_protocol_errors_total") >= 3)
            assert changes(s2, s3, "iop_wire_protocol_errors_total") == {errors("handshake"): 1}
            # The good node never noticed.
            assert s3.get("iop_connected_nodes") == 1
            r = await chat(gw, {"model": "echo", "messages": [{"role": "user", "content": "ok"}]})
            assert r.status == 200


# ------------------------------------------------------------------ canaries


async def test_no_secret_prompt_response_or_id_reaches_metrics_or_status() -> None:
    canaries = {
        "bad_token": "sk-canary-badtoken-5d1e",
        "provider_key": "pk-canary-provider-9b2c",
        "prompt": "canary-prompt-text-3e8f",
        "response": "canary-response-text-a41d",
        "reasoning": "canary-reasoning-text-77aa",
        "meta_value": "canary-meta-value-0c3b",
        "meta_key": "canary_meta_key_61f0",
        "model": "canary-model-name-2d9e",
        "user": "canary-user-field-8e13",
    }
    secrets = [PRINCIPAL_TOKEN, LEGACY_TOKEN, NO_ALIAS_TOKEN, *canaries.values()]
    provider_auth = (
        "  provider_auth: {header: X-Provider-Authorization, target_header: Authorization}\n"
    )
    seen_ids: list[str] = []
    with trio.fail_after(30):
        async with gateway_with_mocks(auth=True, openai_extra=provider_auth) as (gw, oai, oll):
            oai.reply_text = canaries["response"]
            oai.reasoning_text = canaries["reasoning"]
            oll.reply_text = canaries["response"]
            oll.reasoning_text = canaries["reasoning"]
            meta = {"note": canaries["meta_value"], canaries["meta_key"]: "v"}
            prompt = [{"role": "user", "content": f"say {canaries['prompt']}"}]
            pa = [("x-provider-authorization", canaries["provider_key"])]
            calls: list[tuple[str, dict[str, Any], str | None]] = []
            for model in ("echo", "gpt", "llama"):
                for stream in (False, True):
                    body = {
                        "model": model,
                        "messages": prompt,
                        "metadata": meta,
                        "user": canaries["user"],
                        "stream": stream,
                    }
                    calls.append(("/v1/chat/completions", body, PRINCIPAL_TOKEN))
                    calls.append(("/v1/chat/completions", body, LEGACY_TOKEN))
            calls.append(
                ("/v1/chat/completions", {"model": "echo", "messages": prompt}, NO_ALIAS_TOKEN)
            )
            calls.append(("/v1/responses", {"model": "gpt", "input": prompt[0]["content"]}, None))
            calls.append(("/api/chat", {"model": "llama", "messages": prompt}, PRINCIPAL_TOKEN))
            calls.append(
                (
                    "/v1/chat/completions",
                    {"model": canaries["model"], "messages": prompt},
                    PRINCIPAL_TOKEN,
                )
            )
            calls.append(
                (
                    "/v1/chat/completions",
                    {"model": "echo", "messages": prompt},
                    canaries["bad_token"],
                )
            )
            statuses = []
            for path, body, token in calls:
                r = await chat(gw, body, token=token or LEGACY_TOKEN, headers=pa, path=path)
                statuses.append(r.status)
                if r.header("x-request-id"):
                    seen_ids.append(r.header("x-request-id") or "")
                for m in re.finditer(rb'"id":\s*"([^"]+)"', r.body):
                    seen_ids.append(m.group(1).decode())
            assert statuses[-2:] == [404, 401] and set(statuses[:-2]) == {200}
            # The canaries really travelled: the provider got the key, callers got the text.
            assert any(q.header("authorization") == canaries["provider_key"] for q in oai.requests)
            metrics = (await http_request(gw.handle.admin, "GET", "/metrics")).body.decode()
            status = (await http_request(gw.handle.admin, "GET", "/status")).body.decode()
            assert "iop_openai_requests_total" in metrics and '"providers"' in status
    assert seen_ids, "no request or completion id to look for"
    for text, where in ((metrics, "/metrics"), (status, "/status")):
        for secret in secrets + seen_ids:
            assert secret not in text, f"{secret!r} leaked into {where}"


async def test_failure_statuses_are_counted_once_with_their_labels() -> None:
    """client_error (bad JSON, unknown model), queue_full, provider_error (a relayed 500
    and a failed normalized run), dispatch_error, and ``/api/*`` auth failures (which
    use the ``passthrough`` mode convention for ``/api``)."""
    words = " ".join(f"w{i}" for i in range(6))
    pool_yaml = "provider_pool: {max_queue: 0, queue_timeout: 5}"
    with trio.fail_after(30):
        async with gateway_with_mocks(auth=True, delay_ms=100, capacity=1, pool=pool_yaml) as (
            gw,
            oai,
            oll,
        ):
            tok = PRINCIPAL_TOKEN
            before = await scrape(gw)
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body=b"{not json",
                headers=[("authorization", f"Bearer {tok}")],
            )
            assert r.status == 400
            msgs = [{"role": "user", "content": "x"}]
            r = await chat(gw, {"model": "no-such-model", "messages": msgs}, token=tok)
            assert r.status == 404
            r = await chat(gw, {"model": "llama", "messages": msgs}, path="/api/chat")
            assert r.status == 401
            oai.mode = "error500"
            r = await chat(gw, {"model": "gpt", "messages": msgs}, token=tok)
            assert r.status == 500  # the provider's own status, relayed
            oll.mode = "error500"
            r = await chat(gw, {"model": "llama", "messages": msgs}, token=tok)
            assert r.status == 502 and r.json()["error"]["code"] == "provider_error"
            replies: list[RawResponse] = []

            async def slow() -> None:
                body = {"model": "echo", "messages": [{"role": "user", "content": words}]}
                replies.append(await chat(gw, body, token=tok))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                pool = gw.runtime.pool
                await wait_until(lambda: pool.provider_loads()["echo-1"].in_flight == 1)
                r = await chat(gw, {"model": "echo", "messages": msgs}, token=tok)
                assert r.status == 429 and r.json()["error"]["code"] == "queue_full"
            assert [x.status for x in replies] == [200]
            gw.kill_node("node-a")
            await wait_until(lambda: gw.runtime.hub.session("node-a") is None)
            r = await chat(gw, {"model": "echo", "messages": msgs}, token=tok)
            assert r.status == 502 and r.json()["error"]["code"] == "node_dispatch_error"
            after = await wait_requests(gw, before, 8)
    assert changes(before, after, "iop_openai_requests_total") == {
        req(ALICE, group="unknown", status="client_error"): 2,
        req(UNMAPPED, group="unknown", status="auth_error", endpoint="api", mode="passthrough"): 1,
        req(ALICE, group="gpt", status="provider_error", mode="passthrough"): 1,
        req(ALICE, group="llama", status="provider_error"): 1,
        req(ALICE, group="echo", status="ok"): 1,
        req(ALICE, group="echo", status="queue_full"): 1,
        req(ALICE, group="echo", status="dispatch_error"): 1,
    }
    waits = changes(before, after, "iop_dispatch_wait_seconds_count")
    assert waits == {
        wait_series("gpt", "admitted"): 1,
        wait_series("llama", "admitted"): 1,
        wait_series("echo", "admitted"): 1,
        wait_series("echo", "queue_full"): 1,
        wait_series("echo", "dispatch_error"): 1,
    }
    assert changes(before, after, "iop_queue_waiters_timed_out_total") == {}


# ------------------------------------------------------------------ NodeHub hooks (memory streams)


def _metered_hub(rec: HubRecorder) -> NodeHub:
    return make_hub(rec, edge_id=EDGE_ID, handshake_timeout=3.0)


async def _raw_handshake(stream: trio.abc.Stream) -> Connection:
    """Hello, Proof, then ack the pushed NodeConfig; returns the node side's Connection."""
    conn = Connection(Role.NODE)
    nonce = scram.new_nonce()
    await stream.send_all(
        conn.send(Hello(protocol_version=PROTOCOL_VERSION, node_id="node-a", token="", nonce=nonce))
    )
    (challenge,) = conn.receive_data(await stream.receive_some(65536))
    assert isinstance(challenge, Challenge)
    secret = scram.token_sha256(node_token("node-a"))
    salted = scram.salted_password(secret, challenge.salt, challenge.iterations)
    auth = scram.auth_message("node-a", nonce, challenge.nonce, challenge.salt, 4096)
    await stream.send_all(conn.send(Proof(proof=scram.client_proof(salted, auth))))
    while True:
        msgs = conn.receive_data(await stream.receive_some(65536))
        cfg = next((m for m in msgs if isinstance(m, NodeConfig)), None)
        if cfg is not None:
            ack = NodeConfigAck(stream_id=cfg.stream_id, version=cfg.version)
            await stream.send_all(conn.send(ack))
            return conn


async def test_hub_hooks_count_exact_frames_and_classify_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = HubRecorder({"node-a": node_token("node-a")}, config_version=1)
    hub = _metered_hub(rec)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            # A clean handshake: Hello + Proof + NodeConfigAck in,
            # Challenge + HelloAck + NodeConfig out.
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(hub.handle_connection, server)
            await _raw_handshake(client)
            await wait_until(lambda: hub.session("node-a") is not None)
            assert rec.frames == {"in": 3, "out": 3} and rec.errors == []
            # A second Hello on a live session breaks the protocol: "protocol".
            await client.send_all(
                encode_frame(Hello(protocol_version=PROTOCOL_VERSION, node_id="x", token="y"))
            )
            await wait_until(lambda: rec.errors == ["protocol"])
            assert rec.frames["in"] == 3  # a frame the protocol rejects is not counted

            # A node that goes silent after its handshake: "heartbeat_timeout".
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(hub.handle_connection, server)
            await _raw_handshake(client)
            await wait_until(lambda: hub.session("node-a") is not None)
            await wait_until(lambda: len(rec.errors) == 2)
            assert rec.errors[1] == "heartbeat_timeout"
            # Heartbeats went out while it was silent, and were counted.
            assert rec.frames["out"] > 6

            # A peer that never says Hello: "handshake".
            client, server = trio.testing.memory_stream_pair()
            await hub.handle_connection(server)  # returns after handshake_timeout
            assert rec.errors[2:] == ["handshake"]
            nursery.cancel_scope.cancel()


async def test_requests_refused_before_routing_are_counted_by_status() -> None:
    """Malformed HTTP, limits and unknown routes have no endpoint (so they stay
    out of iop_openai_requests_total) but are counted by status."""
    with trio.fail_after(30):
        async with running_gateway(gateway_yaml(auth=True)) as gw:
            before = await scrape(gw)
            r = await http_request(gw.host_port, "GET", "/v1/nope")
            assert r.status == 404
            r = await http_request(gw.host_port, "DELETE", "/v1/models")
            assert r.status == 405
            # Malformed HTTP (no Host on HTTP/1.1): the HTTP layer answers.
            stream = await trio.open_tcp_stream(*gw.host_port)
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\n\r\n")
            reply = b""
            while chunk := await stream.receive_some(65536):
                reply += chunk
            await stream.aclose()
            assert reply.startswith(b"HTTP/1.1 400 ")
            while True:  # a handler may finish (and count) just after its reply
                after = await scrape(gw)
                rejected = after.get("iop_http_requests_rejected_total")
                if rejected - before.get("iop_http_requests_rejected_total") >= 3:
                    break
                await trio.sleep(0.01)

    def series(status: str) -> LabelSet:
        return frozenset({"edge_id": EDGE_ID, "status": status}.items())

    assert changes(before, after, "iop_http_requests_rejected_total") == {
        series("404"): 1,
        series("405"): 1,
        series("400"): 1,
    }
    assert changes(before, after, "iop_openai_requests_total") == {}
