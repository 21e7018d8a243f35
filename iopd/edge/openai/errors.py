"""The one place that renders the OpenAI error envelope (SPEC §4, §10).

Every :class:`iopd.errors.GatewayError` that reaches a caller of the OpenAI
surface becomes ``{"error": {"message", "type", "code", "param"}}`` here: as a
whole JSON response before a response started, or as one SSE ``data:`` event
when a stream is already under way.  Messages come from the exception and are
written by us, never from a traceback.
"""

from __future__ import annotations

import msgspec

from iopd.errors import GatewayError

_encode = msgspec.json.Encoder().encode

JSON_CONTENT_TYPE = ("content-type", "application/json")


def error_body(exc: GatewayError) -> dict[str, dict[str, str | None]]:
    """The envelope as a dict: ``{"error": {"message", "type", "code", "param"}}``."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "code": exc.code,
            "param": exc.param,
        }
    }


def render_error(exc: GatewayError) -> tuple[int, list[tuple[str, str]], bytes]:
    """``(status, headers, body)`` of the JSON error response for ``exc``.

    Headers are the JSON content type plus ``exc.headers`` (e.g. ``Retry-After``).
    """
    return exc.status, [JSON_CONTENT_TYPE, *exc.headers], _encode(error_body(exc))


def error_sse_event(exc: GatewayError) -> bytes:
    """The envelope as one SSE event, for errors after a stream has started."""
    return b"data: " + _encode(error_body(exc)) + b"\n\n"
