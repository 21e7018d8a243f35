"""Fuzz: whatever the YAML, loading returns an EdgeConfig or raises ConfigError with
``path: reason`` lines, never anything else."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iopd.config.load import ConfigError, parse_edge_config, parse_node_config
from iopd.config.schema import EdgeConfig, NodeConfigFile
from tests.support.example_configs import filled_example
from tests.support.paths import ROOT

CONFIGS = ROOT / "configs"
VALID: dict[str, Any] = yaml.safe_load(filled_example("edge.yaml"))
ERROR_LINE = re.compile(r"^[^\n]+?: [^\n]+$")

KEYS = st.sampled_from(
    ["edge", "id", "nodes", "providers", "models", "type", "capacity", "openai", "x", "${A}"]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["${HOME}", "${NOPE}", "${X:-}", "${X:-3}", "${", "127.0.0.1:1", "echo"]),
)
TREES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(KEYS, st.text(max_size=8), st.integers()), children, max_size=4),
    ),
    max_leaves=25,
)


def assert_outcome(text: str, *, node: bool = False) -> None:
    parse = parse_node_config if node else parse_edge_config
    try:
        cfg = parse(text, env={"A": "1", "HOME": "/h"})
    except ConfigError as exc:
        assert exc.errors, "a ConfigError must name at least one problem"
        for err in exc.errors:
            assert isinstance(err, str)
            assert ERROR_LINE.match(err), err
    else:
        assert isinstance(cfg, NodeConfigFile if node else EdgeConfig)


def dump(data: Any) -> str:
    return yaml.safe_dump(data, allow_unicode=True)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(TREES)
def test_random_trees(tree: Any) -> None:
    text = dump(tree)
    assert_outcome(text)
    assert_outcome(text, node=True)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(["edge", "openai", "models", "nodes", "provider_pool"]), TREES))
def test_random_sections(tree: dict[str, Any]) -> None:
    assert_outcome(dump(tree))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    assert_outcome(text)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_random_bytes_decoded_leniently(raw: bytes) -> None:
    assert_outcome(raw.decode("latin-1"))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


ALL_PATHS = [p for p in _paths(VALID) if p]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(ALL_PATHS),
            st.sampled_from(["replace", "delete", "wrap", "dup"]),
            TREES,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mutations_of_a_valid_config(mutations: list[tuple[tuple[Any, ...], str, Any]]) -> None:
    data = copy.deepcopy(VALID)
    for path, op, value in mutations:
        parent: Any = data
        try:
            for key in path[:-1]:
                parent = parent[key]
            last = path[-1]
            current = parent[last]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, dict | list):
            continue  # an earlier mutation turned a container on the path into a scalar
        if op == "replace":
            parent[last] = value
        elif op == "delete":
            del parent[last]
        elif op == "wrap":
            parent[last] = [current]
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(current))
    assert_outcome(dump(data))


def test_unmutated_valid_config_loads() -> None:
    assert isinstance(parse_edge_config(dump(VALID), env={}), EdgeConfig)
