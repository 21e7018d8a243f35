"""The edge's OpenAI-compatible surface: routing and the request lifecycle.

One request, start to end:

    from the head, before any body byte is read (``check_head``, the HTTP
    server's head hook): route, method, authenticate → then, with the body
    (``__call__``, under the ``request_timeout`` scope): ``prepare`` (parse →
    resolve model group → estimate tokens / context class → lease a provider
    from the pool, may queue) → by the path the lease decides: ``relay``
    (raw ``ProviderTunnelRequest``) or ``normalized`` (``RunRequest``) on the
    node's session → write JSON or SSE → ``lifecycle.finish``: metrics + one
    log line.

The route table (:data:`_KNOWN_ROUTES`) and the head check are here and
nowhere else.  Errors are ``iopd.errors.GatewayError``s raised anywhere below
and ended in one place (``lifecycle.fail``).  A caller disconnect cancels the
handler (the HTTP server does that); leaving ``open_stream`` then sends
``Cancel`` to the node and leaving the lease frees the slot.
"""

from __future__ import annotations

import time
from typing import NamedTuple
from urllib.parse import unquote

import msgspec
import trio

from iopd import __version__, errors
from iopd.config.catalog import GroupSpec
from iopd.edge.openai import limits
from iopd.edge.openai.incoming import cors
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.lifecycle import Call, Outcome, RequestIds, fail, finish
from iopd.edge.openai.normalized import (
    chat_once,
    chat_stream,
    responses_once,
    responses_stream,
)
from iopd.edge.openai.outgoing.error_envelope import ShapedRefusal, render_error
from iopd.edge.openai.prepare import model_not_found, prepare
from iopd.edge.openai.relay import relay
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.server import HeadContext, Request, Responder
from iopd.vocabulary import RELAY_ONLY_ENDPOINTS, Endpoint

__all__ = ["Admission", "OpenAIApp"]

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode

_GET = frozenset({"GET"})
_POST = frozenset({"POST"})


class Route(NamedTuple):
    """One route of the listener: its methods and how its requests are counted."""

    methods: frozenset[str]
    #: The metric ``endpoint`` (None: not an API request, e.g. the model list).
    endpoint: Endpoint | None
    #: An Ollama route: errors in Ollama's shape.
    ollama: bool = False


#: Every route of the listener by path: one dict lookup per request.
_ROUTES: dict[str, Route] = {
    "/healthz": Route(frozenset({"GET", "HEAD"}), None),
    "/v1/models": Route(_GET, None),
    "/v1/chat/completions": Route(_POST, "chat_completions"),
    "/v1/responses": Route(_POST, "responses"),
    "/v1/embeddings": Route(_POST, "embeddings"),
    "/v1/completions": Route(_POST, "completions"),
    "/api/chat": Route(_POST, "api", ollama=True),
    "/api/generate": Route(_POST, "api", ollama=True),
    "/api/embed": Route(_POST, "api", ollama=True),
    "/api/embeddings": Route(_POST, "api", ollama=True),  # Ollama's legacy embeddings
    "/api/show": Route(_POST, "api", ollama=True),
    "/api/tags": Route(_GET, "api", ollama=True),
    "/api/ps": Route(_GET, "api", ollama=True),
    "/api/version": Route(_GET, "api", ollama=True),
}
#: ``GET /v1/models/{id}``: the one route with a parameter (the id may hold ``/``).
MODEL_PREFIX = "/v1/models/"
_MODEL_ROUTE = Route(_GET, None)
#: An unknown ``/api/*`` path: still an Ollama caller (its 404 in Ollama's shape).
_UNKNOWN_OLLAMA = Route(frozenset(), "api", ollama=True)


def _model_id_path(path: str) -> bool:
    """``/v1/models/{id}`` with an id whose ``/``-separated parts are names
    (``org/model``), not empty or dot segments (``/v1/models/../../status``)."""
    return all(part not in ("", ".", "..") for part in path[len(MODEL_PREFIX) :].split("/"))


def route_for(path: str) -> Route | None:
    """The route of ``path``: a dict lookup, then the model-retrieve prefix."""
    route = _ROUTES.get(path)
    if route is None:
        if path.startswith(MODEL_PREFIX):
            return _MODEL_ROUTE if _model_id_path(path) else None
        if path.startswith("/api/"):
            return _UNKNOWN_OLLAMA
    return route


class Admission(HeadContext):
    """What :meth:`OpenAIApp.check_head` decided from a request's head.

    The request carries it to the handler (``Request.context``): the snapshot
    it was authenticated against and its outcome so far (id, endpoint,
    principal), so the handler neither routes nor authenticates twice; the
    error shape of its route (``ollama_errors``, see ``errors.render_error``)
    and the headers every response to it carries (CORS, ``response_headers``).
    """

    __slots__ = ("snap", "out", "ollama_errors")

    def __init__(
        self,
        snap: Snapshot,
        out: Outcome,
        *,
        ollama_errors: bool = False,
        response_headers: list[tuple[str, str]] | None = None,
    ) -> None:
        # (HeadContext's field set here: no super() call on the per-request path)
        self.response_headers = response_headers or []
        self.snap = snap
        self.out = out
        self.ollama_errors = ollama_errors


class OpenAIApp:
    """The request handler of the OpenAI listener (an ``iopd.http.server.Handler``).

    ``check_head`` is the server's head hook and ``layer_refused`` its
    ``on_reject``: the three together account for every request once.
    """

    def __init__(self, runtime: EdgeRuntime) -> None:
        self.rt = runtime
        self._ids = RequestIds()
        self._active: set[trio.CancelScope] = set()
        self._cut = False
        self._draining = False

    def begin_drain(self) -> None:
        """The edge is draining: ``/healthz`` answers 503 from now on."""
        self._draining = True

    def cut_all(self) -> None:
        """Drain deadline: end every request in flight with a terminal error."""
        self._cut = True
        for scope in list(self._active):
            scope.cancel()

    # ---------------------------------------------------------------- entry

    def check_head(self, method: str, path: str, headers: list[tuple[str, str]]) -> Admission:
        """The head hook: route, method and caller decided before any body byte.

        A caller without a valid token, or on an unknown route or method,
        never gets its body buffered or a ``100 Continue``.  A refusal is
        counted and logged here, as it was when the handler decided it (401
        with its endpoint in ``iop_openai_requests_total``, 404/405 by status),
        then raised for the server to answer from the head and close.
        """
        out = Outcome(request_id=self._ids.new("req"))
        snap = self.rt.snapshot  # this request's snapshot, kept until it ends
        route = _ROUTES.get(path) or route_for(path)
        ollama = route is not None and route.ollama
        cors_headers: list[tuple[str, str]] | None = None
        if snap.cors_origins:  # CORS on: only then is the Origin looked at
            origin = cors.allowed_origin(snap.cors_origins, headers)
            if origin is not None:
                if method == "OPTIONS" and route is not None:
                    # A preflight carries no credentials: answered before authentication.
                    answer = cors.preflight_headers(origin, route.methods, headers)
                    if answer is not None:
                        # Answered 204 by the handler; the Responder adds ``answer``.
                        return Admission(snap, out, response_headers=answer)
                cors_headers = cors.response_headers(origin)
        try:
            _admit(snap, route, method, path, headers, out)
        except errors.GatewayError as exc:
            out.failed(exc)
            out.http_status = exc.status
            exc.headers.append(("x-request-id", out.request_id))
            if cors_headers:
                exc.headers += cors_headers
            finish(self.rt.metrics, out, self.rt.activity)
            if ollama:
                raise ShapedRefusal(exc) from None
            raise
        return Admission(snap, out, ollama_errors=ollama, response_headers=cors_headers)

    def layer_refused(self, status: int, exc: errors.GatewayError, context: object) -> None:
        """The HTTP layer answered ``status`` itself (its ``on_reject``).

        A 503 ``overloaded`` of an admitted request counts like a queue refusal:
        with its endpoint and principal.  Everything else the layer refuses
        (malformed HTTP, size and time limits) is counted by status, as before
        there was a head hook.
        """
        if isinstance(exc, errors.Overloaded) and isinstance(context, Admission):
            out = context.out
            out.failed(exc)
            out.http_status = status
            finish(self.rt.metrics, out, self.rt.activity)
        else:
            self.rt.metrics.count_http_rejected(status)

    async def __call__(self, request: Request, responder: Responder) -> None:
        admission = request.context
        if not isinstance(admission, Admission):  # served without the head hook
            try:
                admission = self.check_head(request.method, request.path, request.headers)
            except (errors.GatewayError, ShapedRefusal) as refused:
                status, headers, body = render_error(refused)
                await responder.send(status, headers, body)
                return
        out = admission.out
        out.started = time.perf_counter()  # the request's duration starts with its handler
        call: Call | None = None
        if admission.snap.rates_limited and out.principal is not None:
            limits.show_limits(self.rt, admission, out.principal.label_principal_ref)
        try:
            with trio.move_on_after(admission.snap.config.openai.request_timeout) as scope:
                call = Call(admission.snap, out, scope)
                self._active.add(scope)
                if self._cut:  # its body was still arriving at the drain deadline
                    scope.cancel()
                try:
                    await self._route(call, request, responder)
                finally:
                    self._active.discard(scope)
            if scope.cancelled_caught:
                exc: errors.GatewayError = (
                    errors.ShuttingDown("the edge is shutting down")
                    if self._cut
                    else errors.ProviderTimeout("the request exceeded its time limit")
                )
                await fail(
                    responder,
                    out,
                    exc,
                    sse_open=call is not None and call.sse_open,
                    context=admission,
                )
        except errors.GatewayError as exc:
            await fail(
                responder, out, exc, sse_open=call is not None and call.sse_open, context=admission
            )
        finally:
            if call is not None and call.admission is not None:
                await limits.settle(self.rt, call)
            finish(self.rt.metrics, out, self.rt.activity)

    # --------------------------------------------------------------- routing

    async def _route(self, call: Call, request: Request, responder: Responder) -> None:
        """Serve a request :meth:`check_head` admitted (route, method and caller known)."""
        path, out = request.path, call.out
        if request.method == "OPTIONS":  # only a CORS preflight passes check_head
            out.status = "ok"
            await responder.send(204, [], b"")
        elif path == "/v1/chat/completions":
            async with prepare(self.rt, call, request, rq.ChatRequest) as leased:
                if leased.relay:
                    await relay(leased, responder, out)
                elif leased.body.stream:
                    await chat_stream(leased, responder, call, self._ids)
                else:
                    await chat_once(leased, responder, out, self._ids)
        elif path == "/v1/responses":
            async with prepare(self.rt, call, request, rq.ResponsesRequest) as leased_r:
                if leased_r.relay:
                    await relay(leased_r, responder, out)
                elif leased_r.body.stream:
                    await responses_stream(leased_r, responder, call, self._ids)
                else:
                    await responses_once(leased_r, responder, out, self._ids)
        elif path in _RELAYED_OLLAMA:  # only an ollama provider serves these
            async with prepare(self.rt, call, request, rq.OllamaRequest) as leased_o:
                await relay(leased_o, responder, out)
        elif path in _RELAYED_OPENAI:  # only a passthrough provider serves these
            async with prepare(self.rt, call, request, rq.RelayedRequest) as leased_x:
                await relay(leased_x, responder, out)
        elif path == "/healthz":
            if self._draining:  # take this instance out of the load balancer
                raise errors.ShuttingDown("the edge is shutting down")
            out.status = "ok"
            await responder.send(200, [("content-type", JSON)], b'{"status":"ok"}')
        else:  # answered from the catalog, no provider involved
            body = _catalog_answer(self.rt, path)
            out.status = "ok"
            await responder.send(200, [("content-type", JSON)], body)


#: The routes relayed raw to a provider speaking the caller's API, whatever
#: the group's other providers are.
_RELAYED_OLLAMA = frozenset(
    {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"}
)
_RELAYED_OPENAI = frozenset({"/v1/embeddings", "/v1/completions"})


# ------------------------------------------------------------------ catalog answers


def _catalog_answer(rt: EdgeRuntime, path: str) -> bytes:
    """The body of a route the edge answers itself, from the snapshot and the pool."""
    snap = rt.snapshot
    if path == "/v1/models":
        data = [_model_object(g.id) for g in snap.catalog.listed()]
        return _json_encode({"object": "list", "data": data})
    if path.startswith(MODEL_PREFIX):
        return _json_encode(_retrieve_model(snap, path))
    if path == "/api/tags":
        return _json_encode({"models": [_ollama_model(g.id) for g in _ollama_groups(snap)]})
    if path == "/api/ps":
        return _json_encode({"models": [_ollama_model(g) for g in _running_ollama_groups(rt)]})
    # /api/version: the edge's own (no single provider speaks for the gateway).
    return _json_encode({"version": __version__})


def _model_object(group_id: str) -> dict[str, str | int]:
    return {"id": group_id, "object": "model", "created": 0, "owned_by": "iopd"}


def _retrieve_model(snap: Snapshot, path: str) -> dict[str, str | int]:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): exactly a listed id.

    The id is percent-decoded (an SDK quotes ``/`` in ``org/model``); the
    fallback group answers for its own id only, not for every unknown name.
    """
    model = unquote(path[len(MODEL_PREFIX) :])
    group = snap.catalog.group(model)
    if group is None:
        raise model_not_found(snap, model)
    return _model_object(group.id)


def _ollama_groups(snap: Snapshot) -> list[GroupSpec]:
    """The groups ``/api/*`` serves: those with an ``ollama`` provider."""
    return [g for g in snap.catalog.listed() if snap.catalog.has_type(g.id, "ollama")]


def _running_ollama_groups(rt: EdgeRuntime) -> list[str]:
    """``/api/ps``: the Ollama groups with a request in flight on one of their ollama providers."""
    snap, loads = rt.snapshot, rt.pool.provider_loads()
    running = []
    for group in _ollama_groups(snap):
        for pid, _served in group.providers:
            load = loads.get(pid)
            ref = snap.catalog.providers.get(pid)
            if load is not None and load.in_flight and ref is not None and ref.config.type == "ollama":
                running.append(group.id)
                break
    return running


def _ollama_model(name: str) -> dict[str, object]:
    return {
        "name": name,
        "model": name,
        "modified_at": "1970-01-01T00:00:00Z",
        "size": 0,
        "digest": "",
        "details": {},
    }


def _admit(
    snap: Snapshot,
    route: Route | None,
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    out: Outcome,
) -> None:
    """Route, method, then the caller's token (not for ``/healthz``); raises to refuse.

    (A CORS preflight from an allowed origin never gets here: ``check_head``
    answers it before authentication.)
    """
    if route is None:
        raise errors.RouteNotFound(f"no route for {method} {path}")
    out.endpoint = route.endpoint
    if route.endpoint in RELAY_ONLY_ENDPOINTS:
        out.mode = "passthrough"  # the metrics convention: only ever a raw relay
    if method not in route.methods:
        if not route.methods:
            raise errors.RouteNotFound(f"no route for {method} {path}")
        raise errors.MethodNotAllowed(f"{method} is not allowed on {path}")
    if path == "/healthz":
        out.quiet = True  # load balancers poll it: no request line per probe
        return
    authorization = next((v for k, v in headers if k == "authorization"), None)
    out.principal = snap.auth.authenticate(authorization)
