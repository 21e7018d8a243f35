"""The one opening of every request that reaches a provider: :func:`prepare`.

``/v1/chat/completions``, ``/v1/responses`` and ``/api/chat|generate`` all
start the same way, in this order (so the same mistake gets the same error
on every endpoint):

    parse the body → resolve the model group → the caller's provider
    credentials → what the endpoint needs of a provider → workspace →
    estimate input tokens / context class → generation limits, when the
    request can only be relayed raw (a 400 before it queues) → admission
    against the principal's rates and budgets (``limits``: 429, or 400 for a
    reservation that can never fit; only when ``limits`` sets any) → lease a
    provider (may queue; the request's deadline is parked meanwhile) → the
    node session and the path (raw relay or normalized), with the generation
    parameters of that path.

``async with prepare(...) as leased`` holds the lease for the block and
gives a frozen :class:`LeasedRequest`: everything the relay and the
normalized paths read, typed.  It is a class-based context manager (no
generator frame) around the pool's lease: the hot path stays as cheap as
when every endpoint opened the lease itself.
"""

from __future__ import annotations

import os
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Generic, Literal, NamedTuple, TypeVar

from iopd import errors
from iopd.config.catalog import GroupSpec
from iopd.edge.node_session import NodeSession
from iopd.edge.openai import limits
from iopd.edge.openai import requests as rq
from iopd.edge.openai.auth import Principal
from iopd.edge.openai.generation import apply_generation
from iopd.edge.openai.json_body import parse_json_object
from iopd.edge.openai.jsonschema import JSONObject, JSONValue
from iopd.edge.openai.lifecycle import PASSTHROUGH_TYPES, Call, Outcome
from iopd.edge.openai.responses import responses_input_to_messages
from iopd.edge.pool.pool import Lease
from iopd.edge.runtime import EdgeRuntime, Snapshot
from iopd.http.server import Request
from iopd.tokens import estimate_input_tokens

__all__ = ["Body", "ContextClass", "LeasedRequest", "Leasing", "model_not_found", "prepare"]

ContextClass = Literal["normal", "long"]

#: The validated body of an endpoint that reaches a provider.
Body = TypeVar("Body", rq.ChatRequest, rq.ResponsesRequest, rq.OllamaRequest, rq.RelayedRequest)

#: At most this many model ids are named in a ``model_not_found`` message.
MAX_NAMED_MODELS = 20

_NO_REQUIREMENT: frozenset[str] = frozenset()
_NEEDS_PASSTHROUGH = frozenset({"passthrough"})
_NEEDS_OLLAMA = frozenset({"ollama"})


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
    group: GroupSpec
    lease: Lease
    session: NodeSession
    #: The caller's credentials for a passthrough provider (``openai.provider_auth``).
    provider_auth: str | None
    #: The input as chat messages for the normalized path ([] when only relayed).
    messages: list[JSONObject]
    estimate: int
    context_class: ContextClass
    #: The path: True relays the caller's body raw, False runs it normalized.
    relay: bool
    #: Generation parameters for that path (``models[].generation`` applied).
    params: JSONObject


def prepare(rt: EdgeRuntime, call: Call, request: Request, kind: type[Body]) -> Leasing[Body]:
    """Everything up to the lease, checked now; ``async with`` the result to lease.

    Raises ``GatewayError`` for a bad body, an unknown model, missing provider
    credentials, a request no provider of the group can serve, or (for a
    request that can only be relayed) a generation limit exceeded.
    """
    return Leasing(rt, call, request, kind)


class Leasing(Generic[Body]):
    """A prepared request; entering it leases a provider (see :func:`prepare`)."""

    __slots__ = (
        "_rt",
        "_call",
        "_request",
        "_body",
        "_group",
        "_relay_only",
        "_needs",
        "_lease_cm",
    )

    def __init__(self, rt: EdgeRuntime, call: Call, request: Request, kind: type[Body]) -> None:
        snap, out = call.snap, call.out
        body = _parse(snap, request, kind, out)
        group = snap.catalog.resolve(body.model)
        if group is None:
            raise model_not_found(snap, body.model)
        out.group = group.id
        # /api/*, /v1/embeddings and /v1/completions are only ever relayed (to
        # a provider speaking that API); otherwise the group's provider types
        # say whether a normalized path exists.
        relay_only = isinstance(body, rq.OllamaRequest | rq.RelayedRequest) or _all_passthrough(
            snap, group
        )
        out.mode = "passthrough" if relay_only else "normalized"
        if isinstance(body, rq.OllamaRequest):
            needs = _ollama_needs(snap, group, body, request.path)
        elif isinstance(body, rq.RelayedRequest):
            needs = _relayed_needs(snap, request, group, body)
        else:
            needs = _openai_needs(snap, request, group, body, relay_only)
        if relay_only:
            generation_params(body, group, relay=True)  # over a limit: 400 before queueing
        principal = out.principal
        assert principal is not None  # check_head authenticated every provider route
        principal_ref = principal.label_principal_ref
        if call.snap.rates_limited:  # its rates and budgets: 429/400 before queueing
            reservation = limits.reservation_of(body, request.path, needs.estimate)
            limits.admit(rt, call, request.context, principal_ref, reservation)
        self._rt = rt
        self._call = call
        self._request = request
        self._body: Body = body
        self._group = group
        self._relay_only = relay_only
        self._needs = needs
        bound = rt.pool.scheduler.queue_timeout_for(group.id, group.queue_timeout)
        self._lease_cm: AbstractAsyncContextManager[Lease] = rt.pool.lease(
            group.id,
            context_class=needs.context_class,
            requires=needs.requires,
            queue_timeout=min(bound, call.park_deadline()),
            body_bytes=len(request.body),
            principal=principal_ref,  # its share and max_concurrent: the pool's
        )

    async def __aenter__(self) -> LeasedRequest[Body]:
        try:
            lease = await self._lease_cm.__aenter__()
        except errors.NodeDispatchError:
            limits.withdraw(self._rt, self._call)  # no live candidate: it never counted
            raise
        try:
            return self._leased(lease)
        except BaseException as exc:
            await self._lease_cm.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._lease_cm.__aexit__(exc_type, exc, tb)

    def _leased(self, lease: Lease) -> LeasedRequest[Body]:
        call, out = self._call, self._call.out
        call.resume_deadline()
        out.provider = lease.provider_id
        session = self._rt.hub.session(lease.node_id)
        if session is None:
            raise errors.NodeDispatchError(f"node {lease.node_id} is not connected")
        call.leased = True  # from here a provider may spend tokens on it
        relay = self._relay_only or lease.provider_type in PASSTHROUGH_TYPES
        out.mode = "passthrough" if relay else "normalized"
        body, needs = self._body, self._needs
        principal = out.principal
        assert principal is not None  # check_head authenticated every provider route
        return LeasedRequest(
            snap=call.snap,
            request=self._request,
            body=body,
            principal=principal,
            group=self._group,
            lease=lease,
            session=session,
            provider_auth=needs.provider_auth,
            messages=needs.messages,
            estimate=needs.estimate,
            context_class=needs.context_class,
            relay=relay,
            # In a mixed group only the lease decides the path, so a relayed
            # request's limits are checked (again) here.
            params=generation_params(body, self._group, relay=relay),
        )


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


# ------------------------------------------------------------------ steps


class _Needs(NamedTuple):
    """What an endpoint's request needs of a provider, and what it brings."""

    requires: frozenset[str]  # pool capabilities (``passthrough``, ``ollama``)
    provider_auth: str | None
    messages: list[JSONObject]
    estimate: int
    context_class: ContextClass


def _openai_needs(
    snap: Snapshot,
    request: Request,
    group: GroupSpec,
    body: rq.ChatRequest | rq.ResponsesRequest,
    relay_only: bool,
) -> _Needs:
    """Provider credentials, what only a passthrough provider serves, workspace,
    then the estimate."""
    provider_auth = _provider_auth(snap, request, group.id)
    requires = _NO_REQUIREMENT
    _check_workspace(snap, group, body.workspace)
    if isinstance(body, rq.ResponsesRequest):
        messages: list[JSONObject] = []
        if not relay_only:
            try:  # the normalized path's chat form, or why it has none
                messages = responses_input_to_messages(body.raw)
            except errors.InvalidRequest as exc:
                requires = _passthrough_or_refuse(snap, group, exc)
        estimate = estimate_input_tokens(messages) if messages else _estimate_raw_input(body.raw)
    else:
        if body.n > rq.MAX_NORMALIZED_CHOICES and not relay_only:
            requires = _passthrough_or_refuse(
                snap,
                group,
                errors.InvalidRequest(
                    f"'n' may be at most {rq.MAX_NORMALIZED_CHOICES} on this model's "
                    "providers (each choice is one more run)",
                    param="n",
                ),
            )
        messages = body.messages
        estimate = estimate_input_tokens(messages)
    return _Needs(requires, provider_auth, messages, estimate, _context_class(snap, estimate))


def _relayed_needs(
    snap: Snapshot, request: Request, group: GroupSpec, body: rq.RelayedRequest
) -> _Needs:
    """``/v1/embeddings`` and ``/v1/completions`` need a passthrough provider
    (a normalized provider has no such path); a 400 names the endpoint."""
    if not snap.catalog.has_type(group.id, "openai"):
        raise errors.InvalidRequest(
            f"model '{body.model[:200]}' has no provider that serves {request.path}: "
            "only type 'openai' (passthrough) providers do",
            param="model",
        )
    provider_auth = _provider_auth(snap, request, group.id)
    estimate = estimate_input_tokens(body.as_messages())
    return _Needs(
        _NEEDS_PASSTHROUGH, provider_auth, [], estimate, _context_class(snap, estimate)
    )


def _ollama_needs(
    snap: Snapshot, group: GroupSpec, body: rq.OllamaRequest, path: str
) -> _Needs:
    """An ``/api/*`` request needs an ollama provider of its group."""
    if not snap.catalog.has_type(group.id, "ollama"):
        raise errors.InvalidRequest(
            f"model '{body.model[:200]}' has no ollama provider for {path}", param="model"
        )
    return _Needs(_NEEDS_OLLAMA, None, [], 0, "normal")


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


def _parse(snap: Snapshot, request: Request, kind: type[Body], out: Outcome) -> Body:
    """Decode and validate the body; a 400 is labelled with the group when one resolves."""
    raw = parse_json_object(request.body)
    model = raw.get("model")
    if isinstance(model, str):
        group = snap.catalog.resolve(model)
        if group is not None:
            out.group = group.id
    return kind.parse(raw)


def _all_passthrough(snap: Snapshot, group: GroupSpec) -> bool:
    """Every provider of ``group`` is a raw relay: the request can take no other path."""
    types = {snap.catalog.providers[pid].config.type for pid, _ in group.providers}
    return bool(types) and types <= PASSTHROUGH_TYPES


def _provider_auth(snap: Snapshot, request: Request, group_id: str) -> str | None:
    pa = snap.config.openai.provider_auth
    value = request.header(pa.header.lower())
    if pa.required and not value and snap.catalog.has_type(group_id, "openai"):
        raise errors.ProviderAuthRequired(
            f"this model requires the {pa.header} header with the provider's credentials"
        )
    return value


def _passthrough_or_refuse(
    snap: Snapshot, group: GroupSpec, refusal: errors.InvalidRequest
) -> frozenset[str]:
    """A request only a passthrough provider serves: it requires one, or, in a
    group without any, is refused (``refusal`` says why)."""
    if not snap.catalog.has_type(group.id, "openai"):
        raise refusal
    return _NEEDS_PASSTHROUGH


def _check_workspace(snap: Snapshot, group: GroupSpec, workspace: str | None) -> None:
    if workspace is None:
        return
    if not os.path.isabs(workspace) and snap.catalog.has_type(group.id, "cli"):
        raise errors.InvalidRequest(
            "metadata.workspace must be an absolute path", param="metadata.workspace"
        )


def _context_class(snap: Snapshot, estimate: int) -> ContextClass:
    threshold = snap.config.openai.long_context_threshold_tokens
    return "long" if estimate >= threshold else "normal"


def _estimate_raw_input(raw: JSONObject) -> int:
    """The §2.4 estimate over a /v1/responses body: instructions and input items."""
    parts: list[JSONValue] = []
    if isinstance(raw.get("instructions"), str):
        parts.append({"content": raw["instructions"]})
    inp = raw.get("input")
    if isinstance(inp, str):
        parts.append({"content": inp})
    elif isinstance(inp, list):
        parts.extend(inp)  # message-shaped items; text_parts skips anything else
    return estimate_input_tokens(parts)
