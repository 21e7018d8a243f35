"""Classify a config refresh: what may change live and what needs a restart.

Pure: two validated ``EdgeConfig``s in, a ``RefreshDiff`` out.  Providers
and nodes are compared by id, never by list position, so reordering a list
is not a change.  Restart-required changes are reported as YAML paths of the
*new* config (``nodes[0].providers[1].base_url``); an embedded node that was
added or removed is named by id (``nodes[node-a]``), since it has no index in
one of the two files.  Nodes and providers added or removed, principal tokens
and node verifiers are live.  Values are never part of the report, so secrets
never leak into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from iopd.config.schema import EdgeConfig, NodeEntry, ProviderConfig

__all__ = [
    "LIVE_EDGE_KEYS",
    "LIVE_NODE_KEYS",
    "LIVE_OPENAI_KEYS",
    "LIVE_PROVIDER_KEYS",
    "LIVE_SECTIONS",
    "RESTART_LIMITS_KEYS",
    "RefreshDiff",
    "classify",
]

#: Provider keys a refresh applies without a restart.  The rest name the
#: server an id stands for (its pool state, health and ejection are kept
#: under the id): a provider with a new id is added and removed live instead.
LIVE_PROVIDER_KEYS: frozenset[str] = frozenset(
    {"id", "capacity", "long_context_capacity", "priority", "enabled", "models"}
)
#: ``nodes[].*`` keys a refresh applies without a restart.  A node added or
#: removed is live too, unless it is (or was) ``embedded``: the embedded
#: nodes run in the edge's process from its start.
LIVE_NODE_KEYS: frozenset[str] = frozenset(
    {"id", "token_verifier", "token_hash_sha256", "alias", "providers"}
)
#: ``edge.*`` keys a refresh applies without a restart (read per request).
LIVE_EDGE_KEYS: frozenset[str] = frozenset({"admin_token_hash_sha256", "config_revision"})
#: ``openai.*`` keys a refresh applies without a restart.
LIVE_OPENAI_KEYS: frozenset[str] = frozenset(
    {
        "long_context_threshold_tokens",
        "strict_output",
        "strict_output_instruction",
        "forward_headers",
        "cors_allow_origins",
        "principal_tokens",
        "bearer_token",
        "unsupported_tools",
        "session_header",
    }
)
#: Top-level sections a refresh applies live as a whole; a change needs no entry in the report.
LIVE_SECTIONS: frozenset[str] = frozenset({"provider_pool", "limits"})
#: ``limits.*`` keys of the store every edge shares: the rest of ``limits`` is live.
RESTART_LIMITS_KEYS: tuple[str, ...] = (
    "backend",
    "redis_url",
    "on_backend_error",
    "backend_timeout",
    "lease_ttl",
)
#: Top-level sections compared key by key below.
_COMPARED_SECTIONS = frozenset({"edge", "openai", "nodes", "models"})
#: ``openai.*`` keys reported as a whole rather than field by field.
_OPENAI_WHOLE = frozenset({"model_routes"})


@dataclass
class RefreshDiff:
    """What a refresh changes. Every list is always present and in a deterministic order."""

    changed_nodes: list[str] = field(default_factory=list)
    changed_providers: list[str] = field(default_factory=list)
    changed_models: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)
    #: Nodes new in the config (also in ``changed_nodes``): admitted at their next handshake.
    added_nodes: list[str] = field(default_factory=list)
    #: Nodes gone from the config (also in ``changed_nodes``): their sessions are retired.
    removed_nodes: list[str] = field(default_factory=list)
    #: Nodes whose ``token_verifier``/``token_hash_sha256`` changed: the new
    #: one is checked at the node's next handshake.
    verifier_changed: list[str] = field(default_factory=list)

    @property
    def live_ok(self) -> bool:
        """True when the refresh can be applied without a restart."""
        return not self.restart_required

    @property
    def is_empty(self) -> bool:
        """True when nothing at all changed."""
        return not (
            self.changed_nodes
            or self.changed_providers
            or self.changed_models
            or self.restart_required
        )


def _struct_diff(old: msgspec.Struct, new: msgspec.Struct, path: str, out: list[str]) -> None:
    """Append ``path.field`` for every differing field, descending into sub-sections."""
    for name in new.__struct_fields__:
        a: object = getattr(old, name)
        b: object = getattr(new, name)
        if a == b:
            continue
        if isinstance(a, msgspec.Struct) and isinstance(b, msgspec.Struct):
            _struct_diff(a, b, f"{path}.{name}", out)
        else:
            out.append(f"{path}.{name}")


def _provider_diff(
    old: ProviderConfig, new: ProviderConfig, path: str, restart: list[str]
) -> bool:
    """Record restart-required fields of one provider; True when a live field changed."""
    live_changed = False
    for name in new.__struct_fields__:
        if getattr(old, name) == getattr(new, name):
            continue
        if name in LIVE_PROVIDER_KEYS:
            live_changed = True
        else:
            restart.append(f"{path}.{name}")
    return live_changed


def _node_diff(
    old: NodeEntry,
    new: NodeEntry,
    path: str,
    restart: list[str],
    changed_providers: set[str],
) -> bool:
    """Compare one node present in both configs; True when its providers changed
    (live: the node gets a new ``NodeConfig``, built from its whole provider list)."""
    if old.embedded != new.embedded:
        restart.append(f"{path}.embedded")
    old_providers = {p.id: p for p in old.providers}
    new_ids = {p.id for p in new.providers}
    live = False
    for j, p in enumerate(new.providers):
        before = old_providers.get(p.id)
        if before is None or _provider_diff(before, p, f"{path}.providers[{j}]", restart):
            changed_providers.add(p.id)
            live = True
    for p in old.providers:
        if p.id not in new_ids:
            changed_providers.add(p.id)
            live = True
    return live


def classify(old: EdgeConfig, new: EdgeConfig) -> RefreshDiff:
    """Compare the running config ``old`` with the reloaded ``new``."""
    restart: list[str] = []

    edge_changes: list[str] = []
    _struct_diff(old.edge, new.edge, "edge", edge_changes)
    restart += [p for p in edge_changes if p.split(".")[1] not in LIVE_EDGE_KEYS]

    for name in new.openai.__struct_fields__:
        if name in LIVE_OPENAI_KEYS:
            continue
        a: object = getattr(old.openai, name)
        b: object = getattr(new.openai, name)
        if a == b:
            continue
        if isinstance(a, msgspec.Struct) and isinstance(b, msgspec.Struct):
            _struct_diff(a, b, f"openai.{name}", restart)
        else:
            restart.append(f"openai.{name}")

    restart += [
        f"limits.{name}"
        for name in RESTART_LIMITS_KEYS
        if getattr(old.limits, name) != getattr(new.limits, name)
    ]

    # A top-level section neither compared here nor declared live is restart-required
    # as a whole, so a new section is never applied live by accident.
    for name in new.__struct_fields__:
        if name in _COMPARED_SECTIONS or name in LIVE_SECTIONS:
            continue
        if getattr(old, name) != getattr(new, name):
            restart.append(name)

    changed_providers: set[str] = set()
    changed_nodes: set[str] = set()
    old_nodes = {n.id: n for n in old.nodes}
    new_nodes = {n.id: n for n in new.nodes}
    added = [n.id for n in new.nodes if n.id not in old_nodes]
    removed = [n.id for n in old.nodes if n.id not in new_nodes]
    # An embedded node runs in the edge's process from its start.
    restart += [f"nodes[{nid}]" for nid in added if new_nodes[nid].embedded]
    restart += [f"nodes[{nid}]" for nid in removed if old_nodes[nid].embedded]
    verifier_changed: list[str] = []
    for i, node in enumerate(new.nodes):
        before = old_nodes.get(node.id)
        if before is None:
            continue
        if (before.token_verifier, before.token_hash_sha256) != (
            node.token_verifier,
            node.token_hash_sha256,
        ):
            verifier_changed.append(node.id)
        if _node_diff(before, node, f"nodes[{i}]", restart, changed_providers):
            changed_nodes.add(node.id)
    changed_providers.update(p.id for nid in added for p in new_nodes[nid].providers)
    changed_providers.update(p.id for nid in removed for p in old_nodes[nid].providers)
    if old.edge.config_revision != new.edge.config_revision:
        # A new revision is pushed to every node, changed or not: each node
        # applies the highest revision it has seen (several edges).
        changed_nodes.update(n.id for n in new.nodes if n.id in old_nodes)

    old_groups = {m.id: m for m in old.models}
    new_groups = {m.id: m for m in new.models}
    changed_models = {
        gid
        for gid in old_groups.keys() | new_groups.keys()
        if old_groups.get(gid) != new_groups.get(gid)
    }

    changed_nodes.update(added, removed)
    return RefreshDiff(
        changed_nodes=sorted(changed_nodes),
        changed_providers=sorted(changed_providers),
        changed_models=sorted(changed_models),
        restart_required=list(dict.fromkeys(restart)),
        added_nodes=sorted(added),
        removed_nodes=sorted(removed),
        verifier_changed=sorted(verifier_changed),
    )
