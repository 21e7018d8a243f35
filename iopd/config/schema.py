"""Typed schemas of the edge and node configuration files.

Every section is a msgspec Struct with ``forbid_unknown_fields=True`` so a typo
in an operator's YAML is an error, never silently ignored.  Field names, types
and defaults here *are* the contract; ``docs/configuration.md`` documents every
one of them (a test compares the two).

Semantic checks (references, bounds, uniqueness) live in ``rules/``;
loading, ``${NAME}`` substitution and error paths in ``load.py``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from iopd.vocabulary import ProviderType

ProviderCategory = Literal["api", "cli", "local_inference"]
LogFormat = Literal["keyvalue", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
PromptVia = Literal["stdin", "arg"]

#: Display-only flags an operator may attach to a provider.
LIFECYCLE_CAPABILITIES: frozenset[str] = frozenset(
    {
        "streaming",
        "passthrough",
        "tool_calls",
        "reasoning",
        "cancel",
        "health_probe",
        "long_context",
        "responses",
    }
)

DEFAULT_STRICT_OUTPUT_INSTRUCTION = (
    "Put your final answer, and nothing else, inside a single <completion>...</completion> element."
)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for every config section: unknown keys are rejected."""


# --------------------------------------------------------------------- edge


class EdgeTLS(_Section):
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None


class EdgeSection(_Section):
    id: str
    node_listen: str
    admin_listen: str
    #: SHA-256 (hex) of the admin API's bearer token; None: no token asked.
    admin_token_hash_sha256: str | None = None
    drain_timeout: float = 30.0
    log_format: LogFormat = "keyvalue"
    log_level: LogLevel = "info"
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 15.0
    handshake_timeout: float = 5.0
    max_frame_bytes: int = 16 * 1024 * 1024
    #: Caps of the wire listener's connections that have not authenticated yet.
    node_listen_max_pending: int = 256
    node_listen_max_pending_per_address: int = 16
    tls: EdgeTLS = msgspec.field(default_factory=EdgeTLS)
    #: Raised by the operator with each config change on every edge: a node
    #: applies the highest revision it has received.
    config_revision: int = 0


class PrincipalToken(_Section):
    token_ref: str
    token_hash_sha256: str
    principal_ref: str
    alias: str = ""


class ProviderAuth(_Section):
    header: str = "X-Provider-Authorization"
    target_header: str = "Authorization"
    required: bool = False


class ModelRoute(_Section):
    """Legacy ``openai.model_routes[]`` entry; normalised to a one-provider group."""

    model: str
    node: str
    adapter: str  # the provider id on ``node``
    target: str  # the served model name
    session_id: str | None = None
    queue_timeout: float | None = None


class OpenAISection(_Section):
    enabled: bool = True
    listen: str = "127.0.0.1:8080"
    bearer_token: str | None = None
    principal_tokens: list[PrincipalToken] = msgspec.field(default_factory=list)
    provider_auth: ProviderAuth = msgspec.field(default_factory=ProviderAuth)
    #: Caller headers forwarded to passthrough providers beyond the built-in allow-list.
    forward_headers: list[str] = msgspec.field(default_factory=list)
    #: Responses tools a normalized provider cannot run (``web_search``...):
    #: ``drop`` runs the request without them (named in a response header),
    #: ``reject`` answers 400.
    unsupported_tools: Literal["drop", "reject"] = "drop"
    #: A caller header that names the request's session (beside the agents' own).
    session_header: str | None = None
    #: Browser origins (``scheme://host[:port]`` or ``*``) allowed by CORS; empty = off.
    cors_allow_origins: list[str] = msgspec.field(default_factory=list)
    long_context_threshold_tokens: int = 100000
    strict_output: bool = False
    strict_output_instruction: str = DEFAULT_STRICT_OUTPUT_INSTRUCTION
    max_body_bytes: int = 8 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    request_timeout: float = 600.0
    idle_timeout: float = 30.0
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 4096
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    send_timeout: float = 30.0
    model_routes: list[ModelRoute] = msgspec.field(default_factory=list)
    # Legacy single-target form: every request whose model is not otherwise
    # resolved goes to provider ``adapter`` (on ``node``) with served ``target``.
    node: str | None = None
    adapter: str | None = None
    target: str | None = None


class PoolRouting(_Section):
    """``provider_pool.routing``: the prefix index's bounds and the cache-aware choice's
    thresholds (``iopd.edge.pool.routing``; docs/routing.md)."""

    block_bytes: int = 512
    max_prompt_bytes: int = 256 * 1024
    index_blocks: int = 16384
    max_sessions: int = 65536
    min_match: float = 0.5
    max_load_gap: float = 1.0
    max_load_gap_ratio: float = 0.5
    wait_min_tokens: int = 512
    prefill_tokens_per_second: float = 2000.0


class ProviderPoolSection(_Section):
    max_queue: int = 256
    queue_timeout: float = 30.0
    max_queued_bytes: int = 256 * 1024 * 1024  # body bytes held by waiters; 0 = never wait
    # Routing around a failing provider: retries before the first byte, and
    # passive outlier ejection (iopd.edge.pool.retry_rules, .outliers).
    retry_attempts: int = 2
    retry_budget: float = 0.2
    retry_budget_min: int = 10
    retry_on_timeout: bool = False
    eject_after_failures: int = 5
    eject_seconds: float = 30.0
    routing: PoolRouting = msgspec.field(default_factory=PoolRouting)


class LimitDefaults(_Section):
    """``limits.default``: the limits of every principal without its own entry (0 = unlimited)."""

    max_concurrent: int = 0
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    share: int = 1


class PrincipalLimit(_Section):
    """``limits.principals[]``: one principal's limits; a key left out takes ``limits.default``'s."""

    principal_ref: str
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    share: int | None = None


class LimitsSection(_Section):
    default: LimitDefaults = msgspec.field(default_factory=LimitDefaults)
    principals: list[PrincipalLimit] = msgspec.field(default_factory=list)
    # Where the counters live: this edge's memory, or a Redis/Valkey
    # server shared by every edge.  Restart-required.
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None  # redis:// or rediss://; its password is a secret: use ${NAME}
    on_backend_error: Literal["local", "reject", "allow"] = "local"
    backend_timeout: float = 0.5  # seconds; a store call over it is an outage
    lease_ttl: float = 15.0  # seconds a concurrency slot lives unless renewed (every ttl/3)


class Generation(_Section):
    defaults: dict[str, float | int | str | bool] = msgspec.field(default_factory=dict)
    limits: dict[str, float | int] = msgspec.field(default_factory=dict)


class ModelGroup(_Section):
    id: str
    providers: dict[str, str]  # provider id -> served model name
    generation: Generation = msgspec.field(default_factory=Generation)
    fallbacks: list[str] = msgspec.field(default_factory=list)  # group ids, tried in order
    fallback_on_queue_timeout: bool = False
    routing: Literal["prefix", "least_load"] = "prefix"


class ProviderConfig(_Section):
    """One provider under ``nodes[].providers[]``; also pushed to the node."""

    id: str
    type: ProviderType
    category: ProviderCategory = "local_inference"
    models: list[str] = msgspec.field(default_factory=list)
    base_url: str | None = None
    api_key: str | None = None  # sent as Bearer to the provider; use ${NAME}
    #: ``openai``: the server speaks Anthropic's Messages API itself, so
    #: ``/v1/messages`` is relayed to it raw (edge-only: not pushed to the node).
    anthropic_messages: bool = False
    #: ``openai``: the server serves the Responses API (``/v1/responses`` is
    #: relayed to it raw); False: it speaks only Chat Completions, so the edge
    #: translates ``/v1/responses`` to chat and back (edge-only).
    openai_responses: bool = True
    capacity: int = 1
    long_context_capacity: int = 0
    priority: int = 0
    enabled: bool = True
    lifecycle_capabilities: list[str] = msgspec.field(default_factory=list)
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    #: Seconds from the request sent to the first byte of the provider's answer.
    first_byte_timeout: float = 60.0
    health_interval: float = 10.0
    # cli
    command: list[str] | None = None
    prompt_via: PromptVia = "stdin"
    health_command: list[str] | None = None
    kill_grace: float = 5.0
    # echo
    delay_ms: int = 0


class NodeEntry(_Section):
    id: str
    #: One of these two unless ``embedded``; validated in ``rules/edge.py``.
    #: ``token_verifier``: the SCRAM-SHA-256 verifier (``wire.scram``), the
    #: strong form; ``token_hash_sha256``: the weaker, legacy form.
    token_verifier: str = ""
    token_hash_sha256: str = ""
    alias: str = ""
    #: Run this node inside the edge process (one daemon for one machine); it
    #: dials the edge over loopback with a token minted in memory at start.
    embedded: bool = False
    providers: list[ProviderConfig] = msgspec.field(default_factory=list)


class EdgeConfig(_Section):
    edge: EdgeSection
    openai: OpenAISection = msgspec.field(default_factory=OpenAISection)
    provider_pool: ProviderPoolSection = msgspec.field(default_factory=ProviderPoolSection)
    limits: LimitsSection = msgspec.field(default_factory=LimitsSection)
    models: list[ModelGroup] = msgspec.field(default_factory=list)
    nodes: list[NodeEntry] = msgspec.field(default_factory=list)


# --------------------------------------------------------------------- node


class NodeTLS(_Section):
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_hostname: str | None = None


class NodeSection(_Section):
    id: str
    token: str
    #: The one edge to dial (``host:port``), or ``edges``: several, one session
    #: each.  Exactly one of the two; validated in ``rules/edge.py``.
    edge: str = ""
    edges: list[str] = msgspec.field(default_factory=list)
    tls: NodeTLS = msgspec.field(default_factory=NodeTLS)
    drain_timeout: float = 30.0
    reconnect_max_backoff: float = 30.0
    reconnect_initial_backoff: float = 0.5
    max_frame_bytes: int = 16 * 1024 * 1024
    log_format: LogFormat = "keyvalue"
    log_level: LogLevel = "info"
    #: What any edge may make this node do (``iopd.node.consent``): the argv
    #: prefixes a pushed ``command``/``health_command`` must start with (empty:
    #: none may run), and the origins a pushed ``base_url`` may reach (empty:
    #: loopback hosts only).
    allowed_commands: list[list[str]] = msgspec.field(default_factory=list)
    allowed_provider_origins: list[str] = msgspec.field(default_factory=list)
    #: Answer a ``Challenge`` keyed by ``sha256(token)`` (an edge that holds
    #: only ``token_hash_sha256``): that hash is a credential of its own.
    accept_legacy_proof: bool = False


class NodeConfigFile(_Section):
    node: NodeSection


def node_edge_addresses(node: NodeSection) -> list[str]:
    """Every edge the node dials: ``node.edges``, or the one ``node.edge``."""
    return list(node.edges) if node.edges else [node.edge]
