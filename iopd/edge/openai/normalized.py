"""The normalized path: a ``RunRequest`` to the node, its ``RunEvent``s back as
OpenAI objects.

Four shapes of answer: a whole ``chat.completion`` (:func:`chat_once`), a
``chat.completion.chunk`` SSE stream (:func:`chat_stream`) — one run per
choice (``n``), one after the other under the one lease — and a whole
``/v1/responses`` object (:func:`responses_once`) or its event stream
(:func:`responses_stream`), one run each.  The pure rendering lives in ``chat.py`` and
``responses.py``; here are the run, the edge's system messages (strict
output, the text tool protocol), text tool parsing, and the usage record.

Retries: a run that fails before any event reports it to the
request's attempt loop (``leased.leasing.failed``) and, when that says
retry, runs again on the next leased provider; nothing was sent.  That holds
for the streamed answers too: their response head waits for the run's first
event (it leaves, held, with the stream's first chunk, so the first chunk
comes no later), and a run that fails before it can still go elsewhere or
end with a plain HTTP error.  Once a byte went out, or the first choice of
``n`` produced one, nothing is retried; neither is a ``cli`` run whose
process had started.
"""

from __future__ import annotations

import time
from typing import cast

import msgspec

from iopd.edge.metering.usage import run_event_usage
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.jsonschema import JSONArray, JSONObject
from iopd.edge.openai.lifecycle import TEXT_TOOL_TYPES, Call, Outcome, RequestIds
from iopd.edge.openai.outgoing.chat import ChunkStream, CompletionAssembler, add_usage, usage_dict
from iopd.edge.openai.outgoing.responses import ResponseEvents, build_response
from iopd.edge.openai.outgoing.sse import SSE_HEADERS
from iopd.edge.openai.outgoing.strict import (
    StrictStreamFilter,
    extract_completion,
    strict_system_message,
)
from iopd.edge.openai.outgoing.tools import (
    parse_text_tool_calls,
    restore_native_tool_call,
    tool_instruction,
)
from iopd.edge.openai.prepare import Body, LeasedRequest, Leasing
from iopd.edge.openai.run_errors import run_error, run_failure, run_retry_after
from iopd.http.server import Responder
from iopd.tokens import estimate_tokens_from_chars
from wire.messages import RunEvent, RunRequest, Usage

__all__ = ["chat_once", "chat_stream", "responses_once", "responses_stream"]

#: A request on the normalized path (``/api/*`` is only ever relayed).
_Normalized = LeasedRequest[rq.ChatRequest] | LeasedRequest[rq.ResponsesRequest]

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode


# ------------------------------------------------------------------ chat


async def chat_once(
    leased: LeasedRequest[rq.ChatRequest], responder: Responder, out: Outcome, ids: RequestIds
) -> None:
    """A whole ``chat.completion``, sent once the run (one per choice) completed.

    ``n > 1`` runs the request ``n`` times, one after the other under the one
    lease (it holds one provider slot); the choices are indexed 0..n-1 and the
    usage is the runs' sum.
    """
    completion_id, created = ids.new("chatcmpl"), int(time.time())
    while True:
        choices = await _chat_choices(leased, out, completion_id, created)
        if choices is not None:
            break
        leased = await leased.leasing.next_attempt()
    result = choices[0][0]
    if len(choices) > 1:
        result["choices"] = [cast(JSONArray, doc["choices"])[0] for doc, _ in choices]
        usage = usage_dict(_total_usage([asm for _, asm in choices]))
        if usage is not None:
            result["usage"] = usage
    out.answered(200)
    await responder.send(200, [("content-type", JSON)], _json_encode(result))


async def _chat_choices(
    leased: LeasedRequest[rq.ChatRequest], out: Outcome, completion_id: str, created: int
) -> list[tuple[JSONObject, CompletionAssembler]] | None:
    """The ``n`` choices of one attempt, each with its assembler; None to retry."""
    req = leased.body
    text_tools = _text_tools(leased, req.tools)
    asms: list[CompletionAssembler] = []
    choices: list[tuple[JSONObject, CompletionAssembler]] = []
    try:
        for index in range(req.n):
            asm = CompletionAssembler(completion_id=completion_id, model=req.model, created=created)
            asms.append(asm)
            run = _chat_run(leased, text_tools)
            if not await _collect(leased, run, asm, produced=index > 0):
                return None
            text, calls = _settle(leased, asm, run, req.tools if text_tools else None)
            doc = asm.result(text_override=text, tool_calls_override=calls, index=index)
            choices.append((doc, asm))
    finally:
        _account_run_usage(asms, out)
    return choices


async def chat_stream(
    leased: LeasedRequest[rq.ChatRequest], responder: Responder, call: Call, ids: RequestIds
) -> None:
    """A ``chat.completion.chunk`` SSE stream, written as the run's events arrive.

    With ``n > 1`` the choices' runs stream one after the other, each chunk
    with its choice's index; the usage chunk (when asked for) is their sum.
    A first run that fails before any event goes to the next leased provider
    when the attempt loop says so (the stream has not started).
    """
    req = leased.body
    strict = leased.snap.config.openai.strict_output
    stream = _ChatStream(
        call,
        responder,
        ChunkStream(
            completion_id=ids.new("chatcmpl"),
            model=req.model,
            created=int(time.time()),
            include_usage=req.include_usage,
        ),
    )
    asms: list[CompletionAssembler] = []
    try:
        for index in range(req.n):
            # accounting only: the caller sees the chunks
            asm = CompletionAssembler(completion_id="", model=req.model, created=0)
            asms.append(asm)
            filt = StrictStreamFilter() if strict else None
            # A run that is retried produced nothing: asm and filt stay empty.
            while not await stream.run(leased, index, asm, filt):
                leased = await leased.leasing.next_attempt()
        await responder.write(stream.chunks.end(_total_usage(asms)))
        await responder.end()
        call.out.status = "ok"
    finally:
        _account_run_usage(asms, call.out)


class _ChatStream:
    """One streamed completion: run events in, SSE chunks out (one run per choice)."""

    __slots__ = (
        "call",
        "responder",
        "chunks",
        "asm",
        "strict",
        "text_tools",
        "tool_index",
    )

    def __init__(self, call: Call, responder: Responder, chunks: ChunkStream) -> None:
        self.call = call
        self.responder = responder
        self.chunks = chunks
        self.asm = CompletionAssembler(completion_id="", model="", created=0)
        self.strict: StrictStreamFilter | None = None
        #: The caller's tools when they go through the text protocol (set per
        #: run: the leased provider decides): the whole text then decides
        #: between tool calls and text.
        self.text_tools: list[JSONObject] | None = None
        self.tool_index = 0

    async def run(
        self,
        leased: LeasedRequest[rq.ChatRequest],
        index: int,
        asm: CompletionAssembler,
        strict: StrictStreamFilter | None,
    ) -> bool:
        """Stream choice ``index``: its opening chunk, its deltas, its finish chunk.

        False: the run failed before any event, nothing was written, and the
        attempt loop says retry.  The head (and the opening chunk) wait for
        the run's first event.
        """
        tools = leased.body.tools
        text_tools = _text_tools(leased, tools)
        self.text_tools = tools if text_tools else None
        self.asm, self.strict, self.tool_index = asm, strict, 0
        responder, chunks, leasing = self.responder, self.chunks, leased.leasing
        async with leased.session.open_stream(_chat_run(leased, text_tools)) as events:
            next_event = events.__anext__
            ev = await next_event()
            if not responder.started:
                if ev.kind == "error":
                    if _retry_before_event(leased, ev):
                        return False
                    raise run_error(ev)  # an HTTP error: no byte went out
                await _start_sse(self.call, responder)
            await responder.write(chunks.first(index))  # (the held head leaves with it)
            while True:
                kind = ev.kind
                if kind == "text":
                    asm.feed(ev)
                    if not text_tools:  # (with them the whole text decides: calls or text)
                        delta = strict.feed(ev.text) if strict else ev.text
                        if delta:
                            await responder.write(chunks.text(delta))
                elif kind == "reasoning":
                    asm.feed(ev)
                    await responder.write(chunks.reasoning(ev.text))
                elif kind == "tool_call":
                    ev = _restore_tool_event(ev, asm)
                    asm.feed(ev)
                    if ev.tool_call is not None:  # (an empty one is dropped, as asm does)
                        await responder.write(chunks.tool_call(self.tool_index, ev.tool_call))
                        self.tool_index += 1
                elif kind == "usage":
                    asm.feed(ev)
                elif kind == "complete":
                    asm.finish(ev)
                    leasing.succeeded()
                    await self._complete()
                    return True
                elif kind == "error":
                    _report_stream_error(leasing, ev, leased.lease.provider_type)
                    raise run_error(ev)
                ev = await next_event()

    async def _complete(self) -> None:
        """The run completed: the held-back text (or its tool calls), then the finish."""
        responder, chunks, asm, strict = self.responder, self.chunks, self.asm, self.strict
        finish = asm.finish_reason or "stop"
        if self.text_tools is not None:
            text = extract_completion(asm.text) if strict else asm.text
            res = parse_text_tool_calls(text, self.text_tools)
            if res.calls:
                if res.content:
                    await responder.write(chunks.text(res.content))
                for call in res.calls:
                    await responder.write(chunks.tool_call(self.tool_index, call))
                    self.tool_index += 1
                finish = "tool_calls"
            elif text:
                await responder.write(chunks.text(text))
        elif strict:
            rest = strict.flush()
            if rest:
                await responder.write(chunks.text(rest))
        if self.tool_index and finish == "stop":
            finish = "tool_calls"
        await responder.write(chunks.finish_choice(finish))


def _text_tools(leased: _Normalized, tools: list[JSONObject] | None) -> bool:
    """The caller sent tools and the provider is text-only: the <tool_call> protocol."""
    return bool(tools) and leased.lease.provider_type in TEXT_TOOL_TYPES


def _chat_run(leased: LeasedRequest[rq.ChatRequest], text_tools: bool) -> RunRequest:
    req = leased.body
    return _tools_run(leased, req.tools, text_tools, stream=req.stream)


def _tools_run(
    leased: _Normalized, tools: list[JSONObject] | None, text_tools: bool, *, stream: bool
) -> RunRequest:
    """The run of the caller's messages, its tools native or described as text."""
    prefix = _system_prefix(leased)
    if text_tools:
        prefix.append({"role": "system", "content": tool_instruction(tools or [])})
    return _run_request(
        leased,
        messages=prefix + leased.messages,
        tools=None if text_tools else tools,
        stream=stream,
    )


def _settle(
    leased: _Normalized,
    asm: CompletionAssembler,
    run: RunRequest,
    text_tools: list[JSONObject] | None,
) -> tuple[str | None, list[JSONObject] | None]:
    """A whole run's answer: (text override, tool calls override) for ``asm.result``.

    Strict output keeps the inside of ``<completion>``; with ``text_tools``
    the text's ``<tool_call>`` blocks become the calls (or stay text).
    """
    text_override: str | None = None
    calls_override: list[JSONObject] | None = None
    text = asm.text
    if leased.snap.config.openai.strict_output:
        text = extract_completion(text)
        text_override = text
    if text_tools:
        res = parse_text_tool_calls(text, text_tools)
        if res.calls:
            calls_override = res.calls
            text_override = res.content
        elif res.fallback:
            run.metadata["openai_text_tool_fallback"] = "true"
    return text_override, calls_override


# ------------------------------------------------------------- responses


async def responses_once(
    leased: LeasedRequest[rq.ResponsesRequest],
    responder: Responder,
    out: Outcome,
    ids: RequestIds,
) -> None:
    """A whole ``response`` object, sent once the run completed."""
    req = leased.body
    tools = req.function_tools
    while True:
        text_tools = _text_tools(leased, tools)
        run = _tools_run(leased, tools, text_tools, stream=False)
        asm = CompletionAssembler(completion_id="", model=req.model, created=0)
        try:
            done = await _collect(leased, run, asm, produced=False)
        finally:
            _account_run_usage([asm], out)
        if done:
            break
        leased = await leased.leasing.next_attempt()
    text, calls = _settle(leased, asm, run, tools if text_tools else None)
    if calls is not None:  # parsed tool calls: only the text outside the blocks
        text = text or ""
    doc = build_response(
        response_id=ids.new("resp"),
        model=req.model,
        created_at=int(time.time()),
        text=asm.text if text is None else text,
        reasoning_text=asm.reasoning_text,
        usage=asm.usage,
        metadata=_response_metadata(req),
        finish_reason=asm.finish_reason,
        tool_calls=asm.tool_calls if calls is None else calls,
        tools=req.tools,
    )
    out.answered(200)
    await responder.send(200, [("content-type", JSON)], _json_encode(doc))


async def responses_stream(
    leased: LeasedRequest[rq.ResponsesRequest],
    responder: Responder,
    call: Call,
    ids: RequestIds,
) -> None:
    """The Responses event stream of one run (``ResponseEvents``), written as
    its events arrive; text tools hold the text back until the end, as chat's.
    A run that fails before any event goes to the next leased provider when
    the attempt loop says so (the stream has not started)."""
    req = leased.body
    events = ResponseEvents(
        response_id=ids.new("resp"),
        model=req.model,
        created_at=int(time.time()),
        metadata=_response_metadata(req),
        tools=req.tools,
    )
    # A run that is retried produced nothing: asm and the filter stay empty.
    asm = CompletionAssembler(completion_id="", model=req.model, created=0)
    strict = StrictStreamFilter() if leased.snap.config.openai.strict_output else None
    try:
        while not await _responses_run(leased, responder, call, events, asm, strict):
            leased = await leased.leasing.next_attempt()
    finally:
        _account_run_usage([asm], call.out)


async def _responses_run(
    leased: LeasedRequest[rq.ResponsesRequest],
    responder: Responder,
    call: Call,
    events: ResponseEvents,
    asm: CompletionAssembler,
    strict: StrictStreamFilter | None,
) -> bool:
    """One attempt of :func:`responses_stream`; False: it failed before any
    event, nothing was written, and the attempt loop says retry."""
    tools = leased.body.function_tools
    text_tools = _text_tools(leased, tools)
    run = _tools_run(leased, tools, text_tools, stream=True)
    async with leased.session.open_stream(run) as stream:
        next_event = stream.__anext__
        ev = await next_event()
        if ev.kind == "error":
            if _retry_before_event(leased, ev):
                return False
            raise run_error(ev)  # an HTTP error: no byte went out
        await _start_sse(call, responder)
        await responder.write(events.start())  # (the held head leaves with it)
        while True:
            kind = ev.kind
            if kind == "text":
                asm.feed(ev)
                if not text_tools:
                    delta = strict.feed(ev.text) if strict else ev.text
                    if delta:
                        await responder.write(events.text(delta))
            elif kind == "reasoning":
                asm.feed(ev)
                if ev.text:
                    await responder.write(events.reasoning(ev.text))
            elif kind == "tool_call":
                ev = _restore_tool_event(ev, asm)
                asm.feed(ev)
                if ev.tool_call is not None:
                    await responder.write(events.function_call(ev.tool_call))
            elif kind == "usage":
                asm.feed(ev)
            elif kind == "complete":
                asm.finish(ev)
                leased.leasing.succeeded()
                await responder.write(_responses_tail(events, asm, strict, tools, text_tools))
                await responder.end()
                call.out.status = "ok"
                return True
            elif kind == "error":
                _report_stream_error(leased.leasing, ev, leased.lease.provider_type)
                raise run_error(ev)
            ev = await next_event()


def _responses_tail(
    events: ResponseEvents,
    asm: CompletionAssembler,
    strict: StrictStreamFilter | None,
    tools: list[JSONObject] | None,
    text_tools: bool,
) -> bytes:
    """The end of a Responses stream: held-back text or its tool calls, then
    ``response.completed``."""
    out = b""
    if text_tools:
        text = extract_completion(asm.text) if strict else asm.text
        res = parse_text_tool_calls(text, tools or [])
        if res.calls:
            if res.content:
                out += events.text(res.content)
            for tool_call in res.calls:
                out += events.function_call(tool_call)
        elif text:
            out += events.text(text)
    elif strict:
        rest = strict.flush()
        if rest:
            out += events.text(rest)
    return out + events.finish(asm.finish_reason, asm.usage)


def _response_metadata(req: rq.ResponsesRequest) -> dict[str, str]:
    return {k: v for k, v in req.metadata.items() if k != "workspace"}


# ------------------------------------------------------------------- run


def _system_prefix(leased: _Normalized) -> list[JSONObject]:
    """System messages the edge puts before the caller's on the normalized path."""
    oa = leased.snap.config.openai
    return [strict_system_message(oa.strict_output_instruction)] if oa.strict_output else []


def _run_request(
    leased: _Normalized,
    *,
    messages: list[JSONObject],
    tools: list[JSONObject] | None,
    stream: bool,
) -> RunRequest:
    """The ``RunRequest`` for the leased provider (only this path carries run metadata)."""
    lease, req, snap = leased.lease, leased.body, leased.snap
    md = dict(req.metadata)
    md.pop("workspace", None)
    md = snap.auth.apply_principal_metadata(md, leased.principal)
    md.update(
        openai_model=req.model,
        openai_stream="true" if stream else "false",
        strict_output="true" if snap.config.openai.strict_output else "false",
        estimated_input_tokens=str(leased.estimate),
        context_class=leased.context_class,
    )
    return RunRequest(
        stream_id=0,
        provider_id=lease.provider_id,
        adapter=lease.provider_type,
        target=lease.target,
        messages=messages,
        tools=tools,
        params=leased.params,
        metadata=md,
        workspace=req.workspace,
        stream=stream,
        long_context=lease.long,
    )


async def _collect(
    leased: _Normalized, run: RunRequest, asm: CompletionAssembler, *, produced: bool
) -> bool:
    """Run a normalized request to its end, feeding every event to ``asm``.

    False: the run failed before any event (and ``produced``: no earlier run
    of this request produced one) and the attempt loop says retry.
    """
    leasing = leased.leasing
    async with leased.session.open_stream(run) as events:
        async for ev in events:
            if ev.kind == "complete":
                asm.finish(ev)
                leasing.succeeded()
            elif ev.kind == "error":
                if _retry_before_event(leased, ev, produced=produced):
                    return False
                raise run_error(ev)
            else:
                produced = True
                asm.feed(_restore_tool_event(ev, asm))
    return True


async def _start_sse(call: Call, responder: Responder) -> None:
    """Start the SSE response, held: the head leaves with the first chunk written."""
    await responder.start(200, list(SSE_HEADERS), hold=True)
    call.sse_open = True
    call.out.http_status = 200


def _retry_before_event(leased: _Normalized, ev: RunEvent, *, produced: bool = False) -> bool:
    """A run's error before anything reached the caller: report it; True to retry.

    ``produced``: an earlier run of the request (a choice of ``n``) produced an event.
    """
    failure = run_failure(ev, leased.lease.provider_type, produced)
    if failure is None:
        return False
    return leased.leasing.failed(failure, False, retry_after=run_retry_after(ev))


def _report_stream_error(leasing: Leasing[Body], ev: RunEvent, provider_type: str) -> None:
    """A streamed run failed: the stream had started, so it is reported, never retried."""
    failure = run_failure(ev, provider_type, produced=True)
    if failure is not None:
        leasing.failed(failure, True, retry_after=run_retry_after(ev))


def _total_usage(asms: list[CompletionAssembler]) -> Usage | None:
    """The usage of the runs of one request (``n > 1``: their sum)."""
    if len(asms) == 1:
        return asms[0].usage
    total: Usage | None = None
    for asm in asms:
        total = add_usage(total, asm.usage)
    return total


def _account_run_usage(asms: list[CompletionAssembler], out: Outcome) -> None:
    """The request's usage record: all its runs (the cancelled one's so far)."""
    usage = _total_usage(asms)
    out.usage = run_event_usage(usage)
    out.reasoning_reported = bool(usage and usage.reasoning_tokens)
    out.reasoning_chars = sum(len(asm.reasoning_text) for asm in asms)
    text = sum(len(asm.text) for asm in asms)
    out.output_estimate = estimate_tokens_from_chars(text + out.reasoning_chars)


def _restore_tool_event(ev: RunEvent, asm: CompletionAssembler) -> RunEvent:
    if ev.kind != "tool_call" or ev.tool_call is None:
        return ev
    index = len(asm.tool_calls)
    return msgspec.structs.replace(ev, tool_call=restore_native_tool_call(ev.tool_call, index))
