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

The route table (:data:`ROUTES`: every endpoint declared once, see
``routes.Route``) and the head check are here and nowhere else.  Errors are ``iopd.errors.GatewayError``s raised anywhere below
and ended in one place (``lifecycle.fail``).  A caller disconnect cancels the
handler (the HTTP server does that); leaving ``open_stream`` then sends
``Cancel`` to the node and leaving the lease frees the slot.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Generic

import trio

from iopd import errors
from iopd.edge.openai import answers, limits
from iopd.edge.openai.answers import MODEL_PREFIX
from iopd.edge.openai.anthropic_api import handler
from iopd.edge.openai.incoming import cors
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.lifecycle import Call, Outcome, RequestIds, fail, finish, log_request
from iopd.edge.openai.normalized import chat_once, chat_stream
from iopd.edge.openai.outgoing.error_envelope import (
    OLLAMA_ERRORS,
    OPENAI_ERRORS,
    ErrorShape,
    ShapedRefusal,
    render_error,
)
from iopd.edge.openai.outgoing.messages_reply import ANTHROPIC_ERRORS
from iopd.edge.openai.prepare import Body, LeasedRequest, prepare
from iopd.edge.openai.relay import relay
from iopd.edge.openai.responses_api import handler as responses_api
from iopd.edge.openai.routes import GET, POST, Host, Route, Serves
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.server import HeadContext, Request, Responder
from iopd.vocabulary import RELAY_ONLY_ENDPOINTS

__all__ = ["ROUTES", "Admission", "OpenAIApp", "Provided", "route_for"]


#: A normalized answer: the leased request's run(s), written to the caller.
Answer = Callable[[LeasedRequest[Body], Responder, Call, RequestIds], Awaitable[None]]


class Provided(Generic[Body]):
    """The handler of every route a provider serves, one per route of the table.

    It says which providers serve the route (``serves``), the body it parses
    (``kind``) and, on a route that may run normalized, the two normalized
    answers (whole and streamed).  Serving is then the same for every such
    route: ``prepare`` (parse → resolve → needs → lease), then the path its
    decision says: the raw relay, or the normalized answer the body asks for.

    ``once``/``stream``: the normalized answers, on a route served
    ``RELAY_OR_NORMALIZED``; a relay-only route has none.
    """

    __slots__ = ("serves", "kind", "once", "stream")

    def __init__(
        self,
        serves: Serves,
        kind: type[Body],
        once: Answer[Body] | None = None,
        stream: Answer[Body] | None = None,
    ) -> None:
        answers = (once is not None, stream is not None)
        if answers != ((True, True) if serves is Serves.RELAY_OR_NORMALIZED else (False, False)):
            raise ValueError(f"a {serves.value} route names its normalized answers exactly then")
        self.serves = serves
        self.kind: type[Body] = kind
        self.once: Answer[Body] | None = once
        self.stream: Answer[Body] | None = stream

    async def __call__(
        self, host: Host, call: Call, request: Request, responder: Responder
    ) -> None:
        async with prepare(host.rt, call, request, self.kind, self.serves) as leased:
            if leased.decision.relay:
                await relay(leased, responder, call.out)
            elif leased.body.stream:
                assert self.stream is not None  # (a normalized path exists: see __init__)
                await self.stream(leased, responder, call, host.ids)
            else:
                assert self.once is not None
                await self.once(leased, responder, call, host.ids)


_RELAYED_OLLAMA = Provided(Serves.OLLAMA, rq.OllamaRequest)
_RELAYED_OPENAI = Provided(Serves.PASSTHROUGH, rq.RelayedRequest)

#: Every route of the listener by path, each declared once: one dict lookup
#: per request.  Adding an endpoint: one entry here, one handler module.
ROUTES: dict[str, Route] = {
    "/healthz": Route(frozenset({"GET", "HEAD"}), None, answers.health, auth=None, quiet=True),
    "/v1/models": Route(GET, None, answers.models),
    "/v1/chat/completions": Route(
        POST,
        "chat_completions",
        Provided(Serves.RELAY_OR_NORMALIZED, rq.ChatRequest, chat_once, chat_stream),
    ),
    "/v1/responses": Route(POST, "responses", responses_api.serve),
    "/v1/embeddings": Route(POST, "embeddings", _RELAYED_OPENAI),
    "/v1/completions": Route(POST, "completions", _RELAYED_OPENAI),
    "/v1/messages": Route(
        POST, "messages", handler.serve, errors=ANTHROPIC_ERRORS, auth=handler.api_key
    ),
    "/v1/messages/count_tokens": Route(
        POST,
        "messages",
        handler.count_tokens,
        errors=ANTHROPIC_ERRORS,
        auth=handler.api_key,
    ),
    "/api/chat": Route(POST, "api", _RELAYED_OLLAMA, errors=OLLAMA_ERRORS),
    "/api/generate": Route(POST, "api", _RELAYED_OLLAMA, errors=OLLAMA_ERRORS),
    "/api/embed": Route(POST, "api", _RELAYED_OLLAMA, errors=OLLAMA_ERRORS),
    # Ollama's legacy embeddings route, relayed as /api/embed is.
    "/api/embeddings": Route(POST, "api", _RELAYED_OLLAMA, errors=OLLAMA_ERRORS),
    "/api/show": Route(POST, "api", _RELAYED_OLLAMA, errors=OLLAMA_ERRORS),
    "/api/tags": Route(GET, "api", answers.ollama_tags, errors=OLLAMA_ERRORS),
    "/api/ps": Route(GET, "api", answers.ollama_ps, errors=OLLAMA_ERRORS),
    "/api/version": Route(GET, "api", answers.ollama_version, errors=OLLAMA_ERRORS),
}
#: ``GET /v1/models/{id}``: the one route with a parameter (see ``route_for``).
_MODEL_ROUTE = Route(GET, None, answers.model)
#: An unknown ``/api/*`` path: still an Ollama caller (its 404 in Ollama's shape).
_UNKNOWN_OLLAMA = Route(frozenset(), "api", answers.not_found, errors=OLLAMA_ERRORS)
#: An unknown ``/v1/messages/*`` path: an Anthropic client (its 404 in Anthropic's shape).
_UNKNOWN_MESSAGES = Route(
    frozenset(), "messages", answers.not_found, errors=ANTHROPIC_ERRORS, auth=handler.api_key
)


def _model_id_path(path: str) -> bool:
    """``/v1/models/{id}`` with an id whose ``/``-separated parts are names
    (``org/model``), not empty or dot segments (``/v1/models/../../status``)."""
    return all(part not in ("", ".", "..") for part in path[len(MODEL_PREFIX) :].split("/"))


def route_for(path: str) -> Route | None:
    """The route of ``path``: a dict lookup, then the model-retrieve prefix."""
    route = ROUTES.get(path)
    if route is None:
        if path.startswith(MODEL_PREFIX):
            return _MODEL_ROUTE if _model_id_path(path) else None
        if path.startswith("/api/"):
            return _UNKNOWN_OLLAMA
        if path.startswith("/v1/messages/"):
            return _UNKNOWN_MESSAGES
    return route


class Admission(HeadContext):
    """What :meth:`OpenAIApp.check_head` decided from a request's head.

    The request carries it to the handler (``Request.context``): the snapshot
    it was authenticated against, its route and its outcome so far (id,
    endpoint, principal), so the handler neither routes nor authenticates
    twice; the error shape of its route (``error_shape``, see
    ``render_error``) and the headers every response to it carries (CORS,
    ``response_headers``).
    """

    __slots__ = ("snap", "out", "route", "error_shape")

    def __init__(
        self,
        snap: Snapshot,
        out: Outcome,
        route: Route | None,
        *,
        response_headers: list[tuple[str, str]] | None = None,
    ) -> None:
        # (HeadContext's field set here: no super() call on the per-request path)
        self.response_headers = response_headers or []
        self.snap = snap
        self.out = out
        self.route = route
        self.error_shape: ErrorShape = OPENAI_ERRORS if route is None else route.errors


class OpenAIApp:
    """The request handler of the OpenAI listener (an ``iopd.http.server.Handler``).

    ``check_head`` is the server's head hook and ``layer_refused`` its
    ``on_reject``: the three together account for every request once.  It is
    the handlers' ``routes.Host``: ``rt``, ``ids``, ``draining``.
    """

    def __init__(self, runtime: EdgeRuntime) -> None:
        self.rt = runtime
        self.ids = RequestIds()
        self._active: set[trio.CancelScope] = set()
        self._cut = False
        self.draining = False

    def begin_drain(self) -> None:
        """The edge is draining: ``/healthz`` answers 503 from now on."""
        self.draining = True

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
        out = Outcome(request_id=self.ids.new("req"), path=path)
        snap = self.rt.snapshot  # this request's snapshot, kept until it ends
        route = ROUTES.get(path) or route_for(path)
        # On every response to the request: the id of its log line.
        response_headers = [("x-request-id", out.request_id)]
        if snap.cors_origins:  # CORS on: only then is the Origin looked at
            origin = cors.allowed_origin(snap.cors_origins, headers)
            if origin is not None:
                if method == "OPTIONS" and route is not None:
                    # A preflight carries no credentials: answered before authentication.
                    answer = cors.preflight_headers(origin, route.methods, headers)
                    if answer is not None:
                        # Answered 204 by the handler; the Responder adds ``answer``.
                        response_headers += answer
                        return Admission(snap, out, route, response_headers=response_headers)
                response_headers += cors.response_headers(origin)
        try:
            _admit(snap, route, method, path, headers, out)
        except errors.GatewayError as exc:
            out.failed(exc)
            out.http_status = exc.status
            exc.headers += response_headers
            finish(self.rt.metrics, out, self.rt.activity)
            if route is not None and route.errors is not OPENAI_ERRORS:
                raise ShapedRefusal(exc, route.errors) from None
            raise
        return Admission(snap, out, route, response_headers=response_headers)

    def layer_refused(self, status: int, exc: errors.GatewayError, context: object) -> None:
        """The HTTP layer answered ``status`` itself (its ``on_reject``).

        A 503 ``overloaded`` of an admitted request counts like a queue refusal:
        with its endpoint and principal.  Everything else the layer refuses
        (malformed HTTP, size and time limits) is counted by status, as before
        there was a head hook; one of an admitted request (a 413, a 408) also
        gets its request line, with the principal the head hook found.
        """
        if not isinstance(context, Admission):
            self.rt.metrics.count_http_rejected(status)
            return
        out = context.out
        out.failed(exc)
        out.http_status = status
        if isinstance(exc, errors.Overloaded):
            finish(self.rt.metrics, out, self.rt.activity)
        else:
            self.rt.metrics.count_http_rejected(status)
            if not out.quiet:
                log_request(out)

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
                    route = admission.route
                    if route is None or request.method == "OPTIONS":
                        # Only a CORS preflight passes check_head without a handler.
                        out.answered(204)
                        await responder.send(204, [], b"")
                    else:  # its route's handler (found once, by the head hook)
                        await route.handler(self, call, request, responder)
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


def _admit(
    snap: Snapshot,
    route: Route | None,
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    out: Outcome,
) -> None:
    """Route, method, then the caller by its route's ``auth`` (none on an open
    route); raises to refuse.

    (A CORS preflight from an allowed origin never gets here: ``check_head``
    answers it before authentication.)
    """
    if route is None:
        raise errors.RouteNotFound(f"no route for {method} {path}")
    out.endpoint = route.endpoint
    if route.endpoint in RELAY_ONLY_ENDPOINTS:
        out.mode = "passthrough"  # the metrics convention: only ever a raw relay
    # A GET route answers HEAD as GET; the responder leaves the body out.
    if method not in route.methods and (method != "HEAD" or "GET" not in route.methods):
        if not route.methods:
            raise errors.RouteNotFound(f"no route for {method} {path}")
        raise errors.MethodNotAllowed(f"{method} is not allowed on {path}")
    if route.quiet:
        out.quiet = True  # load balancers poll /healthz: no request line per probe
    if route.auth is not None:
        out.principal = route.auth(snap, headers)
