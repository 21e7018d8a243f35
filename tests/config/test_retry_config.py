"""Config of retries, outlier ejection and fallback groups: schema, validation, catalog, refresh."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from iopd.config.catalog import Catalog, build_catalog
from iopd.config.schema import ModelGroup, ProviderPoolSection
from tests.support.refresh_cases import BASE as REFRESH_BASE
from tests.support.refresh_cases import diff_of, load
from tests.support.validate_cases import BASE, Mutation, errors_of


def with_groups(*groups: dict[str, Any]) -> dict[str, Any]:
    """BASE with these model groups (each on provider echo-b unless it says otherwise)."""
    data = copy.deepcopy(BASE)
    data["models"] = [{"providers": {"echo-b": "echo"}, **g} for g in groups]
    return data


def test_defaults_are_the_contract() -> None:
    pool = ProviderPoolSection()
    assert (pool.retry_attempts, pool.retry_budget, pool.retry_budget_min) == (2, 0.2, 10)
    assert pool.retry_on_timeout is False
    assert (pool.eject_after_failures, pool.eject_seconds) == (5, 30.0)
    group = ModelGroup(id="g", providers={"p": "m"})
    assert group.fallbacks == [] and group.fallback_on_queue_timeout is False


def test_valid_settings_pass() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["provider_pool"] = {
            "retry_attempts": 0,
            "retry_budget": 0,
            "retry_budget_min": 0,
            "retry_on_timeout": True,
            "eject_after_failures": 0,
            "eject_seconds": 86400,
        }

    assert errors_of(mutate) == []
    data = with_groups(
        {"id": "a", "fallbacks": ["b", "c"], "fallback_on_queue_timeout": True},
        {"id": "b", "fallbacks": ["c"]},
        {"id": "c"},
    )
    assert errors_of(lambda d: None, data) == []


def pool_set(key: str, value: object) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        d["provider_pool"] = {key: value}

    return mutate


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (pool_set("retry_attempts", -1), "provider_pool.retry_attempts: must be >= 0 (got -1)"),
        (
            pool_set("retry_budget", -0.5),
            "provider_pool.retry_budget: must be a finite number >= 0 (got -0.5)",
        ),
        (
            pool_set("retry_budget", float("inf")),
            "provider_pool.retry_budget: must be a finite number >= 0 (got inf)",
        ),
        (
            pool_set("retry_budget", float("nan")),
            "provider_pool.retry_budget: must be a finite number >= 0 (got nan)",
        ),
        (pool_set("retry_budget_min", -1), "provider_pool.retry_budget_min: must be >= 0 (got -1)"),
        (
            pool_set("eject_after_failures", -2),
            "provider_pool.eject_after_failures: must be >= 0 (got -2)",
        ),
        (
            pool_set("eject_seconds", 0),
            "provider_pool.eject_seconds: must be > 0 and at most 86400 (a day) (got 0.0)",
        ),
        (
            pool_set("eject_seconds", 86401),
            "provider_pool.eject_seconds: must be > 0 and at most 86400 (a day) (got 86401.0)",
        ),
        (
            pool_set("eject_seconds", float("nan")),
            "provider_pool.eject_seconds: must be > 0 and at most 86400 (a day) (got nan)",
        ),
    ],
)
def test_pool_rule(mutate: Mutation, expected: str) -> None:
    assert errors_of(mutate) == [expected]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("retry_attempts", 1.5),
        ("retry_attempts", True),
        ("retry_on_timeout", "yes"),
        ("eject_after_failures", "5"),
        ("eject_seconds", "30"),
    ],
)
def test_pool_types_are_checked(key: str, value: object) -> None:
    errors = errors_of(pool_set(key, value))
    assert len(errors) == 1 and errors[0].startswith(f"provider_pool.{key}: ")


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        (
            [{"id": "a", "fallbacks": ["nope"]}],
            ["models[0].fallbacks[0]: model group 'nope' is not defined"],
        ),
        (
            [{"id": "a", "fallbacks": ["a"]}],
            ["models[0].fallbacks[0]: model group 'a' cannot fall back to itself"],
        ),
        (
            [{"id": "a", "fallbacks": ["b", "b"]}, {"id": "b"}],
            [
                "models[0].fallbacks[1]: model group 'b' is listed twice (first at models[0].fallbacks[0])"
            ],
        ),
        (
            [{"id": "a", "fallbacks": ["b"]}, {"id": "b", "fallbacks": ["a"]}],
            ["models[1].fallbacks[0]: fallback cycle: 'a' -> 'b' -> 'a'"],
        ),
        (
            [
                {"id": "a", "fallbacks": ["b"]},
                {"id": "b", "fallbacks": ["c"]},
                {"id": "c", "fallbacks": ["d", "b"]},
                {"id": "d"},
            ],
            ["models[2].fallbacks[1]: fallback cycle: 'b' -> 'c' -> 'b'"],
        ),
        (
            # Two separate cycles are both reported, each once.
            [
                {"id": "a", "fallbacks": ["b"]},
                {"id": "b", "fallbacks": ["a"]},
                {"id": "c", "fallbacks": ["d"]},
                {"id": "d", "fallbacks": ["c"]},
            ],
            [
                "models[1].fallbacks[0]: fallback cycle: 'a' -> 'b' -> 'a'",
                "models[3].fallbacks[0]: fallback cycle: 'c' -> 'd' -> 'c'",
            ],
        ),
        (
            # A cycle reached from a group outside it is named from where it closes.
            [
                {"id": "x", "fallbacks": ["a"]},
                {"id": "a", "fallbacks": ["b"]},
                {"id": "b", "fallbacks": ["c"]},
                {"id": "c", "fallbacks": ["a"]},
            ],
            ["models[3].fallbacks[0]: fallback cycle: 'a' -> 'b' -> 'c' -> 'a'"],
        ),
    ],
    ids=["unknown", "self", "twice", "two-cycle", "inner-cycle", "two-cycles", "tail-cycle"],
)
def test_fallback_rule(groups: list[dict[str, Any]], expected: list[str]) -> None:
    assert errors_of(lambda d: None, with_groups(*groups)) == expected


def test_diamond_is_not_a_cycle() -> None:
    data = with_groups(
        {"id": "a", "fallbacks": ["b", "c"]},
        {"id": "b", "fallbacks": ["d"]},
        {"id": "c", "fallbacks": ["d"]},
        {"id": "d"},
    )
    assert errors_of(lambda d: None, data) == []


def test_long_chain_is_checked_without_recursion() -> None:
    n = 3000  # deeper than Python's default recursion limit
    groups = [{"id": f"g{i}", "fallbacks": [f"g{i + 1}"]} for i in range(n)]
    groups.append({"id": f"g{n}", "fallbacks": ["g0"]})
    errors = errors_of(lambda d: None, with_groups(*groups))
    assert len(errors) == 1
    assert errors[0].startswith(f"models[{n}].fallbacks[0]: fallback cycle: 'g0' -> 'g1' -> ")
    assert errors[0].endswith(f"'g{n}' -> 'g0'")


def test_fallback_may_name_legacy_groups() -> None:
    data = with_groups({"id": "a", "fallbacks": ["r1", "echo"]})
    data["openai"]["model_routes"] = [
        {"model": "r1", "node": "node-b", "adapter": "echo-b", "target": "echo"}
    ]
    data["openai"]["adapter"] = "echo-b"
    data["openai"]["target"] = "echo"
    assert errors_of(lambda d: None, data) == []
    del data["openai"]["adapter"], data["openai"]["target"]
    assert errors_of(lambda d: None, data) == [
        "models[0].fallbacks[1]: model group 'echo' is not defined"
    ]


# ------------------------------------------------------------------ catalog


def catalog_of(*groups: dict[str, Any]) -> Catalog:
    return build_catalog(load({**copy.deepcopy(REFRESH_BASE), "models": list(groups)}))


def g(gid: str, *fallbacks: str, on_timeout: bool = False) -> dict[str, Any]:
    return {
        "id": gid,
        "providers": {"echo-b": "echo"},
        "fallbacks": list(fallbacks),
        "fallback_on_queue_timeout": on_timeout,
    }


def test_catalog_carries_fallbacks_and_flag() -> None:
    cat = catalog_of(g("a", "b", on_timeout=True), g("b"))
    a, b = cat.group("a"), cat.group("b")
    assert a is not None and b is not None
    assert a.fallbacks == ("b",) and a.fallback_on_queue_timeout is True
    assert b.fallbacks == () and b.fallback_on_queue_timeout is False


def test_fallback_chain_is_depth_first_without_repeats() -> None:
    cat = catalog_of(
        g("a", "b", "c"),
        g("b", "d", "c"),
        g("c", "e"),
        g("d"),
        g("e"),
    )
    assert cat.fallback_chain("a") == ("b", "d", "c", "e")
    assert cat.fallback_chain("b") == ("d", "c", "e")
    assert cat.fallback_chain("d") == ()
    assert cat.fallback_chain("unknown") == ()


def test_fallback_chain_reaches_legacy_routes() -> None:
    cat = catalog_of(g("a", "r1"))
    assert cat.fallback_chain("a") == ("r1",)
    route = cat.group("r1")
    assert route is not None and route.source == "route"


def test_fallback_chain_survives_an_unvalidated_cycle() -> None:
    """build_catalog runs on validated configs, but must not loop on a bad one."""
    groups = [
        ModelGroup(id="a", providers={"echo-b": "echo"}, fallbacks=["b", "ghost", "a"]),
        ModelGroup(id="b", providers={"echo-b": "echo"}, fallbacks=["a"]),
    ]
    cat = build_catalog(msgspec.structs.replace(load(copy.deepcopy(REFRESH_BASE)), models=groups))
    assert cat.fallback_chain("a") == ("b",)
    assert cat.fallback_chain("b") == ("a",)


# ------------------------------------------------------------------ refresh


@pytest.mark.parametrize(
    "key",
    [
        "retry_attempts",
        "retry_budget",
        "retry_budget_min",
        "retry_on_timeout",
        "eject_after_failures",
        "eject_seconds",
    ],
)
def test_pool_keys_are_live(key: str) -> None:
    value = {"retry_on_timeout": True}.get(key, 7)
    diff = diff_of(lambda d: d.setdefault("provider_pool", {}).__setitem__(key, value))
    assert diff.live_ok and diff.restart_required == []


@pytest.mark.parametrize(
    ("key", "value"), [("fallbacks", ["g2"]), ("fallback_on_queue_timeout", True)]
)
def test_group_keys_are_live_and_name_the_group(key: str, value: object) -> None:
    diff = diff_of(lambda d: d["models"][0].__setitem__(key, value))
    assert diff.live_ok and diff.changed_models == ["g1"]
