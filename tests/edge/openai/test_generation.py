"""Generation policy: defaults and caps on the normalized path, 400 on passthrough."""

from __future__ import annotations

from typing import Any

import pytest

from iopd.config.schema import Generation
from iopd.edge.openai.generation import apply_generation
from iopd.errors import InvalidRequest

POLICY = Generation(
    defaults={"temperature": 0.7, "top_p": 0.9},
    limits={"max_tokens": 8192, "temperature": 1.5},
)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # defaults fill what is missing (or null); the caller's value wins
        ({}, {"temperature": 0.7, "top_p": 0.9}),
        ({"temperature": 0.2}, {"temperature": 0.2, "top_p": 0.9}),
        ({"temperature": None}, {"temperature": 0.7, "top_p": 0.9}),
        # limits cap what is given, and never add a field
        ({"max_tokens": 100000}, {"max_tokens": 8192, "temperature": 0.7, "top_p": 0.9}),
        ({"max_tokens": 10}, {"max_tokens": 10, "temperature": 0.7, "top_p": 0.9}),
        ({"temperature": 2}, {"temperature": 1.5, "top_p": 0.9}),
        # max_completion_tokens is max_tokens under another name
        (
            {"max_completion_tokens": 99999},
            {"max_completion_tokens": 8192, "temperature": 0.7, "top_p": 0.9},
        ),
        # unrelated fields are kept
        ({"stop": ["\n"], "top_p": 1}, {"stop": ["\n"], "top_p": 1, "temperature": 0.7}),
    ],
)
def test_normalized(params: dict[str, Any], expected: dict[str, Any]) -> None:
    before = dict(params)
    assert apply_generation(params, POLICY, passthrough=False) == expected
    assert params == before  # a new dict; the request is not mutated


def test_normalized_caps_a_default_too() -> None:
    policy = Generation(defaults={"max_tokens": 50000}, limits={"max_tokens": 4096})
    assert apply_generation({}, policy, passthrough=False) == {"max_tokens": 4096}


def test_default_not_added_when_the_alias_is_set() -> None:
    policy = Generation(defaults={"max_tokens": 256})
    out = apply_generation({"max_completion_tokens": 64}, policy, passthrough=False)
    assert out == {"max_completion_tokens": 64}


def test_limit_given_as_max_completion_tokens_caps_max_tokens() -> None:
    policy = Generation(limits={"max_completion_tokens": 100})
    assert apply_generation({"max_tokens": 500}, policy, passthrough=False) == {"max_tokens": 100}


def test_passthrough_adds_nothing_and_accepts_values_within_limits() -> None:
    assert apply_generation({}, POLICY, passthrough=True) == {}
    params = {"max_tokens": 8192, "temperature": 1.5}
    assert apply_generation(params, POLICY, passthrough=True) == params


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"max_tokens": 8193}, "max_tokens"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"temperature": 1.6}, "temperature"),
    ],
)
def test_passthrough_over_a_limit_is_400(params: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        apply_generation(params, POLICY, passthrough=True)
    assert info.value.status == 400
    assert info.value.param == param
    assert "limit" in info.value.message


@pytest.mark.parametrize("passthrough", [False, True])
@pytest.mark.parametrize("value", ["lots", True, [1]])
def test_a_limited_field_must_be_a_number(passthrough: bool, value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        apply_generation({"max_tokens": value}, POLICY, passthrough=passthrough)
    assert info.value.param == "max_tokens"


def test_empty_policy_is_identity() -> None:
    params = {"max_tokens": 10**9, "temperature": 9}
    assert apply_generation(params, Generation(), passthrough=False) == params
    assert apply_generation(params, Generation(), passthrough=True) == params
