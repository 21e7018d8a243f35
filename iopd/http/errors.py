"""The HTTP layer's own error vocabulary: what the server refuses, and why.

Why its own: ``iopd.http.server`` serves two owners (the OpenAI listener and
the admin API) and must know neither's error envelope.  It decides a handful
of refusals from bytes alone (malformed 400, a method or coding it does not
implement 405/501, too slow 408, too large 413/431, over the in-flight body
budget 503) and says each with a status, a stable ``code`` (the word logged
in ``event=request_rejected``), a message and headers.  The listener's owner
renders them (the server's ``render_error``) and counts them (``on_reject``):
the OpenAI listener maps each to its envelope in one place
(``iopd.edge.openai.outgoing.error_envelope.gateway_error``).  Their names
differ from the gateway's errors of the same statuses (``ContentTooLarge``
here, ``RequestTooLarge`` in ``iopd.errors``; ``RequestTooSlow`` and
``RequestTimeout``...): each name has one home, and a reader never takes one
layer's refusal for the other's.

The owner's own errors cross this layer in two places: a ``head_check`` that
refuses a request, and an error escaping a handler before its response
started.  The server recognises those structurally, as a :class:`Refusal`
(anything with ``status``, ``code``, ``message`` and ``headers``), and hands
them back to the owner's ``render_error`` untouched.  Why a protocol rather
than the alternatives: importing the owner's class would tie this server to
the OpenAI hierarchy; a common base class would make ``iopd.errors`` derive
from an HTTP class; wrapping would make the hook and every handler catch and
re-raise on each refusal.  :class:`HttpError` satisfies the protocol too, so
``render_error`` takes one type.  Any other exception is a bug: logged with
its traceback here, answered with a generic 500, never with its message.

:func:`protocol_error` is the one place a parser error becomes a refusal,
chosen by ``H1ProtocolError.status_hint``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from iopd.http.h1 import H1ProtocolError

Headers = list[tuple[str, str]]
#: What an owner's ``render_error`` returns: ``(status, headers, body)``.
Rendered = tuple[int, Headers, bytes]


@runtime_checkable
class Refusal(Protocol):
    """An error the listener's owner renders: a status, a stable code, a message
    meant for the caller, and headers to add (``Retry-After``...)."""

    status: int
    code: str
    message: str
    headers: Headers


class HttpError(Exception):
    """A refusal decided by this layer (the base: a generic 500)."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, headers: Headers | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers: Headers = headers if headers is not None else []


class BadRequest(HttpError):
    """Malformed HTTP: a bad request line, header or framing, or a cut request."""

    status, code = 400, "invalid_request_error"


class MethodNotServed(HttpError):
    """A method this server never serves (the parser's 405)."""

    status, code = 405, "method_not_allowed"


class RequestTooSlow(HttpError):
    """The head or the body did not arrive within its timeout."""

    status, code = 408, "request_timeout"


class ContentTooLarge(HttpError):
    """The body is over ``max_body_bytes`` (declared or counted)."""

    status, code = 413, "request_too_large"


class HeaderFieldsTooLarge(HttpError):
    """The head is over ``max_header_bytes``."""

    status, code = 431, "headers_too_large"


class NotImplementedByServer(HttpError):
    """Something the request needs that this server does not implement (the parser's 501)."""

    status, code = 501, "not_implemented"


class BodyBudgetFull(HttpError):
    """Receiving this body would hold more than ``max_inflight_body_bytes`` at once."""

    status, code = 503, "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers=[("Retry-After", str(max(1, retry_after)))])


#: The generic answer to a bug (a handler or hook that failed, no response).
INTERNAL_ERROR_MESSAGE = "Internal server error"


def internal_error() -> HttpError:
    """The generic 500: nothing of the failure reaches the caller."""
    return HttpError(INTERNAL_ERROR_MESSAGE)


def protocol_error(exc: H1ProtocolError) -> HttpError:
    """The refusal for a request the parser rejected, by its ``status_hint``."""
    hint = exc.status_hint
    if hint == 431:
        return HeaderFieldsTooLarge("request headers too large")
    if hint == 405:
        return MethodNotServed(f"method not allowed: {exc}")
    if hint == 501:
        return NotImplementedByServer(f"not implemented: {exc}")
    return BadRequest(f"malformed HTTP request: {exc}")


__all__ = [
    "BadRequest",
    "BodyBudgetFull",
    "ContentTooLarge",
    "HeaderFieldsTooLarge",
    "Headers",
    "HttpError",
    "MethodNotServed",
    "NotImplementedByServer",
    "Refusal",
    "Rendered",
    "RequestTooSlow",
    "internal_error",
    "protocol_error",
]
