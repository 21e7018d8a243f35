"""The loopback admin API: /healthz, /status, /refresh, /metrics (SPEC §10).

Served by the same HTTP server (iopd.http.server) as the OpenAI API, on its own listener, and only
to loopback peers (``allow_peer``) — a non-loopback ``admin_listen`` is already
a config error.  The public listener has no route to any of this.
"""

from __future__ import annotations

import ipaddress
import logging

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

    async def _route(self, request: Request, responder: Responder) -> None:
        path, method = request.path, request.method
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
