"""``ProviderHealth.models``: what a node's probe says of its served models, and
that it breaks no peer of an earlier release."""

from __future__ import annotations

import msgspec
import pytest

from wire.messages import (
    MAX_MODEL_FAMILIES,
    MAX_MODEL_INFOS,
    MAX_MODEL_SIZE,
    MAX_MODEL_TEXT_CHARS,
    Message,
    ModelDetails,
    ModelInfo,
    ProviderHealth,
    ProviderStatus,
)

_decode = msgspec.msgpack.Decoder(Message).decode
_encode = msgspec.msgpack.Encoder().encode


class _OldProviderHealth(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``ProviderHealth`` as a release before ``models`` declares it."""

    provider_id: str
    health: str = "unknown"
    last_error: str = ""


class _OldProviderStatus(msgspec.Struct, tag_field="t", tag="ProviderStatus", kw_only=True):
    providers: list[_OldProviderHealth] = msgspec.field(default_factory=list)


INFO = ModelInfo(
    name="llama3",
    size=4661224676,
    digest="365c0bd3c000",
    modified_at="2026-11-30T10:00:00Z",
    details=ModelDetails(format="gguf", family="llama", families=["llama"]),
)


def status(*models: ModelInfo) -> ProviderStatus:
    return ProviderStatus(
        providers=[ProviderHealth(provider_id="ol", health="healthy", models=list(models))]
    )


def test_models_round_trip() -> None:
    assert _decode(_encode(status(INFO))) == status(INFO)


def test_an_older_edge_decodes_a_status_with_models() -> None:
    old = msgspec.msgpack.decode(_encode(status(INFO)), type=_OldProviderStatus)
    assert old.providers == [_OldProviderHealth(provider_id="ol", health="healthy")]


def test_an_older_nodes_status_has_no_models_and_is_the_same_bytes() -> None:
    old = _OldProviderStatus(providers=[_OldProviderHealth(provider_id="ol", health="healthy")])
    assert _encode(status()) == _encode(old)
    decoded = _decode(_encode(old))
    assert isinstance(decoded, ProviderStatus)
    assert decoded.providers[0].models == []


@pytest.mark.parametrize(
    "models",
    [
        [INFO] * (MAX_MODEL_INFOS + 1),
        [ModelInfo(name="x" * (MAX_MODEL_TEXT_CHARS + 1))],
        [ModelInfo(name="m", digest="d" * (MAX_MODEL_TEXT_CHARS + 1))],
        [ModelInfo(name="m", details=ModelDetails(families=["f"] * (MAX_MODEL_FAMILIES + 1)))],
        [ModelInfo(name="m", details=ModelDetails(families=["f" * (MAX_MODEL_TEXT_CHARS + 1)]))],
        [ModelInfo(name="m", size=-1)],
    ],
)
def test_models_past_the_bounds_are_refused_at_decode(models: list[ModelInfo]) -> None:
    with pytest.raises(msgspec.ValidationError):
        _decode(_encode(status(*models)))


def test_models_at_the_bounds_decode() -> None:
    full = ModelInfo(
        name="x" * MAX_MODEL_TEXT_CHARS,
        size=MAX_MODEL_SIZE,
        details=ModelDetails(families=["f" * MAX_MODEL_TEXT_CHARS] * MAX_MODEL_FAMILIES),
    )
    msg = status(*[full] * MAX_MODEL_INFOS)
    assert _decode(_encode(msg)) == msg
