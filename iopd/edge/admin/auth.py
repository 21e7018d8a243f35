"""Who may call the admin listener, and from where.

Four checks, each a small function of the request's headers so that every
route (the API, the runtime controls, the console) gets them from one
``before_request`` hook (``routes.py``):

1. The peer is loopback (``is_loopback_peer``, applied by ``serve.py`` to the
   accepted socket, before any HTTP is spoken).
2. The ``Host`` is a loopback name (``is_loopback_host_header``).  A loopback
   peer is not enough: a web page open in a browser on the edge's host can
   make that browser a loopback peer, and by DNS rebinding (a name of the
   page's that now resolves to 127.0.0.1) read ``/status`` or POST
   ``/refresh``.  Such a request still names the page's host in ``Host``, so
   only ``localhost``, ``127.0.0.1`` and ``[::1]`` (with or without a port)
   are served; anything else is 421.
3. A state-changing request (any method but GET/HEAD) whose ``Origin`` is
   present and is not this listener's own origin is refused with 403
   (``check_same_origin``): a page on another site cannot make the
   operator's browser drain a provider.  A request without ``Origin`` (the
   CLI, curl) passes.  Its body, when it has one, must be JSON (415
   otherwise, ``check_json_body``), which a cross-site HTML form cannot send.
4. With ``edge.admin_token_hash_sha256``, every route but ``GET /healthz``
   wants the bearer token (``bearer_matches``) or a session cookie that a
   ``POST /login`` with that token set (``SessionStore``): a browser's
   EventSource cannot send an Authorization header.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from iopd import errors

#: ``Host`` values served: a loopback name and an optional port.
_LOOPBACK_HOST = re.compile(r"(?:(?i:localhost)|127\.0\.0\.1|\[::1\])(?::[0-9]{1,5})?")

#: Methods that change nothing: exempt from the Origin and Content-Type checks.
SAFE_METHODS = frozenset({"GET", "HEAD"})

#: The session cookie's name; its value is a random token, the store keeps its hash.
SESSION_COOKIE = "iopd_admin_session"
#: How long a session lasts after its login.
SESSION_TTL = 12 * 3600.0
#: Sessions held at once; the oldest is forgotten first (each login makes one).
MAX_SESSIONS = 64


def is_loopback_peer(host: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (also v4-mapped)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def is_loopback_host_header(value: str | None) -> bool:
    """True for ``localhost``, ``127.0.0.1`` or ``[::1]``, with or without ``:port``."""
    return value is not None and _LOOPBACK_HOST.fullmatch(value) is not None


def check_host(host: str | None) -> None:
    """421 unless ``Host`` is a loopback name (the DNS-rebinding guard)."""
    if not is_loopback_host_header(host):
        raise errors.MisdirectedRequest(
            "the admin API answers only requests addressed to localhost, 127.0.0.1 or [::1]"
        )


def _sha256(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_matches(token: str, token_hash_sha256: str) -> bool:
    """True when ``token`` hashes to ``token_hash_sha256``; compared in constant time."""
    return hmac.compare_digest(_sha256(token), bytes.fromhex(token_hash_sha256))


def bearer_matches(authorization: str | None, token_hash_sha256: str) -> bool:
    """True when ``Authorization: Bearer <token>`` hashes to ``token_hash_sha256``.

    The digests are compared in constant time, as the OpenAI listener does.
    """
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return token_matches(token.strip(), token_hash_sha256)


def unauthenticated() -> errors.AuthenticationError:
    """The 401 of a route that wants the admin token."""
    exc = errors.AuthenticationError(
        "the admin API needs 'Authorization: Bearer <admin token>' "
        "(the token whose SHA-256 is edge.admin_token_hash_sha256) or a session from POST /login"
    )
    exc.headers = [("WWW-Authenticate", "Bearer")]
    return exc


def check_same_origin(origin: str | None, host: str) -> None:
    """403 when ``Origin`` is present and is not ``http://<host>`` (this listener).

    ``host`` is the request's ``Host``, already checked to be a loopback name,
    so the only origin that passes is a page served by this listener itself.
    No ``Origin`` passes: the CLI and curl send none, and a browser always
    sends one with a cross-site POST.  ``Origin: null`` (a sandboxed page, a
    redirect chain) is refused.
    """
    if origin is None:
        return
    if origin.strip().lower() != f"http://{host.lower()}":
        raise errors.CrossOriginRefused(
            "a state-changing admin request must come from the admin listener's own page "
            "or carry no Origin header (CLI, curl)"
        )


def check_json_body(content_type: str | None, has_body: bool) -> None:
    """415 when a request has a body that is not ``application/json``.

    ``has_body`` comes from the headers (``Content-Length`` > 0 or a
    ``Transfer-Encoding``), so the check runs before anything is read.  A
    cross-site HTML form can send only urlencoded, multipart or text bodies.
    """
    if not has_body:
        return
    mime = (content_type or "").partition(";")[0].strip().lower()
    if mime != "application/json":
        raise errors.UnsupportedMediaType(
            f"admin request bodies must be 'Content-Type: application/json', not {mime[:60]!r}"
        )


@dataclass
class _Session:
    expires: float
    #: The admin token hash this session was opened under: a new token ends it.
    token_hash: str


class SessionStore:
    """Browser sessions opened by ``POST /login``, in memory (lost on restart).

    The store keeps only the SHA-256 of each cookie value, so a memory dump
    or a debugger never shows a usable cookie.  A session ends after
    ``ttl`` seconds, at ``POST /logout``, or when the configured admin token
    changes (a refresh that rotates the token logs every browser out).
    """

    def __init__(
        self,
        *,
        ttl: float = SESSION_TTL,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: dict[bytes, _Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, token_hash: str) -> str:
        """A new session under ``token_hash``; returns the cookie value (32 random bytes)."""
        self._expire()
        while len(self._sessions) >= self.max_sessions:
            oldest = min(self._sessions, key=lambda key: self._sessions[key].expires)
            del self._sessions[oldest]
        value = secrets.token_urlsafe(32)
        self._sessions[_sha256(value)] = _Session(self._clock() + self.ttl, token_hash)
        return value

    def valid(self, value: str | None, token_hash: str) -> bool:
        """True when ``value`` is a live session opened under ``token_hash``."""
        if not value:
            return False
        session = self._sessions.get(_sha256(value))
        if session is None:
            return False
        if session.expires <= self._clock() or not hmac.compare_digest(
            session.token_hash, token_hash
        ):
            self._sessions.pop(_sha256(value), None)
            return False
        return True

    def close(self, value: str | None) -> None:
        """End the session ``value`` (logout); unknown values are ignored."""
        if value:
            self._sessions.pop(_sha256(value), None)

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, s in self._sessions.items() if s.expires <= now]:
            del self._sessions[key]
