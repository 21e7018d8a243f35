"""The shared vocabulary agrees with every place that speaks it.

Why: a word added in one place and missed in the next is what
``iopd.vocabulary`` exists to prevent, but ``wire/`` and the error hierarchy
spell some words on their own (wire never imports iopd).  These checks fail
as soon as the two drift apart.
"""

from __future__ import annotations

from typing import get_args, get_type_hints

from iopd import errors
from iopd.config.schema import ProviderConfig
from iopd.edge.metering.metrics import HEALTH_GAUGE
from iopd.vocabulary import (
    HEALTH_STATES,
    PROVIDER_TYPES,
    REQUIREMENT_TYPES,
    SHOWN_HEALTH_STATES,
    STATUSES,
    all_passthrough,
    load_ratio,
    types_meeting,
)
from wire.messages import ProviderSpec, RunRequest


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def test_every_gateway_error_counts_under_a_known_status() -> None:
    for cls in [errors.GatewayError, *_subclasses(errors.GatewayError)]:
        assert cls.metric_status in STATUSES, cls.__name__


def test_provider_types_are_the_wire_and_config_types() -> None:
    assert set(get_args(get_type_hints(ProviderSpec)["type"])) == PROVIDER_TYPES
    assert set(get_args(get_type_hints(RunRequest)["adapter"])) == PROVIDER_TYPES
    assert set(get_args(get_type_hints(ProviderConfig)["type"])) == PROVIDER_TYPES
    for types in REQUIREMENT_TYPES.values():
        assert types and types <= PROVIDER_TYPES


def test_every_health_state_has_a_gauge_value() -> None:
    assert set(HEALTH_GAUGE) == SHOWN_HEALTH_STATES
    assert HEALTH_STATES <= SHOWN_HEALTH_STATES


def test_requirements_narrow_the_types() -> None:
    assert types_meeting([]) is None
    assert types_meeting(["passthrough"]) == {"openai"}
    assert types_meeting(["normalized", "ollama"]) == {"ollama"}
    assert types_meeting(["passthrough", "normalized"]) == frozenset()
    assert types_meeting(["teleport"]) == frozenset()


def test_all_passthrough_and_load_ratio() -> None:
    assert all_passthrough(["openai", "openai"])
    assert not all_passthrough([])
    assert not all_passthrough(["openai", "echo"])
    assert load_ratio(1, 4) == 0.25
    assert load_ratio(3, 0) == 0.0
