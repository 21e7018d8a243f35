"""CORS for a web UI on another origin, with a raw client.

Off by default; ``openai.cors_allow_origins`` turns it on (live on refresh).
A browser's preflight carries no credentials, so it is answered from the head
before authentication; every other response to an allowed origin carries
``Access-Control-Allow-Origin``, errors included (the head hook's 401, the
handler's 404, the HTTP layer's 413), and a relayed provider's own CORS
headers are replaced.  An origin not in the list gets no CORS header.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from iopd.config.addresses import origin_problem
from iopd.edge.openai.incoming import cors
from tests.support.configs import echo_entry, gateway_yaml, http_provider, node_entry
from tests.support.gateway import RawResponse, http_request, running_gateway
from tests.support.mock_providers import MockOpenAIServer, MockReply, RecordedRequest

APP = "http://app.example:3000"
TOKEN = "sk-browser-caller"


def cors_yaml(base_url: str, origins: str = "[]") -> str:
    return gateway_yaml(
        edge_id="edge-cors",
        openai_extra=(
            f"  bearer_token: {TOKEN}\n  max_body_bytes: 4096\n  cors_allow_origins: {origins}"
        ),
        models="  - id: echo\n    providers: {echo-1: echo}\n  - id: gpt\n    providers: {oa-1: mock-model}",
        nodes=node_entry(
            "node-a",
            echo_entry(category=None)
            + http_provider("oa-1", "openai", base_url, models="[mock-model]"),
        ),
    )


CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
AUTH = ("authorization", f"Bearer {TOKEN}")


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> list[tuple[str, str]]:
    out = [("origin", origin), ("access-control-request-method", method)]
    if headers is not None:
        out.append(("access-control-request-headers", headers))
    return out


def acao(r: RawResponse) -> list[str]:
    return [v for k, v in r.headers if k.lower() == "access-control-allow-origin"]


def cors_names(r: RawResponse) -> list[str]:
    return [k.lower() for k, _ in r.headers if k.lower().startswith("access-control-")]


def provider_with_its_own_cors(req: RecordedRequest) -> MockReply | None:
    """A provider that sends ``Access-Control-Allow-Origin: *`` itself (vLLM can)."""
    if req.path != "/v1/chat/completions":
        return None
    body = b'{"id":"x","object":"chat.completion","choices":[]}'
    return MockReply(
        headers=[("content-type", "application/json"), ("access-control-allow-origin", "*")],
        chunks=[body],
    )


async def test_cors_is_off_by_default() -> None:
    with trio.fail_after(30):
        async with running_gateway(cors_yaml("http://127.0.0.1:9")) as gw:
            r = await http_request(
                gw.host_port, "OPTIONS", "/v1/chat/completions", headers=preflight(APP)
            )
            assert r.status == 405 and cors_names(r) == []
            r = await http_request(
                gw.host_port, "POST", "/v1/chat/completions", body=CHAT, headers=[AUTH, ("origin", APP)]
            )
            assert r.status == 200 and cors_names(r) == []


async def test_allowed_origin_preflight_and_responses() -> None:
    mock = MockOpenAIServer()
    mock.handler = provider_with_its_own_cors
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(mock.serve)
            async with running_gateway(cors_yaml(mock.base_url, f"['{APP}']")) as gw:
                # The preflight: no token, answered 204 with what the browser needs.
                asked = "Authorization, Content-Type, X-Stainless-OS"
                r = await http_request(
                    gw.host_port, "OPTIONS", "/v1/chat/completions", headers=preflight(APP, headers=asked)
                )
                assert r.status == 204 and r.body == b""
                assert acao(r) == [APP]
                assert r.header("access-control-allow-methods") == "POST"
                assert r.header("access-control-allow-headers") == (
                    "authorization, content-type, x-stainless-os"
                )
                assert r.header("access-control-max-age") == str(cors.MAX_AGE_SECONDS)
                assert "Origin" in (r.header("vary") or "")
                # Requested headers that are not tokens: none allowed (the browser fails it).
                r = await http_request(
                    gw.host_port, "OPTIONS", "/v1/models", headers=preflight(APP, "GET", "a b, c")
                )
                assert r.status == 204 and r.header("access-control-allow-headers") is None
                assert r.header("access-control-allow-methods") == "GET"

                allowed = [AUTH, ("origin", APP)]
                r = await http_request(
                    gw.host_port, "POST", "/v1/chat/completions", body=CHAT, headers=allowed
                )
                assert r.status == 200 and acao(r) == [APP]
                assert r.header("vary") == "Origin"
                assert "x-request-id" in (r.header("access-control-expose-headers") or "")
                # Errors too: the head hook's 401, the handler's 404, the HTTP layer's 413.
                for status, body, headers in (
                    (401, CHAT, [("origin", APP)]),
                    (404, {**CHAT, "model": "nope"}, allowed),
                    (413, {**CHAT, "pad": "x" * 5000}, allowed),
                ):
                    r = await http_request(
                        gw.host_port, "POST", "/v1/chat/completions", body=body, headers=headers
                    )
                    assert r.status == status and acao(r) == [APP], (status, r.headers)
                # A relayed provider's own CORS header is replaced, never doubled.
                r = await http_request(
                    gw.host_port,
                    "POST",
                    "/v1/chat/completions",
                    body={**CHAT, "model": "gpt"},
                    headers=allowed,
                )
                assert r.status == 200 and acao(r) == [APP]
            n.cancel_scope.cancel()


async def test_other_origins_get_no_cors_headers() -> None:
    with trio.fail_after(30):
        async with running_gateway(cors_yaml("http://127.0.0.1:9", f"['{APP}']")) as gw:
            evil = "https://evil.example"
            r = await http_request(
                gw.host_port, "OPTIONS", "/v1/chat/completions", headers=preflight(evil)
            )
            assert r.status == 405 and cors_names(r) == []
            # A preflight for a method the route does not take: no preflight answer.
            r = await http_request(
                gw.host_port, "OPTIONS", "/v1/chat/completions", headers=preflight(APP, "DELETE")
            )
            assert r.status == 405
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body=CHAT,
                headers=[AUTH, ("origin", evil)],
            )
            assert r.status == 200 and cors_names(r) == []


async def test_cors_origins_apply_live_on_refresh(tmp_path: Path) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(cors_yaml("http://127.0.0.1:9"))
    with trio.fail_after(30):
        async with running_gateway(path.read_text(), config_path=str(path)) as gw:
            ask = preflight(APP)
            r = await http_request(gw.host_port, "OPTIONS", "/v1/chat/completions", headers=ask)
            assert r.status == 405
            path.write_text(cors_yaml("http://127.0.0.1:9", "['*']"))
            report = await http_request(gw.handle.admin, "POST", "/refresh", body={"mode": "apply"})
            assert report.json()["applied"] and report.json()["restart_required"] == []
            r = await http_request(gw.host_port, "OPTIONS", "/v1/chat/completions", headers=ask)
            assert r.status == 204 and acao(r) == [APP]  # '*' allows every origin, echoed


@pytest.mark.parametrize(
    ("origin", "problem"),
    [
        ("*", None),
        ("https://chat.example.com", None),
        ("http://localhost:3000", None),
        ("http://[::1]:8080", None),
        ("https://chat.example.com/", "without path or trailing '/'"),
        ("https://Chat.example.com", "lower case"),
        ("chat.example.com", "must be '*' or an origin"),
        ("ftp://chat.example.com", "must be '*' or an origin"),
        ("https://chat.example.com:443", "drop the default port :443"),
        ("http://h:99999", "out of range"),
    ],
)
def test_origin_validation(origin: str, problem: str | None) -> None:
    got = origin_problem(origin)
    assert (got is None) if problem is None else (got is not None and problem in got)
