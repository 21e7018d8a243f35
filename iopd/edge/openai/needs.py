"""What a request needs of a provider, decided once before it is leased.

Each endpoint family has one function: the pool capabilities the request
requires (``passthrough``, ``ollama``), the caller's provider credential,
the chat messages the normalized paths run (when they can), the input
estimate (the project's one estimate, ``iopd.tokens``) and its context
class.  A request only a passthrough provider can serve either requires one
or, in a group without any, gets the 400 that says why.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from iopd import errors
from iopd.config.catalog import GroupSpec
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue
from iopd.edge.openai.incoming.responses_tools import dropped_header, unsupported_refusal
from iopd.edge.openai.lifecycle import PASSTHROUGH_TYPES
from iopd.edge.openai.outgoing.responses import responses_input_to_messages
from iopd.edge.runtime.edge_runtime import EdgeRuntime, Snapshot
from iopd.http.server import Request
from iopd.tokens import estimate_input_tokens
from iopd.vocabulary import ContextClass

__all__ = ["Needs", "all_passthrough", "announce_dropped_tools", "ollama_needs", "openai_needs", "relayed_needs"]

_NO_REQUIREMENT: frozenset[str] = frozenset()
_NEEDS_PASSTHROUGH = frozenset({"passthrough"})
_NEEDS_OLLAMA = frozenset({"ollama"})


class Needs(NamedTuple):
    """What an endpoint's request needs of a provider, and what it brings."""

    requires: frozenset[str]  # pool capabilities (``passthrough``, ``ollama``)
    provider_auth: str | None
    messages: list[JSONObject]
    estimate: int
    context_class: ContextClass
    #: Responses tool types the normalized path runs without (``openai.unsupported_tools``).
    dropped_tools: tuple[str, ...] = ()


def openai_needs(
    snap: Snapshot,
    request: Request,
    group: GroupSpec,
    body: rq.ChatRequest | rq.ResponsesRequest,
    relay_only: bool,
) -> Needs:
    """Provider credentials, what only a passthrough provider serves, workspace,
    then the estimate."""
    provider_auth = _provider_auth(snap, request, group.id)
    requires = _NO_REQUIREMENT
    _check_workspace(snap, group, body.workspace)
    dropped: tuple[str, ...] = ()
    if isinstance(body, rq.ResponsesRequest):
        messages: list[JSONObject] = []
        if not relay_only:
            try:  # the normalized path's chat form, or why it has none
                messages = responses_input_to_messages(body.raw)
            except errors.InvalidRequest as exc:
                requires = _passthrough_or_refuse(snap, group, exc)
            else:
                requires, dropped = _unsupported_tools(snap, group, body)
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
    return Needs(
        requires, provider_auth, messages, estimate, _context_class(snap, estimate), dropped
    )


def _unsupported_tools(
    snap: Snapshot, group: GroupSpec, body: rq.ResponsesRequest
) -> tuple[frozenset[str], tuple[str, ...]]:
    """Tools no normalized provider runs (``web_search``...): a passthrough
    provider of the group takes the request; without one, ``drop`` runs it
    without them (their types returned) and ``reject`` refuses it (as is a
    malformed custom or namespace tool, under either policy)."""
    refusal = unsupported_refusal(body.tool_plan)
    if refusal is None:
        return _NO_REQUIREMENT, ()
    plan, policy = body.tool_plan, snap.config.openai.unsupported_tools
    if plan.problem is not None or policy == "reject" or snap.catalog.has_type(group.id, "openai"):
        return _passthrough_or_refuse(snap, group, refusal), ()
    return _NO_REQUIREMENT, tuple(body.tool_plan.dropped_types)


def announce_dropped_tools(
    rt: EdgeRuntime, request: Request, group_id: str, dropped: tuple[str, ...]
) -> None:
    """The tools a normalized request runs without: named on every response
    to it (``X-Iopd-Dropped-Tools``) and counted."""
    context = request.context
    if context is not None:
        context.response_headers.append(dropped_header(dropped))
    for kind in dropped:
        rt.metrics.count_dropped_tool(group_id, kind)


def relayed_needs(
    snap: Snapshot, request: Request, group: GroupSpec, body: rq.RelayedRequest
) -> Needs:
    """``/v1/embeddings`` and ``/v1/completions`` need a passthrough provider
    (a normalized provider has no such path), but embeddings are served by an
    ``ollama`` provider too (through its own ``/api/embed``: the node
    translates) in a group without a passthrough one; a 400 names the endpoint."""
    requires = _NEEDS_PASSTHROUGH
    if not snap.catalog.has_type(group.id, "openai"):
        if request.path != "/v1/embeddings" or not snap.catalog.has_type(group.id, "ollama"):
            served_by = "type 'openai' (passthrough) providers" + (
                " and 'ollama' ones" if request.path == "/v1/embeddings" else ""
            )
            raise errors.InvalidRequest(
                f"model '{body.model[:200]}' has no provider that serves {request.path}: "
                f"only {served_by} do",
                param="model",
            )
        requires = _NEEDS_OLLAMA
    provider_auth = _provider_auth(snap, request, group.id)
    estimate = estimate_input_tokens(body.as_messages())
    return Needs(requires, provider_auth, [], estimate, _context_class(snap, estimate))


def ollama_needs(
    snap: Snapshot, group: GroupSpec, body: rq.OllamaRequest, path: str
) -> Needs:
    """An ``/api/*`` request needs an ollama provider of its group."""
    if not snap.catalog.has_type(group.id, "ollama"):
        raise errors.InvalidRequest(
            f"model '{body.model[:200]}' has no ollama provider for {path}", param="model"
        )
    return Needs(_NEEDS_OLLAMA, None, [], 0, "normal")


def all_passthrough(snap: Snapshot, group: GroupSpec) -> bool:
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
    """The input-token estimate (``iopd.tokens``) over a /v1/responses body:
    instructions and input items."""
    parts: list[JSONValue] = []
    if isinstance(raw.get("instructions"), str):
        parts.append({"content": raw["instructions"]})
    inp = raw.get("input")
    if isinstance(inp, str):
        parts.append({"content": inp})
    elif isinstance(inp, list):
        parts.extend(inp)  # message-shaped items; text_parts skips anything else
    return estimate_input_tokens(parts)
