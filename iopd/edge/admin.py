"""The loopback admin API: /healthz, /status, /refresh, /metrics (SPEC §10), and the
runtime controls (``POST /providers/{id}/state|override|reset``, ``POST
/nodes/{id}/drain``; issue #19), whose logic is ``iopd.edge.controls``.

Served by the same HTTP server (iopd.http.server) as the OpenAI API, on its own listener, and only
to loopback peers (``allow_peer``) — a non-loopback ``admin_listen`` is already
a config error.  The public listener has no route to any of this.

A loopback peer is not enough: a web page open in a browser on the edge's
host can make that browser a loopback peer, and by DNS rebinding (a name of
the page's that now resolves to 127.0.0.1) read ``/status`` or POST
``/refresh``.  Such a request still names the page's host in ``Host``, so
only the loopback names are served (``localhost``, ``127.0.0.1``, ``[::1]``,
with or without a port); anything else is 421.  With
``edge.admin_token_hash_sha256`` every route but ``GET /healthz`` also wants
the matching bearer token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re

import msgspec

from iopd import errors
from iopd.edge.openai.errors import render_error
from iopd.edge.runtime import EdgeRuntime
from iopd.http.server import Request, Responder

log = logging.getLogger("iopd.edge.admin")
JSON = "application/json"
_encode = msgspec.json.Encoder().encode

_ROUTES = {
    "/healthz": "GET",
    "/status": "GET",
    "/refresh": "POST",
    "/metrics": "GET",
}


#: Runtime controls: ``(kind, id, action)`` from the path; every one is a POST.
_CONTROL_ROUTE = re.compile(r"/(providers)/([^/]+)/(state|override|reset)|/(nodes)/([^/]+)/(drain)")

#: ``Host`` values served: a loopback name and an optional port.
_LOOPBACK_HOST = re.compile(r"(?:(?i:localhost)|127\.0\.0\.1|\[::1\])(?::[0-9]{1,5})?")
#: The one route served without the admin token (load balancers, systemd checks).
_OPEN_ROUTE = "/healthz"


def is_loopback_host_header(value: str | None) -> bool:
    """True for ``localhost``, ``127.0.0.1`` or ``[::1]``, with or without ``:port``."""
    return value is not None and _LOOPBACK_HOST.fullmatch(value) is not None


def bearer_matches(authorization: str | None, token_hash_sha256: str) -> bool:
    """True when ``Authorization: Bearer <token>`` hashes to ``token_hash_sha256``.

    The digests are compared in constant time, as the OpenAI listener does.
    """
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    digest = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(digest, bytes.fromhex(token_hash_sha256))


class _RefreshBody(msgspec.Struct, forbid_unknown_fields=True):
    mode: str = "apply"


def is_loopback_peer(host: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (also v4-mapped)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class AdminApp:
    """Request handler of the admin listener."""

    def __init__(self, runtime: EdgeRuntime) -> None:
        self.rt = runtime

    async def __call__(self, request: Request, responder: Responder) -> None:
        try:
            await self._route(request, responder)
        except errors.GatewayError as exc:
            status, headers, body = render_error(exc)
            await responder.send(status, headers, body)

    def _check_caller(self, request: Request) -> None:
        """The ``Host`` must be a loopback name (421), then the admin token (401) if set."""
        if not is_loopback_host_header(request.header("host")):
            raise errors.MisdirectedRequest(
                "the admin API answers only requests addressed to localhost, 127.0.0.1 or [::1]"
            )
        expected = self.rt.snapshot.config.edge.admin_token_hash_sha256
        if expected is None or (request.path == _OPEN_ROUTE and request.method in ("GET", "HEAD")):
            return
        if not bearer_matches(request.header("authorization"), expected):
            exc = errors.AuthenticationError(
                "the admin API needs 'Authorization: Bearer <admin token>' "
                "(the token whose SHA-256 is edge.admin_token_hash_sha256)"
            )
            exc.headers = [("WWW-Authenticate", "Bearer")]
            raise exc

    async def _route(self, request: Request, responder: Responder) -> None:
        self._check_caller(request)
        path, method = request.path, request.method
        control = _CONTROL_ROUTE.fullmatch(path)
        if control is not None:
            if method != "POST":
                raise errors.MethodNotAllowed(f"{method} is not allowed on {path}")
            result = self._control(control, request)
            await responder.send(200, [("content-type", JSON)], _encode(result))
            return
        want = _ROUTES.get(path)
        if want is None:
            raise errors.RouteNotFound(f"no admin route for {method} {path}")
        if method != want and not (want == "GET" and method == "HEAD"):
            raise errors.MethodNotAllowed(f"{method} is not allowed on {path}")
        if path == "/healthz":
            await responder.send(200, [("content-type", JSON)], b'{"status":"ok"}')
        elif path == "/status":
            await responder.send(200, [("content-type", JSON)], _encode(self.rt.status()))
        elif path == "/metrics":
            body, ctype = self.rt.metrics.exposition()
            await responder.send(200, [("content-type", ctype)], body)
        else:
            mode = "apply"
            if request.body.strip():
                try:
                    mode = msgspec.json.decode(request.body, type=_RefreshBody).mode
                except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
                    raise errors.InvalidRequest(
                        f'refresh body must be {{"mode": "dry_run"|"apply"}}: {exc}'
                    ) from None
            if mode not in ("dry_run", "apply"):
                raise errors.InvalidRequest(
                    f"mode must be 'dry_run' or 'apply', not {mode[:40]!r}", param="mode"
                )
            report = await self.rt.refresh(mode)
            await responder.send(200, [("content-type", JSON)], _encode(report))

    def _control(self, route: re.Match[str], request: Request) -> object:
        """A runtime control: the body must be JSON (or absent); ``runtime.controls`` does it."""
        ctype = (request.header("content-type") or "").split(";", 1)[0].strip().lower()
        if request.body.strip() and ctype != JSON:
            raise errors.UnsupportedMediaType(
                "runtime controls take a JSON body with 'Content-Type: application/json'"
            )
        controls, body = self.rt.controls, request.body
        if route.group(4):  # /nodes/{id}/drain
            return controls.drain_node(route.group(5), body)
        provider_id, action = route.group(2), route.group(3)
        if action == "state":
            return controls.set_state(provider_id, body)
        if action == "override":
            return controls.set_override(provider_id, body)
        return controls.reset(provider_id, body)
