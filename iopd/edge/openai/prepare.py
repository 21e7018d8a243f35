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

Attempts.  The ``Leasing`` is also the request's attempt loop:
the paths report how each attempt ended (``leased.leasing.succeeded()`` or
``failed(...)``), which tells the pool's outlier tracker and the metrics,
and -- only when ``retry_rules.classify_failure`` says it is safe, an
attempt is left (``provider_pool.retry_attempts``), a candidate that has
not failed this request remains and the group's ``RetryBudget`` allows it
-- ``failed`` returns True and the path calls ``next_attempt()``: the
failed lease is released and another candidate of the group (or of its
fallback groups) is leased under the same queue rules, with the failed
providers excluded (never to another ``base_url`` origin with the caller's
credentials).  A provider whose node had no session is retried the same
way.  An error status answered to the caller's own provider credential is
reported as ``attempt_caller_credentialed``: it marks the provider for
nobody else (see ``retry_rules.classify_failure``).  Nothing here writes to
the caller before the paths' first byte.
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Generic, NamedTuple, TypeVar

import trio

from iopd import errors
from iopd.config.catalog import GroupSpec
from iopd.edge.nodes.node_session import NodeSession
from iopd.edge.openai import limits
from iopd.edge.openai.generation import apply_generation
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.json_body import parse_json_object
from iopd.edge.openai.incoming.jsonschema import JSONObject
from iopd.edge.openai.incoming.prompt_blocks import prompt_bytes
from iopd.edge.openai.lifecycle import PASSTHROUGH_TYPES, Call, Outcome
from iopd.edge.openai.needs import all_passthrough, ollama_needs, openai_needs, relayed_needs
from iopd.edge.pool.outliers import SATURATION_DEFAULT_SECONDS, Transition
from iopd.edge.pool.pool import Lease
from iopd.edge.pool.retry_rules import (
    AttemptFailure,
    FailureKind,
    RetryPolicy,
    TrackerEffect,
    classify_failure,
    url_origin,
)
from iopd.edge.principals.authenticator import Principal
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.connection import HeadContext
from iopd.http.server import Request
from iopd.vocabulary import ContextClass

__all__ = [
    "MODEL_GROUP_HEADER", "Body", "ContextClass", "LeasedRequest", "Leasing",
    "model_not_found", "prepare",
]

log = logging.getLogger("iopd.edge.request")

#: On every response of a leased request: the model group that served it (or fallback).
MODEL_GROUP_HEADER = "X-Iopd-Model-Group"

#: The validated body of an endpoint that reaches a provider.
Body = TypeVar("Body", rq.ChatRequest, rq.ResponsesRequest, rq.OllamaRequest, rq.RelayedRequest)

#: At most this many model ids are named in a ``model_not_found`` message.
MAX_NAMED_MODELS = 20



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
    #: The group that serves it: the one asked for, or a fallback group.
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
    #: The request's attempt loop: report this attempt's end, lease the next.
    leasing: Leasing[Body]


def prepare(rt: EdgeRuntime, call: Call, request: Request, kind: type[Body]) -> Leasing[Body]:
    """Everything up to the lease, checked now; ``async with`` the result to lease.

    Raises ``GatewayError`` for a bad body, an unknown model, missing provider
    credentials, a request no provider of the group can serve, or (for a
    request that can only be relayed) a generation limit exceeded.
    """
    return Leasing(rt, call, request, kind)


class Leasing(Generic[Body]):
    """A prepared request; entering it leases a provider (see :func:`prepare`).

    Then it is the request's attempt loop (see the module docstring).
    """

    __slots__ = (
        "_rt",
        "_principal_ref",
        "_call",
        "_request",
        "_body",
        "_group",
        "_relay_only",
        "_needs",
        "_lease_cm",
        "_lease",
        "_chain",
        "_failed",
        "_retries",
        "_reported",
        "_relay_params",
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
        relay_only = isinstance(body, rq.OllamaRequest | rq.RelayedRequest) or all_passthrough(
            snap, group
        )
        out.mode = "passthrough" if relay_only else "normalized"
        if isinstance(body, rq.OllamaRequest):
            needs = ollama_needs(snap, group, body, request.path)
        elif isinstance(body, rq.RelayedRequest):
            needs = relayed_needs(snap, request, group, body)
        else:
            needs = openai_needs(snap, request, group, body, relay_only)
        # Over a limit: 400 before queueing (kept for the lease, when its group is this one).
        relay_params = generation_params(body, group, relay=True) if relay_only else None
        principal = out.principal
        assert principal is not None  # check_head authenticated every provider route
        principal_ref = principal.label_principal_ref
        self._rt = rt
        self._call = call
        self._principal_ref = principal_ref
        self._request = request
        self._body: Body = body
        self._group = group
        self._relay_only = relay_only
        self._needs = needs
        self._chain = snap.catalog.fallback_chain(group.id)
        self._failed: frozenset[str] = frozenset()  # providers that failed it (never again)
        self._retries = 0
        self._lease: Lease | None = None  # the lease held now
        self._reported = False  # this attempt's verdict went to the tracker
        self._relay_params = relay_params
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
            session_key=None,
        )
        return limits.lease_with_slot(self._rt, self._call, open_lease, self._queue_timeout())

    def _prompt_bytes(self) -> bytes:
        """The prompt as the prefix index reads it (empty for a ``least_load`` group)."""
        if self._group.routing != "prefix":
            return b""
        limit = self._rt.pool.snapshot.routing.max_prompt_bytes
        return prompt_bytes(self._request.path, getattr(self._body, "raw", None), limit)

    def _queue_timeout(self) -> float:
        bound = self._rt.pool.scheduler.snapshot.queue_timeout_of(
            self._group.id, self._group.queue_timeout
        )
        return min(bound, self._call.time_left())

    async def __aenter__(self) -> LeasedRequest[Body]:
        rt, call, request = self._rt, self._call, self._request
        if call.snap.rates_limited:  # its limits: 429/400 before queueing
            call.park_deadline()  # (its store may be remote: a wait, not the provider's time)
            await limits.admit(rt, call, request, self._principal_ref, self._body, self._needs.estimate)
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
            self._lease, self._reported = lease, False
            try:
                session = self._rt.hub.session(lease.node_id)
                if session is not None:
                    return self._leased(lease, session)
                if not self.failed(AttemptFailure(FailureKind.NODE_LOST_BEFORE_RUN), False):
                    raise errors.NodeDispatchError(f"node {lease.node_id} is not connected")
            except BaseException as exc:
                self._lease = None
                await self._lease_cm.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            await self._release()
            self._lease_cm = self._open_lease(self._exclude())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._lease is None:  # a retry's lease was refused: nothing is held
            return None
        self._lease = None
        return await self._lease_cm.__aexit__(exc_type, exc, tb)

    # ------------------------------------------------------------ attempts

    def succeeded(self) -> None:
        """The attempt worked (a caller's 4xx relayed counts as working)."""
        lease = self._lease
        if lease is not None and not self._reported:
            self._reported = True
            self._rt.pool.attempt_succeeded(lease)

    def failed(
        self,
        failure: AttemptFailure,
        caller_saw_bytes: bool,
        *,
        retry_after: float = SATURATION_DEFAULT_SECONDS,
    ) -> bool:
        """Report a failed attempt; True when the path should call :meth:`next_attempt`.

        Synchronous (the path decides while its stream is still open, before
        writing anything).  ``retry_after``: a 429's bounded ``Retry-After``.
        True spends one retry of the group's budget (a node's ``Busy``: none).
        """
        lease = self._lease
        if lease is None or self._reported:
            return False
        self._reported = True
        if failure.kind is FailureKind.NODE_BUSY:  # node full: lease again, not a failure
            return True
        rt, out = self._rt, self._call.out
        pool_cfg = self._call.snap.config.provider_pool
        verdict = classify_failure(
            failure,
            caller_saw_bytes=caller_saw_bytes,
            retry_on_timeout=pool_cfg.retry_on_timeout,
            caller_credentialed=self._carried_credential(lease),
        )
        transition: Transition | None = None
        if verdict.effect is TrackerEffect.FAILURE and verdict.reason is not None:
            transition = rt.pool.attempt_failed(lease, verdict.reason)
        elif verdict.effect is TrackerEffect.SATURATED:
            transition = rt.pool.attempt_saturated(lease, retry_after)
        elif verdict.effect is TrackerEffect.SUCCESS:
            rt.pool.attempt_succeeded(lease)
        elif verdict.effect is TrackerEffect.CALLER_CREDENTIALED:
            rt.pool.attempt_caller_credentialed(lease)
        if verdict.reason is not None:
            rt.metrics.count_attempt_failure(
                lease.group_id or self._group.id, lease.provider_id, verdict.reason.value
            )
        if transition is Transition.EJECTED:
            rt.metrics.count_ejection(lease.provider_id)
            log.warning(
                "event=provider_ejected provider=%s reason=%s",
                lease.provider_id,
                verdict.reason.value if verdict.reason else "-",
            )
        self._failed |= {lease.provider_id}
        why = verdict.no_retry.value if verdict.no_retry is not None else None
        if why is None:
            why = self._retry_refusal(pool_cfg.retry_attempts)
        log.info(
            "event=attempt_failed request_id=%s group=%s provider=%s failure=%s status=%s "
            "retry=%s tracker=%s",
            out.request_id,
            lease.group_id or self._group.id,
            lease.provider_id,
            failure.kind.value,
            failure.status if failure.status is not None else "-",
            "yes" if why is None else f"no({why})",
            verdict.effect.value,
        )
        if why is not None:
            return False
        self._retries += 1
        rt.metrics.count_retry(self._group.id)
        return True

    def _carried_credential(self, lease: Lease) -> bool:
        """This attempt took the caller's own provider credential to the provider
        (only a relayed request carries it, under ``provider_auth.target_header``)."""
        return bool(self._needs.provider_auth) and (
            self._relay_only or lease.provider_type in PASSTHROUGH_TYPES
        )

    def _retry_refusal(self, attempts: int) -> str | None:
        """Why a safe retry is not made (attempts, candidates, budget), or None (spent)."""
        if not RetryPolicy(attempts=attempts).attempt_left(self._retries):
            return "attempts"
        if not self._candidates_left():
            return "no_candidate"
        if not self._rt.retry_budget.try_retry(self._group.id, trio.current_time()):
            return "budget"
        return None

    def _candidates_left(self) -> bool:
        """A provider of the group or its fallbacks this request may still go to."""
        catalog = self._call.snap.catalog
        exclude = self._exclude()
        for gid in (self._group.id, *self._chain):
            spec = catalog.group(gid)
            if spec is not None and any(pid not in exclude for pid, _ in spec.providers):
                return True
        return False

    def _exclude(self) -> frozenset[str]:
        """Failed providers, and -- with the caller's provider credentials -- every
        provider of another ``base_url`` origin than the first one leased."""
        if not self._needs.provider_auth or not self._failed:
            return self._failed
        catalog = self._call.snap.catalog
        first = catalog.providers.get(next(iter(self._failed)))
        origin = _origin(first.config.base_url) if first is not None else None
        other = {
            pid for pid, ref in catalog.providers.items() if _origin(ref.config.base_url) != origin
        }
        return self._failed | other

    async def next_attempt(self) -> LeasedRequest[Body]:
        """Release the failed lease and lease another candidate (after ``failed`` said True).

        Raises what a first lease raises (no candidate left, queue timeout).
        """
        await self._release()
        self._lease_cm = self._open_lease(self._exclude())
        return await self._enter()

    async def _release(self) -> None:
        self._lease = None
        await self._lease_cm.__aexit__(None, None, None)

    def _leased(self, lease: Lease, session: NodeSession) -> LeasedRequest[Body]:
        call, out = self._call, self._call.out
        call.resume_deadline()
        out.provider = lease.provider_id
        group = self._group
        if lease.group_id and lease.group_id != group.id:  # served by a fallback group
            fallback = call.snap.catalog.group(lease.group_id)
            if fallback is not None:
                self._rt.metrics.count_fallback(group.id, fallback.id)
                group = fallback
        out.group = group.id  # metering and the log line: the group that served it
        _name_serving_group(self._request, group.id)
        call.leased = True  # from here a provider may spend tokens on it
        relay = self._relay_only or lease.provider_type in PASSTHROUGH_TYPES
        out.mode = "passthrough" if relay else "normalized"
        body, needs, params = self._body, self._needs, self._relay_params
        if params is None or not relay or group is not self._group:
            params = generation_params(body, group, relay=relay)
        principal = out.principal
        assert principal is not None  # check_head authenticated every provider route
        return LeasedRequest(
            snap=call.snap,
            request=self._request,
            body=body,
            principal=principal,
            group=group,
            lease=lease,
            session=session,
            provider_auth=needs.provider_auth,
            messages=needs.messages,
            estimate=needs.estimate,
            context_class=needs.context_class,
            relay=relay,
            # In a mixed group only the lease decides the path, so a relayed
            # request's limits are checked (again) here.
            params=params,
            leasing=self,
        )


def _origin(base_url: str | None) -> str | None:
    try:
        return url_origin(base_url) if base_url else None
    except ValueError:
        return None


def _name_serving_group(request: Request, group_id: str) -> None:
    """``X-Iopd-Model-Group`` on the response: the head hook's headers are the
    ones every response to the request carries (a retry's group replaces it)."""
    context = request.context
    if not isinstance(context, HeadContext):
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


def _parse(snap: Snapshot, request: Request, kind: type[Body], out: Outcome) -> Body:
    """Decode and validate the body; a 400 is labelled with the group when one resolves."""
    raw = parse_json_object(request.body)
    model = raw.get("model")
    if isinstance(model, str):
        group = snap.catalog.resolve(model)
        if group is not None:
            out.group = group.id
    return kind.parse(raw)
