"""The admin application: /healthz, /status, /refresh, /metrics, the runtime controls, /login, /logout.

A quart-trio app, served by ``serve.py`` on hypercorn's trio worker inside the
edge's own trio run.  The admin side is a small classic web application
(a JSON API, runtime controls, a server-rendered console with live updates),
so it uses a framework; the public OpenAI listener does not (the measured
reasons are in ``docs/ARCHITECTURE.md``).

Every request passes one ``before_request`` hook (``_check_request``): the
``Host`` check (421), then for a state-changing request the Origin check (403)
and the JSON-body check (415), then the admin token — bearer or session
cookie — when ``edge.admin_token_hash_sha256`` is set (401; ``GET /`` answers
the login form instead).  Routes added later (the runtime controls, the console
blueprint) get the same checks by being on this app.

Every response, errors and the login form included, carries the same
security headers (``SECURITY_HEADERS``, by one ``after_request`` hook): the
console may be framed by nobody, loads nothing but the listener's own files
(no inline script or style), and leaks no URL to another site.

Every error a caller sees is the OpenAI envelope from
``iopd.edge.openai.outgoing.error_envelope.render_error``: werkzeug's routing errors (404, 405,
413, 408) are mapped to their ``GatewayError``, and anything unexpected is a
500 envelope plus one log line, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol
from urllib.parse import parse_qs

import msgspec
import trio
from quart import Response, render_template, request
from quart_trio import QuartTrio
from werkzeug.datastructures import Headers
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from iopd import errors
from iopd.edge.admin.auth import (
    SAFE_METHODS,
    SESSION_COOKIE,
    SessionStore,
    bearer_matches,
    check_host,
    check_json_body,
    check_same_origin,
    token_matches,
    unauthenticated,
)
from iopd.edge.console import console_blueprint
from iopd.edge.openai.outgoing.error_envelope import render_error
from iopd.edge.runtime.edge_runtime import EdgeRuntime

log = logging.getLogger("iopd.edge.admin")
JSON = "application/json"
HTML = "text/html; charset=utf-8"
_encode = msgspec.json.Encoder().encode

#: Largest request body (``/refresh``, the runtime controls, ``/login``).
MAX_BODY_BYTES = 64 * 1024
#: How long a request body may take to arrive (Quart's ``BODY_TIMEOUT``).
BODY_TIMEOUT = 30.0
#: Routes served without the admin token: the health check (load balancers,
#: systemd), and the login/logout pair (the login checks the token itself).
_OPEN_ROUTES = {("/healthz", "GET"), ("/healthz", "HEAD"), ("/login", "POST"), ("/logout", "POST")}
#: Longest ``/login`` form (one field; anything longer is not a login).
_MAX_LOGIN_FIELDS = 4
#: Where the admin app's own static files are (the login form's stylesheet).
STATIC_PATH = "/admin/static"
#: Files served without the admin token: what the login form itself loads.
_OPEN_STATIC = {f"{STATIC_PATH}/login.css"}
#: On every admin response.  The CSP allows only the listener's own script,
#: stylesheet and ``/events`` (no inline code: an injected string can never
#: run), and no framing; the older header says the same to older browsers.
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": (
        "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'; object-src 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _RefreshBody(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "apply"


class _AdminQuart(QuartTrio):
    """QuartTrio whose last-resort error log is one line, never a traceback."""

    def log_exception(self, exc_info: object) -> None:
        exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
        log.error("event=admin_error error=%s", type(exc).__name__)


class RestartOutcome(Protocol):
    """What ``POST /restart`` waits for (``iopd.edge.handover.HandoverOutcome``)."""

    done: trio.Event
    successor_pid: int | None
    error: str | None


def create_admin_app(
    runtime: EdgeRuntime,
    *,
    sessions: SessionStore | None = None,
    restart: Callable[[], RestartOutcome] | None = None,
) -> QuartTrio:
    """The admin application of ``runtime``'s edge (not yet served: see ``serve.py``).

    ``restart``: starts a hand-over to a successor process (``POST /restart``;
    None: this edge cannot, e.g. one embedded in a test or another program).
    """
    app = _AdminQuart(__name__, static_url_path=STATIC_PATH)
    app.config.update(
        MAX_CONTENT_LENGTH=MAX_BODY_BYTES,
        BODY_TIMEOUT=BODY_TIMEOUT,
        # Quart cuts every response after RESPONSE_TIMEOUT (60 s by default),
        # silently: the console's event stream lives for hours.  Bodies here are
        # small and the peer is loopback, so no response gets a framework timeout.
        RESPONSE_TIMEOUT=None,
        # OPTIONS is 405 like any method a route does not take (no CORS here).
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    routes = _AdminRoutes(runtime, sessions or SessionStore(), restart)
    app.extensions["iopd_admin_sessions"] = routes.sessions
    app.before_request(routes.check_request)
    app.after_request(_with_security_headers)
    app.register_error_handler(errors.GatewayError, _gateway_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected_error)
    app.add_url_rule("/healthz", view_func=routes.healthz, methods=["GET"])
    app.add_url_rule("/status", view_func=routes.status, methods=["GET"])
    app.add_url_rule("/metrics", view_func=routes.metrics, methods=["GET"])
    app.add_url_rule("/refresh", view_func=routes.refresh, methods=["POST"])
    app.add_url_rule("/restart", view_func=routes.restart, methods=["POST"])
    app.add_url_rule("/login", view_func=routes.login, methods=["POST"])
    app.add_url_rule("/logout", view_func=routes.logout, methods=["POST"])
    app.add_url_rule("/providers/<provider_id>/state", view_func=routes.state, methods=["POST"])
    app.add_url_rule(
        "/providers/<provider_id>/override", view_func=routes.override, methods=["POST"]
    )
    app.add_url_rule("/providers/<provider_id>/reset", view_func=routes.reset, methods=["POST"])
    app.add_url_rule("/nodes/<node_id>/drain", view_func=routes.drain_node, methods=["POST"])
    register_console(app, runtime)
    return app


def register_console(app: QuartTrio, runtime: EdgeRuntime) -> None:
    """Mount the web console (``GET /``, ``GET /events``, its static files) on ``app``.

    The console is its own package (``iopd/edge/console/``); being on this app,
    its routes pass the same ``before_request`` check (a browser without a
    session gets the login form at ``GET /``).
    """
    app.register_blueprint(console_blueprint(runtime))


async def _with_security_headers(response: Response) -> Response:
    """``SECURITY_HEADERS`` on ``response`` (a route's, an error's, the login form)."""
    response.headers.update(SECURITY_HEADERS)
    return response


def error_response(exc: errors.GatewayError) -> Response:
    """``exc`` as the OpenAI error envelope."""
    status, headers, body = render_error(exc)
    return Response(body, status=status, headers=Headers(headers))


async def _gateway_error(exc: errors.GatewayError) -> Response:
    return error_response(exc)


async def _http_error(exc: HTTPException) -> Response:
    """werkzeug's own refusals (routing, body size, body timeout) in our envelope."""
    method, path = request.method, request.path[:200]
    error: errors.GatewayError
    if exc.code == 404 or isinstance(exc, RequestRedirect):
        error = errors.RouteNotFound(f"no admin route for {method} {path}")
    elif exc.code == 405:
        error = errors.MethodNotAllowed(f"{method} is not allowed on {path}")
    elif exc.code == 413:
        error = errors.RequestTooLarge(f"admin request bodies are at most {MAX_BODY_BYTES} bytes")
    elif exc.code == 408:
        error = errors.RequestTimeout(
            f"the request body did not arrive within {BODY_TIMEOUT:g} seconds"
        )
    else:
        error = errors.InvalidRequest(f"{exc.code} {exc.name}")
        error.status = exc.code or 400
    return error_response(error)


async def _unexpected_error(exc: Exception) -> Response:
    log.error(
        "event=admin_error method=%s path=%r error=%s",
        request.method,
        request.path[:200],
        type(exc).__name__,
    )
    return error_response(errors.GatewayError("the admin API failed; the edge's log says why"))


def _has_body(content_length: int | None, transfer_encoding: str | None) -> bool:
    return bool(content_length) or transfer_encoding is not None


class _AdminRoutes:
    """The routes and the per-request check, around one runtime and its sessions."""

    def __init__(
        self,
        runtime: EdgeRuntime,
        sessions: SessionStore,
        restart: Callable[[], RestartOutcome] | None = None,
    ) -> None:
        self.rt = runtime
        self._restart = restart
        self.sessions = sessions

    def _token_hash(self) -> str | None:
        """Read per request: a refresh that sets, rotates or removes the token is live."""
        return self.rt.snapshot.config.edge.admin_token_hash_sha256

    async def check_request(self) -> Response | None:
        """Host (421), Origin and JSON body (403, 415), then token or session (401).

        Returns the login form for a browser's ``GET /`` without a session; None
        lets the request through to its route (or to routing's 404/405).
        """
        host = request.headers.get("Host")
        check_host(host)
        if request.method not in SAFE_METHODS:
            check_same_origin(request.headers.get("Origin"), host or "")
            if request.path != "/login":  # the login form posts urlencoded
                check_json_body(
                    request.headers.get("Content-Type"),
                    _has_body(request.content_length, request.headers.get("Transfer-Encoding")),
                )
        expected = self._token_hash()
        if expected is None or (request.path, request.method) in _OPEN_ROUTES:
            return None
        if request.method in SAFE_METHODS and request.path in _OPEN_STATIC:
            return None
        if bearer_matches(request.headers.get("Authorization"), expected):
            return None
        if self.sessions.valid(request.cookies.get(SESSION_COOKIE), expected):
            return None
        if request.path == "/" and request.method in SAFE_METHODS:
            return await _login_page(failed=False)
        raise unauthenticated()

    async def healthz(self) -> Response:
        return Response(b'{"status":"ok"}', content_type=JSON)

    async def status(self) -> Response:
        return Response(_encode(self.rt.status()), content_type=JSON)

    async def metrics(self) -> Response:
        body, ctype = self.rt.metrics.exposition()
        return Response(body, content_type=ctype)

    async def refresh(self) -> Response:
        body = await request.get_data(as_text=False)
        mode = "apply"
        if body.strip():
            try:
                mode = msgspec.json.decode(body, type=_RefreshBody).mode
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
                raise errors.InvalidRequest(
                    f'refresh body must be {{"mode": "dry_run"|"apply"}}: {exc}'
                ) from None
        if mode not in ("dry_run", "apply"):
            raise errors.InvalidRequest(
                f"mode must be 'dry_run' or 'apply', not {mode[:40]!r}", param="mode"
            )
        report = await self.rt.refresh(mode)
        return Response(_encode(report), content_type=JSON)

    async def restart(self) -> Response:
        """Hand over to a new ``iopd edge`` on the same sockets; answered once it took
        over (200, its pid) or did not (409, why: this edge goes on serving)."""
        outcome = self._restart() if self._restart is not None else None
        if outcome is not None:
            await outcome.done.wait()  # bounded: the successor is given SUCCESSOR_TIMEOUT
        if outcome is None or outcome.error is not None:
            why = outcome.error if outcome is not None else "this edge cannot start a successor"
            error = errors.GatewayError(f"no restart: {why}")
            error.status, error.code = 409, "restart_refused"
            raise error
        return _json({"outcome": "handed_over", "successor_pid": outcome.successor_pid})

    # The runtime controls (``iopd/edge/runtime/runtime_controls.py``): the body was checked to
    # be JSON (or absent) and same-origin by ``check_request``; the controls
    # validate it and answer the changed providers.

    async def state(self, provider_id: str) -> Response:
        body = await _body()
        return _json(self.rt.controls.set_state(provider_id, body))

    async def override(self, provider_id: str) -> Response:
        body = await _body()
        return _json(self.rt.controls.set_override(provider_id, body))

    async def reset(self, provider_id: str) -> Response:
        body = await _body()
        return _json(self.rt.controls.reset(provider_id, body))

    async def drain_node(self, node_id: str) -> Response:
        body = await _body()
        return _json(self.rt.controls.drain_node(node_id, body))

    async def login(self) -> Response:
        """Check the form's ``token`` once; on a match open a session and go to ``/``."""
        expected = self._token_hash()
        if expected is None:  # nothing to log into: the console is open
            return _see_other("/")
        mime = (request.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
        if mime != "application/x-www-form-urlencoded":
            raise errors.UnsupportedMediaType(
                "POST /login takes the login form (application/x-www-form-urlencoded)"
            )
        body = await request.get_data(as_text=False)
        try:
            text = body.decode("utf-8") if isinstance(body, bytes) else body
            fields = parse_qs(text, max_num_fields=_MAX_LOGIN_FIELDS)
            token = fields.get("token", [""])[0].strip()
        except (ValueError, UnicodeDecodeError):
            raise errors.InvalidRequest("the login form has one field, token") from None
        if not token or not token_matches(token, expected):
            log.warning("event=admin_login result=refused")
            return await _login_page(failed=True)
        response = _see_other("/")
        response.set_cookie(
            SESSION_COOKIE,
            self.sessions.open(expected),
            max_age=int(self.sessions.ttl),
            path="/",
            httponly=True,
            samesite="Strict",
        )
        log.info("event=admin_login result=ok sessions=%d", len(self.sessions))
        return response

    async def logout(self) -> Response:
        self.sessions.close(request.cookies.get(SESSION_COOKIE))
        response = _see_other("/")
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="Strict")
        return response


async def _body() -> bytes:
    """The request body as bytes (quart's ``get_data`` is typed ``str | bytes``)."""
    data = await request.get_data(as_text=False)
    return data.encode() if isinstance(data, str) else data


def _json(document: object) -> Response:
    return Response(_encode(document), content_type=JSON)


def _see_other(location: str) -> Response:
    """303: after a POST, the browser GETs ``location``."""
    return Response(b"", status=303, headers={"Location": location})


async def _login_page(*, failed: bool) -> Response:
    """The login form (200), or again with a notice after a wrong token (401)."""
    page = await render_template("login.html", failed=failed)
    return Response(
        page,
        status=401 if failed else 200,
        content_type=HTML,
        headers={"Cache-Control": "no-store", **({"WWW-Authenticate": "Bearer"} if failed else {})},
    )
