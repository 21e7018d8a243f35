"""The gateway's error hierarchy for the OpenAI surface.

The status, ``type`` and ``code`` of each are the table of
docs/troubleshooting.md, "Errors callers see".

Every failure that can reach an HTTP caller is one of these; the OpenAI
listener turns them into the ``{"error": {...}}`` envelope in exactly one
place (``iopd/edge/openai/outgoing/error_envelope.py``).  ``metric_status`` is the ``status``
label of ``iop_openai_requests_total``.
"""

from __future__ import annotations

from iopd.vocabulary import Status


class GatewayError(Exception):
    """Base: an error with an HTTP status and an OpenAI ``type``/``code``."""

    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    metric_status: Status = "provider_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: list[tuple[str, str]] = []


class AuthenticationError(GatewayError):
    status, type, code, metric_status = 401, "authentication_error", "invalid_api_key", "auth_error"


class ProviderAuthRequired(GatewayError):
    status, type, code, metric_status = (
        401,
        "authentication_error",
        "provider_auth_required",
        "auth_error",
    )


class InvalidRequest(GatewayError):
    status, type, code, metric_status = 400, "invalid_request_error", "invalid_request_error", "client_error"


class ModelNotFound(GatewayError):
    status, type, code, metric_status = 404, "invalid_request_error", "model_not_found", "client_error"


class RouteNotFound(GatewayError):
    status, type, code, metric_status = 404, "invalid_request_error", "not_found", "client_error"


class ResourceNotFound(GatewayError):
    """An admin route names a provider or node the running config does not have."""

    status, type, code, metric_status = 404, "invalid_request_error", "not_found", "client_error"


class NodeDisconnected(GatewayError):
    """A runtime control for a node that has no session with this edge:
    the node holds the controls, so nothing can be set while it is away."""

    status, type, code, metric_status = 409, "invalid_request_error", "node_disconnected", "client_error"


class UnsupportedMediaType(GatewayError):
    """A state-changing admin route got a body that is not ``application/json``."""

    status, type, code, metric_status = (
        415,
        "invalid_request_error",
        "unsupported_media_type",
        "client_error",
    )


class MethodNotAllowed(GatewayError):
    status, type, code, metric_status = 405, "invalid_request_error", "method_not_allowed", "client_error"


class RequestTooLarge(GatewayError):
    status, type, code, metric_status = 413, "invalid_request_error", "request_too_large", "client_error"


class HeadersTooLarge(GatewayError):
    status, type, code, metric_status = 431, "invalid_request_error", "headers_too_large", "client_error"


class RequestTimeout(GatewayError):
    status, type, code, metric_status = 408, "invalid_request_error", "request_timeout", "client_error"


class QueueFull(GatewayError):
    status, type, code, metric_status = 429, "rate_limit_error", "queue_full", "queue_full"


class QueueTimeout(GatewayError):
    status, type, code, metric_status = 503, "server_error", "queue_timeout", "queue_timeout"

    def __init__(self, message: str, *, retry_after: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.headers = [("Retry-After", str(max(1, retry_after)))]


class NodeDispatchError(GatewayError):
    status, type, code, metric_status = 502, "server_error", "node_dispatch_error", "dispatch_error"


class ProviderDrained(NodeDispatchError):
    """Every provider of the model group is drained (or draining) by an operator.

    A kind of ``NodeDispatchError``: fallback groups are tried as for any group
    without a live provider; the caller is told to come back later."""

    status, code = 503, "provider_drained"


class ProviderError(GatewayError):
    status, type, code, metric_status = 502, "server_error", "provider_error", "provider_error"


class ProviderTimeout(GatewayError):
    status, type, code, metric_status = 504, "server_error", "provider_timeout", "provider_error"


class ShuttingDown(GatewayError):
    """The edge is draining and its deadline passed before this request finished."""

    status, type, code, metric_status = 503, "server_error", "shutting_down", "cancelled"


class MisdirectedRequest(GatewayError):
    """A request whose ``Host`` this listener does not serve (the admin API: loopback names only)."""

    status, type, code, metric_status = (
        421,
        "invalid_request_error",
        "misdirected_request",
        "client_error",
    )


class CrossOriginRefused(GatewayError):
    """A state-changing admin request sent by a page of another origin."""

    status, type, code, metric_status = (
        403,
        "invalid_request_error",
        "cross_origin_refused",
        "client_error",
    )


class Overloaded(GatewayError):
    """The listener is receiving as many request bodies as it may hold at once.

    A refusal before the body is read (``openai.max_inflight_body_bytes``): the
    caller retries after ``Retry-After`` seconds.
    """

    status, type, code, metric_status = 503, "server_error", "overloaded", "overloaded"

    def __init__(self, message: str, *, retry_after: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.headers = [("Retry-After", str(max(1, retry_after)))]


class LimitsUnavailable(GatewayError):
    """The shared limits store is unreachable and ``limits.on_backend_error`` is ``reject``.

    The caller retries after ``Retry-After`` seconds; the edge retries the store meanwhile.
    """

    status, type, code, metric_status = 503, "server_error", "limits_unavailable", "limits_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.headers = [("Retry-After", str(max(1, retry_after)))]


class NotImplementedByEdge(GatewayError):
    """A request method or transfer-coding iopd does not implement (RFC 9110 §15.6.2)."""

    status, type, code, metric_status = 501, "invalid_request_error", "not_implemented", "client_error"


class RateLimited(GatewayError):
    """The caller's principal is over one of its ``limits``.

    OpenAI's answer: 429, ``type`` ``requests`` or ``tokens`` (which kind of
    limit), code ``rate_limit_exceeded``, ``Retry-After`` in whole seconds.
    """

    status, type, code, metric_status = 429, "tokens", "rate_limit_exceeded", "rate_limited"

    def __init__(
        self, message: str, *, kind: str, retry_after: str, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.type = kind
        self.headers = [("Retry-After", retry_after)]
