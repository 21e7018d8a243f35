"""The model catalog: which model groups exist, in which order, and where providers live.

Pure and immutable, built once per config (at start and on every refresh)
and shared by the OpenAI surface, the pool and the admin API.  The legacy
forms (docs/configuration.md, "Legacy forms and resolution order") are
normalised here and nowhere else: each
``openai.model_routes[]`` entry becomes a one-provider group (source
``"route"``), and the single ``openai.adapter`` + ``openai.target`` form
becomes a ``fallback`` group that catches every model not otherwise resolved.

That catch-all is unrelated to ``models[].fallbacks``: the groups a request
is sent to when its own group cannot take it.  ``Catalog.fallback_chain``
gives those, transitively, in the order they are tried.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from iopd.config.provider_url import HTTP_PROVIDER_TYPES, provider_root
from iopd.config.schema import EdgeConfig, Generation, ProviderConfig
from wire.messages import NodeConfig, ProviderSpec

__all__ = [
    "Catalog",
    "GroupSource",
    "GroupSpec",
    "ProviderRef",
    "build_catalog",
    "node_config_for",
    "provider_spec_for",
]

GroupSource = Literal["models", "route", "fallback"]

_SPEC_FIELDS: tuple[str, ...] = ProviderSpec.__struct_fields__


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One model group: the providers (``(provider_id, served_name)``) a model maps to."""

    id: str
    providers: tuple[tuple[str, str], ...]
    queue_timeout: float | None = None  # None = provider_pool.queue_timeout
    generation: Generation = field(default_factory=Generation)
    source: GroupSource = "models"
    fallbacks: tuple[str, ...] = ()  # models[].fallbacks as written
    fallback_on_queue_timeout: bool = False
    routing: Literal["prefix", "least_load"] = "prefix"  # models[].routing


@dataclass(frozen=True, slots=True)
class ProviderRef:
    """Where a provider lives (its node) and its settings."""

    node_id: str
    config: ProviderConfig


@dataclass(frozen=True, slots=True)
class Catalog:
    """Model groups in resolution order, the optional fallback, and every provider by id."""

    groups: Mapping[str, GroupSpec]
    fallback: GroupSpec | None
    providers: Mapping[str, ProviderRef]
    fallback_chains: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def resolve(self, model: str) -> GroupSpec | None:
        """The group a request's ``model`` maps to: models[], legacy routes, then the fallback."""
        group = self.groups.get(model)
        if group is not None:
            return group
        return self.fallback

    def group(self, group_id: str) -> GroupSpec | None:
        """The group with exactly this id (the fallback included), without falling back."""
        group = self.groups.get(group_id)
        if group is None and self.fallback is not None and self.fallback.id == group_id:
            return self.fallback
        return group

    def fallback_chain(self, group_id: str) -> tuple[str, ...]:
        """The groups tried, in order, when group ``group_id`` cannot take a request.

        Its ``fallbacks``, each followed by that group's own chain (depth
        first), every group at most once and never ``group_id`` itself; ids
        that are not groups are skipped.  Empty for a group without fallbacks.
        """
        return self.fallback_chains.get(group_id, ())

    def listed(self) -> list[GroupSpec]:
        """Groups as ``/v1/models`` lists them: models[], routes, fallback; no duplicates."""
        out = list(self.groups.values())
        if self.fallback is not None and self.fallback.id not in self.groups:
            out.append(self.fallback)
        return out

    def has_type(self, group_id: str, provider_type: str) -> bool:
        """True when group ``group_id`` has at least one provider of ``provider_type``."""
        group = self.group(group_id)
        if group is None:
            return False
        for provider_id, _served in group.providers:
            ref = self.providers.get(provider_id)
            if ref is not None and ref.config.type == provider_type:
                return True
        return False


def build_catalog(cfg: EdgeConfig) -> Catalog:
    """The catalog of a (validated) edge config."""
    providers: dict[str, ProviderRef] = {}
    for node in cfg.nodes:
        for p in node.providers:
            providers.setdefault(p.id, ProviderRef(node_id=node.id, config=p))

    groups: dict[str, GroupSpec] = {}
    for m in cfg.models:
        if m.id in groups:
            continue
        groups[m.id] = GroupSpec(
            id=m.id,
            providers=tuple(m.providers.items()),
            queue_timeout=None,
            generation=m.generation,
            source="models",
            fallbacks=tuple(m.fallbacks),
            fallback_on_queue_timeout=m.fallback_on_queue_timeout,
            routing=m.routing,
        )
    for route in cfg.openai.model_routes:
        if route.model in groups:
            continue  # models[] wins: it comes first in resolution order
        groups[route.model] = GroupSpec(
            id=route.model,
            providers=((route.adapter, route.target),),
            queue_timeout=route.queue_timeout,
            generation=Generation(),
            source="route",
        )

    fallback: GroupSpec | None = None
    o = cfg.openai
    if o.adapter is not None and o.target is not None:
        fallback = GroupSpec(
            id=o.target,
            providers=((o.adapter, o.target),),
            queue_timeout=None,
            generation=Generation(),
            source="fallback",
        )
    known = set(groups) | ({fallback.id} if fallback is not None else set())
    chains = {
        gid: chain
        for gid, group in groups.items()
        if group.fallbacks and (chain := _fallback_chain(gid, groups, known))
    }
    return Catalog(
        groups=MappingProxyType(groups),
        fallback=fallback,
        providers=MappingProxyType(providers),
        fallback_chains=MappingProxyType(chains),
    )


def _fallback_chain(
    origin: str, groups: Mapping[str, GroupSpec], known: set[str]
) -> tuple[str, ...]:
    """Depth-first order of ``origin``'s fallbacks; safe on cycles (validation forbids them)."""
    chain: list[str] = []
    seen = {origin}
    stack = list(reversed(groups[origin].fallbacks))
    while stack:
        gid = stack.pop()
        if gid in seen or gid not in known:
            continue
        seen.add(gid)
        chain.append(gid)
        spec = groups.get(gid)
        if spec is not None:
            stack.extend(reversed(spec.fallbacks))
    return tuple(chain)


def provider_spec_for(p: ProviderConfig) -> ProviderSpec:
    """The node's view of a provider: the adapter settings, no edge-only policy."""
    values: dict[str, object] = {name: getattr(p, name) for name in _SPEC_FIELDS}
    if p.base_url and p.type in HTTP_PROVIDER_TYPES:
        # The node joins request paths to the root: ``.../v1`` in the config is not doubled.
        values["base_url"] = provider_root(p.type, p.base_url)
    # Copy lists so the pushed message never aliases the running config.  (Any:
    # the keyword arguments of ProviderSpec, each field of its own type.)
    copied: dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in values.items()}
    return ProviderSpec(**copied)


def node_config_for(cfg: EdgeConfig, node_id: str, version: int, stream_id: int = 0) -> NodeConfig:
    """The ``NodeConfig`` push for node ``node_id``; raises ``KeyError`` for an unknown node."""
    for node in cfg.nodes:
        if node.id == node_id:
            return NodeConfig(
                stream_id=stream_id,
                version=version,
                providers=[provider_spec_for(p) for p in node.providers],
                revision=cfg.edge.config_revision,
            )
    raise KeyError(node_id)
