"""The one opening of every request that reaches a provider: :func:`prepare`.

``/v1/chat/completions``, ``/v1/responses`` and ``/api/chat|generate`` all
start the same way, in this order (so the same mistake gets the same error
on every endpoint):

    parse the body → resolve the model group → the caller's provider
    credentials → what the endpoint needs of a provider → workspace →
    estimate input tokens / context class → generation limits, when the
    request can only be relayed raw (a 400 before it queues) → on entering:
    admission against the principal's limits (``limits``: 429, or 400 for a
    reservation that can never fit) → lease a provider (may queue; the
    request's deadline is parked meanwhile; with it, a shared
    ``max_concurrent`` slot) → the node session and the path.

``async with prepare(...) as leased`` holds the lease for the block and
gives a frozen :class:`LeasedRequest`: everything the relay and the
normalized paths read, typed.  A class-based context manager (no generator
frame) around the pool's lease keeps the hot path cheap.

Attempts.  ``Leasing`` only leases: the first lease, and the next one when
the request's retry policy (``attempts.Attempts``, on ``leased.attempts``)
answered ``RETRY`` to a path's report.  The paths report and return;
:func:`until_done` is the one loop that then leases another candidate of
the group (or of its fallback groups) under the same queue rules, with the
failed providers excluded (never to another ``base_url`` origin with the
caller's credentials).  A provider whose node had no session is retried
the same way, here.  Nothing here writes to the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Concatenate, Generic, NamedTuple, ParamSpec, TypeVar

import trio

from iopd import errors
from iopd.config.catalog import GroupSpec
from iopd.edge.nodes.node_session import NodeSession
from iopd.edge.openai import limits
from iopd.edge.openai.attempts import Attempts, AttemptVerdict
from iopd.edge.openai.generation import apply_generation
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.json_body import parse_json_object
from iopd.edge.openai.incoming.jsonschema import JSONObject
from iopd.edge.openai.incoming.prompt_blocks import prompt_bytes
from iopd.edge.openai.incoming.session_key import session_key
from iopd.edge.openai.lifecycle import PASSTHROUGH_TYPES, Call, Outcome
from iopd.edge.openai.needs import (
    all_passthrough,
    announce_dropped_tools,
    ollama_needs,
    openai_needs,
    relayed_needs,
)
from iopd.edge.openai.routes import Serves
from iopd.edge.pool.pool import Lease
from iopd.edge.pool.retry_rules import AttemptFailure, FailureKind
from iopd.edge.principals.authenticator import Principal
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.server import Request
from iopd.vocabulary import ContextClass, ResponseMode

__all__ = [
    "MODEL_GROUP_HEADER",
    "Body",
    "ContextClass",
    "Decision",
    "LeasedRequest",
    "Leasing",
    "model_not_found",
    "prepare",
    "until_done",
]

#: On every response of a leased request: the model group that served it (or fallback).
MODEL_GROUP_HEADER = "X-Iopd-Model-Group"

#: The validated body of an endpoint that reaches a provider.
Body = TypeVar("Body", rq.ChatRequest, rq.ResponsesRequest, rq.OllamaRequest, rq.RelayedRequest)

P = ParamSpec("P")

#: At most this many model ids are named in a ``model_not_found`` message.
MAX_NAMED_MODELS = 20


class Decision(NamedTuple):
    """What is decided about a request once and carried, frozen, to its end.

    The model group that serves it (the one asked for, or a fallback group),
    the path (True: the caller's body relayed raw; False: run normalized),
    the response mode that follows, and the generation parameters of that
    path and group (``models[].generation`` applied, :func:`generation_params`).

    A request that can only be relayed is decided before it queues (its
    limits are a 400 then); any other at its first lease, by the leased
    provider's type.  A retry keeps the path (the path's own loop runs the
    next attempt); only a retry served by a fallback group changes the
    group, and so the parameters, with :meth:`for_group`.
    """

    group: GroupSpec
    relay: bool
    params: JSONObject

    @property
    def mode(self) -> ResponseMode:
        """The metrics' ``response_mode``: the path's name."""
        return "passthrough" if self.relay else "normalized"

    @classmethod
    def make(cls, body: Body, group: GroupSpec, *, relay: bool) -> Decision:
        """Decide: ``group`` serves ``body`` on that path (a 400 over a relayed limit)."""
        return cls(group, relay, generation_params(body, group, relay=relay))

    def for_group(self, group: GroupSpec, body: Body) -> Decision:
        """The same path served by another group (a fallback): its parameters."""
        return self if group is self.group else Decision.make(body, group, relay=self.relay)


class LeasedRequest(NamedTuple, Generic[Body]):
    """A request that holds a provider: what the relay and the normalized paths need.

    Immutable.  A ``NamedTuple`` rather than a frozen dataclass: one is built
    per request, and a frozen dataclass's ``__init__`` (``object.__setattr__``
    per field) cost several microseconds more on the hot path.
    """

    snap: Snapshot
    request: Request
    body: Body
    principal: Principal
    #: The group that serves it, its path and that path's parameters.
    decision: Decision
    lease: Lease
    session: NodeSession
    #: The caller's credentials for a passthrough provider (``openai.provider_auth``).
    provider_auth: str | None
    #: The input as chat messages for the normalized path ([] when only relayed).
    messages: list[JSONObject]
    estimate: int
    context_class: ContextClass
    #: The retry policy: the path reports this attempt's end to it.
    attempts: Attempts
    #: The lease's owner (:func:`until_done` leases the next attempt with it).
    leasing: Leasing[Body]


def prepare(
    rt: EdgeRuntime, call: Call, request: Request, kind: type[Body], serves: Serves
) -> Leasing[Body]:
    """Everything up to the lease, checked now; ``async with`` the result to lease.

    Raises ``GatewayError`` for a bad body, an unknown model, missing provider
    credentials, a request no provider of the group can serve, or (for a
    request that can only be relayed) a generation limit exceeded.
    """
    return Leasing(rt, call, request, kind, serves)


class Leasing(Generic[Body]):
    """A prepared request; entering it leases a provider (see :func:`prepare`),
    :meth:`next_attempt` the next one (see the module docstring)."""

    __slots__ = (
        "_rt",
        "_principal_ref",
        "_call",
        "_request",
        "_body",
        "_group",
        "_decision",
        "_needs",
        "_lease_cm",
        "_lease",
        "_chain",
        "attempts",
    )

    def __init__(
        self, rt: EdgeRuntime, call: Call, request: Request, kind: type[Body], serves: Serves
    ) -> None:
        snap, out = call.snap, call.out
        body, group = _parse(snap, request, kind, out)
        # A relay-only route (/api/*, /v1/embeddings, /v1/completions) is
        # only ever relayed (to a provider speaking that API); otherwise the
        # group's provider types say whether a normalized path exists.
        relay_only = serves is not Serves.RELAY_OR_NORMALIZED or all_passthrough(snap, group)
        if relay_only:  # its path is known: a refusal from here on is labelled with it
            out.mode = "passthrough"
        if isinstance(body, rq.OllamaRequest):
            needs = ollama_needs(snap, group, body, request.path)
        elif isinstance(body, rq.RelayedRequest):
            needs = relayed_needs(snap, request, group, body)
        else:
            needs = openai_needs(snap, request, group, body, relay_only)
            if needs.dropped_tools:
                announce_dropped_tools(rt, request, group.id, needs.dropped_tools)
        # Relayed only: decided now, and over a limit is a 400 before queueing.
        decision = Decision.make(body, group, relay=True) if relay_only else None
        principal = out.principal
        assert principal is not None  # check_head authenticated every provider route
        principal_ref = principal.label_principal_ref
        self._rt = rt
        self._call = call
        self._principal_ref = principal_ref
        self._request = request
        self._body: Body = body
        self._group = group
        self._decision = decision
        self._needs = needs
        self._chain = snap.catalog.fallback_chain(group.id)
        self._lease: Lease | None = None  # the lease held now
        #: The retry policy the paths report to (this object only leases).
        self.attempts = Attempts(rt, call, group.id, self._chain, bool(needs.provider_auth))
        self._lease_cm: AbstractAsyncContextManager[Lease] = self._open_lease(frozenset())

    def _open_lease(self, exclude: frozenset[str]) -> AbstractAsyncContextManager[Lease]:
        """The pool's lease for the next attempt (waits like any request)."""
        open_lease = functools.partial(
            self._rt.pool.lease,
            self._group.id,
            context_class=self._needs.context_class,
            requires=self._needs.requires,
            exclude=exclude,
            body_bytes=len(self._request.body),
            fallbacks=self._chain,
            fallback_on_queue_timeout=self._group.fallback_on_queue_timeout,
            principal=self._principal_ref,  # its share (and, memory, max_concurrent): the pool's
            # Cache-aware routing (docs/routing.md): the prompt's bytes and the session key.
            prompt=self._prompt_bytes(),
            session_key=self._call.out.session,
        )
        return limits.lease_with_slot(self._rt, self._call, open_lease, self._queue_timeout())

    def _prompt_bytes(self) -> bytes:
        """The prompt as the prefix index reads it (empty for a ``least_load`` group)."""
        policy = self._rt.pool.snapshot.routing
        # The prompt is parts of the body, re-encoded no longer: a body under
        # one block can fill none, and is not serialized at all.
        if self._group.routing != "prefix" or len(self._request.body) < policy.block_bytes:
            return b""
        return prompt_bytes(
            self._request.path, getattr(self._body, "raw", None), policy.max_prompt_bytes
        )

    def _queue_timeout(self) -> float:
        bound = self._rt.pool.scheduler.snapshot.queue_timeout_of(
            self._group.id, self._group.queue_timeout
        )
        return min(bound, self._call.time_left())

    async def __aenter__(self) -> LeasedRequest[Body]:
        rt, call, request = self._rt, self._call, self._request
        if call.snap.rates_limited:  # its limits: 429/400 before queueing
            call.park_deadline()  # (its store may be remote: a wait, not the provider's time)
            await limits.admit(
                rt, call, request, self._principal_ref, self._body, self._needs.estimate
            )
        rt.retry_budget.note_request(self._group.id, trio.current_time())
        return await self._enter()

    async def _enter(self) -> LeasedRequest[Body]:
        """Lease (``_lease_cm``); a provider whose node has no session is retried."""
        while True:
            try:
                lease = await self._lease_cm.__aenter__()
            except errors.NodeDispatchError:
                if not self._call.leased:  # no live candidate: it never counted
                    await limits.withdraw(self._rt, self._call)
                raise
            self._lease = lease
            decision = self._decision
            relay = lease.provider_type in PASSTHROUGH_TYPES if decision is None else decision.relay
            self.attempts.begin(lease, relay=relay)
            try:
                session = self._rt.hub.session(lease.node_id)
                if session is not None:
                    return self._leased(lease, session)
                lost = AttemptFailure(FailureKind.NODE_LOST_BEFORE_RUN)
                if self.attempts.failed(lost, caller_saw_bytes=False) is AttemptVerdict.FINAL:
                    raise errors.NodeDispatchError(f"node {lease.node_id} is not connected")
            except BaseException as exc:
                self._lease = None
                self.attempts.end()
                await self._lease_cm.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            await self._release()
            self._lease_cm = self._open_lease(self.attempts.exclude())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._lease is None:  # a retry's lease was refused: nothing is held
            return None
        self._lease = None
        self.attempts.end()
        return await self._lease_cm.__aexit__(exc_type, exc, tb)

    # ------------------------------------------------------------ attempts

    async def next_attempt(self) -> LeasedRequest[Body]:
        """Release the failed lease and lease another candidate (after a
        ``RETRY`` verdict; only :func:`until_done` calls it).

        Raises what a first lease raises (no candidate left, queue timeout).
        """
        await self._release()
        self._lease_cm = self._open_lease(self.attempts.exclude())
        return await self._enter()

    async def _release(self) -> None:
        self._lease = None
        self.attempts.end()
        await self._lease_cm.__aexit__(None, None, None)

    def _leased(self, lease: Lease, session: NodeSession) -> LeasedRequest[Body]:
        call, out = self._call, self._call.out
        call.resume_deadline()
        out.provider = lease.provider_id
        decision = self._decide(lease)
        out.group, out.mode = decision.group.id, decision.mode  # metering and the log line
        _name_serving_group(self._request, decision.group.id)
        call.leased = True  # from here a provider may spend tokens on it
        needs = self._needs
        principal = out.principal
        assert principal is not None  # check_head authenticated every provider route
        return LeasedRequest(
            snap=call.snap,
            request=self._request,
            body=self._body,
            principal=principal,
            decision=decision,
            lease=lease,
            session=session,
            provider_auth=needs.provider_auth,
            messages=needs.messages,
            estimate=needs.estimate,
            context_class=needs.context_class,
            attempts=self.attempts,
            leasing=self,
        )

    def _decide(self, lease: Lease) -> Decision:
        """The request's :class:`Decision`: made at its first lease unless it
        was before it queued, then kept (a fallback group's lease re-groups it)."""
        group = self._group
        if lease.group_id and lease.group_id != group.id:  # served by a fallback group
            fallback = self._call.snap.catalog.group(lease.group_id)
            if fallback is not None:
                self._rt.metrics.count_fallback(group.id, fallback.id)
                group = fallback
        decision = self._decision
        if decision is None:  # the leased provider decides the path, once
            relay = lease.provider_type in PASSTHROUGH_TYPES
            decision = Decision.make(self._body, group, relay=relay)
        else:
            decision = decision.for_group(group, self._body)
        self._decision = decision
        return decision


async def until_done(
    leased: LeasedRequest[Body],
    attempt: Callable[Concatenate[LeasedRequest[Body], P], Awaitable[bool]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> LeasedRequest[Body]:
    """Run ``attempt(leased, *args, **kwargs)`` until it is done: False (its
    report got ``RETRY``, and nothing was written) leases the next candidate
    and runs it again there.

    The one retry loop of every path; gives the lease the request ended on.
    """
    while not await attempt(leased, *args, **kwargs):
        leased = await leased.leasing.next_attempt()
    return leased


def _name_serving_group(request: Request, group_id: str) -> None:
    """``X-Iopd-Model-Group`` on the response: the head hook's headers are the
    ones every response to the request carries (a retry's group replaces it)."""
    context = request.context
    if context is None:
        return
    headers = context.response_headers
    headers[:] = [(k, v) for k, v in headers if k != MODEL_GROUP_HEADER]
    headers.append((MODEL_GROUP_HEADER, group_id))


def generation_params(body: Body, group: GroupSpec, *, relay: bool) -> JSONObject:
    """The generation limits, in one place: the request's parameters under
    ``models[].generation``.  Relayed, the body is the caller's (nothing is
    added; over a limit is a 400 naming the caller's field); normalized,
    defaults fill in and limits cap."""
    if relay:
        return apply_generation(
            body.params(), group.generation, passthrough=True, field_names=body.field_names
        )
    return apply_generation(body.params(), group.generation, passthrough=False)


def model_not_found(snap: Snapshot, model: str) -> errors.ModelNotFound:
    """The 404 for an unknown model: it names the ids the caller may send (bounded)."""
    ids = [g.id for g in snap.catalog.listed()]
    named = ", ".join(ids[:MAX_NAMED_MODELS])
    if len(ids) > MAX_NAMED_MODELS:
        named += f" and {len(ids) - MAX_NAMED_MODELS} more (GET /v1/models lists them)"
    available = f"; available models: {named}" if ids else "; no model is configured"
    return errors.ModelNotFound(
        f"The model '{model[:200]}' does not exist{available}", param="model"
    )


def _parse(
    snap: Snapshot, request: Request, kind: type[Body], out: Outcome
) -> tuple[Body, GroupSpec]:
    """Decode the body, resolve its model group (once), validate the body.

    The group labels the request (``out.group``) as soon as it resolves, so
    a 400 of the body is counted under it; an unknown model is a 404.
    """
    raw = parse_json_object(request.body)
    out.session = session_key(request.headers, raw, header=snap.config.openai.session_header)
    model = raw.get("model")
    group = snap.catalog.resolve(model) if isinstance(model, str) else None
    if group is not None:
        out.group = group.id
    body = kind.parse(raw)  # (its model is that string: a 400 otherwise)
    if group is None:
        raise model_not_found(snap, body.model)
    return body, group
