"""The normalized answers fed scripted ``RunEvent``s: the one event loop.

No node runs here: each attempt's session plays a script of run events, the
retry policy is a recorder that answers scripted verdicts, and the responder
records what reached the caller.  Pinned: a run that fails before its first
event goes to the next lease with nothing written; an error once the stream
started is reported as seen by the caller and never retried; a whole answer
retries even after events (nothing was sent); usage is the runs' sum; the
text tool protocol turns the held-back text into tool calls at the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
import trio

from iopd import errors
from iopd.edge.openai.attempts import AttemptVerdict
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.lifecycle import Call, Outcome, RequestIds
from iopd.edge.openai.normalized import chat_once, chat_stream, responses_once, responses_stream
from iopd.edge.openai.prepare import Decision, LeasedRequest
from iopd.edge.pool.pool import Lease
from iopd.edge.pool.retry_rules import AttemptFailure, FailureKind
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.http.connection import Request
from tests.support.configs import edge_yaml
from tests.support.gateway import edge_config
from wire.messages import RunEvent, RunRequest, Usage

Script = list[RunEvent]


def text(t: str) -> RunEvent:
    return RunEvent(stream_id=1, kind="text", text=t)


def usage(i: int, o: int) -> RunEvent:
    return RunEvent(stream_id=1, kind="usage", usage=Usage(input_tokens=i, output_tokens=o))


def complete(reason: str = "stop") -> RunEvent:
    return RunEvent(stream_id=1, kind="complete", finish_reason=reason)


def error(code: str) -> RunEvent:
    return RunEvent(stream_id=1, kind="error", code=code, message="it broke")


class Session:
    """Plays one script per run; records the runs it was asked for."""

    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts)
        self.runs: list[RunRequest] = []

    @asynccontextmanager
    async def open_stream(self, run: RunRequest) -> AsyncIterator[AsyncIterator[RunEvent]]:
        self.runs.append(run)
        script = self.scripts.pop(0)

        async def events() -> AsyncIterator[RunEvent]:
            for ev in script:
                await trio.lowlevel.checkpoint()
                yield ev

        yield events()


class Policy:
    """The retry policy's interface, recording the reports; answers ``verdicts`` in turn."""

    def __init__(self, *verdicts: AttemptVerdict) -> None:
        self.verdicts = list(verdicts)
        self.reports: list[tuple[str, FailureKind | None, bool | None]] = []

    def succeeded(self) -> None:
        self.reports.append(("succeeded", None, None))

    def failed(
        self, failure: AttemptFailure, *, caller_saw_bytes: bool, retry_after: float = 0.0
    ) -> AttemptVerdict:
        self.reports.append(("failed", failure.kind, caller_saw_bytes))
        return self.verdicts.pop(0)


class Responder:
    """What reached the caller."""

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.status = 0
        self.chunks: list[bytes] = []

    async def start(self, status: int, headers: list[tuple[str, str]], hold: bool = False) -> None:
        self.started, self.status = True, status

    async def write(self, data: bytes, hold: bool = False) -> None:
        assert self.started
        self.chunks.append(data)

    async def end(self) -> None:
        self.finished = True

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        await self.start(status, headers)
        await self.write(body)
        await self.end()

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def sse(self) -> list[Any]:
        data = [
            line[6:]
            for block in self.body.decode().split("\n\n")
            for line in block.split("\n")
            if line.startswith("data: {")
        ]
        return [json.loads(x) for x in data]


class Leasing:
    """Gives the next attempt's lease (what ``until_done`` asks after a RETRY)."""

    def __init__(self, attempts: list[LeasedRequest[Any]]) -> None:
        self.attempts = attempts

    async def next_attempt(self) -> LeasedRequest[Any]:
        return self.attempts.pop(0)


def leased_chain(
    body: rq.ChatRequest | rq.ResponsesRequest,
    sessions: list[Session],
    policy: Policy,
    *,
    provider_type: str = "ollama",
) -> tuple[LeasedRequest[Any], Call]:
    rt = EdgeRuntime.create(edge_config(edge_yaml()))
    snap = rt.snapshot
    group = snap.catalog.resolve("echo")
    assert group is not None
    out = Outcome(request_id="req-1", principal=snap.auth.authenticate(None))
    call = Call(snap, out, trio.CancelScope())
    later: list[LeasedRequest[Any]] = []
    leasing = Leasing(later)
    chain = [
        LeasedRequest(
            snap=snap,
            request=Request("POST", "/", "/", "", [], b"", None, "1.1"),
            body=body,
            principal=out.principal,
            decision=Decision(group, False, {}),
            lease=Lease(f"p{i}", "node-a", provider_type, "served", False, 0.0, "echo"),
            session=cast(Any, session),
            provider_auth=None,
            messages=[{"role": "user", "content": "hi"}],
            estimate=1,
            context_class="normal",
            attempts=cast(Any, policy),
            leasing=cast(Any, leasing),
        )
        for i, session in enumerate(sessions)
    ]
    later.extend(chain[1:])
    return chain[0], call


def chat_body(**fields: Any) -> rq.ChatRequest:
    return rq.ChatRequest.parse(
        {"model": "echo", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


RETRY, FINAL = AttemptVerdict.RETRY, AttemptVerdict.FINAL


async def test_a_stream_whose_run_fails_before_its_first_event_goes_to_the_next_lease() -> None:
    first, second = Session([error("provider_unreachable")]), Session([text("hi"), complete()])
    policy = Policy(RETRY)
    leased, call = leased_chain(chat_body(stream=True), [first, second], policy)
    responder = Responder()
    await chat_stream(leased, cast(Any, responder), call, RequestIds())
    assert policy.reports == [
        ("failed", FailureKind.CONNECT_FAILED, False),
        ("succeeded", None, None),
    ]
    assert len(first.runs) == len(second.runs) == 1
    chunks = responder.sse()
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # one opening chunk
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:2]] == ["hi"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert responder.body.endswith(b"data: [DONE]\n\n") and call.out.status == "ok"


async def test_a_stream_error_after_its_first_event_is_reported_as_seen_and_never_retried() -> None:
    policy = Policy(RETRY)  # even a RETRY verdict cannot take back what was sent
    session = Session([text("partial"), error("provider_error")])
    leased, call = leased_chain(chat_body(stream=True), [session], policy)
    responder = Responder()
    with pytest.raises(errors.GatewayError):
        await chat_stream(leased, cast(Any, responder), call, RequestIds())
    assert policy.reports == [("failed", FailureKind.RUN_ERROR_AFTER_EVENT, True)]
    assert call.sse_open and b"partial" in responder.body


async def test_a_run_that_fails_with_no_retry_left_is_a_plain_http_error() -> None:
    policy = Policy(FINAL)
    leased, call = leased_chain(chat_body(stream=True), [Session([error("provider_reset")])], policy)
    responder = Responder()
    with pytest.raises(errors.GatewayError):
        await chat_stream(leased, cast(Any, responder), call, RequestIds())
    assert not responder.started and not call.sse_open  # lifecycle.fail answers in JSON


async def test_a_cancelled_run_is_not_reported_to_the_policy() -> None:
    policy = Policy()
    leased, call = leased_chain(chat_body(), [Session([error("cancelled")])], policy)
    with pytest.raises(errors.GatewayError):
        await chat_once(leased, cast(Any, Responder()), call, RequestIds())
    assert policy.reports == []


async def test_a_whole_answer_retries_even_after_events_because_nothing_was_sent() -> None:
    policy = Policy(RETRY)
    first = Session([text("lost"), usage(3, 1), error("provider_timeout")])
    second = Session([text("kept"), usage(3, 2), complete()])
    leased, call = leased_chain(chat_body(), [first, second], policy)
    responder = Responder()
    await chat_once(leased, cast(Any, responder), call, RequestIds())
    assert policy.reports[0] == ("failed", FailureKind.READ_TIMEOUT, False)
    doc = json.loads(responder.body)
    assert doc["choices"][0]["message"]["content"] == "kept"
    assert doc["usage"]["prompt_tokens"] == 3 and doc["usage"]["completion_tokens"] == 2
    assert [(t, n) for _src, t, n in call.out.usage] == [("input", 3), ("output", 2)]


async def test_the_choices_of_n_are_one_run_each_and_their_usage_is_the_sum() -> None:
    policy = Policy()
    session = Session(
        [text("a"), usage(3, 1), complete()],
        [text("b"), usage(3, 2), complete()],
    )
    leased, call = leased_chain(chat_body(n=2), [session], policy)
    responder = Responder()
    await chat_once(leased, cast(Any, responder), call, RequestIds())
    doc = json.loads(responder.body)
    assert [c["message"]["content"] for c in doc["choices"]] == ["a", "b"]
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert doc["usage"]["prompt_tokens"] == 6 and doc["usage"]["completion_tokens"] == 3
    assert [(t, n) for _src, t, n in call.out.usage] == [("input", 6), ("output", 3)]
    assert call.out.status == "ok" and call.out.http_status == 200


async def test_a_second_choice_that_fails_before_an_event_counts_as_produced() -> None:
    policy = Policy(FINAL)
    session = Session([text("a"), complete()], [error("provider_unreachable")])
    leased, call = leased_chain(chat_body(n=2, stream=True), [session], policy)
    responder = Responder()
    with pytest.raises(errors.GatewayError):
        await chat_stream(leased, cast(Any, responder), call, RequestIds())
    # The first choice went out: the second's failure is after an event, seen.
    assert policy.reports[-1] == ("failed", FailureKind.RUN_ERROR_AFTER_EVENT, True)


async def test_a_cancelled_stream_keeps_the_usage_it_had() -> None:
    session = Session([text("so far"), usage(4, 2), error("cancelled")])
    leased, call = leased_chain(chat_body(stream=True), [session], Policy())
    with pytest.raises(errors.GatewayError):
        await chat_stream(leased, cast(Any, Responder()), call, RequestIds())
    assert [(t, n) for _src, t, n in call.out.usage] == [("input", 4), ("output", 2)]
    assert call.out.output_estimate > 0


TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
CALL_TEXT = 'before <tool_call>{"name": "get", "arguments": {}}</tool_call>'


async def test_a_text_tool_stream_holds_its_text_back_and_ends_in_tool_calls() -> None:
    session = Session([text(CALL_TEXT[:10]), text(CALL_TEXT[10:]), complete()])
    leased, call = leased_chain(
        chat_body(stream=True, tools=TOOLS), [session], Policy(), provider_type="echo"
    )
    responder = Responder()
    await chat_stream(leased, cast(Any, responder), call, RequestIds())
    deltas = [c["choices"][0]["delta"] for c in responder.sse() if c["choices"]]
    assert [d.get("content") for d in deltas if d.get("content")] == ["before"]
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert [c["function"]["name"] for c in calls] == ["get"] and calls[0]["index"] == 0
    assert responder.sse()[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert session.runs[0].tools is None  # described to the provider as text


async def test_the_responses_stream_takes_the_same_loop_and_tail() -> None:
    body = rq.ResponsesRequest.parse({"model": "echo", "input": "hi", "stream": True})
    first, second = Session([error("provider_unreachable")]), Session([text("hello"), complete()])
    policy = Policy(RETRY)
    leased, call = leased_chain(body, [first, second], policy)
    responder = Responder()
    await responses_stream(leased, cast(Any, responder), call, RequestIds())
    types = [e["type"] for e in responder.sse()]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.output_text.delta" in types
    assert responder.finished and call.out.status == "ok"
    assert [r[0] for r in policy.reports] == ["failed", "succeeded"]


async def test_a_whole_response_object_is_sent_once_complete() -> None:
    body = rq.ResponsesRequest.parse({"model": "echo", "input": "hi"})
    leased, call = leased_chain(body, [Session([text("whole"), usage(2, 1), complete()])], Policy())
    responder = Responder()
    await responses_once(leased, cast(Any, responder), call, RequestIds())
    doc = json.loads(responder.body)
    assert doc["object"] == "response" and doc["output"][0]["content"][0]["text"] == "whole"
    assert [(t, n) for _src, t, n in call.out.usage] == [("input", 2), ("output", 1)]
