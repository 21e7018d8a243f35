"""The OpenAI error envelope: one renderer for every GatewayError."""

from __future__ import annotations

import json

import pytest

from iopd import errors
from iopd.edge.openai.outgoing.error_envelope import error_sse_event, render_error

TABLE = [
    (errors.AuthenticationError, 401, "authentication_error", "invalid_api_key"),
    (errors.ProviderAuthRequired, 401, "authentication_error", "provider_auth_required"),
    (errors.InvalidRequest, 400, "invalid_request_error", "invalid_request_error"),
    (errors.ModelNotFound, 404, "invalid_request_error", "model_not_found"),
    (errors.RouteNotFound, 404, "invalid_request_error", "not_found"),
    (errors.MethodNotAllowed, 405, "invalid_request_error", "method_not_allowed"),
    (errors.RequestTooLarge, 413, "invalid_request_error", "request_too_large"),
    (errors.HeadersTooLarge, 431, "invalid_request_error", "headers_too_large"),
    (errors.RequestTimeout, 408, "invalid_request_error", "request_timeout"),
    (errors.QueueFull, 429, "rate_limit_error", "queue_full"),
    (errors.QueueTimeout, 503, "server_error", "queue_timeout"),
    (errors.NodeDispatchError, 502, "server_error", "node_dispatch_error"),
    (errors.ProviderError, 502, "server_error", "provider_error"),
    (errors.ProviderTimeout, 504, "server_error", "provider_timeout"),
]


@pytest.mark.parametrize(("cls", "status", "type_", "code"), TABLE)
def test_envelope_matches_the_spec_table(
    cls: type[errors.GatewayError], status: int, type_: str, code: str
) -> None:
    got_status, headers, body = render_error(cls("something went wrong"))
    assert got_status == status
    assert ("content-type", "application/json") in headers
    assert json.loads(body) == {
        "error": {"message": "something went wrong", "type": type_, "code": code, "param": None}
    }


def test_param_is_rendered() -> None:
    _, _, body = render_error(errors.InvalidRequest("bad temperature", param="temperature"))
    assert json.loads(body)["error"]["param"] == "temperature"


def test_extra_headers_are_kept() -> None:
    status, headers, _ = render_error(errors.QueueTimeout("waited too long", retry_after=7))
    assert status == 503
    assert ("Retry-After", "7") in headers


def test_generic_error_is_a_500() -> None:
    status, _, body = render_error(errors.GatewayError("Internal server error"))
    assert status == 500
    assert json.loads(body)["error"]["type"] == "server_error"


def test_sse_event() -> None:
    event = error_sse_event(errors.ProviderError('upstream "failed"\nbadly'))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # one event: newlines in the message stay escaped
    payload = json.loads(event[len(b"data: ") : -2])
    assert payload["error"]["code"] == "provider_error"
    assert payload["error"]["message"] == 'upstream "failed"\nbadly'
