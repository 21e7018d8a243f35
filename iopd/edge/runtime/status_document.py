"""The typed documents of the admin API: ``GET /status`` and ``POST /refresh``.

``EdgeRuntime.status()`` and ``refresh()`` build them; the admin app encodes
them, and the CLI and the console read the same shapes.  Types only.
"""

from __future__ import annotations

from typing import TypedDict

from iopd.edge.principals.backend import BackendRow
from iopd.edge.principals.status import PrincipalRow
from iopd.edge.runtime.runtime_controls import OverrideView


class NodeRow(TypedDict):
    """One node of ``GET /status``."""

    id: str
    alias: str
    connected: bool
    connected_since: float | None
    providers: list[str]
    #: The config revision in force on the node (None until it told this edge).
    config_revision: int | None
    #: This edge pushed the node a lower revision, or another config at the
    #: same revision: it serves with the node's config.
    config_mismatch: bool


class ProviderRow(TypedDict):
    """One provider of ``GET /status``."""

    node_id: str
    id: str
    type: str
    category: str
    models: list[str]
    enabled: bool  # as configured (``enabled: false`` in the config)
    state: str  # runtime control: active | draining | drained | disabled
    health: str
    capacity: int  # in force: the runtime override, else the configured one
    priority: int  # in force, as ``capacity``
    override: OverrideView  # the raw runtime overrides (null: none)
    in_flight: int
    queued: int
    load_ratio: float
    long_context_capacity: int
    long_in_flight: int
    lifecycle_capabilities: list[str]
    last_error: str
    ejected_until: float | None  # Unix time; set while ``health`` is ``ejected``


class ModelProviderRow(TypedDict):
    """One provider of a model group in ``GET /status``."""

    provider: str
    served: str  # the model name the provider is asked for
    type: str


class ModelRow(TypedDict):
    """One model group of ``GET /status``: the id callers send, and where it goes."""

    id: str
    source: str  # models (``models[]``), route (legacy route), fallback
    routing: str  # ``models[].routing``: prefix | least_load (docs/routing.md)
    providers: list[ModelProviderRow]


class QueueRow(TypedDict):
    """The global queue in ``GET /status``."""

    depth: int
    max_queue: int
    queued_bytes: int
    max_queued_bytes: int


class RoutingProviderRow(TypedDict):
    """One provider's prefix index in ``GET /status`` ``routing``."""

    index_blocks: int  # block hashes held (at most ``index_blocks_per_provider``)
    lookups: int  # lookups it was a candidate of
    hits: int  # of them, those where it held the prompt's first block at least
    hit_rate: float


class RoutingRow(TypedDict):
    """The cache-aware routing in ``GET /status`` (docs/routing.md)."""

    index_blocks: int  # over every provider
    index_blocks_per_provider: int  # provider_pool.routing.index_blocks
    index_bytes_per_block: int  # provider_pool.routing.block_bytes
    sessions: int  # session keys placed and remembered
    max_sessions: int
    providers: dict[str, RoutingProviderRow]
    decisions: dict[str, dict[str, int]]  # model group -> reason -> grants


class StatusDocument(TypedDict):
    """The admin ``GET /status`` document."""

    edge_id: str
    config_version: int
    config_revision: int  # ``edge.config_revision`` of this edge's config
    nodes: list[NodeRow]
    providers: list[ProviderRow]
    models: list[ModelRow]
    queue: QueueRow
    principals: list[PrincipalRow]
    limits_backend: BackendRow
    routing: RoutingRow


class RefreshReport(TypedDict):
    """The admin ``POST /refresh`` answer."""

    mode: str
    applied: bool
    changed_nodes: list[str]
    changed_providers: list[str]
    changed_models: list[str]
    restart_required: list[str]
    errors: list[str]
