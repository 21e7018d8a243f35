"""CORS for browsers calling the OpenAI listener (``openai.cors_allow_origins``).

Off by default (an empty list).  When a request's ``Origin`` is allowed:

* a preflight (``OPTIONS`` with ``Access-Control-Request-Method`` naming a
  method the route takes) is answered ``204`` from the head, *before*
  authentication: a browser sends no credentials with a preflight.  The
  answer allows the origin, the route's methods, the requested headers (each
  an HTTP token, at most :data:`MAX_REQUEST_HEADERS` of them in at most
  :data:`MAX_REQUEST_HEADERS_CHARS`; otherwise none is allowed and the
  browser fails the preflight) for :data:`MAX_AGE_SECONDS`;
* every other response to it, errors included, carries
  ``Access-Control-Allow-Origin: <origin>``, ``Access-Control-Expose-Headers``
  (the edge's ``x-request-id`` and ``retry-after``) and ``Vary: Origin``.

A request from an origin that is not allowed gets no CORS header at all (its
preflight is what it was without CORS: 405, the routes take no ``OPTIONS``).
The origin is echoed, never ``*``, and credentials (cookies) are never
allowed: callers authenticate with a bearer token in a header.

Pure functions of the allowed set and the request's headers; nothing here
runs unless the list is non-empty.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Final

__all__ = [
    "MAX_AGE_SECONDS",
    "MAX_REQUEST_HEADERS",
    "MAX_REQUEST_HEADERS_CHARS",
    "allowed_origin",
    "preflight_headers",
    "response_headers",
]

Headers = list[tuple[str, str]]

#: How long a browser may cache a preflight answer.
MAX_AGE_SECONDS: Final = 600
#: Bounds on ``Access-Control-Request-Headers`` echoed (the OpenAI JS SDK sends ~12).
MAX_REQUEST_HEADERS: Final = 64
MAX_REQUEST_HEADERS_CHARS: Final = 2048
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: The edge's own headers a page may read.
_EXPOSED = "x-request-id, retry-after"


def _header(headers: Headers, name: str) -> str | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def allowed_origin(allowed: Collection[str], headers: Headers) -> str | None:
    """The request's ``Origin`` when ``allowed`` lets it in (``*`` lets every one in)."""
    origin = _header(headers, "origin")
    if origin is None or not origin:
        return None
    return origin if origin in allowed or "*" in allowed else None


def response_headers(origin: str) -> Headers:
    """The headers of every response to an allowed origin."""
    return [
        ("access-control-allow-origin", origin),
        ("access-control-expose-headers", _EXPOSED),
        ("vary", "Origin"),
    ]


def preflight_headers(origin: str, methods: Collection[str], headers: Headers) -> Headers | None:
    """The answer to a preflight for a route taking ``methods``; None when the
    request is no preflight of one of them (it is then routed as any request)."""
    method = _header(headers, "access-control-request-method")
    if method is None or method not in methods:
        return None
    out = [
        ("access-control-allow-origin", origin),
        ("access-control-allow-methods", ", ".join(sorted(methods))),
        ("access-control-max-age", str(MAX_AGE_SECONDS)),
        ("vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
    ]
    requested = _allowed_request_headers(_header(headers, "access-control-request-headers"))
    if requested:
        out.append(("access-control-allow-headers", requested))
    return out


def _allowed_request_headers(value: str | None) -> str | None:
    """The requested header names, lower-cased, when each is a token and the list is bounded."""
    if not value or len(value) > MAX_REQUEST_HEADERS_CHARS:
        return None
    names = [name.strip().lower() for name in value.split(",")]
    names = [name for name in names if name]
    if len(names) > MAX_REQUEST_HEADERS or not all(_TOKEN.fullmatch(n) for n in names):
        return None
    return ", ".join(names)
