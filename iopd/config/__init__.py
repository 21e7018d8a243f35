"""Configuration: schema, loading, validation, catalog and refresh classification."""

from iopd.config.catalog import (
    Catalog,
    GroupSpec,
    ProviderRef,
    build_catalog,
    node_config_for,
    provider_spec_for,
)
from iopd.config.load import (
    ConfigError,
    load_any_config,
    load_edge_config,
    load_node_config,
    parse_any_config,
    parse_edge_config,
    parse_node_config,
)
from iopd.config.refresh_classify import RefreshDiff, classify
from iopd.config.rules import validate_edge_config, validate_node_config
from iopd.config.schema import EdgeConfig, NodeConfigFile, ProviderConfig

__all__ = [
    "Catalog",
    "ConfigError",
    "EdgeConfig",
    "GroupSpec",
    "NodeConfigFile",
    "ProviderConfig",
    "ProviderRef",
    "RefreshDiff",
    "build_catalog",
    "classify",
    "load_any_config",
    "load_edge_config",
    "load_node_config",
    "node_config_for",
    "parse_any_config",
    "parse_edge_config",
    "parse_node_config",
    "provider_spec_for",
    "validate_edge_config",
    "validate_node_config",
]
