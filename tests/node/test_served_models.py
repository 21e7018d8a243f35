"""The probe's check of the served model names against the provider's list, and
what it keeps of each served model's Ollama entry (pure)."""

from __future__ import annotations

import json

import pytest

from iopd.node.served_models import MAX_LIST_ITEMS, listed_names, model_infos, not_served
from tests.support.mock_providers import LLAMA_TAG_DETAILS
from wire.messages import (
    MAX_MODEL_FAMILIES,
    MAX_MODEL_INFOS,
    MAX_MODEL_TEXT_CHARS,
    ModelDetails,
    ModelInfo,
)


def openai_list(*names: str) -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}
    ).encode()


def ollama_tags(*names: str) -> bytes:
    return json.dumps({"models": [{"name": n, "model": n} for n in names]}).encode()


def test_openai_and_ollama_lists_are_read() -> None:
    assert listed_names(openai_list("a", "b"), "openai") == {"a", "b"}
    assert listed_names(ollama_tags("qwen3:32b"), "ollama") == {"qwen3:32b"}


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", b'{"data": "x"}', b'{"models": []}', b"\xff\xfe"],
    ids=["garbage", "array", "data not a list", "other flavour's key", "not utf-8"],
)
def test_a_body_that_is_no_model_list_checks_nothing(body: bytes) -> None:
    assert listed_names(body, "openai") is None


def test_entries_past_the_cap_and_odd_entries_are_ignored() -> None:
    items = [{"id": f"m{i}"} for i in range(MAX_LIST_ITEMS + 5)] + [{"id": 7}, "x"]
    names = listed_names(json.dumps({"data": items}).encode(), "openai")
    assert names is not None and len(names) == MAX_LIST_ITEMS and "m0" in names


def test_a_name_the_list_lacks_is_reported_with_what_it_lists() -> None:
    listed = {"Qwen/Qwen3-8B", "a", "b", "c"}
    assert not_served(["Qwen/Qwen3-8B"], listed, "openai", "/v1/models") is None
    assert not_served(["qwen3-8b"], listed, "openai", "/v1/models") == (
        "model 'qwen3-8b' not served: /v1/models lists 'Qwen/Qwen3-8B', 'a', 'b' and 1 more; "
        "fix nodes[].providers[].models or the server's model name"
    )


def test_ollama_names_without_a_tag_are_their_latest() -> None:
    assert not_served(["llama3"], {"llama3:latest"}, "ollama", "/api/tags") is None
    assert not_served(["llama3"], {"llama3:latest"}, "openai", "/v1/models") is not None
    assert not_served(["llama3:8b"], {"llama3:latest"}, "ollama", "/api/tags") is not None


def test_an_empty_list_says_nothing() -> None:
    assert not_served(["anything"], set(), "openai", "/v1/models") is None


def test_quoted_names_are_cut_short() -> None:
    error = not_served(["x" * 500], {"y" * 500}, "openai", "/v1/models")
    assert error is not None and len(error) < 300


# ------------------------------------------------- the served models' entries

LLAMA = {
    "name": "llama3:latest",
    "model": "llama3:latest",
    "modified_at": "2026-11-30T10:00:00.5+01:00",
    **LLAMA_TAG_DETAILS,
}


def tags(*entries: dict[str, object]) -> bytes:
    return json.dumps({"models": list(entries)}).encode()


def test_a_served_models_entry_is_kept_under_its_served_name() -> None:
    other = {**LLAMA, "name": "other:7b", "model": "other:7b", "size": 1}
    infos = model_infos(tags(other, LLAMA), ["llama3", "missing:1b"])
    assert infos == [
        ModelInfo(
            name="llama3",  # the config's spelling; Ollama lists its :latest
            size=4661224676,
            digest="365c0bd3c000",
            modified_at="2026-11-30T10:00:00.5+01:00",
            details=ModelDetails(
                format="gguf",
                family="llama",
                families=["llama"],
                parameter_size="8.0B",
                quantization_level="Q4_0",
            ),
        )
    ]  # a listed model that is not served, and a served one not listed, are left out


def test_an_entry_is_bounded() -> None:
    long = "x" * 100_000
    entry = {
        "name": "m",
        "size": 10**30,  # not a size msgspec could send
        "digest": long,
        "modified_at": 12,
        "details": {"family": long, "families": [long] * 1000 + [3], "format": None},
    }
    (info,) = model_infos(tags(entry), ["m"])
    assert len(info.digest) == MAX_MODEL_TEXT_CHARS and info.modified_at == ""
    assert len(info.details.families) == MAX_MODEL_FAMILIES
    assert all(len(f) == MAX_MODEL_TEXT_CHARS for f in info.details.families)
    assert info.details.format == "" and len(info.details.family) == MAX_MODEL_TEXT_CHARS
    assert info.size == 0


@pytest.mark.parametrize(
    ("size", "kept"), [(-1, 0), (True, 0), ("12", 0), (2.5, 0), (2**63, 0), (2**63 - 1, 2**63 - 1)]
)
def test_only_a_plain_size_is_kept(size: object, kept: int) -> None:
    (info,) = model_infos(tags({"name": "m", "size": size}), ["m"])
    assert info.size == kept


def test_at_most_the_cap_of_served_models_and_never_a_name_too_long_to_send() -> None:
    names = [f"m{i}" for i in range(MAX_MODEL_INFOS + 5)]
    long_name = "n" * (MAX_MODEL_TEXT_CHARS + 1)
    body = tags(*({"name": n} for n in [long_name, *names]))
    infos = model_infos(body, [long_name, *names, *names])
    assert [i.name for i in infos] == names[:MAX_MODEL_INFOS]


@pytest.mark.parametrize("body", [b"", b"[]", b'{"models": 3}', b'{"models": [1, "x"]}'])
def test_no_list_keeps_nothing(body: bytes) -> None:
    assert model_infos(body, ["m"]) == []
