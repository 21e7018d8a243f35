"""The limiter's glue on the request path: what a request reserves, the
``x-ratelimit-*`` headers on its head context, and what it settles with.

The backends themselves are tested in ``tests/edge/limits/``; here they are
a recording stand-in, so each call the request path makes is seen."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from iopd import errors
from iopd.edge.openai import limits
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.principals.decisions import NeverFits, Rejection
from iopd.http.server import HeadContext, Request

HEADERS = [("x-ratelimit-limit-requests", "10"), ("x-ratelimit-remaining-requests", "9")]
CHAT = [{"role": "user", "content": "hi"}]


class _Backend:
    """What ``limits`` calls on ``rt.limits``, recorded."""

    def __init__(self, decision: object = "admitted") -> None:
        self.decision = decision
        self.calls: list[tuple[str, Any]] = []

    def headers(self, principal_ref: str) -> list[tuple[str, str]]:
        return list(HEADERS)

    async def admit(self, principal_ref: str, reservation: object) -> object:
        self.calls.append(("admit", reservation))
        return self.decision

    async def withdraw(self, admission: object) -> None:
        self.calls.append(("withdraw", admission))

    async def settle(self, admission: object, used: int | None, floor: int) -> None:
        self.calls.append(("settle", (admission, used, floor)))


def _rt(backend: _Backend) -> Any:
    return SimpleNamespace(limits=backend, metrics=SimpleNamespace(count_limit_rejection=_noop))


def _noop(*args: object) -> None:
    return None


def _call(**kw: object) -> Any:
    out = SimpleNamespace(usage=kw.pop("usage", []), output_estimate=kw.pop("output", 0))
    return SimpleNamespace(admission=None, input_estimate=0, leased=False, out=out, **kw)


def _request(path: str, context: HeadContext | None) -> Request:
    return Request("POST", path, path, "", [], b"", None, "1.1", context)


def test_a_chat_reserves_n_times_its_maximum_output() -> None:
    body = rq.ChatRequest({"model": "m", "messages": CHAT, "n": 2, "max_completion_tokens": 50})
    r = limits.reservation_of(body, "/v1/chat/completions", 7)
    assert (r.input_tokens, r.output_tokens, r.explicit_output) == (7, 100, True)
    assert (r.input_param, r.output_param) == ("messages", "max_completion_tokens")


def test_responses_and_relayed_bodies_name_their_own_fields() -> None:
    body = rq.ResponsesRequest({"model": "m", "input": "hi", "max_output_tokens": 30})
    r = limits.reservation_of(body, "/v1/responses", 1)
    assert (r.output_tokens, r.input_param, r.output_param) == (30, "input", "max_output_tokens")
    embed = rq.RelayedRequest({"model": "m", "input": "hi"})
    r = limits.reservation_of(embed, "/v1/embeddings", 3)
    assert (r.input_tokens, r.output_tokens, r.input_param) == (3, 0, "input")
    completion = rq.RelayedRequest({"model": "m", "prompt": "p", "n": 3, "max_tokens": 10})
    r = limits.reservation_of(completion, "/v1/completions", 2)
    assert (r.output_tokens, r.input_param) == (30, "prompt")
    # A boolean is no count, a non-positive maximum no maximum.
    odd = rq.RelayedRequest({"model": "m", "prompt": "p", "n": True, "max_tokens": 0})
    assert not limits.reservation_of(odd, "/v1/completions", 2).explicit_output


def test_show_limits_replaces_the_rate_limit_headers_only() -> None:
    context = HeadContext([("x-ratelimit-remaining-requests", "old"), ("vary", "Origin")])
    limits.show_limits(_rt(_Backend()), context, "team-a")
    assert context.response_headers == [("vary", "Origin"), *HEADERS]
    limits.show_limits(_rt(_Backend()), None, "team-a")  # no head context: nothing to do


def test_admit_holds_the_admission_and_redoes_the_headers() -> None:
    backend, call = _Backend("an admission"), _call()
    context = HeadContext()
    body = rq.ChatRequest({"model": "m", "messages": CHAT})
    request = _request("/v1/chat/completions", context)
    trio.run(limits.admit, _rt(backend), call, request, "team-a", body, 5)
    assert (call.admission, call.input_estimate) == ("an admission", 5)
    assert context.response_headers == HEADERS
    assert [name for name, _ in backend.calls] == ["admit"]


@pytest.mark.parametrize(
    ("decision", "error", "status"),
    [
        (Rejection("team-a", "tokens_per_minute", 100, 90, 20, 3.2), errors.RateLimited, 429),
        (NeverFits("team-a", "tokens_per_day", 10, 50, "max_tokens"), errors.InvalidRequest, 400),
    ],
)
def test_a_refused_admission_is_the_callers_error(
    decision: object, error: type[errors.GatewayError], status: int
) -> None:
    call = _call()
    context = HeadContext()
    body = rq.ChatRequest({"model": "m", "messages": CHAT})
    with pytest.raises(error) as info:
        trio.run(limits.admit, _rt(_Backend(decision)), call, _request("/", context), "t", body, 5)
    assert info.value.status == status and call.admission is None
    assert context.response_headers == HEADERS  # the refusal carries them too


def test_settle_takes_the_metered_usage_else_the_reservation_else_nothing() -> None:
    metered = [("provider_body", "input", 4), ("provider_body", "output", 6), ("x", "reasoning", 9)]
    for usage, leased, used in ((metered, True, 10), ([], True, None), ([], False, 0)):
        backend = _Backend()
        call = _call(usage=usage, output=3)
        call.admission, call.input_estimate, call.leased = "adm", 2, leased
        trio.run(limits.settle, _rt(backend), call)
        assert backend.calls == [("settle", ("adm", used, 5))]
        assert call.admission is None
        trio.run(limits.settle, _rt(backend), call)  # once only
        assert len(backend.calls) == 1


def test_withdraw_gives_the_admission_back_once() -> None:
    backend, call = _Backend(), _call()
    call.admission = "adm"
    trio.run(limits.withdraw, _rt(backend), call)
    trio.run(limits.withdraw, _rt(backend), call)
    assert backend.calls == [("withdraw", "adm")]
