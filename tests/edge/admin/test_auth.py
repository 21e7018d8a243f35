"""Admin auth for a browser: login form, session cookie, Origin and JSON rules.

The session store and the two header checks are tested as functions; the
login round trip, the cookie's attributes and the refusals through a running
edge's admin listener.
"""

from __future__ import annotations

import re
from pathlib import Path

import h11
import pytest
import trio

from iopd import errors
from iopd.edge.admin.auth import (
    SESSION_COOKIE,
    SessionStore,
    check_json_body,
    check_same_origin,
)
from iopd.edge.admin.routes import SECURITY_HEADERS
from tests.support.admin import ADMIN_TOKEN, token_yaml, two_node_yaml
from tests.support.gateway import RawResponse, read_response, running_gateway, token_hash

HASH = token_hash(ADMIN_TOKEN)
FORM = "application/x-www-form-urlencoded"


async def call(
    addr: tuple[str, int],
    method: str,
    path: str,
    *,
    headers: list[tuple[str, str]] | None = None,
    body: bytes | None = None,
) -> RawResponse:
    """One request with exactly ``headers`` (plus Host and close) on a fresh connection."""
    hdrs = [("host", f"127.0.0.1:{addr[1]}"), ("connection", "close"), *(headers or [])]
    if body is not None:
        hdrs.append(("content-length", str(len(body))))
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        data = conn.send(h11.Request(method=method, target=path, headers=hdrs))
        data += conn.send(h11.Data(data=body)) if body else b""
        await stream.send_all(data + conn.send(h11.EndOfMessage()))
        return await read_response(stream, conn)


def cookie_of(response: RawResponse) -> str:
    match = re.match(rf"{SESSION_COOKIE}=([^;]+)", response.header("set-cookie") or "")
    assert match, response.headers
    return match.group(1)


# ----------------------------------------------------------- pure checks


def test_sessions_expire_end_at_logout_and_at_a_new_token() -> None:
    now = [1000.0]
    store = SessionStore(ttl=60, clock=lambda: now[0])
    a = store.open(HASH)
    assert len(a) >= 43  # 32 random bytes, urlsafe base64
    assert store.valid(a, HASH)
    assert not store.valid(a, token_hash("rotated-token"))  # a refresh changed the token
    assert not store.valid(a, HASH)  # ... and that ended it
    b = store.open(HASH)
    assert not store.valid(b + "x", HASH) and not store.valid(None, HASH)
    now[0] += 59
    assert store.valid(b, HASH)
    now[0] += 1
    assert not store.valid(b, HASH)
    c = store.open(HASH)
    store.close(c)
    assert not store.valid(c, HASH)
    store.close("never-issued")


def test_sessions_keep_only_hashes_and_are_bounded() -> None:
    store = SessionStore(max_sessions=3)
    values = [store.open(HASH) for _ in range(5)]
    assert len(store) == 3
    assert not any(v.encode() in repr(store.__dict__).encode() for v in values)
    assert [store.valid(v, HASH) for v in values] == [False, False, True, True, True]


@pytest.mark.parametrize(
    ("origin", "host", "allowed"),
    [
        (None, "127.0.0.1:7071", True),
        ("http://127.0.0.1:7071", "127.0.0.1:7071", True),
        ("http://LOCALHOST:7071", "localhost:7071", True),
        ("http://127.0.0.1:7072", "127.0.0.1:7071", False),
        ("http://localhost:7071", "127.0.0.1:7071", False),
        ("https://127.0.0.1:7071", "127.0.0.1:7071", False),
        ("http://evil.example", "127.0.0.1:7071", False),
        ("null", "127.0.0.1:7071", False),
        ("", "127.0.0.1:7071", False),
    ],
)
def test_same_origin(origin: str | None, host: str, allowed: bool) -> None:
    if allowed:
        check_same_origin(origin, host)
    else:
        with pytest.raises(errors.CrossOriginRefused):
            check_same_origin(origin, host)


@pytest.mark.parametrize(
    ("content_type", "has_body", "allowed"),
    [
        (None, False, True),
        ("text/plain", False, True),
        ("application/json", True, True),
        ("Application/JSON; charset=utf-8", True, True),
        (None, True, False),
        ("text/plain", True, False),
        (FORM, True, False),
        ("multipart/form-data; boundary=x", True, False),
        ("application/json-seq", True, False),
    ],
)
def test_json_body(content_type: str | None, has_body: bool, allowed: bool) -> None:
    if allowed:
        check_json_body(content_type, has_body)
    else:
        with pytest.raises(errors.UnsupportedMediaType):
            check_json_body(content_type, has_body)


# ------------------------------------------------------------ through an edge


async def test_login_form_cookie_and_logout(tmp_path: Path) -> None:
    path = token_yaml(tmp_path, ADMIN_TOKEN)
    with trio.fail_after(30):
        async with running_gateway(path.read_text(), nodes=[], config_path=str(path)) as gw:
            adm = gw.handle.admin
            own = [("origin", f"http://127.0.0.1:{adm[1]}")]
            page = await call(adm, "GET", "/")
            assert page.status == 200
            assert (page.header("content-type") or "").startswith("text/html")
            html = page.body.decode()
            assert '<form method="post" action="/login">' in html
            assert 'name="token"' in html and 'type="password"' in html
            # One asset, the listener's own stylesheet, open without a session (no inline style).
            assert re.findall(r'(?:src|href)="([^"]*)"', html) == ["/admin/static/login.css"]
            assert "<style" not in html and "style=" not in html
            css = await call(adm, "GET", "/admin/static/login.css")
            assert css.status == 200 and (css.header("content-type") or "").startswith("text/css")
            assert (await call(adm, "HEAD", "/")).status == 200

            wrong = await call(
                adm, "POST", "/login", headers=[*own, ("content-type", FORM)], body=b"token=nope"
            )
            assert wrong.status == 401 and wrong.header("set-cookie") is None
            assert "does not match" in wrong.body.decode()

            ok = await call(
                adm,
                "POST",
                "/login",
                headers=[*own, ("content-type", FORM)],
                body=f"token={ADMIN_TOKEN}".encode(),
            )
            assert ok.status == 303 and ok.header("location") == "/"
            attrs = {a.strip().lower() for a in (ok.header("set-cookie") or "").split(";")}
            assert {"httponly", "samesite=strict", "path=/", "max-age=43200"} <= attrs
            session = [("cookie", f"{SESSION_COOKIE}={cookie_of(ok)}")]
            assert ADMIN_TOKEN not in (ok.header("set-cookie") or "")

            # The cookie opens every route the bearer does; GET / is the console.
            assert (await call(adm, "GET", "/status", headers=session)).status == 200
            assert (await call(adm, "GET", "/metrics", headers=session)).status == 200
            console = await call(adm, "GET", "/", headers=session)
            assert console.status == 200 and b"login" not in console.body.lower()
            r = await call(
                adm,
                "POST",
                "/refresh",
                headers=[*session, *own, ("content-type", "application/json")],
                body=b'{"mode": "dry_run"}',
            )
            assert r.status == 200 and r.json()["mode"] == "dry_run"
            assert (await call(adm, "GET", "/status")).status == 401

            out = await call(adm, "POST", "/logout", headers=[*session, *own])
            assert out.status == 303
            assert "max-age=0" in (out.header("set-cookie") or "").lower()
            assert (await call(adm, "GET", "/status", headers=session)).status == 401
            assert (await call(adm, "GET", "/", headers=session)).status == 200  # the form again


async def test_cross_origin_and_non_json_posts_are_refused(tmp_path: Path) -> None:
    path = token_yaml(tmp_path, ADMIN_TOKEN)
    bearer = [("authorization", f"Bearer {ADMIN_TOKEN}")]
    with trio.fail_after(30):
        async with running_gateway(path.read_text(), nodes=[], config_path=str(path)) as gw:
            adm = gw.handle.admin
            version = gw.runtime.snapshot.version
            json_ct = [("content-type", "application/json")]
            for origin in ("http://evil.example", "null", f"http://127.0.0.1:{adm[1] + 1}"):
                for route, hdrs, body in [
                    ("/refresh", json_ct, b'{"mode": "apply"}'),
                    ("/login", [("content-type", FORM)], f"token={ADMIN_TOKEN}".encode()),
                    ("/logout", [], None),
                ]:
                    r = await call(
                        adm, "POST", route, headers=[*bearer, ("origin", origin), *hdrs], body=body
                    )
                    assert r.status == 403, (origin, route)
                    err = r.json()["error"]
                    assert err["code"] == "cross_origin_refused"
                    assert err["type"] == "invalid_request_error"
                    assert r.header("set-cookie") is None
            for ctype in ("text/plain", FORM, None):
                hdrs = [("content-type", ctype)] if ctype else []
                r = await call(
                    adm, "POST", "/refresh", headers=[*bearer, *hdrs], body=b'{"mode": "apply"}'
                )
                assert r.status == 415, ctype
                assert r.json()["error"]["code"] == "unsupported_media_type"
            r = await call(adm, "POST", "/login", headers=json_ct, body=b'{"token": "x"}')
            assert r.status == 415
            assert gw.runtime.snapshot.version == version
            # No Origin (CLI, curl) passes, with or without a body.
            assert (await call(adm, "POST", "/refresh", headers=bearer)).status == 200


async def test_without_a_token_the_console_route_is_open() -> None:
    with trio.fail_after(30):
        async with running_gateway(two_node_yaml(), nodes=[]) as gw:
            adm = gw.handle.admin
            assert (await call(adm, "GET", "/")).status == 200  # the console, no login
            r = await call(adm, "POST", "/login", headers=[("content-type", FORM)], body=b"token=x")
            assert r.status == 303 and r.header("set-cookie") is None


async def test_every_admin_response_carries_the_security_headers(tmp_path: Path) -> None:
    """Routes, errors, the login form and the console: none may be framed or sniffed."""
    path = token_yaml(tmp_path, ADMIN_TOKEN)
    bearer = [("authorization", f"Bearer {ADMIN_TOKEN}")]
    with trio.fail_after(30):
        async with running_gateway(path.read_text(), nodes=[], config_path=str(path)) as gw:
            adm = gw.handle.admin
            responses = {
                "healthz": await call(adm, "GET", "/healthz"),
                "login form": await call(adm, "GET", "/"),
                "401": await call(adm, "GET", "/status"),
                "404": await call(adm, "GET", "/nowhere", headers=bearer),
                "405": await call(adm, "DELETE", "/status", headers=bearer),
                "status": await call(adm, "GET", "/status", headers=bearer),
                "console": await call(adm, "GET", "/", headers=bearer),
                "console.js": await call(adm, "GET", "/console/static/console.js", headers=bearer),
                "login.css": await call(adm, "GET", "/admin/static/login.css"),
            }
    for name, response in responses.items():
        for header, value in SECURITY_HEADERS.items():
            assert response.header(header) == value, (name, header, response.headers)
    csp = SECURITY_HEADERS["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert responses["401"].status == 401 and responses["404"].status == 404
    assert responses["console"].status == 200 and responses["login.css"].status == 200
