"""Per-principal rates and budgets on the request path.

The limiter (``iopd.edge.principals.limiter``) decides; this module is the
glue, in three calls the request's life makes:

* :func:`show_limits` when the handler starts: a principal with a rate or a
  budget gets OpenAI's ``x-ratelimit-*`` headers on every response, its
  errors included.  They ride on the request's head context
  (``HeadContext.response_headers``), so the HTTP layer writes them on
  whatever response goes out and they replace a relayed provider's headers of
  the same names.
* :func:`admit` in ``prepare``, once the request is authenticated, its model
  resolved and what it needs of a provider known: the reservation (input
  estimate + ``n`` x maximum output) is admitted or refused (429
  ``rate_limit_exceeded``, or 400 when it can never fit), and the headers are
  redone so ``remaining`` counts this request.  The admission is held on the
  :class:`~iopd.edge.openai.lifecycle.Call`: once per request, however many
  leases it takes.  :func:`withdraw` undoes it when the pool then finds no
  live candidate (a 502 before it counts).
* :func:`lease_with_slot` around each of the request's pool leases: with a
  shared ``max_concurrent`` (``limits.backend: redis``), the principal's
  slot is held with the provider, and only then.
* :func:`settle` in the handler's ``finally``, on every path (answer, error,
  cancel, node loss): the metered usage replaces the reservation; with no
  usage metered, the larger of the reservation and the input estimate plus
  the output relayed to the caller (``Outcome.output_estimate``, counted
  as it was relayed, so also when the caller left early), unless no
  provider was ever leased (then nothing ran: 0 tokens).

Nothing here runs while ``limits`` sets no rate or budget
(``Snapshot.rates_limited``; with ``limits.backend: redis``, no shared
``max_concurrent`` either); otherwise ``max_concurrent`` and ``share`` are
the pool's (the lease carries the principal).  The backend
(``iopd.edge.principals.backend``) decides where the counters live.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType

import trio

from iopd import errors
from iopd.edge.metering.usage import UsageItem
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.lifecycle import Call
from iopd.edge.pool.pool import Lease
from iopd.edge.principals.backend import SharedAdmission
from iopd.edge.principals.decisions import NeverFits, Rejection
from iopd.edge.principals.reservation import Reservation, reservation_for
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.http.server import HeadContext, Request

__all__ = [
    "RATELIMIT_PREFIX",
    "admit",
    "lease_with_slot",
    "reservation_of",
    "settle",
    "show_limits",
    "withdraw",
]

#: OpenAI's rate-limit headers all start so.
RATELIMIT_PREFIX = "x-ratelimit-"
_COUNTED = ("input", "output")


def show_limits(rt: EdgeRuntime, context: HeadContext | None, principal_ref: str) -> None:
    """Put the principal's ``x-ratelimit-*`` headers, as things stand, on every response."""
    if context is not None:
        _set_headers(context, rt.limits.headers(principal_ref))


def _set_headers(context: HeadContext, headers: list[tuple[str, str]]) -> None:
    """Replace the context's rate-limit headers in place (the responder holds the list)."""
    current = context.response_headers
    current[:] = [h for h in current if not h[0].startswith(RATELIMIT_PREFIX)]
    current += headers


AnyBody = rq.ChatRequest | rq.ResponsesRequest | rq.OllamaRequest | rq.RelayedRequest


def reservation_of(body: AnyBody, path: str, estimate: int) -> Reservation:
    """What a request reserves: its input estimate plus ``n`` x its maximum output."""
    if isinstance(body, rq.RelayedRequest):
        if path == "/v1/embeddings":  # no output tokens
            return reservation_for(estimate, 0, input_param="input")
        raw_n = body.raw.get("n")
        n = raw_n if isinstance(raw_n, int) and not isinstance(raw_n, bool) else 1
        cap = body.raw.get("max_tokens")
        limit = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None
        return reservation_for(estimate, limit, n=n, input_param="prompt")
    params = body.params()
    cap = params.get("max_tokens")
    limit = cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None
    n = body.n if isinstance(body, rq.ChatRequest) else 1
    field = body.field_names.get("max_tokens", "max_tokens")
    input_param = "input" if isinstance(body, rq.ResponsesRequest) else "messages"
    return reservation_for(estimate, limit, n=n, output_param=field, input_param=input_param)


async def admit(
    rt: EdgeRuntime,
    call: Call,
    request: Request,
    principal_ref: str,
    body: AnyBody,
    estimate: int,
) -> None:
    """Admit the request against its principal's limits, or raise.

    Raises ``RateLimited`` (429, ``Retry-After``) when a window is full and
    ``InvalidRequest`` (400, no ``Retry-After``) when the reservation alone
    exceeds a token limit.  Either way, and on admission, the response's
    ``x-ratelimit-*`` headers are redone (after an admission, ``remaining``
    counts this request).  A shared ``max_concurrent`` slot is
    :func:`lease_with_slot`'s (taken here only when free, in the same call).
    """
    backend = rt.limits
    decision = await backend.admit(principal_ref, reservation_of(body, request.path, estimate))
    if request.context is not None:
        _set_headers(request.context, backend.headers(principal_ref))
    if isinstance(decision, Rejection):
        rt.metrics.count_limit_rejection(principal_ref, decision.limit)
        raise errors.RateLimited(
            decision.message, kind=decision.type, retry_after=decision.retry_after_header
        )
    if isinstance(decision, NeverFits):
        raise errors.InvalidRequest(decision.message, param=decision.param)
    call.admission = decision
    call.input_estimate = estimate


def lease_with_slot(
    rt: EdgeRuntime,
    call: Call,
    open_lease: Callable[..., AbstractAsyncContextManager[Lease]],
    queue_timeout: float,
) -> AbstractAsyncContextManager[Lease]:
    """The pool's lease (``open_lease(queue_timeout=, on_queued=)``), holding
    the principal's shared ``max_concurrent`` slot with it (``limits.backend:
    redis``): the request waits for a slot (holding no provider), then
    leases; if it has to queue, the slot is given back meanwhile and taken
    again when the pool grants a provider; refused then, the provider is
    let go and it starts over, all within ``queue_timeout``.  So a request
    counts against ``max_concurrent`` only while it holds a provider, as
    the pool counts it with ``memory`` (there, or without limits, this is
    the pool's lease alone).  Decided on entering: the request is admitted
    after its lease is set up.  The request's time limit is parked while
    it waits (``Call.park_deadline``): from the start with a shared slot,
    else only once the pool queues it (``on_queued``)."""
    return _SlotLease(rt, call, open_lease, queue_timeout)


class _SlotLease:
    """:func:`lease_with_slot` (a class: no generator frame on the hot path)."""

    __slots__ = ("_call", "_cm", "_open_lease", "_queue_timeout", "_rt")

    def __init__(
        self,
        rt: EdgeRuntime,
        call: Call,
        open_lease: Callable[..., AbstractAsyncContextManager[Lease]],
        queue_timeout: float,
    ) -> None:
        self._rt, self._call = rt, call
        self._open_lease, self._queue_timeout = open_lease, queue_timeout
        self._cm: AbstractAsyncContextManager[Lease] | None = None

    async def __aenter__(self) -> Lease:
        call = self._call
        admission = call.admission
        if isinstance(admission, SharedAdmission):
            call.park_deadline()  # it may wait for its slot before any lease
            deadline = trio.current_time() + self._queue_timeout
            self._cm = _shared_slot_lease(self._rt, admission, self._open_lease, deadline)
        else:
            # The request's time limit is parked only if it has to queue.
            self._cm = self._open_lease(queue_timeout=self._queue_timeout, on_queued=call.park)
        return await self._cm.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._cm is not None
        return await self._cm.__aexit__(exc_type, exc, tb)


@asynccontextmanager
async def _shared_slot_lease(
    rt: EdgeRuntime,
    admission: SharedAdmission,
    open_lease: Callable[..., AbstractAsyncContextManager[Lease]],
    deadline: float,
) -> AsyncIterator[Lease]:
    backend = rt.limits

    async def give_back() -> None:
        await backend.free_slot(admission)

    while True:
        await backend.hold_slot(admission, max(0.0, deadline - trio.current_time()))
        left = max(0.0, deadline - trio.current_time())
        async with open_lease(queue_timeout=left, on_queued=give_back) as lease:
            if await backend.try_slot(admission):
                yield lease
                return


async def withdraw(rt: EdgeRuntime, call: Call) -> None:
    """The pool found no live candidate: the request never counted."""
    if call.admission is not None:
        admission, call.admission = call.admission, None
        await rt.limits.withdraw(admission)


async def settle(rt: EdgeRuntime, call: Call) -> None:
    """End the request's admission with its metered usage (see the module doc)."""
    admission = call.admission
    if admission is None:
        return
    call.admission = None
    used = _used_tokens(call.out.usage, leased=call.leased)
    await rt.limits.settle(admission, used, call.input_estimate + call.out.output_estimate)


def _used_tokens(usage: list[UsageItem], *, leased: bool) -> int | None:
    """Input + output tokens metered; None (the full reservation) when nothing
    was metered after a provider ran it; 0 when no provider ever did."""
    counted = [n for _source, ttype, n in usage if ttype in _COUNTED]
    if counted:
        return sum(counted)
    return None if leased else 0
