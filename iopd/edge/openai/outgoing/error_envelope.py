"""The one place that renders error responses of the OpenAI listener.

Every :class:`iopd.errors.GatewayError` that reaches a caller of the OpenAI
surface becomes ``{"error": {"message", "type", "code", "param"}}`` here: as a
whole JSON response before a response started, or as one SSE ``data:`` event
when a stream is already under way.  Messages come from the exception and are
written by us, never from a traceback.

Ollama's routes (``/api/*``) answer in Ollama's shape, ``{"error": "..."}``
(what the ``ollama`` client and Ollama-speaking tools parse), with the same
status: the shape (an :class:`ErrorShape`) is decided by the route
(``openai/app.py``'s route table) and travels as the request's head-hook
context (:class:`Shaped`), so the HTTP layer's own refusals of an admitted
request (413, 408, 503) get it too; a refusal from the head itself carries
it in a :class:`ShapedRefusal`.  A route with an error envelope of its own
names its own ``ErrorShape``.  The metrics are unchanged by the shape.

The HTTP server refuses some requests itself (malformed, too slow, too large,
over budget) in its own vocabulary (``iopd.http.errors``); :func:`gateway_error`
is the one place those become OpenAI errors, for the envelope and for the
``status`` label of the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import msgspec

from iopd import errors
from iopd.errors import GatewayError
from iopd.http.errors import Refusal, Rendered

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


class ErrorShape(NamedTuple):
    """How a route's errors look to its callers: a whole response's body and,
    on a stream that already started, the one event that ends it."""

    name: str
    body: Callable[[GatewayError], bytes]
    sse_event: Callable[[GatewayError], bytes]


@runtime_checkable
class Shaped(Protocol):
    """A request context that says its errors' shape (the app's ``Admission``)."""

    error_shape: ErrorShape


class ShapedRefusal(Exception):
    """A refusal from a request's head on a route whose errors are not OpenAI's.

    The head hook raises it (there is no context yet to carry the shape); it
    is a :class:`~iopd.http.errors.Refusal` like the error it wraps.
    """

    def __init__(self, error: GatewayError, shape: ErrorShape) -> None:
        super().__init__(error.message)
        self.error = error
        self.error_shape = shape
        self.status = error.status
        self.code = error.code
        self.message = error.message
        self.headers = error.headers  # the same list: headers added later travel


def render_error(exc: Refusal, context: object = None) -> Rendered:
    """``(status, headers, body)`` of the JSON error response for ``exc``.

    Headers are the JSON content type plus ``exc.headers`` (e.g. ``Retry-After``).
    An HTTP-layer refusal is mapped first (:func:`gateway_error`).  ``context``
    is the request's head-hook context: a :class:`Shaped` one says the shape
    (Ollama's ``{"error": "..."}``, a route's own); anything else gets the
    OpenAI envelope.
    """
    if isinstance(exc, ShapedRefusal):
        exc, context = exc.error, exc
    error = gateway_error(exc)
    shape = context.error_shape if isinstance(context, Shaped) else OPENAI_ERRORS
    return error.status, [JSON_CONTENT_TYPE, *error.headers], shape.body(error)


def error_sse_event(exc: GatewayError) -> bytes:
    """The envelope as one SSE event, for errors after a stream has started."""
    return b"data: " + _encode(error_body(exc)) + b"\n\n"


def _openai_body(exc: GatewayError) -> bytes:
    return _encode(error_body(exc))


def _ollama_body(exc: GatewayError) -> bytes:
    return _encode({"error": exc.message})


#: ``{"error": {"message", "type", "code", "param"}}``: every OpenAI route's.
OPENAI_ERRORS = ErrorShape("openai", _openai_body, error_sse_event)
#: Ollama's ``{"error": "..."}`` (its streams are NDJSON relayed raw: a cut
#: ends them, so the event is the OpenAI one and never sent).
OLLAMA_ERRORS = ErrorShape("ollama", _ollama_body, error_sse_event)
