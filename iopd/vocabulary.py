"""The words edge and node share, each defined once.

Why one module: the same small vocabularies -- which provider types tunnel
the OpenAI API raw, what a finished request's metric status may be, what a
provider's health may be, which headers never cross a hop -- were spelled out
in the request handlers, the pool, the metrics and the node's relay, and a
word added in one place was missing in the next.  Here every closed set is a
``Literal`` (for the type checker) and the matching ``frozenset`` is derived
from it with ``typing.get_args`` (for the runtime check), never written twice.

It imports nothing of ``iopd`` (so any module may import it without a cycle);
``Health``, ``ErrorCode`` and ``ProviderType`` come from ``wire/``, which never imports ``iopd``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal, get_args

from wire.messages import ErrorCode, Health, ProviderType

__all__ = [
    "ADMIN_ACTIONS",
    "AdminAction",
    "SHOWN_HEALTH_STATES",
    "ShownHealth",
    "DISPATCH_OUTCOMES",
    "ENDPOINTS",
    "ERROR_CODES",
    "FRAMING_HEADERS",
    "FRAME_DIRECTIONS",
    "HEALTH_STATES",
    "HOP_BY_HOP",
    "LIMIT_NAMES",
    "NEVER_REACHED",
    "OLLAMA_TYPES",
    "PASSTHROUGH_TYPES",
    "PROVIDER_TYPES",
    "REFRESH_OUTCOMES",
    "RELAY_ONLY_ENDPOINTS",
    "REQUIREMENT_TYPES",
    "RESPONSE_MODES",
    "STATUSES",
    "TEXT_TOOL_TYPES",
    "TOKEN_TYPES",
    "UNKNOWN_GROUP",
    "UNMAPPED",
    "USAGE_SOURCES",
    "WIRE_ERROR_REASONS",
    "ContextClass",
    "DispatchOutcome",
    "Endpoint",
    "ErrorCode",
    "FrameDirection",
    "Health",
    "LimitName",
    "ProviderType",
    "RefreshOutcome",
    "Requirement",
    "ResponseMode",
    "Status",
    "TokenType",
    "UsageSource",
    "WireErrorReason",
    "all_passthrough",
    "forbidden_reason",
    "load_ratio",
    "types_meeting",
]

# ------------------------------------------------------------ provider types

#: ``ProviderType`` (``wire.messages``): what each provider type can do.
PROVIDER_TYPES: Final = frozenset(get_args(ProviderType))

#: Speak the OpenAI HTTP API natively: requests to them are tunnelled raw.
PASSTHROUGH_TYPES: Final[frozenset[ProviderType]] = frozenset({"openai"})
#: Speak the Ollama API natively: ``/api/*`` is relayed raw to them.
OLLAMA_TYPES: Final[frozenset[ProviderType]] = frozenset({"ollama"})
#: Text-only providers: tools go through the ``<tool_call>`` text protocol.
TEXT_TOOL_TYPES: Final[frozenset[ProviderType]] = frozenset({"cli", "echo"})

#: What a request may require of the provider it leases (``pool.lease(requires=...)``).
Requirement = Literal["passthrough", "ollama", "normalized"]
#: The provider types that satisfy each ``Requirement`` (an unknown one: none).
REQUIREMENT_TYPES: Final[Mapping[str, frozenset[ProviderType]]] = {
    "passthrough": PASSTHROUGH_TYPES,
    "ollama": OLLAMA_TYPES,
    "normalized": PROVIDER_TYPES - PASSTHROUGH_TYPES,
}


def types_meeting(requires: Iterable[str]) -> frozenset[str] | None:
    """The provider types that meet every requirement; None when there is none to meet."""
    allowed: frozenset[str] | None = None
    for need in requires:
        types = REQUIREMENT_TYPES.get(need, frozenset())
        allowed = types if allowed is None else allowed & types
    return allowed


def all_passthrough(provider_types: Iterable[str]) -> bool:
    """True when there is at least one type and every one tunnels raw.

    A model group made only of such providers always runs as ``passthrough``.
    """
    types = set(provider_types)
    return bool(types) and types <= PASSTHROUGH_TYPES


#: Which slots a request needs: ``long`` when its input estimate reaches
#: ``openai.long_context_threshold_tokens`` (it takes a long-context slot where there is one).
ContextClass = Literal["normal", "long"]

# ------------------------------------------------------------ health and load

#: A provider's health as its node's probe reports it (``wire.messages.Health``).
HEALTH_STATES: Final = frozenset(get_args(Health))
#: What ``/status`` and the health gauge show for a provider: its probe's
#: health, or ``disconnected`` while its node has no live session (the last
#: probe result is history then, not the provider's state), or ``ejected``
#: while passive outlier ejection keeps it out (``iopd.edge.pool.outliers``).
#: Precedence when several hold: ``disconnected`` > ``ejected`` > the probe.
ShownHealth = Literal["disconnected", "ejected", Health]
SHOWN_HEALTH_STATES: Final = frozenset(get_args(ShownHealth))


def load_ratio(in_flight: int, capacity: int) -> float:
    """``in_flight / capacity``; 0 when capacity is 0 (a disabled-by-size provider)."""
    return in_flight / capacity if capacity > 0 else 0.0


# ------------------------------------------------------------ request outcomes

#: ``principal_ref``/``principal_alias``/``token_ref`` of legacy-bearer, open
#: and unauthenticated callers.
UNMAPPED: Final = "unmapped"
#: ``model_group`` of a request that did not resolve to a catalog id.
UNKNOWN_GROUP: Final = "unknown"

#: The metric ``endpoint`` of a request (every ``/api/*`` path is ``api``;
#: ``/v1/messages`` and its ``count_tokens`` are ``messages``).
Endpoint = Literal["chat_completions", "responses", "embeddings", "completions", "api", "messages"]
ENDPOINTS: Final = frozenset(get_args(Endpoint))
#: The endpoints only a provider speaking that API serves: always a raw relay
#: (``response_mode`` ``passthrough``, whatever else the group holds).
RELAY_ONLY_ENDPOINTS: Final[frozenset[Endpoint]] = frozenset({"embeddings", "completions", "api"})

#: The execution path a request took: the raw tunnel or ``RunRequest``.
ResponseMode = Literal["passthrough", "normalized"]
RESPONSE_MODES: Final = frozenset(get_args(ResponseMode))

#: The metric ``status`` of a finished request (``GatewayError.metric_status``).
Status = Literal[
    "ok",
    "client_error",
    "auth_error",
    "queue_full",
    "queue_timeout",
    "dispatch_error",
    "provider_error",
    "cancelled",
    "overloaded",
    "rate_limited",
    "limits_unavailable",
]
STATUSES: Final = frozenset(get_args(Status))

#: The ``limit`` label of ``iop_limit_rejections_total`` (``limits`` keys a 429 names).
LimitName = Literal["requests_per_minute", "tokens_per_minute", "tokens_per_day"]
LIMIT_NAMES: Final = frozenset(get_args(LimitName))

#: How one ``pool.lease()`` attempt ended.
DispatchOutcome = Literal["admitted", "queue_full", "queue_timeout", "dispatch_error", "cancelled"]
DISPATCH_OUTCOMES: Final = frozenset(get_args(DispatchOutcome))

#: Where a token count came from, and what it counts.
UsageSource = Literal["provider_body", "tunnel_frame", "run_event"]
USAGE_SOURCES: Final = frozenset(get_args(UsageSource))
TokenType = Literal["input", "output", "reasoning", "cached_input"]
TOKEN_TYPES: Final = frozenset(get_args(TokenType))

#: How one config refresh request ended.
RefreshOutcome = Literal["applied", "refused", "failed", "dry_run"]
REFRESH_OUTCOMES: Final = frozenset(get_args(RefreshOutcome))

#: An operator's runtime control (the ``action`` of ``iop_admin_actions_total``).
AdminAction = Literal["drain", "disable", "enable", "override", "reset", "node_drain"]
ADMIN_ACTIONS: Final = frozenset(get_args(AdminAction))

#: Wire frames: ``in`` = node to edge.
FrameDirection = Literal["in", "out"]
FRAME_DIRECTIONS: Final = frozenset(get_args(FrameDirection))
#: Why a wire connection was closed for a protocol problem.
WireErrorReason = Literal[
    "frame_too_large", "malformed", "protocol", "handshake", "heartbeat_timeout", "pending_limit"
]
WIRE_ERROR_REASONS: Final = frozenset(get_args(WireErrorReason))

#: The ``code`` of a run's or a tunnel's ``error`` (``wire.messages.ErrorCode``;
#: what each means to the edge: ``iopd/edge/openai/run_errors.py``).
ERROR_CODES: Final[frozenset[ErrorCode]] = frozenset(get_args(ErrorCode))
#: What the caller is told when the provider was never reached, whatever a
#: node's own text says (it may name the provider's address): the node's
#: adapters send these, and the edge keeps to them for a node that does not.
NEVER_REACHED: Final[Mapping[ErrorCode, str]] = {
    "provider_unreachable": "the provider could not be reached",
    "provider_reset": "the connection to the provider broke while the request was sent",
}

# ------------------------------------------------------------ header sets

#: Headers that belong to one connection and are never relayed in either
#: direction (RFC 9110 §7.6.1 and the proxy-era ones); the names a
#: ``Connection:`` header lists are hop-by-hop too (the relays check that).
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "trailers",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
#: The headers that frame a message on its connection: the HTTP server writes
#: its own and drops a handler's.
FRAMING_HEADERS: Final = frozenset({"content-length", "transfer-encoding", "connection"})

#: Headers ``openai.forward_headers`` may never add and a passthrough never
#: forwards, by what they are (and ``HOP_BY_HOP``).
_FRAMING = frozenset(
    {"content-length", "content-encoding", "content-type", "expect", "accept-encoding"}
)
_CREDENTIALS = frozenset({"authorization", "cookie", "cookie2", "set-cookie", "host"})
_FORWARDING = frozenset(
    {
        "forwarded",
        "via",
        "x-real-ip",
        "x-client-ip",
        "true-client-ip",
        "x-original-url",
        "x-rewrite-url",
    }
)
_FORWARDING_PREFIXES = ("x-forwarded-", "x-original-", "proxy-")


def forbidden_reason(name: str) -> str | None:
    """Why header ``name`` may never be forwarded to a provider, or None if it may."""
    lname = name.lower()
    # Forwarding first: a ``Proxy-*`` header is named for what it routes.
    if lname in _FORWARDING or lname.startswith(_FORWARDING_PREFIXES):
        return "a forwarding or routing header"
    if lname in HOP_BY_HOP:
        return "a hop-by-hop header"
    if lname in _FRAMING:
        return "a framing or encoding header of the body the edge re-encodes"
    if lname in _CREDENTIALS:
        return "the caller's credentials or the edge's own host"
    return None
