"""A whole passthrough reply as one ``whole`` tunnel frame, through a real edge.

The node sends a non-streamed reply (head, body, usage and end) as one
terminal ``whole`` frame.  A scripted node sends them here: a 200 the edge's
wire reader writes itself (its usage counted once), and a 500 the relay's
loop writes (a status the attempt loop looks at before anything goes out).
Both reach the caller byte for byte, with the edge's headers.
"""

from __future__ import annotations

import math

import trio

from tests.support.metered import (
    UNMAPPED,
    chat,
    gateway_with_fake_node,
    reasoning,
    req,
    tokens,
    wait_requests,
)
from tests.support.metrics import changes, scrape
from wire.messages import ProviderTunnelFrame, ProviderTunnelRequest, RunRequest, Usage

OK_BODY = b'{"id": "x", "choices": [], "usage": {"prompt_tokens": 10}}'
FAILED_BODY = b'{"error": {"message": "the model crashed"}}'


async def test_whole_frames_reach_the_caller_byte_exact_with_usage_counted_once() -> None:
    replies = [
        (200, OK_BODY, Usage(input_tokens=10, output_tokens=6), Usage(cached_input_tokens=3), 5),
        (500, FAILED_BODY, None, None, 0),
    ]

    def script(r: RunRequest | ProviderTunnelRequest) -> list[ProviderTunnelFrame]:
        assert isinstance(r, ProviderTunnelRequest)
        status, body, body_usage, frame_usage, chars = replies.pop(0)
        return [
            ProviderTunnelFrame(
                stream_id=r.stream_id,
                kind="whole",
                status=status,
                headers=[
                    ("content-type", "application/json"),
                    ("x-provider-note", "kept"),
                    ("date", "Mon, 01 Jan 2001 00:00:00 GMT"),
                ],
                data=body,
                body_usage=body_usage,
                usage=frame_usage,
                reasoning_chars=chars,
            )
        ]

    with trio.fail_after(30):
        async with gateway_with_fake_node(script) as (gw, _node):
            before = await scrape(gw)
            body = {"model": "fake-pt", "messages": [{"role": "user", "content": "hi"}]}
            ok = await chat(gw, body)
            failed = await chat(gw, body)
            after = await wait_requests(gw, before, 2)
    assert (ok.status, ok.body) == (200, OK_BODY)
    assert ok.header("x-provider-note") == "kept"
    assert ok.header("x-iopd-upstream-status") is None  # relayed errors only
    assert ok.header("date") != "Mon, 01 Jan 2001 00:00:00 GMT"  # the edge's own
    assert (failed.status, failed.body) == (500, FAILED_BODY)
    assert failed.header("x-iopd-upstream-status") == "500"
    labels = req(UNMAPPED, group="fake-pt", mode="passthrough")
    assert changes(before, after, "iop_openai_usage_tokens_total") == {
        **tokens(labels, "provider_body", input=10, output=6),
        **tokens(labels, "tunnel_frame", cached_input=3),
    }
    r_l = reasoning(UNMAPPED, "fake-pt")
    assert changes(before, after, "iop_openai_reasoning_observed_total") == {r_l: 1}
    assert changes(before, after, "iop_openai_reasoning_chars_total") == {r_l: 5}
    method = ("estimation_method", "chars_div_4")
    assert changes(before, after, "iop_openai_reasoning_estimated_tokens_total") == {
        r_l | {method}: math.ceil(5 / 4)
    }
    assert sum(changes(before, after, "iop_openai_requests_total").values()) == 2
