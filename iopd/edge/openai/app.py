"""The edge's OpenAI-compatible surface: routing and the request lifecycle (SPEC §3, §4).

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

import msgspec
import trio

from iopd import errors
from iopd.edge.openai import requests as rq
from iopd.edge.openai.errors import render_error
from iopd.edge.openai.lifecycle import ENDPOINTS, Call, Outcome, RequestIds, fail, finish
from iopd.edge.openai.normalized import (
    chat_once,
    chat_stream,
    responses_once,
    responses_stream,
)
from iopd.edge.openai.prepare import prepare
from iopd.edge.openai.relay import relay
from iopd.edge.runtime import EdgeRuntime, Snapshot
from iopd.http.server import Request, Responder

__all__ = ["Admission", "OpenAIApp"]

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode

#: Every route of the listener and the methods it takes.
_KNOWN_ROUTES: dict[str, frozenset[str]] = {
    "/healthz": frozenset({"GET", "HEAD"}),
    "/v1/models": frozenset({"GET"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/responses": frozenset({"POST"}),
    "/api/chat": frozenset({"POST"}),
    "/api/generate": frozenset({"POST"}),
    "/api/tags": frozenset({"GET"}),
}


class Admission:
    """What :meth:`OpenAIApp.check_head` decided from a request's head.

    The request carries it to the handler (``Request.context``): the snapshot
    it was authenticated against and its outcome so far (id, endpoint,
    principal), so the handler neither routes nor authenticates twice.
    """

    __slots__ = ("snap", "out")

    def __init__(self, snap: Snapshot, out: Outcome) -> None:
        self.snap = snap
        self.out = out


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
        try:
            _admit(snap, method, path, headers, out)
        except errors.GatewayError as exc:
            out.status = exc.metric_status
            out.http_status = exc.status
            exc.headers.append(("x-request-id", out.request_id))
            finish(self.rt.metrics, out)
            raise
        return Admission(snap, out)

    def layer_refused(self, status: int, exc: errors.GatewayError, context: object) -> None:
        """The HTTP layer answered ``status`` itself (its ``on_reject``).

        A 503 ``overloaded`` of an admitted request counts like a queue refusal:
        with its endpoint and principal.  Everything else the layer refuses
        (malformed HTTP, size and time limits) is counted by status, as before
        there was a head hook.
        """
        if isinstance(exc, errors.Overloaded) and isinstance(context, Admission):
            out = context.out
            out.status = exc.metric_status
            out.http_status = status
            finish(self.rt.metrics, out)
        else:
            self.rt.metrics.count_http_rejected(status)

    async def __call__(self, request: Request, responder: Responder) -> None:
        admission = request.context
        if not isinstance(admission, Admission):  # served without the head hook
            try:
                admission = self.check_head(request.method, request.path, request.headers)
            except errors.GatewayError as refused:
                status, headers, body = render_error(refused)
                await responder.send(status, headers, body)
                return
        out = admission.out
        out.started = time.perf_counter()  # the request's duration starts with its handler
        call: Call | None = None
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
                await fail(responder, out, exc, sse_open=call is not None and call.sse_open)
        except errors.GatewayError as exc:
            await fail(responder, out, exc, sse_open=call is not None and call.sse_open)
        finally:
            finish(self.rt.metrics, out)

    # --------------------------------------------------------------- routing

    async def _route(self, call: Call, request: Request, responder: Responder) -> None:
        """Serve a request :meth:`check_head` admitted (route, method and caller known)."""
        path, out = request.path, call.out
        if path == "/v1/chat/completions":
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
        elif path in ("/api/chat", "/api/generate"):
            async with prepare(self.rt, call, request, rq.OllamaRequest) as leased_o:
                await relay(leased_o, responder, out)
        elif path == "/healthz":
            if self._draining:  # take this instance out of the load balancer
                raise errors.ShuttingDown("the edge is shutting down")
            out.status = "ok"
            await responder.send(200, [("content-type", JSON)], b'{"status":"ok"}')
        elif path == "/v1/models":
            await self._list_models(call.snap, responder, out)
        else:  # /api/tags
            await self._ollama_tags(call.snap, responder, out)

    # ---------------------------------------------------------------- models

    @staticmethod
    async def _list_models(snap: Snapshot, responder: Responder, out: Outcome) -> None:
        data = [
            {"id": g.id, "object": "model", "created": 0, "owned_by": "iopd"}
            for g in snap.catalog.listed()
        ]
        out.status = "ok"
        await responder.send(
            200, [("content-type", JSON)], _json_encode({"object": "list", "data": data})
        )

    @staticmethod
    async def _ollama_tags(snap: Snapshot, responder: Responder, out: Outcome) -> None:
        models = [
            {
                "name": g.id,
                "model": g.id,
                "modified_at": "1970-01-01T00:00:00Z",
                "size": 0,
                "digest": "",
                "details": {},
            }
            for g in snap.catalog.listed()
            if snap.catalog.has_type(g.id, "ollama")
        ]
        out.status = "ok"
        await responder.send(200, [("content-type", JSON)], _json_encode({"models": models}))


def _admit(
    snap: Snapshot, method: str, path: str, headers: list[tuple[str, str]], out: Outcome
) -> None:
    """Route, method, then the caller's token (not for ``/healthz``); raises to refuse.

    (A CORS preflight, answered before authentication, belongs here too.)
    """
    allowed = _KNOWN_ROUTES.get(path)
    if path.startswith("/api/"):
        out.endpoint = "api"
        out.mode = "passthrough"  # the metrics convention: /api/* is a raw relay
    else:
        out.endpoint = ENDPOINTS.get(path)
    if allowed is None:
        raise errors.RouteNotFound(f"no route for {method} {path}")
    if method not in allowed:
        raise errors.MethodNotAllowed(f"{method} is not allowed on {path}")
    if path == "/healthz":
        out.quiet = True  # load balancers poll it: no request line per probe
        return
    authorization = next((v for k, v in headers if k == "authorization"), None)
    out.principal = snap.auth.authenticate(authorization)
