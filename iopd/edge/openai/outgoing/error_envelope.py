"""The one place that renders error responses of the OpenAI listener.

Every :class:`iopd.errors.GatewayError` that reaches a caller of the OpenAI
surface becomes ``{"error": {"message", "type", "code", "param"}}`` here: as a
whole JSON response before a response started, or as one SSE ``data:`` event
when a stream is already under way.  Messages come from the exception and are
written by us, never from a traceback.

Anthropic's Messages routes (``/v1/messages``, its ``count_tokens``) answer in
Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``
(``outgoing/messages_reply.py``), the same way (the context's ``anthropic_errors``).

Ollama's routes (``/api/*``) answer in Ollama's shape, ``{"error": "..."}``
(what the ``ollama`` client and Ollama-speaking tools parse), with the same
status: the shape is decided by the route (``openai/app.py``'s route table) and
travels as the request's head-hook context (:class:`Shaped`), so the HTTP
layer's own refusals of an admitted request (413, 408, 503) get it too; a
refusal from the head itself carries it in a :class:`ShapedRefusal`.  The
metrics are unchanged by the shape.

The HTTP server refuses some requests itself (malformed, too slow, too large,
over budget) in its own vocabulary (``iopd.http.errors``); :func:`gateway_error`
is the one place those become OpenAI errors, for the envelope and for the
``status`` label of the metrics.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from iopd import errors
from iopd.edge.openai.outgoing import messages_reply as anthropic
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


@runtime_checkable
class Shaped(Protocol):
    """A request context that says its errors take Ollama's shape (the app's ``Admission``)."""

    ollama_errors: bool


class ShapedRefusal(Exception):
    """A refusal from a request's head on an Ollama route: ``error`` in Ollama's shape.

    The head hook raises it (there is no context yet to carry the shape); it
    is a :class:`~iopd.http.errors.Refusal` like the error it wraps.
    """

    ollama_errors = True
    anthropic_errors = False

    def __init__(self, error: GatewayError, *, anthropic_shape: bool = False) -> None:
        super().__init__(error.message)
        if anthropic_shape:  # a Messages route: Anthropic's shape instead
            self.ollama_errors, self.anthropic_errors = False, True
        self.error = error
        self.status = error.status
        self.code = error.code
        self.message = error.message
        self.headers = error.headers  # the same list: headers added later travel


def render_error(exc: Refusal, context: object = None) -> Rendered:
    """``(status, headers, body)`` of the JSON error response for ``exc``.

    Headers are the JSON content type plus ``exc.headers`` (e.g. ``Retry-After``).
    An HTTP-layer refusal is mapped first (:func:`gateway_error`).  ``context``
    is the request's head-hook context: a :class:`Shaped` one may ask for
    Ollama's ``{"error": "..."}``; anything else gets the OpenAI envelope.
    """
    if isinstance(exc, ShapedRefusal):
        exc, context = exc.error, exc
    error = gateway_error(exc)
    if isinstance(context, Shaped) and context.ollama_errors:
        body = _encode({"error": error.message})
    elif getattr(context, "anthropic_errors", False):
        body = _encode(anthropic.error_envelope(error.status, error.message))
    else:
        body = _encode(error_body(error))
    return error.status, [JSON_CONTENT_TYPE, *error.headers], body


def error_sse_event(exc: GatewayError, context: object = None) -> bytes:
    """The envelope as one SSE event, for errors after a stream has started
    (Anthropic's ``error`` event on a Messages route's stream)."""
    if getattr(context, "anthropic_errors", False):
        return anthropic.error_event(exc.status, exc.message)
    return b"data: " + _encode(error_body(exc)) + b"\n\n"
