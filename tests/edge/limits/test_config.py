"""The ``limits:`` section: schema, validation (each rule with its exact message), refresh class."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from iopd.config import refresh_classify
from iopd.config.load import ConfigError, parse_edge_config
from iopd.config.refresh_classify import classify
from iopd.config.schema import EdgeConfig
from iopd.edge.principals.limiter import Limits, limits_from_config
from tests.support.validate_cases import BASE


def load(data: dict[str, Any]) -> EdgeConfig:
    return parse_edge_config(yaml.safe_dump(data), env={})


def with_limits(limits: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["limits"] = limits
    return data


def errors_of(limits: Any) -> list[str]:
    try:
        load(with_limits(limits))
    except ConfigError as exc:
        return exc.errors
    return []


CONTRACT = {
    "default": {
        "max_concurrent": 0,
        "requests_per_minute": 0,
        "tokens_per_minute": 0,
        "tokens_per_day": 0,
        "share": 1,
    },
    "principals": [
        {
            "principal_ref": "user-1",
            "max_concurrent": 8,
            "requests_per_minute": 600,
            "tokens_per_minute": 200000,
            "tokens_per_day": 5000000,
            "share": 2,
        }
    ],
}


def test_the_issue_example_is_valid_and_resolves() -> None:
    cfg = load(with_limits(CONTRACT))
    default, principals = limits_from_config(cfg.limits)
    assert default == Limits()
    assert principals == {"user-1": Limits(8, 600, 200000, 5000000, 2)}


def test_no_limits_section_means_unlimited() -> None:
    default, principals = limits_from_config(load(copy.deepcopy(BASE)).limits)
    assert default == Limits(0, 0, 0, 0, 1) and principals == {}


def test_a_left_out_principal_key_takes_the_default() -> None:
    cfg = load(
        with_limits(
            {
                "default": {"requests_per_minute": 60, "tokens_per_day": 1000, "share": 3},
                "principals": [{"principal_ref": "user-1", "tokens_per_day": 0}],
            }
        )
    )
    _, principals = limits_from_config(cfg.limits)
    assert principals["user-1"] == Limits(0, 60, 0, 0, 3)


CASES: list[tuple[str, Any, str]] = [
    (
        "negative default",
        {"default": {"tokens_per_minute": -1}},
        "limits.default.tokens_per_minute: must be >= 0 (got -1)",
    ),
    ("share 0", {"default": {"share": 0}}, "limits.default.share: must be >= 1 (got 0)"),
    (
        "negative principal value",
        {"principals": [{"principal_ref": "user-1", "max_concurrent": -2}]},
        "limits.principals[0].max_concurrent: must be >= 0 (got -2)",
    ),
    (
        "principal share 0",
        {"principals": [{"principal_ref": "user-1", "share": 0}]},
        "limits.principals[0].share: must be >= 1 (got 0)",
    ),
    (
        "unknown principal",
        {"principals": [{"principal_ref": "team-x"}]},
        "limits.principals[0].principal_ref: unknown principal 'team-x': no "
        "openai.principal_tokens[] entry has this principal_ref (callers without a "
        "principal get limits.default)",
    ),
    (
        "duplicate principal",
        {"principals": [{"principal_ref": "user-1"}, {"principal_ref": "user-1", "share": 2}]},
        "limits.principals[1].principal_ref: duplicate principal_ref 'user-1' (first at limits.principals[0])",
    ),
    (
        "empty principal",
        {"principals": [{"principal_ref": " "}]},
        "limits.principals[0].principal_ref: must not be empty",
    ),
]


@pytest.mark.parametrize(("limits", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(limits: Any, expected: str) -> None:
    assert errors_of(limits) == [expected]


def test_every_problem_at_once_in_file_order() -> None:
    errors = errors_of(
        {
            "default": {"requests_per_minute": -1, "share": 0},
            "principals": [
                {"principal_ref": "nobody", "tokens_per_day": -5},
                {"principal_ref": "user-1", "share": 0},
            ],
        }
    )
    assert errors == [
        "limits.default.requests_per_minute: must be >= 0 (got -1)",
        "limits.default.share: must be >= 1 (got 0)",
        "limits.principals[0].principal_ref: unknown principal 'nobody': no "
        "openai.principal_tokens[] entry has this principal_ref (callers without a "
        "principal get limits.default)",
        "limits.principals[0].tokens_per_day: must be >= 0 (got -5)",
        "limits.principals[1].share: must be >= 1 (got 0)",
    ]


@pytest.mark.parametrize(
    ("limits", "fragment"),
    [
        ({"default": {"tokens_per_day": 1.5}}, "limits.default.tokens_per_day"),
        ({"default": {"share": True}}, "limits.default.share"),
        ({"default": {"burst": 3}}, "limits.default"),
        ({"principals": [{"max_concurrent": 1}]}, "limits.principals[0]"),
        ({"principals": [{"principal_ref": "user-1", "rpm": 1}]}, "limits.principals[0]"),
    ],
)
def test_structure_errors_name_the_path(limits: Any, fragment: str) -> None:
    errors = errors_of(limits)
    assert len(errors) == 1 and errors[0].startswith(fragment), errors


@pytest.mark.parametrize(
    "change",
    [
        {"default": {"requests_per_minute": 5}},
        {"default": {"share": 4}},
        {"principals": [{"principal_ref": "user-1", "tokens_per_day": 10}]},
        CONTRACT,
    ],
)
def test_every_limits_change_is_live(change: Any) -> None:
    old = load(copy.deepcopy(BASE))
    diff = classify(old, load(with_limits(change)))
    assert diff.live_ok and diff.restart_required == []
    assert classify(load(with_limits(change)), old).live_ok


def test_an_unclassified_top_level_section_is_restart_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A top-level section not declared live is never applied live by accident."""
    monkeypatch.setattr(refresh_classify, "LIVE_SECTIONS", frozenset({"provider_pool"}))
    old = load(copy.deepcopy(BASE))
    diff = classify(old, load(with_limits({"default": {"share": 2}})))
    assert diff.restart_required == ["limits"]
