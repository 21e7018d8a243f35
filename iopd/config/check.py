"""``iopd config check PATH``: validate an edge or node config and list every problem."""

from __future__ import annotations

from iopd.config.load import ConfigError, load_any_config
from iopd.config.schema import EdgeConfig

__all__ = ["check_main"]


def check_main(path: str) -> int:
    """Print ``OK: ...`` and return 0, or print each ``YAML.PATH: reason`` and return 1."""
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
    else:
        print(f"OK: node config {path} (node {cfg.node.id}, edge {cfg.node.edge})")
    return 0
