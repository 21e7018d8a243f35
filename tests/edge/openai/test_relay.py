"""``relay``'s pure parts: the headers a passthrough provider is sent, and which
provider heads the attempt loop must see before a byte goes out.  The relay
itself runs end to end in tests/e2e (test_passthrough_relay, test_retry,
test_whole_reply, test_stream_end_metering)."""

from __future__ import annotations

from iopd.edge.openai.relay import _may_retry, tunnel_headers
from tests.support.request_path import post_request, runtime


def test_the_provider_gets_the_allowed_caller_headers_its_credential_and_json() -> None:
    rt = runtime(forward_headers=["x-team"])
    request = post_request(
        b"{}",
        headers=[
            ("authorization", "Bearer iop-caller-token"),
            ("x-provider-authorization", "Bearer sk-provider"),
            ("x-team", "blue"),
            ("user-agent", "sdk/1"),
            ("session_id", "s-1"),
            ("cookie", "a=b"),
            ("connection", "keep-alive, user-agent"),  # names user-agent hop-by-hop
        ],
    )
    headers = tunnel_headers(rt.snapshot, request, "Bearer sk-provider")
    assert headers == [
        ("x-team", "blue"),
        ("session_id", "s-1"),
        ("Authorization", "Bearer sk-provider"),  # under provider_auth.target_header
        ("content-type", "application/json"),
    ]


def test_without_a_credential_the_caller_token_never_travels() -> None:
    rt = runtime()
    request = post_request(b"{}", headers=[("authorization", "Bearer iop-caller-token")])
    assert tunnel_headers(rt.snapshot, request, None) == [("content-type", "application/json")]


def test_only_429_and_5xx_heads_wait_for_the_attempt_loop() -> None:
    assert [s for s in (200, 204, 400, 404, 422, 429, 500, 502, 503) if _may_retry(s)] == [
        429,
        500,
        502,
        503,
    ]
