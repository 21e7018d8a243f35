"""The edge's OpenAI-compatible surface: routing and the request lifecycle (SPEC §3, §4).

One request, start to end:

    from the head, before any body byte is read (``check_head``, the HTTP
    server's head hook): route, method, authenticate → then, with the body:
    parse → resolve model group → estimate tokens / context
    class → lease a provider from the pool (may queue) → by the provider's
    type: normalized RunRequest or raw ProviderTunnelRequest on the node's
    session → write JSON or SSE → metrics + one log line.

Errors are ``iopd.errors.GatewayError``s raised anywhere below and rendered
in one place (``errors.render_error``).  A caller disconnect cancels the
handler (the HTTP server does that); leaving ``open_stream`` then sends
``Cancel`` to the node and leaving ``pool.lease`` frees the slot.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import trio

from iopd import errors
from iopd.edge.metrics import RequestLabels
from iopd.edge.openai import chat as chatfmt
from iopd.edge.openai import requests as rq
from iopd.edge.openai.auth import Principal
from iopd.edge.openai.errors import error_sse_event, render_error
from iopd.edge.openai.generation import apply_generation
from iopd.edge.openai.json_body import parse_json_object
from iopd.edge.openai.responses import build_response, responses_input_to_messages
from iopd.edge.openai.sse import SSE_HEADERS
from iopd.edge.openai.strict import StrictStreamFilter, extract_completion, strict_system_message
from iopd.edge.openai.tools import parse_text_tool_calls, restore_native_tool_call, tool_instruction
from iopd.edge.openai.upstream_headers import upstream_headers
from iopd.edge.pool.pool import Lease
from iopd.edge.runtime import EdgeRuntime, Snapshot
from iopd.edge.usage import run_event_usage, tunnel_usage
from iopd.http.server import AbortResponse, Request, Responder
from iopd.tokens import estimate_input_tokens
from wire.messages import (
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)

log = logging.getLogger("iopd.edge.request")

_Req = TypeVar("_Req", rq.ChatRequest, rq.ResponsesRequest, rq.OllamaRequest)

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode

#: Provider types that speak the OpenAI HTTP API natively (raw tunnel).
PASSTHROUGH_TYPES = frozenset({"openai"})
#: Text-only providers: tools go through the <tool_call> text protocol.
TEXT_TOOL_TYPES = frozenset({"cli", "echo"})

# Headers never relayed in either direction (RFC 9110 §7.6.1 and friends).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
#: How long an SSE stream that already started gets to take its error event.
ERROR_EVENT_GRACE = 2.0

_KNOWN_ROUTES: dict[str, frozenset[str]] = {
    "/healthz": frozenset({"GET", "HEAD"}),
    "/v1/models": frozenset({"GET"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/responses": frozenset({"POST"}),
    "/api/chat": frozenset({"POST"}),
    "/api/generate": frozenset({"POST"}),
    "/api/tags": frozenset({"GET"}),
}


#: The metric ``endpoint`` of the OpenAI routes (every ``/api/*`` path is ``api``).
_ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/responses": "responses"}


@dataclass
class Outcome:
    """What one request did, for the metrics and the log line."""

    request_id: str
    endpoint: str | None = None  # chat_completions | responses | api
    principal: Principal | None = None
    group: str = "unknown"
    mode: str = "normalized"
    provider: str = "-"
    status: str | None = None  # metric status; None until known
    http_status: int = 0
    usage: list[tuple[str, str, int]] = field(default_factory=list)
    reasoning_chars: int = 0
    reasoning_reported: bool = False
    quiet: bool = False  # not logged (health probes)
    started: float = field(default_factory=time.perf_counter)
    # The request_timeout scope and its deadline, parked while the request is
    # queued for a lease (``OpenAIApp._queue_bound``).
    scope: trio.CancelScope | None = None
    deadline: float = math.inf


@dataclass(slots=True)
class Admission:
    """What :meth:`OpenAIApp.check_head` decided from a request's head.

    The request carries it to the handler (``Request.context``): the snapshot
    it was authenticated against and its outcome so far (id, endpoint,
    principal), so the handler neither routes nor authenticates twice.
    """

    snap: Snapshot
    out: Outcome


class OpenAIApp:
    """The request handler of the OpenAI listener (an ``iopd.http.server.Handler``).

    ``check_head`` is the server's head hook and ``layer_refused`` its
    ``on_reject``: the three together account for every request once.
    """

    def __init__(self, runtime: EdgeRuntime) -> None:
        self.rt = runtime
        self._seq = itertools.count(1)
        self._id_prefix = secrets.token_hex(4)
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

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self._id_prefix}{next(self._seq):08x}"

    # ---------------------------------------------------------------- entry

    def check_head(self, method: str, path: str, headers: list[tuple[str, str]]) -> Admission:
        """The head hook: route, method and caller decided before any body byte.

        A caller without a valid token, or on an unknown route or method,
        never gets its body buffered or a ``100 Continue``.  A refusal is
        counted and logged here, as it was when the handler decided it (401
        with its endpoint in ``iop_openai_requests_total``, 404/405 by status),
        then raised for the server to answer from the head and close.
        """
        out = Outcome(request_id=self._new_id("req"))
        snap = self.rt.snapshot  # this request's snapshot, kept until it ends
        try:
            self._admit(snap, method, path, headers, out)
        except errors.GatewayError as exc:
            out.status = exc.metric_status
            out.http_status = exc.status
            exc.headers.append(("x-request-id", out.request_id))
            self._finish(out)
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
            self._finish(out)
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
        snap, out = admission.snap, admission.out
        out.started = time.perf_counter()  # the request's duration starts with its handler
        try:
            timeout = snap.config.openai.request_timeout
            with trio.move_on_after(timeout) as scope:
                out.scope, out.deadline = scope, scope.deadline
                self._active.add(scope)
                if self._cut:  # its body was still arriving at the drain deadline
                    scope.cancel()
                try:
                    await self._route(snap, request, responder, out)
                finally:
                    self._active.discard(scope)
            if scope.cancelled_caught:
                exc: errors.GatewayError = (
                    errors.ShuttingDown("the edge is shutting down")
                    if self._cut
                    else errors.ProviderTimeout("the request exceeded its time limit")
                )
                await self._fail(responder, out, exc)
        except errors.GatewayError as exc:
            await self._fail(responder, out, exc)
        finally:
            self._finish(out)

    async def _fail(self, responder: Responder, out: Outcome, exc: errors.GatewayError) -> None:
        out.status = exc.metric_status
        if not responder.started:
            status, headers, body = render_error(exc)
            out.http_status = status
            headers.append(("x-request-id", out.request_id))
            await responder.send(status, headers, body)
        elif out.mode == "normalized" and out.endpoint != "api" and not responder.finished:
            # An SSE stream already started: end it with an error event.  Bounded:
            # after a timeout or a drain cut the caller may be one that stopped
            # reading, and this write must not outlive the request's deadline.
            with trio.move_on_after(ERROR_EVENT_GRACE):
                await responder.write(error_sse_event(exc))
                await responder.end()
                return
            raise _AbortConnection(exc.message)
        else:
            # A raw relay (or a whole response's write) is mid-body: the only
            # honest signal is a cut connection.
            raise _AbortConnection(exc.message)

    def _finish(self, out: Outcome) -> None:
        duration = time.perf_counter() - out.started
        status = out.status or "cancelled"
        p = out.principal
        if out.endpoint is not None:
            labels = RequestLabels(
                principal_ref=p.label_principal_ref if p else "unmapped",
                principal_alias=p.label_principal_alias if p else "unmapped",
                token_ref=p.label_token_ref if p else "unmapped",
                model_group=out.group,
                endpoint=out.endpoint,
                response_mode=out.mode,
            )
            self.rt.metrics.record_request(
                labels,
                status=status,
                duration=duration,
                usage=out.usage,
                reasoning_chars=out.reasoning_chars,
                reasoning_reported=out.reasoning_reported,
            )
        elif out.quiet:
            return  # /healthz: load balancers poll it; no line per probe
        elif out.http_status in (404, 405):  # an unknown route, or a wrong method
            self.rt.metrics.count_http_rejected(out.http_status)
        tokens = {"input": 0, "output": 0}
        for _src, ttype, n in out.usage:
            if ttype in tokens:
                tokens[ttype] += n
        log.info(
            "event=request request_id=%s principal=%s group=%s provider=%s endpoint=%s "
            "mode=%s status=%s http_status=%d duration_ms=%.1f input_tokens=%d output_tokens=%d",
            out.request_id,
            (p.alias or p.principal_ref) if p and p.source == "principal_token" else (
                p.source if p else "-"
            ),
            out.group,
            out.provider,
            out.endpoint or "-",
            out.mode,
            status,
            out.http_status,
            duration * 1000,
            tokens["input"],
            tokens["output"],
        )

    # --------------------------------------------------------------- routing

    @staticmethod
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
            out.endpoint = _ENDPOINTS.get(path)
        if allowed is None:
            raise errors.RouteNotFound(f"no route for {method} {path}")
        if method not in allowed:
            raise errors.MethodNotAllowed(f"{method} is not allowed on {path}")
        if path == "/healthz":
            out.quiet = True  # load balancers poll it: no request line per probe
            return
        authorization = next((v for k, v in headers if k == "authorization"), None)
        out.principal = snap.auth.authenticate(authorization)

    async def _route(
        self, snap: Snapshot, request: Request, responder: Responder, out: Outcome
    ) -> None:
        """Serve a request :meth:`check_head` admitted (route, method and caller known)."""
        path = request.path
        if path == "/healthz":
            if self._draining:  # take this instance out of the load balancer
                raise errors.ShuttingDown("the edge is shutting down")
            out.status = "ok"
            await responder.send(200, [("content-type", JSON)], b'{"status":"ok"}')
            return
        if path == "/v1/models":
            await self._list_models(snap, responder, out)
        elif path == "/api/tags":
            await self._ollama_tags(snap, responder, out)
        elif path == "/v1/chat/completions":
            await self._chat(snap, request, responder, out)
        elif path == "/v1/responses":
            await self._responses(snap, request, responder, out)
        else:
            await self._ollama_relay(snap, request, responder, out)

    # ---------------------------------------------------------------- models

    async def _list_models(self, snap: Snapshot, responder: Responder, out: Outcome) -> None:
        data = [
            {"id": g.id, "object": "model", "created": 0, "owned_by": "iopd"}
            for g in snap.catalog.listed()
        ]
        out.status = "ok"
        await responder.send(
            200, [("content-type", JSON)], _json_encode({"object": "list", "data": data})
        )

    async def _ollama_tags(self, snap: Snapshot, responder: Responder, out: Outcome) -> None:
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

    # ------------------------------------------------------------ shared prep

    @staticmethod
    def _parse(snap: Snapshot, request: Request, kind: type[_Req], out: Outcome) -> _Req:
        """Decode and validate the body; a 400 is labelled with the group when one resolves."""
        body = parse_json_object(request.body)
        model = body.get("model")
        if isinstance(model, str):
            group = snap.catalog.resolve(model)
            if group is not None:
                out.group = group.id
        return kind.parse(body)

    def _resolve(self, snap: Snapshot, model: str, out: Outcome) -> Any:
        group = snap.catalog.resolve(model)
        if group is None:
            raise errors.ModelNotFound(
                f"The model '{model[:200]}' does not exist", param="model"
            )
        out.group = group.id
        types = {snap.catalog.providers[pid].config.type for pid, _ in group.providers}
        out.mode = "passthrough" if types and types <= PASSTHROUGH_TYPES else "normalized"
        return group

    def _check_provider_auth(
        self, snap: Snapshot, request: Request, group_id: str
    ) -> str | None:
        pa = snap.config.openai.provider_auth
        value = request.header(pa.header.lower())
        if pa.required and not value and snap.catalog.has_type(group_id, "openai"):
            raise errors.ProviderAuthRequired(
                f"this model requires the {pa.header} header with the provider's credentials"
            )
        return value

    def _run_metadata(
        self,
        snap: Snapshot,
        meta: dict[str, str],
        principal: Principal,
        *,
        model: str,
        stream: bool,
        estimate: int,
        context_class: str,
    ) -> dict[str, str]:
        md = dict(meta)
        md.pop("workspace", None)
        md = snap.auth.apply_principal_metadata(md, principal)
        md.update(
            openai_model=model,
            openai_stream="true" if stream else "false",
            strict_output="true" if snap.config.openai.strict_output else "false",
            estimated_input_tokens=str(estimate),
            context_class=context_class,
        )
        return md

    def _check_workspace(self, snap: Snapshot, group: Any, workspace: str | None) -> None:
        if workspace is None:
            return
        if not os.path.isabs(workspace) and snap.catalog.has_type(group.id, "cli"):
            raise errors.InvalidRequest(
                "metadata.workspace must be an absolute path", param="metadata.workspace"
            )

    def _tunnel_headers(
        self, snap: Snapshot, request: Request, provider_auth: str | None
    ) -> list[tuple[str, str]]:
        """The allow-listed caller headers (``upstream_headers``), the provider's
        credentials under ``provider_auth.target_header``, and the JSON type."""
        pa = snap.config.openai.provider_auth
        headers = upstream_headers(
            request.headers,
            extra=snap.config.openai.forward_headers,
            provider_auth_header=pa.header,
        )
        if provider_auth:
            headers.append((pa.target_header, provider_auth))
        headers.append(("content-type", JSON))
        return headers

    @staticmethod
    def _check_passthrough_limits(
        group: Any, req: rq.ChatRequest | rq.ResponsesRequest | rq.OllamaRequest, out: Outcome
    ) -> None:
        """A request that can only be relayed raw (an all-passthrough group, or
        ``/api/*``): a generation limit is a 400 before it queues."""
        if out.mode == "passthrough":
            apply_generation(
                req.params(), group.generation, passthrough=True, field_names=req.field_names
            )

    @staticmethod
    def _long_class(snap: Snapshot, estimate: int) -> Literal["normal", "long"]:
        threshold = snap.config.openai.long_context_threshold_tokens
        return "long" if estimate >= threshold else "normal"

    # ------------------------------------------------------------------ chat

    async def _chat(
        self, snap: Snapshot, request: Request, responder: Responder, out: Outcome
    ) -> None:
        req = self._parse(snap, request, rq.ChatRequest, out)
        group = self._resolve(snap, req.model, out)
        assert out.principal is not None
        provider_auth = self._check_provider_auth(snap, request, group.id)
        meta = req.metadata
        workspace = meta.get("workspace")
        self._check_workspace(snap, group, workspace)
        estimate = estimate_input_tokens(req.messages)
        cclass = self._long_class(snap, estimate)
        self._check_passthrough_limits(group, req, out)
        async with self.rt.pool.lease(
            group.id,
            context_class=cclass,
            requires=frozenset(),
            queue_timeout=self._queue_bound(group, out),
            body_bytes=len(request.body),
        ) as lease:
            session = self._leased(lease, out)
            if lease.provider_type in PASSTHROUGH_TYPES:
                await self._passthrough(
                    snap, request, req, group, lease, session, provider_auth, responder, out
                )
                return
            out.mode = "normalized"
            params = apply_generation(req.params(), group.generation, passthrough=False)
            messages = list(req.messages)
            tools = req.tools
            text_tools = bool(tools) and lease.provider_type in TEXT_TOOL_TYPES
            prefix = self._system_prefix(snap)
            if text_tools:
                prefix.append({"role": "system", "content": tool_instruction(tools or [])})
            run = RunRequest(
                stream_id=0,
                provider_id=lease.provider_id,
                adapter=lease.provider_type,  # type: ignore[arg-type]
                target=lease.target,
                messages=prefix + messages,
                tools=None if text_tools else tools,
                params=params,
                # (only the normalized path carries run metadata)
                metadata=self._run_metadata(
                    snap,
                    meta,
                    out.principal,
                    model=req.model,
                    stream=req.stream,
                    estimate=estimate,
                    context_class=cclass,
                ),
                workspace=workspace,
                stream=req.stream,
            )
            if req.stream:
                await self._chat_stream(
                    snap, session, run, responder, out, req, text_tools=text_tools
                )
            else:
                await self._chat_once(snap, session, run, responder, out, req, text_tools=text_tools)

    def _queue_bound(self, group: Any, out: Outcome) -> float:
        """The queue timeout of this request's lease, which also takes over its time limit.

        A request that runs out of time before it holds a lease involved no
        provider: that is a queue timeout (503 + Retry-After, counted as one
        by the pool's metrics), not the request scope's 504
        ``provider_timeout``.  So the pool waits at most the time left, and
        the scope's deadline is parked until ``_leased`` puts it back (a
        lease error leaves the scope at once).  A drain cut still cancels.
        """
        bound = self.rt.pool.scheduler.queue_timeout_for(group.id, group.queue_timeout)
        if out.scope is None:
            return bound
        out.scope.deadline = math.inf
        return min(bound, max(0.0, out.deadline - trio.current_time()))

    def _leased(self, lease: Lease, out: Outcome) -> Any:
        """The request holds ``lease``: its time limit is the scope's again
        (see ``_queue_bound``); the node session to send it on."""
        if out.scope is not None:
            out.scope.deadline = out.deadline
        out.provider = lease.provider_id
        return self._session(lease)

    def _session(self, lease: Lease) -> Any:
        session = self.rt.hub.session(lease.node_id)
        if session is None:
            raise errors.NodeDispatchError(f"node {lease.node_id} is not connected")
        return session

    async def _chat_once(
        self,
        snap: Snapshot,
        session: Any,
        run: RunRequest,
        responder: Responder,
        out: Outcome,
        req: rq.ChatRequest,
        *,
        text_tools: bool,
    ) -> None:
        asm = chatfmt.CompletionAssembler(
            completion_id=self._new_id("chatcmpl"), model=req.model, created=int(time.time())
        )
        await self._collect(session, run, asm, out)
        text_override: str | None = None
        calls_override: list[dict[str, Any]] | None = None
        text = asm.text
        if snap.config.openai.strict_output:
            text = extract_completion(text)
            text_override = text
        if text_tools:
            res = parse_text_tool_calls(text, req.tools or [])
            if res.calls:
                calls_override = res.calls
                text_override = res.content
            elif res.fallback:
                run.metadata["openai_text_tool_fallback"] = "true"
        result = asm.result(text_override=text_override, tool_calls_override=calls_override)
        out.status = "ok"
        out.http_status = 200
        await responder.send(200, [("content-type", JSON)], _json_encode(result))

    async def _collect(self, session: Any, run: RunRequest, asm: Any, out: Outcome) -> None:
        """Run a normalized request to its end, feeding every event to ``asm``."""
        try:
            async with session.open_stream(run) as events:
                async for ev in events:
                    if ev.kind == "complete":
                        asm.finish(ev)
                    elif ev.kind == "error":
                        raise _run_error(ev)
                    else:
                        asm.feed(_restore_tool_event(ev, asm))
        finally:
            self._account_run_usage(asm, out)

    @staticmethod
    def _account_run_usage(asm: Any, out: Outcome) -> None:
        usage: Usage | None = asm.usage
        out.usage = run_event_usage(usage)
        out.reasoning_reported = bool(usage and usage.reasoning_tokens)
        out.reasoning_chars = len(asm.reasoning_text)

    async def _chat_stream(
        self,
        snap: Snapshot,
        session: Any,
        run: RunRequest,
        responder: Responder,
        out: Outcome,
        req: rq.ChatRequest,
        *,
        text_tools: bool,
    ) -> None:
        chunks = chatfmt.ChunkStream(
            completion_id=self._new_id("chatcmpl"),
            model=req.model,
            created=int(time.time()),
            include_usage=req.include_usage,
        )
        asm = chatfmt.CompletionAssembler(
            completion_id="", model=req.model, created=0
        )  # accounting only
        strict = StrictStreamFilter() if snap.config.openai.strict_output else None
        try:
            await self._stream_events(session, run, responder, out, req, chunks, asm, strict, text_tools)
        finally:
            self._account_run_usage(asm, out)

    async def _stream_events(
        self,
        session: Any,
        run: RunRequest,
        responder: Responder,
        out: Outcome,
        req: rq.ChatRequest,
        chunks: Any,
        asm: Any,
        strict: StrictStreamFilter | None,
        text_tools: bool,
    ) -> None:
        tool_index = 0
        async with session.open_stream(run) as events:
            await responder.start(200, list(SSE_HEADERS))
            out.http_status = 200
            await responder.write(chunks.first())
            async for ev in events:
                kind = ev.kind
                if kind == "text":
                    asm.feed(ev)
                    if text_tools:
                        continue  # the whole text decides: tool calls or text
                    delta = strict.feed(ev.text) if strict else ev.text
                    if delta:
                        await responder.write(chunks.text(delta))
                elif kind == "reasoning":
                    asm.feed(ev)
                    await responder.write(chunks.reasoning(ev.text))
                elif kind == "tool_call":
                    ev = _restore_tool_event(ev, asm)
                    asm.feed(ev)
                    await responder.write(chunks.tool_call(tool_index, ev.tool_call))
                    tool_index += 1
                elif kind == "usage":
                    asm.feed(ev)
                elif kind == "complete":
                    asm.finish(ev)
                    finish = asm.finish_reason or "stop"
                    if text_tools:
                        text = extract_completion(asm.text) if strict else asm.text
                        res = parse_text_tool_calls(text, req.tools or [])
                        if res.calls:
                            if res.content:
                                await responder.write(chunks.text(res.content))
                            for call in res.calls:
                                await responder.write(chunks.tool_call(tool_index, call))
                                tool_index += 1
                            finish = "tool_calls"
                        elif text:
                            await responder.write(chunks.text(text))
                    elif strict:
                        rest = strict.flush()
                        if rest:
                            await responder.write(chunks.text(rest))
                    if tool_index and finish == "stop":
                        finish = "tool_calls"
                    await responder.write(chunks.finish(finish, asm.usage))
                    await responder.end()
                    out.status = "ok"
                    return
                elif kind == "error":
                    raise _run_error(ev)

    # ------------------------------------------------------------- responses

    async def _responses(
        self, snap: Snapshot, request: Request, responder: Responder, out: Outcome
    ) -> None:
        req = self._parse(snap, request, rq.ResponsesRequest, out)
        group = self._resolve(snap, req.model, out)
        assert out.principal is not None
        provider_auth = self._check_provider_auth(snap, request, group.id)
        has_passthrough = snap.catalog.has_type(group.id, "openai")
        simple = not req.stream and isinstance(req.raw.get("input"), str)
        requires: frozenset[str] = frozenset()
        if not simple:
            if not has_passthrough:
                raise errors.InvalidRequest(
                    "this model's providers support only non-streaming /v1/responses with a "
                    "string 'input'",
                    param="input" if not isinstance(req.raw.get("input"), str) else "stream",
                )
            requires = frozenset({"passthrough"})
        meta = req.metadata
        workspace = meta.get("workspace")
        self._check_workspace(snap, group, workspace)
        messages = responses_input_to_messages(req.raw) if simple else []
        estimate = estimate_input_tokens(messages) if simple else _estimate_raw_input(req.raw)
        cclass = self._long_class(snap, estimate)
        self._check_passthrough_limits(group, req, out)
        async with self.rt.pool.lease(
            group.id,
            context_class=cclass,
            requires=requires,
            queue_timeout=self._queue_bound(group, out),
            body_bytes=len(request.body),
        ) as lease:
            session = self._leased(lease, out)
            if lease.provider_type in PASSTHROUGH_TYPES:
                await self._passthrough(
                    snap, request, req, group, lease, session, provider_auth, responder, out
                )
                return
            out.mode = "normalized"
            prefix = self._system_prefix(snap)
            run = RunRequest(
                stream_id=0,
                provider_id=lease.provider_id,
                adapter=lease.provider_type,  # type: ignore[arg-type]
                target=lease.target,
                messages=prefix + messages,
                params=apply_generation(req.params(), group.generation, passthrough=False),
                metadata=self._run_metadata(
                    snap,
                    meta,
                    out.principal,
                    model=req.model,
                    stream=False,
                    estimate=estimate,
                    context_class=cclass,
                ),
                workspace=workspace,
                stream=False,
            )
            asm = chatfmt.CompletionAssembler(completion_id="", model=req.model, created=0)
            await self._collect(session, run, asm, out)
            text = asm.text
            if snap.config.openai.strict_output:
                text = extract_completion(text)
            doc = build_response(
                response_id=self._new_id("resp"),
                model=req.model,
                created_at=int(time.time()),
                text=text,
                reasoning_text=asm.reasoning_text,
                usage=asm.usage,
                metadata={k: v for k, v in meta.items() if k != "workspace"},
            )
            out.status = "ok"
            out.http_status = 200
            await responder.send(200, [("content-type", JSON)], _json_encode(doc))

    # ---------------------------------------------------------------- ollama

    async def _ollama_relay(
        self, snap: Snapshot, request: Request, responder: Responder, out: Outcome
    ) -> None:
        req = self._parse(snap, request, rq.OllamaRequest, out)
        group = self._resolve(snap, req.model, out)
        out.mode = "passthrough"
        if not snap.catalog.has_type(group.id, "ollama"):
            raise errors.InvalidRequest(
                f"model '{req.model[:200]}' has no ollama provider for {request.path}",
                param="model",
            )
        self._check_passthrough_limits(group, req, out)
        async with self.rt.pool.lease(
            group.id,
            requires=frozenset({"ollama"}),
            queue_timeout=self._queue_bound(group, out),
            body_bytes=len(request.body),
        ) as lease:
            session = self._leased(lease, out)
            await self._passthrough(
                snap, request, req, group, lease, session, None, responder, out
            )

    # ----------------------------------------------------------------- relay

    @staticmethod
    def _system_prefix(snap: Snapshot) -> list[dict[str, Any]]:
        """System messages the edge puts before the caller's on the normalized path."""
        oa = snap.config.openai
        return [strict_system_message(oa.strict_output_instruction)] if oa.strict_output else []

    async def _passthrough(
        self,
        snap: Snapshot,
        request: Request,
        req: rq.ChatRequest | rq.ResponsesRequest | rq.OllamaRequest,
        group: Any,
        lease: Lease,
        session: Any,
        provider_auth: str | None,
        responder: Responder,
        out: Outcome,
    ) -> None:
        """Relay the caller's request to the leased provider, ``model`` rewritten.

        Generation limits are checked here (passthrough adds nothing; over a
        limit is a 400): in a mixed group only the lease decides the path.
        """
        apply_generation(
            req.params(), group.generation, passthrough=True, field_names=req.field_names
        )
        out.mode = "passthrough"
        treq = ProviderTunnelRequest(
            stream_id=0,
            provider_id=lease.provider_id,
            method="POST",
            path=request.path,
            headers=self._tunnel_headers(snap, request, provider_auth),
            body=rq.rewrite_model(req.raw, lease.target),
        )
        await self._relay(session, treq, responder, out)

    async def _relay(
        self, session: Any, treq: ProviderTunnelRequest, responder: Responder, out: Outcome
    ) -> None:
        """Relay a provider's raw response: status, end-to-end headers, body bytes."""
        body_usage: Usage | None = None
        frame_usage: Usage | None = None
        try:
            async with session.open_stream(treq) as frames:
                async for fr in frames:
                    fr_: ProviderTunnelFrame = fr
                    kind = fr_.kind
                    # hold: the next frame is already here, so write both at once.
                    if kind == "body":
                        if fr_.data:
                            await responder.write(fr_.data, hold=frames.buffered() > 0)
                    elif kind == "head":
                        headers = [(k, v) for k, v in fr_.headers if k.lower() not in HOP_BY_HOP]
                        ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
                        if ctype.startswith("text/event-stream") or ctype.startswith(
                            "application/x-ndjson"
                        ):
                            headers.append(("X-Accel-Buffering", "no"))
                        await responder.start(fr_.status, headers, hold=frames.buffered() > 0)
                        out.http_status = fr_.status
                    elif kind == "usage":
                        body_usage = fr_.body_usage or body_usage
                        frame_usage = fr_.usage or frame_usage
                        out.reasoning_chars += fr_.reasoning_chars
                    elif kind == "end":
                        await responder.end()
                        out.status = "ok" if out.http_status < 400 else (
                            "client_error" if out.http_status < 500 else "provider_error"
                        )
                        return
                    else:  # error
                        raise _tunnel_error(fr_)
        finally:
            out.usage = tunnel_usage(body_usage, frame_usage)
            out.reasoning_reported = bool(
                (body_usage and body_usage.reasoning_tokens)
                or (frame_usage and frame_usage.reasoning_tokens)
            )


class _AbortConnection(AbortResponse):
    """Raised to make the HTTP server cut a connection whose body was mid-relay."""


def _run_error(ev: RunEvent) -> errors.GatewayError:
    msg = ev.message or "the provider failed"
    if ev.code == "provider_timeout":
        return errors.ProviderTimeout(msg)
    if ev.code == "bad_request":
        return errors.InvalidRequest(msg)
    if ev.code in ("node_lost", "node_dispatch_error"):
        return errors.NodeDispatchError(msg)
    return errors.ProviderError(msg)


def _tunnel_error(fr: ProviderTunnelFrame) -> errors.GatewayError:
    msg = fr.message or "the provider failed"
    if fr.code == "provider_timeout":
        return errors.ProviderTimeout(msg)
    if fr.code == "bad_request":
        return errors.InvalidRequest(msg)
    return errors.ProviderError(msg)


def _restore_tool_event(ev: RunEvent, asm: Any) -> RunEvent:
    if ev.kind != "tool_call" or ev.tool_call is None:
        return ev
    index = len(asm.tool_calls)
    return msgspec.structs.replace(ev, tool_call=restore_native_tool_call(ev.tool_call, index))


def _estimate_raw_input(raw: dict[str, Any]) -> int:
    """The §2.4 estimate over a /v1/responses body: instructions and input items."""
    parts: list[Any] = []
    if isinstance(raw.get("instructions"), str):
        parts.append({"content": raw["instructions"]})
    inp = raw.get("input")
    if isinstance(inp, str):
        parts.append({"content": inp})
    elif isinstance(inp, list):
        parts.extend(inp)  # message-shaped items; text_parts skips anything else
    return estimate_input_tokens(parts)
