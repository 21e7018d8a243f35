"""Coding agents' sessions kept whole: their session headers reach a passthrough
provider as sent, and every request's session key is on its log line."""

from __future__ import annotations

import logging

import pytest
import trio

from iopd.edge.openai.incoming.session_key import session_digest
from tests.support.configs import remote_yaml
from tests.support.daemons import parse_log_line
from tests.support.gateway import http_request, running_gateway
from tests.support.mock_providers import MockOpenAIServer

CODEX = [
    ("session_id", "0199a1b2-codex"),
    ("thread-id", "0199a1b2-thread"),
    ("conversation_id", "0199a1b2-conv"),
    ("originator", "codex_cli_rs"),
    ("x-client-request-id", "req-7"),
]
OPENCODE = [("x-session-id", "ses_abc"), ("x-session-affinity", "ses_abc")]
CLAUDE = [
    ("x-claude-code-session-id", "cc-42"),
    ("anthropic-version", "2023-06-01"),
    ("anthropic-beta", "fine-grained-tool-streaming-2025-05-14"),
]


def _yaml(base_url: str, extra: str = "") -> str:
    return remote_yaml(base_url, openai_extra=extra)


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    return [
        parse_log_line(r.getMessage())
        for r in caplog.records
        if r.name == "iopd.edge.request" and "event=request" in r.getMessage()
    ]


@pytest.mark.parametrize("headers", [CODEX, OPENCODE, CLAUDE], ids=["codex", "opencode", "claude"])
async def test_session_headers_arrive_upstream_and_key_the_log_line(
    openai_mock: MockOpenAIServer,
    caplog: pytest.LogCaptureFixture,
    headers: list[tuple[str, str]],
) -> None:
    caplog.set_level(logging.INFO, logger="iopd.edge.request")
    body = {"model": "remote", "messages": [{"role": "user", "content": "hi"}]}
    with trio.fail_after(30):
        async with running_gateway(_yaml(openai_mock.base_url)) as gw:
            resp = await http_request(
                gw.host_port, "POST", "/v1/chat/completions", body=body, headers=headers
            )
            assert resp.status == 200, resp.body
    seen = openai_mock.requests[-1]
    for name, value in headers:
        assert seen.header(name) == value, name
    (line,) = _request_lines(caplog)
    assert line["session"] == session_digest(headers[0][1])
    assert headers[0][1] not in caplog.text  # the key itself is never logged


async def test_operator_header_and_body_fields_key_the_session(
    openai_mock: MockOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iopd.edge.request")
    body = {
        "model": "remote",
        "messages": [{"role": "user", "content": "hi"}],
        "user": "u-1",
    }
    with trio.fail_after(30):
        async with running_gateway(
            _yaml(openai_mock.base_url, "  session_header: X-Team-Session\n")
        ) as gw:
            for headers in ([("x-team-session", "team-7"), ("session_id", "s")], [], None):
                sent = dict(body) if headers is not None else {"model": "remote", "messages": []}
                resp = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=sent, headers=headers
                )
                assert resp.status in (200, 400), resp.body
    # The operator's header is not forwarded unless forward_headers names it.
    assert openai_mock.requests[0].header("x-team-session") is None
    assert [line["session"] for line in _request_lines(caplog)] == [
        session_digest("team-7"),
        session_digest("u-1"),
        "-",
    ]
