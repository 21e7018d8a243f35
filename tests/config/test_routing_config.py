"""Config of the cache-aware routing: models[].routing and provider_pool.routing,
their bounds (each error names its key) and what reaches the pool."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from iopd.config.catalog import build_catalog
from iopd.config.load import parse_edge_config
from iopd.config.schema import PoolRouting
from iopd.edge.pool.routing import RoutingPolicy
from iopd.edge.runtime.pool_config import pool_snapshot
from tests.support.validate_cases import BASE, Mutation, errors_of


def routing_set(key: str, value: object) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        d["provider_pool"] = {"routing": {key: value}}

    return mutate


def test_the_schema_and_the_pool_agree_on_the_defaults() -> None:
    schema = PoolRouting()
    policy = RoutingPolicy()
    for name in PoolRouting.__struct_fields__:
        assert getattr(schema, name) == getattr(policy, name), name


def test_valid_settings_pass_and_reach_the_pool() -> None:
    data = copy.deepcopy(BASE)
    data["provider_pool"] = {"routing": {"block_bytes": 256, "min_match": 1, "index_blocks": 0}}
    data["models"][0]["routing"] = "least_load"
    assert errors_of(lambda d: None, data) == []
    cfg = parse_edge_config(yaml.safe_dump(data), env={})
    snap = pool_snapshot(cfg, build_catalog(cfg))
    assert snap.routing.block_bytes == 256 and snap.routing.index_blocks == 0
    assert snap.groups[data["models"][0]["id"]].routing == "least_load"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            routing_set("block_bytes", 8),
            "provider_pool.routing.block_bytes: must be in 64..65536 (got 8)",
        ),
        (
            routing_set("max_prompt_bytes", -1),
            "provider_pool.routing.max_prompt_bytes: must be in 0..16777216 (got -1)",
        ),
        (
            routing_set("index_blocks", 10**9),
            "provider_pool.routing.index_blocks: must be in 0..10000000 (got 1000000000)",
        ),
        (
            routing_set("min_match", 0),
            "provider_pool.routing.min_match: must be > 0 and <= 1 (got 0.0)",
        ),
        (
            routing_set("max_load_gap", float("inf")),
            "provider_pool.routing.max_load_gap: must be a finite number >= 0 (got inf)",
        ),
        (
            routing_set("prefill_tokens_per_second", 0),
            "provider_pool.routing.prefill_tokens_per_second: must be a finite number > 0 (got 0.0)",
        ),
    ],
)
def test_routing_rule(mutate: Mutation, expected: str) -> None:
    assert errors_of(mutate) == [expected]


def test_too_many_blocks_per_request_is_refused() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["provider_pool"] = {"routing": {"block_bytes": 64, "max_prompt_bytes": 64 * 20000}}

    assert errors_of(mutate) == [
        "provider_pool.routing.max_prompt_bytes: at most 16384 blocks of block_bytes "
        "per request (got 20000)"
    ]


def test_an_unknown_policy_names_its_key() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["models"][0]["routing"] = "random"

    (error,) = errors_of(mutate)
    assert error.startswith("models[0].routing:")
