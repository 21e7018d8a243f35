"""``prepare``: parse → resolve → needs → the path decision, before any lease.

Everything ``prepare()`` checks is checked when it is called (the lease is
taken only on entering it), so these build a ``Leasing`` against a real
snapshot and look at what it decided, or at the error it raised, for each
bad case.  ``Decision`` is pinned on its own: made once, kept by a retry,
re-grouped by a fallback group only.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from iopd import errors
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.lifecycle import Call, Outcome
from iopd.edge.openai.prepare import Body, Decision, Leasing, prepare
from iopd.edge.openai.routes import Serves
from iopd.edge.pool.pool import Lease
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.vocabulary import UNKNOWN_GROUP
from tests.support.request_path import post_request, runtime

RON = Serves.RELAY_OR_NORMALIZED


def prepared(
    rt: EdgeRuntime,
    body: object,
    kind: type[Body] = rq.ChatRequest,  # type: ignore[assignment]
    serves: Serves = RON,
    *,
    path: str = "/v1/chat/completions",
    headers: list[tuple[str, str]] | None = None,
) -> tuple[Leasing[Body], Outcome]:
    out = Outcome(request_id="req-1", principal=rt.snapshot.auth.authenticate(None))
    call = Call(rt.snapshot, out, trio.CancelScope())
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return prepare(rt, call, post_request(raw, path, headers), kind, serves), out


def chat(model_id: str, **fields: Any) -> dict[str, Any]:
    return {"model": model_id, "messages": [{"role": "user", "content": "hi"}], **fields}


def lease(provider_type: str, group_id: str = "", provider_id: str = "p") -> Lease:
    return Lease(provider_id, "node-a", provider_type, "served", False, 0.0, group_id)


# ----------------------------------------------------------------- the path


async def test_a_normalized_group_waits_for_its_lease_to_decide() -> None:
    leasing, out = prepared(runtime(), chat("echo"))
    assert out.group == "echo" and out.mode == "normalized"
    assert leasing._decision is None  # a passthrough provider may still be leased
    decision = leasing._decide(lease("echo", "echo"))
    assert decision == Decision(decision.group, False, decision.params)
    assert decision.group.id == "echo" and decision.mode == "normalized"


async def test_a_passthrough_only_group_is_decided_before_it_queues() -> None:
    leasing, out = prepared(runtime(), chat("pt", max_tokens=50))
    decision = leasing._decision
    assert decision is not None and decision.relay and decision.mode == "passthrough"
    assert decision.params == {"max_tokens": 50}  # the caller's, nothing added
    assert out.mode == "passthrough" and out.group == "pt"
    assert leasing._decide(lease("openai", "pt")) is decision  # the lease keeps it


async def test_a_relay_only_route_is_relayed_whatever_the_group_holds() -> None:
    body = {"model": "mixed", "input": "text"}
    leasing, out = prepared(
        runtime(), body, rq.RelayedRequest, Serves.PASSTHROUGH, path="/v1/embeddings"
    )
    assert leasing._decision is not None and leasing._decision.relay
    assert out.mode == "passthrough"


async def test_in_a_mixed_group_the_first_lease_decides_and_a_retry_keeps_the_path() -> None:
    leasing, _out = prepared(runtime(), chat("mixed", temperature=0.5))
    first = leasing._decide(lease("openai", "mixed"))
    assert first.relay
    again = leasing._decide(lease("echo", "mixed"))  # a retry on a normalized provider
    assert again is first  # same group, same path, same parameters


async def test_a_fallback_group_regroups_the_decision_but_keeps_its_path() -> None:
    rt = runtime()
    leasing, _out = prepared(rt, chat("mixed"))
    first = leasing._decide(lease("echo", "mixed"))
    fallback = leasing._decide(lease("openai", "echo"))  # served by group "echo"
    assert fallback.group.id == "echo" and fallback.relay is first.relay is False


# --------------------------------------------------------------- bad bodies


async def test_a_body_that_is_not_json_is_a_400_before_any_group() -> None:
    with pytest.raises(errors.InvalidRequest):
        prepared(runtime(), b"{not json")


async def test_an_unknown_model_is_a_404_naming_the_models() -> None:
    rt = runtime()
    out = Outcome(request_id="req-1", principal=rt.snapshot.auth.authenticate(None))
    body = json.dumps(chat("nope")).encode()
    with pytest.raises(errors.ModelNotFound) as exc:
        prepare(rt, Call(rt.snapshot, out, trio.CancelScope()), post_request(body), rq.ChatRequest, RON)
    assert "available models: echo, pt, mixed, ol" in exc.value.message
    assert out.group == UNKNOWN_GROUP


async def test_a_bad_body_of_a_known_model_is_counted_under_its_group() -> None:
    rt = runtime()
    out = Outcome(request_id="req-1", principal=rt.snapshot.auth.authenticate(None))
    body = json.dumps({"model": "echo", "messages": "not a list"}).encode()
    with pytest.raises(errors.InvalidRequest) as exc:
        prepare(rt, Call(rt.snapshot, out, trio.CancelScope()), post_request(body), rq.ChatRequest, RON)
    assert exc.value.param == "messages"
    assert out.group == "echo"  # resolved once, before the body was validated


async def test_a_passthrough_request_over_its_groups_limit_is_a_400_before_it_queues() -> None:
    with pytest.raises(errors.InvalidRequest) as exc:
        prepared(runtime(), chat("pt", max_tokens=500))
    assert exc.value.param == "max_tokens"


async def test_more_choices_than_a_normalized_provider_runs_is_a_400_without_passthrough() -> None:
    with pytest.raises(errors.InvalidRequest) as exc:
        prepared(runtime(), chat("echo", n=rq.MAX_NORMALIZED_CHOICES + 1))
    assert exc.value.param == "n"
    # A group with a passthrough provider requires one instead.
    leasing, _ = prepared(runtime(), chat("mixed", n=rq.MAX_NORMALIZED_CHOICES + 1))
    assert leasing._needs.requires == frozenset({"passthrough"})


async def test_an_endpoint_only_passthrough_serves_is_a_400_in_a_group_without_one() -> None:
    body = {"model": "echo", "input": "text"}
    with pytest.raises(errors.InvalidRequest) as exc:
        prepared(runtime(), body, rq.RelayedRequest, Serves.PASSTHROUGH, path="/v1/embeddings")
    assert "/v1/embeddings" in exc.value.message


async def test_an_ollama_route_needs_an_ollama_provider() -> None:
    body = {"model": "echo", "messages": []}
    with pytest.raises(errors.InvalidRequest) as exc:
        prepared(runtime(), body, rq.OllamaRequest, Serves.OLLAMA, path="/api/chat")
    assert "no ollama provider" in exc.value.message
    body["model"] = "ol"
    leasing, _ = prepared(runtime(), body, rq.OllamaRequest, Serves.OLLAMA, path="/api/chat")
    assert leasing._needs.requires == frozenset({"ollama"})


async def test_required_provider_credentials_are_a_refusal_when_missing() -> None:
    rt = runtime(provider_auth={"required": True})
    with pytest.raises(errors.ProviderAuthRequired):
        prepared(rt, chat("pt"))
    leasing, _ = prepared(rt, chat("pt"), headers=[("x-provider-authorization", "Bearer k")])
    assert leasing._needs.provider_auth == "Bearer k"


async def test_a_relative_workspace_is_no_error_where_no_cli_provider_runs() -> None:
    leasing, _ = prepared(runtime(), chat("echo", metadata={"workspace": "rel/dir"}))
    assert leasing._body.workspace == "rel/dir"


async def test_the_estimate_and_context_class_are_the_needs() -> None:
    rt = runtime(long_context_threshold_tokens=5)
    leasing, _ = prepared(rt, chat("echo", messages=[{"role": "user", "content": "word " * 50}]))
    assert leasing._needs.estimate >= 5 and leasing._needs.context_class == "long"
    leasing, _ = prepared(rt, chat("echo"))
    assert leasing._needs.context_class == "normal"
