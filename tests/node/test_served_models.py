"""The probe's check of the served model names against the provider's list (pure)."""

from __future__ import annotations

import json

import pytest

from iopd.node.served_models import MAX_LIST_ITEMS, listed_names, not_served


def openai_list(*names: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": n, "object": "model"} for n in names]}).encode()


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
