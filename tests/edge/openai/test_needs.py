"""``needs``: what a request needs of a provider, decided before it is leased:
the capability it requires, the caller's provider credential, the chat form
the normalized path runs, the estimate and the context class."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iopd import errors
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.needs import all_passthrough, ollama_needs, openai_needs, relayed_needs
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from tests.support.request_path import post_request, runtime


def _chat(text: str = "hi", **fields: Any) -> rq.ChatRequest:
    return rq.ChatRequest.parse(
        {"model": "m", "messages": [{"role": "user", "content": text}], **fields}
    )


def _group(rt: EdgeRuntime, group_id: str) -> Any:
    group = rt.snapshot.catalog.group(group_id)
    assert group is not None
    return group


def _req(headers: list[tuple[str, str]] | None = None, path: str = "/v1/chat/completions") -> Any:
    return post_request(b"{}", path, headers)


def test_a_chat_needs_nothing_special_and_carries_its_estimate() -> None:
    rt = runtime()
    needs = openai_needs(rt.snapshot, _req(), _group(rt, "echo"), _chat("abcdefgh"), False)
    assert needs.requires == frozenset() and needs.provider_auth is None
    assert needs.messages == [{"role": "user", "content": "abcdefgh"}]
    assert needs.estimate == 2 and needs.context_class == "normal"


def test_the_long_context_class_starts_at_the_threshold() -> None:
    rt = runtime(long_context_threshold_tokens=2)
    needs = openai_needs(rt.snapshot, _req(), _group(rt, "echo"), _chat("abcdefgh"), False)
    assert needs.context_class == "long"


def test_more_choices_than_a_normalized_run_takes_need_a_passthrough_provider() -> None:
    rt = runtime()
    many = _chat(n=rq.MAX_NORMALIZED_CHOICES + 1)
    needs = openai_needs(rt.snapshot, _req(), _group(rt, "mixed"), many, False)
    assert needs.requires == frozenset({"passthrough"})
    with pytest.raises(errors.InvalidRequest) as refused:
        openai_needs(rt.snapshot, _req(), _group(rt, "echo"), many, False)
    assert refused.value.param == "n"


def test_the_callers_provider_credential_is_taken_and_may_be_required() -> None:
    rt = runtime(provider_auth={"required": True})
    headers = [("x-provider-authorization", "Bearer sk-caller")]
    needs = openai_needs(rt.snapshot, _req(headers), _group(rt, "pt"), _chat(), False)
    assert needs.provider_auth == "Bearer sk-caller"
    with pytest.raises(errors.ProviderAuthRequired):
        openai_needs(rt.snapshot, _req(), _group(rt, "pt"), _chat(), False)
    # A group without a passthrough provider never needs it.
    assert (
        openai_needs(rt.snapshot, _req(), _group(rt, "echo"), _chat(), False).provider_auth is None
    )


def test_a_responses_tool_no_normalized_provider_runs_is_dropped_or_refused() -> None:
    body = {"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}
    rt = runtime()
    resp = rq.ResponsesRequest.parse(json.dumps(body).encode())
    dropped = openai_needs(rt.snapshot, _req(path="/v1/responses"), _group(rt, "echo"), resp, False)
    assert dropped.dropped_tools == ("web_search",) and dropped.requires == frozenset()
    # A group with a passthrough provider sends it there instead.
    mixed = openai_needs(rt.snapshot, _req(path="/v1/responses"), _group(rt, "mixed"), resp, False)
    assert mixed.requires == frozenset({"passthrough"}) and mixed.dropped_tools == ()
    strict = runtime(unsupported_tools="reject")
    with pytest.raises(errors.InvalidRequest) as refused:
        openai_needs(
            strict.snapshot, _req(path="/v1/responses"), _group(strict, "echo"), resp, False
        )
    assert refused.value.param == "tools[0].type"


def test_embeddings_need_a_passthrough_or_an_ollama_provider_and_completions_a_passthrough() -> (
    None
):
    rt = runtime()
    body = rq.RelayedRequest.parse({"model": "m", "input": "abcd"})
    assert relayed_needs(
        rt.snapshot, _req(path="/v1/embeddings"), _group(rt, "pt"), body
    ).requires == {"passthrough"}
    on_ollama = relayed_needs(rt.snapshot, _req(path="/v1/embeddings"), _group(rt, "ol"), body)
    assert on_ollama.requires == {"ollama"} and on_ollama.estimate == 1
    with pytest.raises(errors.InvalidRequest) as refused:
        relayed_needs(rt.snapshot, _req(path="/v1/completions"), _group(rt, "ol"), body)
    assert "only type 'openai' (passthrough) providers do" in str(refused.value)
    with pytest.raises(errors.InvalidRequest) as refused:
        relayed_needs(rt.snapshot, _req(path="/v1/embeddings"), _group(rt, "echo"), body)
    assert "and 'ollama' ones" in str(refused.value)


def test_the_ollama_routes_need_an_ollama_provider() -> None:
    rt = runtime()
    body = rq.OllamaRequest.parse({"model": "m"})
    assert ollama_needs(rt.snapshot, _group(rt, "ol"), body, "/api/chat").requires == {"ollama"}
    with pytest.raises(errors.InvalidRequest):
        ollama_needs(rt.snapshot, _group(rt, "echo"), body, "/api/chat")


def test_all_passthrough_only_when_every_provider_relays() -> None:
    rt = runtime()
    assert all_passthrough(rt.snapshot, _group(rt, "pt"))
    assert not all_passthrough(rt.snapshot, _group(rt, "mixed"))
    assert not all_passthrough(rt.snapshot, _group(rt, "echo"))
