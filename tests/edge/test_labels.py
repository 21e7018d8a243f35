"""The metric label records: what a label may hold, checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from iopd.edge.metering.labels import (
    UNMAPPED_PRINCIPAL,
    PrincipalLabels,
    RequestLabels,
    check_id_shape,
    expected_response_mode,
)
from iopd.vocabulary import UNMAPPED


@dataclass(frozen=True)
class _Caller:
    """An authenticated caller as the labels see one (``LabelledPrincipal``)."""

    label_principal_ref: str = "team-a"
    label_principal_alias: str = "Team A"
    label_token_ref: str = "tok-1"


def test_no_principal_is_the_unmapped_caller() -> None:
    labels = RequestLabels.build(
        None, model_group="m", endpoint="chat_completions", response_mode="normalized"
    )
    assert labels.principal == UNMAPPED_PRINCIPAL
    assert (labels.principal_ref, labels.token_ref) == (UNMAPPED, UNMAPPED)


def test_a_caller_and_its_principal_labels_give_the_same_record() -> None:
    kwargs = {"model_group": "m", "endpoint": "responses", "response_mode": "passthrough"}
    from_caller = RequestLabels.build(_Caller(), **kwargs)
    from_labels = RequestLabels.build(PrincipalLabels("team-a", "Team A", "tok-1"), **kwargs)
    assert from_caller == from_labels
    assert from_caller.principal.principal_alias == "Team A"
    # One record per distinct set of labels: the second build is the first one.
    assert RequestLabels.build(_Caller(), **kwargs) is from_caller


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("endpoint", "v1/chat"),
        ("response_mode", "raw"),
        ("model_group", ""),
        ("model_group", "x" * 129),
        ("model_group", "a\nb"),
    ],
)
def test_a_label_outside_its_vocabulary_or_shape_is_refused(field: str, value: str) -> None:
    kwargs = {"model_group": "m", "endpoint": "chat_completions", "response_mode": "normalized"}
    kwargs[field] = value
    with pytest.raises(ValueError, match=field) as info:
        RequestLabels.build(None, **kwargs)
    assert value not in str(info.value) or not value  # the value itself is never echoed


def test_an_empty_alias_shows_the_principal_ref() -> None:
    assert PrincipalLabels.from_config("ops", "", "t").principal_alias == "ops"
    assert PrincipalLabels.from_config("ops", "Ops", "t").principal_alias == "Ops"
    with pytest.raises(ValueError, match="token_ref"):
        PrincipalLabels.from_config("ops", "Ops", "")


def test_id_shape_bounds() -> None:
    check_id_shape("model_group", "x" * 128)
    with pytest.raises(ValueError):
        check_id_shape("model_group", "x" * 129)


@pytest.mark.parametrize(
    ("endpoint", "types", "mode"),
    [
        ("api", ["ollama"], "passthrough"),  # /api/* is only ever relayed raw
        ("embeddings", [], "passthrough"),
        ("completions", ["echo"], "passthrough"),
        ("chat_completions", ["openai", "openai"], "passthrough"),  # only tunnelling providers
        ("chat_completions", ["openai", "echo"], "normalized"),
        ("responses", [], "normalized"),  # unknown group
        ("responses", ["cli"], "normalized"),
    ],
)
def test_expected_response_mode(endpoint: str, types: list[str], mode: str) -> None:
    assert expected_response_mode(endpoint, types) == mode


def test_expected_response_mode_refuses_an_unknown_endpoint() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        expected_response_mode("nope", [])
