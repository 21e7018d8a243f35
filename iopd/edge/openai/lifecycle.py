"""One request's life on the OpenAI surface: its record, its clock, its end.

Two objects per request, kept apart on purpose:

* :class:`Outcome` is the *record*: what the request did, written by the
  paths as they learn it (group, provider, response mode, status, usage) and
  read once, at the end, by :func:`finish` (the metrics and the one log line).
  Nothing decides control flow from it.
* :class:`Call` is the *control state* of an admitted request in flight: the
  config snapshot it runs under, the ``request_timeout`` scope (whose
  deadline is parked while the request queues for a lease, see
  :meth:`Call.park_deadline`), and whether an SSE stream is open, which
  decides how a failure ends the response (:func:`fail`).

Every ``GatewayError`` a request raises ends in :func:`fail`: a JSON error
envelope before the response started, an SSE error event on an open stream,
or a cut connection mid-body (the only honest signal on a raw relay).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field

import trio

from iopd import errors
from iopd.edge.metering.activity import ActivityRecorder
from iopd.edge.metering.metrics import GatewayMetrics, RequestLabels
from iopd.edge.metering.usage import UsageItem, run_event_usage
from iopd.edge.openai.incoming.session_key import session_digest
from iopd.edge.openai.outgoing.chat import CompletionAssembler, add_usage
from iopd.edge.openai.outgoing.error_envelope import OPENAI_ERRORS, Shaped, render_error
from iopd.edge.principals.authenticator import Principal
from iopd.edge.principals.backend import AnyAdmission
from iopd.edge.runtime.edge_runtime import Snapshot
from iopd.http.server import AbortResponse, Responder
from iopd.tokens import estimate_tokens_from_chars
from iopd.vocabulary import (
    HOP_BY_HOP,
    PASSTHROUGH_TYPES,
    TEXT_TOOL_TYPES,
    UNKNOWN_GROUP,
    Endpoint,
    ResponseMode,
    Status,
)
from wire.messages import Usage

__all__ = [
    "ERROR_EVENT_GRACE",
    "HOP_BY_HOP",
    "PASSTHROUGH_TYPES",
    "TEXT_TOOL_TYPES",
    "AbortConnection",
    "Call",
    "Outcome",
    "RequestIds",
    "fail",
    "finish",
    "log_request",
    "note_run_usage",
    "total_usage",
]

log = logging.getLogger("iopd.edge.request")

# ------------------------------------------------------------- vocabulary
# Provider-type capabilities and header sets are the shared vocabulary's
# (``iopd.vocabulary``), re-exported for the surface's modules.

# ------------------------------------------------------------------ record

#: At most this many characters of a request's path go to its log line.
MAX_LOGGED_PATH = 200

#: How long an SSE stream that already started gets to take its error event.
ERROR_EVENT_GRACE = 2.0


@dataclass(slots=True)
class Outcome:
    """What one request did, for the metrics and the log line (never for control)."""

    request_id: str
    endpoint: Endpoint | None = None
    principal: Principal | None = None
    group: str = UNKNOWN_GROUP
    mode: ResponseMode = "normalized"
    provider: str = "-"
    status: Status | None = None  # metric status; None until known ("cancelled" at the end)
    http_status: int = 0
    usage: list[UsageItem] = field(default_factory=list)
    reasoning_chars: int = 0
    reasoning_reported: bool = False
    #: Output tokens relayed to the caller, by the one estimate (``iopd.tokens``):
    #: what the token limits settle when no usage was reported.
    output_estimate: int = 0
    quiet: bool = False  # not logged (health probes)
    started: float = field(default_factory=time.perf_counter)
    #: The error the request ended with (``fail``), for the console's recent errors.
    error_code: str = ""
    error_message: str = ""
    #: The request's session key (``incoming.session_key``), bounded; None when it names none.
    session: str | None = None
    #: The request's path, as the caller sent it (its log line quotes it).
    path: str = ""

    def failed(self, exc: errors.GatewayError) -> None:
        """The request ends with ``exc``: its metric status, error code and message."""
        self.status = exc.metric_status
        self.error_code = exc.code
        self.error_message = exc.message

    def answered(self, http_status: int) -> None:
        """The response went out whole (or a relay ended): status from its HTTP status."""
        self.http_status = http_status
        self.status = (
            "ok" if http_status < 400 else "client_error" if http_status < 500 else "provider_error"
        )


class RequestIds:
    """Request, completion and response ids: one random prefix per edge, then a counter."""

    __slots__ = ("_prefix", "_seq")

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._prefix = secrets.token_hex(4)

    def new(self, kind: str) -> str:
        """``<kind>-<edge prefix><counter>``, e.g. ``chatcmpl-1a2b3c4d0000002a``."""
        return f"{kind}-{self._prefix}{next(self._seq):08x}"


# ----------------------------------------------------------------- control


class Call:
    """An admitted request in flight: what steers it.  ``out`` is its record.

    ``scope`` is the request's ``request_timeout`` scope.  A request that runs
    out of time before it holds a lease involved no provider: that is a queue
    timeout (503 + Retry-After, counted as one by the pool's metrics), not the
    scope's 504 ``provider_timeout``.  So while it waits -- queued in the pool
    (the pool's ``on_queued``), for a shared ``max_concurrent`` slot, or on
    its limits' store -- the scope's deadline is parked (:meth:`park_deadline`;
    the wait is bounded by :meth:`time_left`) and put back once it holds a
    lease (:meth:`resume_deadline`; a lease error leaves the scope at once).
    A request granted a provider at once never moves the deadline.  A drain
    cut still cancels the scope.

    ``admission`` is what the request holds against its principal's rates and
    budgets (``iopd.edge.openai.limits``): taken once in ``prepare``, given
    back in the handler's ``finally`` whatever way the request ends.
    """

    __slots__ = (
        "snap",
        "out",
        "scope",
        "deadline",
        "sse_open",
        "admission",
        "leased",
        "input_estimate",
    )

    def __init__(self, snap: Snapshot, out: Outcome, scope: trio.CancelScope) -> None:
        self.snap = snap
        self.out = out
        self.scope = scope
        self.deadline = scope.deadline
        #: An SSE stream of the normalized path is open: a failure can still
        #: end it with an error event.
        self.sse_open = False
        #: Its admission against the principal's rates and budgets,
        #: held once for its whole life; settled when it ends (``limits.settle``).
        self.admission: AnyAdmission | None = None
        #: A provider was leased for it (a request that never got one used no tokens).
        self.leased = False
        #: Its input estimate, settled with the output relayed when no usage is metered.
        self.input_estimate = 0

    def time_left(self) -> float:
        """The seconds its time limit leaves: what bounds its wait for a lease."""
        return max(0.0, self.deadline - trio.current_time())

    @property
    def parked(self) -> bool:
        """The scope's deadline is lifted: the request waits (``park_deadline``)."""
        return self.scope.deadline != self.deadline

    def park_deadline(self) -> None:
        """Lift the time limit while the request waits (the wait itself is
        bounded by :meth:`time_left`).  Only a request that has to wait
        parks: moving a scope's deadline is two updates of trio's deadline
        heap, on the path of every request otherwise."""
        if self.scope.deadline != math.inf:
            self.scope.deadline = math.inf

    async def park(self) -> None:
        """:meth:`park_deadline`, as the pool's ``on_queued`` hook."""
        self.park_deadline()

    def resume_deadline(self) -> None:
        """The request holds its lease: its time limit is the scope's again."""
        if self.parked:
            self.scope.deadline = self.deadline


class AbortConnection(AbortResponse):
    """Raised to make the HTTP server cut a connection whose body was mid-relay."""


# --------------------------------------------------------------------- end


async def fail(
    responder: Responder,
    out: Outcome,
    exc: errors.GatewayError,
    *,
    sse_open: bool,
    context: object = None,
) -> None:
    """End a request with ``exc``: an error response, an SSE error event, or a cut.

    ``context`` is the request's head-hook context: its route decides the
    error's shape (Ollama's on ``/api/*``, see ``render_error``).  A provider
    timeout names the model group it happened in.
    """
    if isinstance(exc, errors.ProviderTimeout) and out.group != UNKNOWN_GROUP:
        exc.message = f"model group '{out.group}': {exc.message}"
    out.failed(exc)
    if not responder.started:
        status, headers, body = render_error(exc, context)
        out.http_status = status
        headers.append(("x-request-id", out.request_id))
        await responder.send(status, headers, body)
    elif sse_open and not responder.finished:
        # An SSE stream already started: end it with an error event.  Bounded:
        # after a timeout or a drain cut the caller may be one that stopped
        # reading, and this write must not outlive the request's deadline.
        with trio.move_on_after(ERROR_EVENT_GRACE):
            shape = context.error_shape if isinstance(context, Shaped) else OPENAI_ERRORS
            await responder.write(shape.sse_event(exc))
            await responder.end()
            return
        raise AbortConnection(exc.message)
    else:
        # A raw relay (or a whole response's write) is mid-body: the only
        # honest signal is a cut connection.
        raise AbortConnection(exc.message)


def finish(metrics: GatewayMetrics, out: Outcome, activity: ActivityRecorder | None = None) -> None:
    """Count the request once (``iop_openai_requests_total`` etc.) and log its line.

    ``activity``: the edge's recent usage and errors (the web console), noted
    too for a request of an OpenAI endpoint.
    """
    duration = time.perf_counter() - out.started
    status = out.status or "cancelled"
    p = out.principal
    if out.endpoint is not None:
        labels = RequestLabels.build(
            p, model_group=out.group, endpoint=out.endpoint, response_mode=out.mode
        )
        if activity is not None:
            _note_activity(activity, out, labels.principal_alias, status)
        metrics.record_request(
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
        metrics.count_http_rejected(out.http_status)
    log_request(out, status, duration)


def log_request(out: Outcome, status: Status | None = None, duration: float | None = None) -> None:
    """The request's one ``event=request`` line (``status``/``duration``: as
    :func:`finish` found them, else from ``out`` and now).

    ``path`` is the caller's, bounded (the HTTP parser lets only visible
    ASCII into a request target: one token, never a second line); the
    principal is its alias or kind, never a token.
    """
    if duration is None:
        duration = time.perf_counter() - out.started
    p = out.principal
    tokens = {"input": 0, "output": 0}
    for _src, ttype, n in out.usage:
        if ttype in tokens:
            tokens[ttype] += n
    log.info(
        "event=request request_id=%s principal=%s group=%s provider=%s endpoint=%s "
        "mode=%s status=%s http_status=%d duration_ms=%.1f input_tokens=%d output_tokens=%d "
        "session=%s path=%s",
        out.request_id,
        (p.alias or p.principal_ref)
        if p and p.source == "principal_token"
        else (p.source if p else "-"),
        out.group,
        out.provider,
        out.endpoint or "-",
        out.mode,
        status or out.status or "cancelled",
        out.http_status,
        duration * 1000,
        tokens["input"],
        tokens["output"],
        session_digest(out.session),
        out.path[:MAX_LOGGED_PATH] or "-",
    )


def _note_activity(
    activity: ActivityRecorder, out: Outcome, principal: str, status: Status
) -> None:
    """The request in the console's recent activity: its tokens, and its error if it failed."""
    tokens = sum(n for _src, ttype, n in out.usage if ttype in ("input", "output"))
    activity.note(
        principal,
        out.group,
        tokens=tokens,
        ok=status in ("ok", "cancelled"),
        provider=out.provider,
        status=out.http_status,
        code=out.error_code or status,
        message=out.error_message,
    )


# ------------------------------------------------------------- usage record


def total_usage(asms: list[CompletionAssembler]) -> Usage | None:
    """The usage of the runs of one request (``n > 1``: their sum)."""
    if len(asms) == 1:
        return asms[0].usage
    total: Usage | None = None
    for asm in asms:
        total = add_usage(total, asm.usage)
    return total


def note_run_usage(asms: list[CompletionAssembler], out: Outcome) -> None:
    """The request's usage record: all its runs (the cancelled one's so far)."""
    usage = total_usage(asms)
    out.usage = run_event_usage(usage)
    out.reasoning_reported = bool(usage and usage.reasoning_tokens)
    out.reasoning_chars = sum(len(asm.reasoning_text) for asm in asms)
    text = sum(len(asm.text) for asm in asms)
    out.output_estimate = estimate_tokens_from_chars(text + out.reasoning_chars)
