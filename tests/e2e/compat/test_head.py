"""``HEAD`` on the OpenAI listener: a GET route answers it as GET without the
body, and every answer to a HEAD (a refusal included) carries no body, so
the bytes after the head are the next response's."""

from __future__ import annotations

import trio

from tests.support.configs import echo_yaml
from tests.support.gateway import Gateway, running_gateway


async def _exchange(gw: Gateway, raw: bytes) -> bytes:
    """``raw`` (one or more requests) on one connection; every byte until it closes."""
    stream = await trio.open_tcp_stream(*gw.host_port)
    async with stream:
        await stream.send_all(raw)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
        return data


def _request(method: str, path: str, *, close: bool = False) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer any\r\n"
    return (head + ("connection: close\r\n" if close else "") + "\r\n").encode()


def _split(data: bytes) -> tuple[str, dict[str, str], bytes]:
    """The first response's status line, headers, and every byte after its head."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return lines[0], {k.lower(): v for k, v in headers.items()}, rest


async def test_head_of_a_get_route_is_the_get_answer_without_its_body() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            for path in ("/v1/models", "/v1/models/echo", "/healthz", "/api/version"):
                got = await _exchange(gw, _request("GET", path, close=True))
                status, get_headers, body = _split(got)
                assert status == "HTTP/1.1 200 OK", (path, got)
                # HEAD then GET on one connection: the HEAD's answer has no body,
                # so the next bytes are the GET's whole answer.
                raw = _request("HEAD", path) + _request("GET", path, close=True)
                got = await _exchange(gw, raw)
                status, head_headers, rest = _split(got)
                assert status == "HTTP/1.1 200 OK", (path, got)
                length = head_headers.get("content-length")
                assert length in (None, get_headers["content-length"]), path
                assert rest.startswith(b"HTTP/1.1 200 OK\r\n"), (path, rest[:80])
                assert rest.endswith(body), path
                assert "connection" not in head_headers  # kept open for the GET


async def test_refusals_of_a_head_carry_no_body() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            for path, want in (
                ("/", "HTTP/1.1 404 Not Found"),
                ("/v1/chat/completions", "HTTP/1.1 405 Method Not Allowed"),
            ):
                got = await _exchange(gw, _request("HEAD", path))
                status, headers, rest = _split(got)
                assert status == want, got
                assert rest == b"", (path, rest)  # the edge closes after a refusal
                assert headers["connection"] == "close"
                assert headers["content-type"] == "application/json"
                # The GET gets the same refusal with its body.
                status, _, body = _split(await _exchange(gw, _request("GET", path)))
                assert status == want and b'"error"' in body
