"""Every message of the Edge-Node wire, as tagged msgspec Structs in one union.

Schema evolution follows msgspec's rules: a new field always gets a default,
a field is never renamed or retyped, unknown fields are ignored on decode.
``omit_defaults`` keeps hot messages (RunEvent, ProviderTunnelFrame) small.

Streams: the edge opens every stream (RunRequest, ProviderTunnelRequest,
NodeConfig) with a fresh ``stream_id``; all replies carry the same id. A stream
ends with exactly one terminal message: RunEvent kind ``complete``/``error``,
ProviderTunnelFrame kind ``end``/``error``, or NodeConfigAck; a run or tunnel
the node does not admit ends with ``Busy`` instead (see the admission block).
Flow control is credit based: a request carries ``window`` (frames the node may
send before waiting), the edge returns credit with ``Credit`` as it consumes.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

import msgspec

#: 2: the node proves its token with SCRAM-SHA-256 (Hello, Challenge, Proof,
#: HelloAck) instead of sending it in Hello.  3: a whole (not streamed)
#: passthrough reply may cross as one ``whole`` tunnel frame.
PROTOCOL_VERSION = 3


class _Msg(msgspec.Struct, tag_field="t", omit_defaults=True, kw_only=True):
    """Base of every wire message; the tag is the class name."""


# ----------------------------------------------------------------- handshake


class Hello(_Msg, tag=True):
    """Node -> edge, first frame on a connection: SCRAM's client-first message.

    ``token`` is always ``""`` since protocol 2 (the token never crosses); it
    stays a required field so that an edge of protocol 1 can still decode this
    Hello and refuse it with its version.  ``nonce``: the node's fresh nonce.
    """

    protocol_version: int
    node_id: str
    token: str
    software_version: str = ""
    nonce: str = ""
    #: What this node understands beyond its protocol version (``"go_away"``).
    #: An edge that predates a feature ignores the field; a node that predates
    #: it sends none, and is sent nothing it would not decode.
    features: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=32)]], msgspec.Meta(max_length=16)
    ] = msgspec.field(default_factory=list)


class Challenge(_Msg, tag=True):
    """Edge -> node: SCRAM's server-first message.

    ``nonce`` is the node's nonce followed by the edge's; ``salt`` and
    ``iterations`` are those of the verifier the edge holds.  ``secret`` says
    what the proof is keyed with: the token itself (the edge holds a
    ``token_verifier``), or the hex SHA-256 of the token (the edge holds only
    ``token_hash_sha256``: the weaker, legacy form).
    """

    nonce: str
    salt: bytes
    iterations: int
    secret: Literal["token", "token_sha256"] = "token"


class Proof(_Msg, tag=True):
    """Node -> edge: SCRAM's client-final message (its proof over the AuthMessage)."""

    proof: bytes


class HelloAck(_Msg, tag=True):
    """Edge -> node: the session is established.

    ``server_signature``: the edge's own SCRAM proof that it holds the node's
    verifier; the node checks it before serving anything.
    """

    edge_id: str
    protocol_version: int = PROTOCOL_VERSION
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 15.0
    session_id: str = ""
    server_signature: bytes = b""


class Refused(_Msg, tag=True):
    """Edge -> node: the handshake is refused; the edge closes the connection."""

    reason: str
    code: Literal["unknown_node", "bad_token", "version_mismatch", "bad_handshake"] = (
        "bad_handshake"
    )


class Heartbeat(_Msg, tag=True):
    """Either direction; the peer answers with Pong carrying the same seq."""

    seq: int = 0


class Pong(_Msg, tag=True):
    seq: int = 0


# ------------------------------------------------------------ provider state

Health = Literal["unknown", "healthy", "unhealthy"]

#: Most providers one ProviderStatus may carry: a node sends all of its
#: providers at most, and a config gives one node no more (see
#: ``iopd.config.rules``).  A longer list is refused at its array header,
#: before any entry is decoded.
MAX_STATUS_ENTRIES = 1024
#: Longest provider id accepted in a node's message.
MAX_PROVIDER_ID_CHARS = 256
_ProviderId = Annotated[str, msgspec.Meta(max_length=MAX_PROVIDER_ID_CHARS)]


#: Most served models one ``ProviderHealth`` describes, families one model
#: names, and characters of each of a model's strings (the node cuts them).
MAX_MODEL_INFOS = 64
MAX_MODEL_FAMILIES = 8
MAX_MODEL_TEXT_CHARS = 128
#: Largest model size in bytes (msgpack's largest signed integer).
MAX_MODEL_SIZE = 2**63 - 1
_ModelText = Annotated[str, msgspec.Meta(max_length=MAX_MODEL_TEXT_CHARS)]


class ModelDetails(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A served model's ``details`` as Ollama's ``/api/tags`` lists them."""

    format: _ModelText = ""
    family: _ModelText = ""
    families: Annotated[list[_ModelText], msgspec.Meta(max_length=MAX_MODEL_FAMILIES)] = (
        msgspec.field(default_factory=list)
    )
    parameter_size: _ModelText = ""
    quantization_level: _ModelText = ""
    parent_model: _ModelText = ""


class ModelInfo(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One served model as the provider's list describes it; ``name`` is the
    served name of the node's config (not the provider's spelling)."""

    name: _ModelText
    size: Annotated[int, msgspec.Meta(ge=0, le=MAX_MODEL_SIZE)] = 0
    digest: _ModelText = ""
    modified_at: _ModelText = ""
    details: ModelDetails = msgspec.field(default_factory=ModelDetails)


class ProviderHealth(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One provider's probe result.  ``last_error`` is free text: the edge cuts
    it to ``iopd.edge.node_text.MAX_LAST_ERROR_CHARS`` when it applies it.
    ``models``: what the probe's list says of the served models (Ollama's
    ``/api/tags``; empty when unknown, and from a node of an earlier release)."""

    provider_id: _ProviderId
    health: Health = "unknown"
    last_error: str = ""
    models: Annotated[list[ModelInfo], msgspec.Meta(max_length=MAX_MODEL_INFOS)] = (
        msgspec.field(default_factory=list)
    )


class ProviderStatus(_Msg, tag=True):
    """Node -> edge: health of some or all of the node's providers."""

    providers: Annotated[list[ProviderHealth], msgspec.Meta(max_length=MAX_STATUS_ENTRIES)] = (
        msgspec.field(default_factory=list)
    )


#: The kinds of provider a node runs, each an adapter (``iopd/node/adapters/``);
#: ``iopd.vocabulary`` derives what each can do from this one list.
ProviderType = Literal["openai", "ollama", "cli", "echo"]


class ProviderSpec(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One provider as the node needs it: the adapter settings, no edge policy."""

    id: str
    type: ProviderType
    category: str = "local_inference"
    models: list[str] = msgspec.field(default_factory=list)
    base_url: str | None = None
    api_key: str | None = None
    capacity: int = 1
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    #: Seconds from the request sent to the response's first byte (http types).
    first_byte_timeout: float = 60.0
    health_interval: float = 10.0
    command: list[str] | None = None
    prompt_via: Literal["stdin", "arg"] = "stdin"
    health_command: list[str] | None = None
    kill_grace: float = 5.0
    delay_ms: int = 0
    #: Slots of ``capacity`` that long-context requests may hold (the node admits
    #: against both; see the admission block below).
    long_context_capacity: int = 0


class NodeConfig(_Msg, tag=True):
    """Edge -> node: the node's provider set, at handshake and on refresh."""

    stream_id: int
    version: int
    providers: list[ProviderSpec] = msgspec.field(default_factory=list)
    #: The edge's ``edge.config_revision``: the node applies the
    #: highest revision it has received (see ``NodeConfigState``).
    revision: int = 0


class NodeConfigAck(_Msg, tag=True):
    stream_id: int
    version: int
    ok: bool = True
    error: str = ""


# ------------------------------------------------------------- normalized run


class Usage(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Token usage as the provider reported it (None = not reported)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_input_tokens: int | None = None


class RunRequest(_Msg, tag=True):
    """Edge -> node: run a normalized request on ``provider_id``."""

    stream_id: int
    provider_id: str
    adapter: ProviderType
    target: str  # the provider's served model name (already rewritten)
    # Any (here and in RunEvent.tool_call): the caller's JSON as the edge
    # validated it; ``wire/`` imports nothing of iopd's JSONValue.
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)  # Any: see above
    tools: list[dict[str, Any]] | None = None  # Any: see above
    params: dict[str, Any] = msgspec.field(default_factory=dict)  # temperature, max_tokens...
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    workspace: str | None = None
    stream: bool = False
    window: int = 64
    #: The request's context class is ``long``: it holds a long-context slot too.
    long_context: bool = False


RunEventKind = Literal["text", "reasoning", "tool_call", "usage", "complete", "error"]

#: The codes a provider's failure crosses the wire with (what a node adapter
#: raises): ``provider_unreachable`` (never connected, or a ``cli`` process
#: never started), ``provider_reset`` (lost while the request was written),
#: ``provider_timeout`` (sent, no answer for ``read_timeout``),
#: ``provider_saturated`` (the provider's 429 to a normalized run),
#: ``bad_request`` (the request cannot run there), ``provider_error`` (anything else).
ProviderErrorCode = Literal[
    "provider_error",
    "provider_timeout",
    "bad_request",
    "provider_unreachable",
    "provider_reset",
    "provider_saturated",
]
#: Every ``code`` of an ``error`` RunEvent or ProviderTunnelFrame: a provider's
#: failure, ``cancelled`` (the edge cancelled the stream, or the node is stopping
#: it), and ``node_busy``, which no node sends: the edge ends a stream with it
#: when its node answered ``Busy``.  What each means to the edge (its retry and
#: the caller's error) is one table, ``iopd/edge/openai/run_errors.py``.
#:
#: The ``code`` fields stay ``str``, not this ``Literal``: msgspec would refuse
#: to decode a frame whose code it does not list, so an edge would drop the
#: stream of a node of another version that added one.  The edge reads an
#: unknown code as ``provider_error`` (``run_errors.known_code``).
ErrorCode = Literal[ProviderErrorCode, "cancelled", "node_busy"]


class RunEvent(_Msg, tag=True):
    """Node -> edge: one event of a normalized run.

    ``complete`` and ``error`` are terminal.  ``error`` carries ``code``
    (an ``ErrorCode``) and ``message``.
    """

    stream_id: int
    kind: RunEventKind
    text: str = ""
    tool_call: dict[str, Any] | None = None  # OpenAI shape {id, type, function{...}}
    usage: Usage | None = None
    finish_reason: str | None = None
    code: str = ""
    message: str = ""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


# -------------------------------------------------------------- passthrough


class ProviderTunnelRequest(_Msg, tag=True):
    """Edge -> node: relay one raw HTTP request to an ``openai``/``ollama`` provider."""

    stream_id: int
    provider_id: str
    method: str
    path: str  # origin-form, e.g. /v1/chat/completions
    headers: list[tuple[str, str]] = msgspec.field(default_factory=list)
    body: bytes = b""
    window: int = 64
    #: The request's context class is ``long``: it holds a long-context slot too.
    long_context: bool = False


TunnelFrameKind = Literal["head", "body", "usage", "end", "error", "whole"]


class ProviderTunnelFrame(_Msg, tag=True):
    """Node -> edge: one frame of a relayed response.

    Order: ``head`` (status, headers), ``body``* (data), at most one ``usage``,
    then terminal ``end`` or ``error`` (code, message; ``error`` may come
    before ``head`` when the provider could not be reached).  Or, for a
    whole (not streamed) reply, one terminal ``whole``: the head's status
    and headers, the whole body as ``data`` and the usage fields, in one
    frame (since protocol version 3).
    """

    stream_id: int
    kind: TunnelFrameKind
    status: int = 0
    headers: list[tuple[str, str]] = msgspec.field(default_factory=list)
    data: bytes = b""
    # kind "usage": ``body_usage`` is what the node extracted from the provider's
    # body (JSON ``usage`` or the SSE chunk carrying it); ``usage`` is usage the
    # node learned otherwise (e.g. response headers).  The edge merges them:
    # body input/output win, frame reasoning/cached_input supplement.
    usage: Usage | None = None
    body_usage: Usage | None = None
    reasoning_chars: int = 0  # reasoning text the node saw in the relayed body
    code: str = ""
    message: str = ""


# ------------------------------------------------------------------- control


class Cancel(_Msg, tag=True):
    """Edge -> node: abort the run or tunnel on ``stream_id``."""

    stream_id: int
    reason: str = ""


class Credit(_Msg, tag=True):
    """Edge -> node: the edge consumed ``frames`` more frames of ``stream_id``."""

    stream_id: int
    frames: int


# ----------------------------------------------------------------- admission
#
# The node is the authority for its providers' slots.  It admits
# every RunRequest/ProviderTunnelRequest against its own counters or ends the
# stream at once with ``Busy``.  It pushes each edge the load that edge cannot
# see itself (``LoadReport``: the other edges' streams and the slots held for
# their waiters), and an edge says which of the node's providers it has
# waiters for (``Waiting``), so that a freed slot is held for one waiting
# edge at a time.  Every field is bounded: a peer cannot make the other
# allocate more than these caps (and the frame cap) allow.

#: Most providers one LoadReport may carry (a node has far fewer).
MAX_LOAD_ENTRIES = 1024
_Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


class SlotLoad(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One provider's slots as one edge must count them, besides its own streams.

    ``in_flight``/``long_in_flight``: streams of the *other* edges on the
    provider; ``offered``: slots the node holds for other edges' waiters.  An
    edge adds its own streams (which it knows exactly and sooner) to these.
    """

    provider_id: _ProviderId
    in_flight: _Count = 0
    long_in_flight: _Count = 0
    offered: _Count = 0


class LoadReport(_Msg, tag=True):
    """Node -> edge: the load of some of its providers, for this edge (coalesced)."""

    providers: Annotated[list[SlotLoad], msgspec.Meta(max_length=MAX_LOAD_ENTRIES)] = msgspec.field(
        default_factory=list
    )


class Busy(_Msg, tag=True):
    """Node -> edge: the terminal reply of a run or tunnel the node did not admit.

    Sent at once, before anything ran: the provider is full (``capacity`` or
    ``long_context_capacity``) counting every edge's streams.  ``load`` is the
    provider's load as this edge must count it now.
    """

    stream_id: int
    load: SlotLoad


class Waiting(_Msg, tag=True):
    """Edge -> node: the edge has (``waiting``) or no longer has waiters that
    ``provider_id`` could serve; the node offers freed slots in this order."""

    provider_id: _ProviderId
    waiting: bool = True


# ============================================ several edges
# What every edge of a fleet must agree on is held by the node, the one
# place all of them talk to: the config revision in force and the operator's
# runtime controls.  Neither is on a stream: the node sends its state when it
# changes and after each session's first config; the edge sends a control
# change when an operator asks for one.


def node_config_digest(providers: list[ProviderSpec]) -> str:
    """A digest of a node's provider set, the same on edge and node.

    Taken over the typed round trip of the msgpack encoding, so a value the
    edge built as an ``int`` where the field is a ``float`` digests as the
    node decodes it.
    """
    data = msgspec.msgpack.encode(providers)
    canonical = msgspec.msgpack.encode(msgspec.msgpack.decode(data, type=list[ProviderSpec]))
    return hashlib.sha256(canonical).hexdigest()[:32]


#: Longest ``NodeConfigState.digest`` accepted (``node_config_digest`` gives 32).
MAX_DIGEST_CHARS = 128


class NodeConfigState(_Msg, tag=True):
    """Node -> edge: the config in force on the node.

    Sent to the pushing edge after each ``NodeConfigAck``, and to every edge
    when the config in force changes.  ``revision`` is the highest
    ``NodeConfig.revision`` applied, ``digest`` the ``node_config_digest`` of
    its providers: an edge whose own push differs is flagged
    ``config_mismatch`` and keeps serving with the node's config.
    """

    revision: int
    digest: Annotated[str, msgspec.Meta(max_length=MAX_DIGEST_CHARS)]


ControlName = Literal["active", "draining", "disabled"]
_Override = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
#: Most providers one control message may name (a node has a handful).
MAX_CONTROLS = 4096


class ProviderControlSpec(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One provider's runtime control: its state and overrides (None: configured value)."""

    provider_id: _ProviderId
    state: ControlName = "active"
    capacity: _Override | None = None
    priority: _Override | None = None


class ControlUpdate(_Msg, tag=True):
    """Edge -> node: an operator set these providers' controls (last write wins)."""

    controls: Annotated[list[ProviderControlSpec], msgspec.Meta(max_length=MAX_CONTROLS)] = (
        msgspec.field(default_factory=list)
    )


class ControlState(_Msg, tag=True):
    """Node -> edge: every control the node holds; a provider not named is active
    with no override.  Sent to every edge on each change and at each session's start."""

    controls: Annotated[list[ProviderControlSpec], msgspec.Meta(max_length=MAX_CONTROLS)] = (
        msgspec.field(default_factory=list)
    )


class GoAway(_Msg, tag=True):
    """Edge -> node (only to a node whose ``Hello.features`` has ``"go_away"``):
    this edge process is handing over to a successor on the same address.

    The node dials the address again (reaching the successor) and keeps this
    session for the streams in flight until the edge closes it; no reconnect
    follows that close.
    """

    reason: str = ""


#: ``Hello.features``: the node understands ``GoAway``.
FEATURE_GO_AWAY = "go_away"


Message = (
    Hello
    | Challenge
    | Proof
    | HelloAck
    | Refused
    | Heartbeat
    | Pong
    | ProviderStatus
    | NodeConfig
    | NodeConfigAck
    | RunRequest
    | RunEvent
    | ProviderTunnelRequest
    | ProviderTunnelFrame
    | Cancel
    | Credit
    | LoadReport
    | Busy
    | Waiting
    | NodeConfigState
    | ControlUpdate
    | ControlState
    | GoAway
)

TERMINAL_RUN_KINDS = frozenset({"complete", "error"})
TERMINAL_TUNNEL_KINDS = frozenset({"end", "error", "whole"})


def is_terminal(msg: Message) -> bool:
    """True when ``msg`` ends its stream."""
    if isinstance(msg, RunEvent):
        return msg.kind in TERMINAL_RUN_KINDS
    if isinstance(msg, ProviderTunnelFrame):
        return msg.kind in TERMINAL_TUNNEL_KINDS
    return isinstance(msg, NodeConfigAck | Busy)
