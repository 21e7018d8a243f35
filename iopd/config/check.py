"""``iopd config check PATH``: validate an edge or node config and list every problem."""

from __future__ import annotations

from iopd.config.load import ConfigError, load_any_config
from iopd.config.provider_url import HTTP_PROVIDER_TYPES, request_url
from iopd.config.schema import EdgeConfig, ProviderConfig, node_edge_addresses

__all__ = ["check_main"]


def _where_it_goes(p: ProviderConfig) -> str:
    """What a provider's requests reach, as the node will do it (no secrets)."""
    if p.type in HTTP_PROVIDER_TYPES and p.base_url:
        return f"requests go to {request_url(p.type, p.base_url)}"
    if p.type == "cli" and p.command:
        return f"runs {p.command[0]}"
    return "answered inside the node"


def check_main(path: str) -> int:
    """Print ``OK: ...`` and a line per provider and return 0, or print each
    ``YAML.PATH: reason`` and return 1."""
    try:
        cfg = load_any_config(path)
    except ConfigError as exc:
        print(f"{path}: {len(exc.errors)} problem{'s' if len(exc.errors) != 1 else ''} found")
        for line in exc.errors:
            print(line)
        return 1
    if isinstance(cfg, EdgeConfig):
        n_nodes = len(cfg.nodes)
        n_providers = sum(len(n.providers) for n in cfg.nodes)
        n_groups = len(cfg.models)
        print(
            f"OK: edge config {path} ({n_nodes} node{'s' if n_nodes != 1 else ''}, "
            f"{n_providers} provider{'s' if n_providers != 1 else ''}, "
            f"{n_groups} model group{'s' if n_groups != 1 else ''})"
        )
        for node in cfg.nodes:
            for p in node.providers:
                print(f"provider {p.id} ({p.type}): {_where_it_goes(p)}")
    else:
        edges = ", ".join(node_edge_addresses(cfg.node))
        print(f"OK: node config {path} (node {cfg.node.id}, edges {edges})")
    return 0
