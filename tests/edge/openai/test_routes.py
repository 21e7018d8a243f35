"""The route table (``app.ROUTES``) and the head hook that reads it.

Every route resolves to its entry by one lookup (``/v1/models/{id}`` and an
unknown ``/api/*`` path by prefix), a wrong method is a 405 and an unknown
path a 404, each in its route's error shape (Ollama's on ``/api/*``), and an
entry alone decides who authenticates: no HTTP server runs here.
"""

from __future__ import annotations

import json

import pytest

from iopd import errors
from iopd.edge.openai.app import ROUTES, Admission, OpenAIApp, Provided, route_for
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.outgoing.error_envelope import (
    OLLAMA_ERRORS,
    OPENAI_ERRORS,
    ShapedRefusal,
    render_error,
)
from iopd.edge.openai.outgoing.messages_reply import ANTHROPIC_ERRORS
from iopd.edge.openai.responses_api import handler as responses_api
from iopd.edge.openai.routes import Serves
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.http.connection import Request
from tests.support.configs import edge_yaml, principal_token
from tests.support.gateway import edge_config

TOKEN = "sk-route-test"
AUTH = [("authorization", f"Bearer {TOKEN}")]


def app() -> OpenAIApp:
    cfg = edge_config(edge_yaml(openai={"principal_tokens": [principal_token(TOKEN)]}))
    return OpenAIApp(EdgeRuntime.create(cfg))


def test_every_route_of_the_table_resolves_to_its_entry() -> None:
    for path, route in ROUTES.items():
        assert route_for(path) is route
        assert route.methods, path


def test_the_model_route_takes_an_id_with_slashes_but_no_dot_segments() -> None:
    route = route_for("/v1/models/org/model")
    assert route is not None and route.methods == frozenset({"GET"})
    assert route_for("/v1/models/../../status") is None
    assert route_for("/v1/models/") is None
    assert route_for("/v2/models") is None


def test_an_unknown_ollama_path_is_an_ollama_route_without_methods() -> None:
    route = route_for("/api/pull")
    assert route is not None and not route.methods and route.errors is OLLAMA_ERRORS


def test_the_routes_a_provider_serves_say_which_providers() -> None:
    served = {
        path: (route.handler.serves, route.handler.kind)
        for path, route in ROUTES.items()
        if isinstance(route.handler, Provided)
    }
    assert served == {
        "/v1/chat/completions": (Serves.RELAY_OR_NORMALIZED, rq.ChatRequest),
        "/v1/embeddings": (Serves.PASSTHROUGH, rq.RelayedRequest),
        "/v1/completions": (Serves.PASSTHROUGH, rq.RelayedRequest),
        "/api/chat": (Serves.OLLAMA, rq.OllamaRequest),
        "/api/generate": (Serves.OLLAMA, rq.OllamaRequest),
        "/api/embed": (Serves.OLLAMA, rq.OllamaRequest),
        "/api/embeddings": (Serves.OLLAMA, rq.OllamaRequest),
        "/api/show": (Serves.OLLAMA, rq.OllamaRequest),
    }
    # /v1/responses has its own handler (relayed, translated through chat, or normalized).
    assert ROUTES["/v1/responses"].handler is responses_api.serve
    # Every /api/* route answers in Ollama's shape, the Messages routes in
    # Anthropic's, every other in OpenAI's.
    for path, route in ROUTES.items():
        if path.startswith("/api/"):
            assert route.errors is OLLAMA_ERRORS, path
        elif path.startswith("/v1/messages"):
            assert route.errors is ANTHROPIC_ERRORS, path
        else:
            assert route.errors is OPENAI_ERRORS, path


def test_an_unknown_messages_path_is_an_anthropic_route_without_methods() -> None:
    route = route_for("/v1/messages/batches")
    assert route is not None and not route.methods and route.errors is ANTHROPIC_ERRORS
    with pytest.raises(ShapedRefusal) as refused:
        app().check_head("POST", "/v1/messages/batches", AUTH)
    _, _, body = render_error(refused.value)
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no route for POST /v1/messages/batches"},
    }


def test_a_relay_only_route_names_no_normalized_answer() -> None:
    with pytest.raises(ValueError):
        Provided(Serves.PASSTHROUGH, rq.RelayedRequest, once=lambda *a: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError):
        Provided(Serves.RELAY_OR_NORMALIZED, rq.ChatRequest)


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/v1/nope", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("POST", "/v1/models", 405, "method_not_allowed"),
        ("DELETE", "/healthz", 405, "method_not_allowed"),
    ],
)
def test_a_wrong_route_or_method_is_refused_from_the_head(
    method: str, path: str, status: int, code: str
) -> None:
    with pytest.raises(errors.GatewayError) as refused:
        app().check_head(method, path, AUTH)
    got_status, headers, body = render_error(refused.value)
    assert got_status == status
    assert json.loads(body)["error"]["code"] == code
    assert ("x-request-id", refused.value.headers[-1][1]) in headers


@pytest.mark.parametrize(
    ("method", "path", "status"), [("POST", "/api/pull", 404), ("GET", "/api/chat", 405)]
)
def test_an_ollama_route_refuses_in_ollamas_shape(method: str, path: str, status: int) -> None:
    with pytest.raises(ShapedRefusal) as refused:
        app().check_head(method, path, AUTH)
    got_status, _headers, body = render_error(refused.value)
    assert got_status == status
    assert set(json.loads(body)) == {"error"}
    assert isinstance(json.loads(body)["error"], str)


def test_the_head_hook_authenticates_by_the_route() -> None:
    gate = app()
    with pytest.raises(errors.AuthenticationError):
        gate.check_head("POST", "/v1/chat/completions", [])
    with pytest.raises(ShapedRefusal):  # the same 401, in Ollama's shape
        gate.check_head("POST", "/api/chat", [])
    open_route = gate.check_head("GET", "/healthz", [])  # no auth, no request line
    assert open_route.out.principal is None and open_route.out.quiet
    admitted = gate.check_head("POST", "/v1/chat/completions", AUTH)
    assert isinstance(admitted, Admission)
    assert admitted.route is ROUTES["/v1/chat/completions"]
    assert admitted.out.principal is not None and admitted.out.endpoint == "chat_completions"
    assert admitted.error_shape is OPENAI_ERRORS
    assert gate.check_head("GET", "/api/tags", AUTH).error_shape is OLLAMA_ERRORS


def test_a_relay_only_endpoint_is_labelled_passthrough_from_its_route() -> None:
    gate = app()
    assert gate.check_head("POST", "/v1/embeddings", AUTH).out.mode == "passthrough"
    assert gate.check_head("GET", "/api/tags", AUTH).out.mode == "passthrough"
    assert gate.check_head("POST", "/v1/responses", AUTH).out.mode == "normalized"


# ------------------------------------------------------- every answer, logged


class _Recorder:
    """The responder's part a handler uses: what was sent."""

    started = False
    status = 0

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.started, self.status, self.body = True, status, body


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=request ")]


def test_every_admitted_request_carries_its_id_on_every_response() -> None:
    admitted = app().check_head("POST", "/v1/chat/completions", AUTH)
    assert admitted.response_headers == [("x-request-id", admitted.out.request_id)]


def test_a_404_has_its_request_line_with_the_path(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="iopd.edge.request")
    with pytest.raises(errors.RouteNotFound):
        app().check_head("POST", "/v1/nothing-here", AUTH)
    (line,) = _request_lines(caplog)
    assert "http_status=404" in line and line.endswith("path=/v1/nothing-here")


def test_a_413_of_an_admitted_request_has_its_request_line_with_the_principal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = app()
    admitted = gate.check_head("POST", "/v1/chat/completions", AUTH)
    caplog.set_level("INFO", logger="iopd.edge.request")
    gate.layer_refused(413, errors.RequestTooLarge("request body too large"), admitted)
    (line,) = _request_lines(caplog)
    assert "principal=user-1" in line and "http_status=413" in line
    assert "status=client_error" in line and "path=/v1/chat/completions" in line


async def test_the_model_list_is_logged_with_its_status(caplog: pytest.LogCaptureFixture) -> None:
    gate = app()
    admitted = gate.check_head("GET", "/v1/models", AUTH)
    request = Request("GET", "/v1/models", "/v1/models", "", AUTH, b"", None, "1.1", admitted)
    responder = _Recorder()
    caplog.set_level("INFO", logger="iopd.edge.request")
    await gate(request, responder)  # type: ignore[arg-type]
    (line,) = _request_lines(caplog)
    assert responder.status == 200 and "http_status=200" in line and "status=ok" in line
    assert json.loads(responder.body)["data"][0]["id"] == "echo"
