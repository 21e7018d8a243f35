"""Passthrough response headers read like one response.

A relayed response used to carry the provider's ``Date`` and ``Server`` next
to the edge's own, which clients merge (``httpx`` shows ``"Mon, ..., Mon,
..."``).  The edge now drops the provider's two, and marks every relayed
error with ``X-Iopd-Upstream-Status`` so a provider's own error (relayed
byte-exact) is told from the edge's (never marked); a success is not marked.
Checked with a raw client (every header as sent) and with the official
``openai`` SDK.
"""

from __future__ import annotations

import json

import openai
import pytest
import trio

from tests.support.configs import remote_yaml
from tests.support.gateway import http_request, in_thread, running_gateway
from tests.support.mock_providers import MockOpenAIServer, MockReply, RecordedRequest

PROVIDER_DATE = "Thu, 01 Jan 2026 00:00:00 GMT"
CHAT = "/v1/chat/completions"
ERROR_BODY = b'{"error":{"message":"slow down","type":"rate_limit","code":"rl"}}\n'


def _yaml(base_url: str) -> str:
    return remote_yaml(base_url)


def _with_provider_headers(mock: MockOpenAIServer) -> None:
    """Every reply of ``mock`` carries its own Date and Server; "rate me" gets a 429."""

    def handler(req: RecordedRequest) -> MockReply | None:
        if req.method != "POST":
            return None
        if b"rate me" in req.body:
            reply = MockReply(status=429, body=ERROR_BODY)
        else:
            reply = mock.route(req)
        reply.headers = [
            ("Date", PROVIDER_DATE),
            ("Server", "uvicorn"),
            *reply.headers,
        ]
        return reply

    mock.handler = handler


def _values(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k.lower() == name]


def _chat(text: str, **extra: object) -> dict[str, object]:
    return {"model": "remote", "messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.parametrize("stream", [False, True])
async def test_raw_client_sees_one_date_one_server_and_the_upstream_status(stream: bool) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            _with_provider_headers(mock)
            async with running_gateway(_yaml(mock.base_url)) as gw:
                ok = await http_request(gw.host_port, "POST", CHAT, body=_chat("hi", stream=stream))
                assert ok.status == 200, ok.body
                assert _values(ok.headers, "date") != [PROVIDER_DATE]
                assert len(_values(ok.headers, "date")) == 1
                assert _values(ok.headers, "server") == ["iopd"]
                assert _values(ok.headers, "x-iopd-upstream-status") == []  # errors only

                err = await http_request(gw.host_port, "POST", CHAT, body=_chat("rate me"))
                assert err.status == 429
                assert err.body == ERROR_BODY  # the provider's, byte for byte
                assert _values(err.headers, "x-iopd-upstream-status") == ["429"]
                assert len(_values(err.headers, "date")) == 1
                assert _values(err.headers, "server") == ["iopd"]

                # The edge's own error: no upstream status.
                own = await http_request(gw.host_port, "POST", CHAT, body=_chat("x", model="nope"))
                assert own.status == 404
                assert _values(own.headers, "x-iopd-upstream-status") == []
            n.cancel_scope.cancel()


async def test_sdk_sees_single_headers_and_tells_provider_errors_apart() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = await n.start(MockOpenAIServer().serve)
            _with_provider_headers(mock)
            async with running_gateway(_yaml(mock.base_url)) as gw:
                client = gw.sdk()
                msgs = [{"role": "user", "content": "hi"}]
                raw = await in_thread(
                    lambda: client.chat.completions.with_raw_response.create(
                        model="remote", messages=msgs
                    )
                )
                assert raw.headers.get_list("date") == [raw.headers["date"]]
                assert raw.headers["date"] != PROVIDER_DATE
                assert raw.headers["server"] == "iopd"
                assert "x-iopd-upstream-status" not in raw.headers  # errors only
                assert raw.parse().choices[0].message.content == mock.reply_text

                def provider_error() -> openai.APIStatusError:
                    try:
                        client.chat.completions.create(
                            model="remote", messages=[{"role": "user", "content": "rate me"}]
                        )
                    except openai.APIStatusError as exc:
                        return exc
                    raise AssertionError("no error")

                exc = await in_thread(provider_error)
                assert exc.status_code == 429
                assert exc.response.headers["x-iopd-upstream-status"] == "429"
                assert exc.response.content == ERROR_BODY
                assert json.loads(exc.response.content)["error"]["code"] == "rl"

                def edge_error() -> openai.APIStatusError:
                    try:
                        client.chat.completions.create(model="nope", messages=msgs)
                    except openai.APIStatusError as exc:
                        return exc
                    raise AssertionError("no error")

                own = await in_thread(edge_error)
                assert own.status_code == 404
                assert "x-iopd-upstream-status" not in own.response.headers
            n.cancel_scope.cancel()
