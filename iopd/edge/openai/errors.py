"""The one place that renders the OpenAI error envelope (SPEC §4, §10).

Every :class:`iopd.errors.GatewayError` that reaches a caller of the OpenAI
surface becomes ``{"error": {"message", "type", "code", "param"}}`` here: as a
whole JSON response before a response started, or as one SSE ``data:`` event
when a stream is already under way.  Messages come from the exception and are
written by us, never from a traceback.

The HTTP server refuses some requests itself (malformed, too slow, too large,
over budget) in its own vocabulary (``iopd.http.errors``); :func:`gateway_error`
is the one place those become OpenAI errors, for the envelope and for the
``status`` label of the metrics.
"""

from __future__ import annotations

import msgspec

from iopd import errors
from iopd.errors import GatewayError
from iopd.http.errors import Refusal

_encode = msgspec.json.Encoder().encode

JSON_CONTENT_TYPE = ("content-type", "application/json")


#: The HTTP layer's refusals by ``code``: each has the same code here.
_BY_HTTP_CODE: dict[str, type[GatewayError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidRequest,
        errors.MethodNotAllowed,
        errors.RequestTimeout,
        errors.RequestTooLarge,
        errors.HeadersTooLarge,
        errors.Overloaded,
        errors.NotImplementedByEdge,
        GatewayError,
    )
}


def gateway_error(exc: Refusal) -> GatewayError:
    """The OpenAI error for ``exc``: itself if it is one, else the HTTP layer's
    refusal mapped by its code (an unknown code keeps its status and code)."""
    if isinstance(exc, GatewayError):
        return exc
    cls = _BY_HTTP_CODE.get(exc.code)
    error = (cls or GatewayError)(exc.message)
    if cls is None:
        error.status, error.code = exc.status, exc.code
        if 400 <= exc.status < 500:
            error.type, error.metric_status = "invalid_request_error", "client_error"
    error.headers = list(exc.headers)
    return error


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


def render_error(exc: Refusal) -> tuple[int, list[tuple[str, str]], bytes]:
    """``(status, headers, body)`` of the JSON error response for ``exc``.

    Headers are the JSON content type plus ``exc.headers`` (e.g. ``Retry-After``).
    An HTTP-layer refusal is mapped first (:func:`gateway_error`).
    """
    exc = gateway_error(exc)
    return exc.status, [JSON_CONTENT_TYPE, *exc.headers], _encode(error_body(exc))


def error_sse_event(exc: GatewayError) -> bytes:
    """The envelope as one SSE event, for errors after a stream has started."""
    return b"data: " + _encode(error_body(exc)) + b"\n\n"
