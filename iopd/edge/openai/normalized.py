"""The normalized path: a ``RunRequest`` to the node, its ``RunEvent``s back as
OpenAI objects.

Four shapes of answer: a whole ``chat.completion`` (:func:`chat_once`), a
``chat.completion.chunk`` SSE stream (:func:`chat_stream`) — one run per
choice (``n``), one after the other under the one lease — and a whole
``/v1/responses`` object (:func:`responses_once`) or its event stream
(:func:`responses_stream`), one run each.  The pure rendering lives in ``chat.py`` and
``responses.py``; here are the run, the edge's system messages (strict
output, the text tool protocol), text tool parsing, and the usage record.

Every run goes through one event loop, :func:`_run_events`: it feeds each
event to the run's ``CompletionAssembler``, reports the run's end to the
retry policy, and hands what the caller may see to the answer's
:class:`_Answer` (the strategy: nothing for a whole answer, chat chunks
for :class:`_ChatStream`, Responses events for :class:`_ResponsesStream`).
A streamed run's end is :func:`_held_back`: the text held back for strict
output or the text tool protocol, and the tool calls found in it.

Retries: a run that fails before anything reached the caller reports it to
the request's retry policy (``leased.attempts.failed``) and, on ``RETRY``,
returns; ``prepare.until_done`` runs it again on the next leased provider.
That holds for the streamed answers too: their response head waits for the
run's first event (it leaves, held, with the stream's first chunk, so the
first chunk comes no later), and a run that fails before it can still go
elsewhere or end with a plain HTTP error.  Once a byte went out, or the
first choice of ``n`` produced one, nothing is retried; neither is a ``cli``
run whose process had started.
"""

from __future__ import annotations

import time
from typing import cast

import msgspec

from iopd.edge.openai.attempts import AttemptVerdict
from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.jsonschema import JSONArray, JSONObject
from iopd.edge.openai.lifecycle import (
    TEXT_TOOL_TYPES,
    Call,
    Outcome,
    RequestIds,
    note_run_usage,
    total_usage,
)
from iopd.edge.openai.outgoing.chat import ChunkStream, CompletionAssembler, usage_dict
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
from iopd.edge.openai.prepare import LeasedRequest, until_done
from iopd.edge.openai.run_errors import run_error, run_failure, run_retry_after
from iopd.http.server import Responder
from wire.messages import RunEvent, RunRequest

__all__ = ["chat_once", "chat_stream", "responses_once", "responses_stream"]

#: A request on the normalized path (``/api/*`` is only ever relayed).
_Normalized = LeasedRequest[rq.ChatRequest] | LeasedRequest[rq.ResponsesRequest]

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode


# ------------------------------------------------------------ the event loop


class _Answer:
    """How a run's events reach the caller: a whole answer's strategy (nothing
    until the run is over); the streamed answers override it.  The per-event
    methods give the bytes to write (b"": none), so an event costs no coroutine.
    """

    __slots__ = ()

    #: The streaming filter of ``openai.strict_output`` (None: text goes as it comes).
    strict: StrictStreamFilter | None = None
    #: The text tool protocol is on: the text is held back, the whole decides.
    text_tools: bool = False

    @property
    def visible(self) -> bool:
        """A byte of the answer reached the caller (the head included)."""
        return False

    async def begin(self) -> None:
        """The run's first event that is not an error arrived."""

    def text(self, delta: str) -> bytes:
        return b""

    def reasoning(self, text: str) -> bytes:
        return b""

    def tool_call(self, call: JSONObject) -> bytes:
        return b""

    async def complete(self, asm: CompletionAssembler) -> None:
        """The run completed (its ``complete`` event is in ``asm``)."""


#: The strategy of every whole answer (stateless: one for all).
_WHOLE = _Answer()


async def _run_events(
    leased: _Normalized,
    run: RunRequest,
    asm: CompletionAssembler,
    answer: _Answer,
    responder: Responder | None = None,
    *,
    produced: bool = False,
) -> bool:
    """Run ``run`` on the leased provider to its end: every event into
    ``asm``, what the caller sees through ``answer`` to ``responder``.

    True: the run completed.  False: it failed while nothing had reached the
    caller and the retry policy said ``RETRY`` (the run is left: the node
    cancels it).  ``produced``: an earlier run of this request (a choice of
    ``n``) already produced an event.
    """
    attempts, began = leased.attempts, False
    async with leased.session.open_stream(run) as events:
        async for ev in events:
            kind = ev.kind
            if kind == "error":
                # Safe to run again elsewhere only while the caller saw nothing
                # of it: a second run's text cannot be spliced behind the first's.
                # A stream's head waits, held, for the first event for that
                # reason; a whole answer is sent only once complete.
                failure = run_failure(ev, leased.lease.provider_type, produced or began)
                if failure is not None:
                    visible = answer.visible
                    verdict = attempts.failed(
                        failure, caller_saw_bytes=visible, retry_after=run_retry_after(ev)
                    )
                    if verdict is AttemptVerdict.RETRY and not visible:
                        return False
                raise run_error(ev)  # (before any byte: a plain HTTP error)
            if not began:
                began = True
                await answer.begin()
            data = b""
            if kind == "text":
                asm.feed(ev)
                if not answer.text_tools:  # (with them the whole text decides: calls or text)
                    strict = answer.strict
                    delta = strict.feed(ev.text) if strict else ev.text
                    if delta:
                        data = answer.text(delta)
            elif kind == "reasoning":
                asm.feed(ev)
                data = answer.reasoning(ev.text)
            elif kind == "tool_call":
                ev = _restore_tool_event(ev, asm)
                asm.feed(ev)
                if ev.tool_call is not None:  # (an empty one is dropped, as asm does)
                    data = answer.tool_call(ev.tool_call)
            elif kind == "usage":
                asm.feed(ev)
            elif kind == "complete":
                asm.finish(ev)
                attempts.succeeded()
                await answer.complete(asm)
                return True
            if data and responder is not None:
                await responder.write(data)
    return True  # (the node ends every stream with complete or error)


def _held_back(
    asm: CompletionAssembler, strict: StrictStreamFilter | None, tools: list[JSONObject] | None
) -> tuple[str, list[JSONObject]]:
    """The end of a streamed run: (text still to send, tool calls found in it):
    with ``tools`` (the text tool protocol) the held-back text's ``<tool_call>``
    blocks become calls; with strict output, the filter's last piece."""
    if tools is not None:
        text = extract_completion(asm.text) if strict else asm.text
        res = parse_text_tool_calls(text, tools)
        return (res.content or "", res.calls) if res.calls else (text, [])
    return (strict.flush() if strict else ""), []


# ------------------------------------------------------------------ chat


async def chat_once(
    leased: LeasedRequest[rq.ChatRequest], responder: Responder, call: Call, ids: RequestIds
) -> None:
    """A whole ``chat.completion``, sent once the run (one per choice) completed.

    ``n > 1`` runs the request ``n`` times, one after the other under the one
    lease (it holds one provider slot); the choices are indexed 0..n-1 and the
    usage is the runs' sum.  Nothing is sent before the last one completed,
    so a failed choice retries them all on the next provider.
    """
    out = call.out
    completion_id, created = ids.new("chatcmpl"), int(time.time())
    choices: list[tuple[JSONObject, CompletionAssembler]] = []

    async def attempt(leased: LeasedRequest[rq.ChatRequest]) -> bool:
        nonlocal choices
        got = await _chat_choices(leased, out, completion_id, created)
        choices = got or []
        return got is not None

    await until_done(leased, attempt)
    result = choices[0][0]
    if len(choices) > 1:
        result["choices"] = [cast(JSONArray, doc["choices"])[0] for doc, _ in choices]
        usage = usage_dict(total_usage([asm for _, asm in choices]))
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
            run = _tools_run(leased, req.tools, text_tools, stream=False)
            if not await _run_events(leased, run, asm, _WHOLE, produced=index > 0):
                return None
            text, calls = _settle(leased, asm, run, req.tools if text_tools else None)
            doc = asm.result(text_override=text, tool_calls_override=calls, index=index)
            choices.append((doc, asm))
    finally:
        note_run_usage(asms, out)
    return choices


async def chat_stream(
    leased: LeasedRequest[rq.ChatRequest], responder: Responder, call: Call, ids: RequestIds
) -> None:
    """A ``chat.completion.chunk`` SSE stream, written as the run's events arrive.

    With ``n > 1`` the choices' runs stream one after the other, each chunk
    with its choice's index; the usage chunk (when asked for) is their sum.
    A first run that fails before any event goes to the next leased provider
    when the retry policy says so (the stream has not started).
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
            leased = await until_done(leased, stream.run, index, asm, filt)
        await responder.write(stream.chunks.end(total_usage(asms)))
        call.out.status = "ok"  # the final chunk went out: a caller closing now had it all
        await responder.end()
    finally:
        note_run_usage(asms, call.out)


class _ChatStream(_Answer):
    """One streamed completion: run events in, SSE chunks out (one run per choice)."""

    __slots__ = ("call", "responder", "chunks", "index", "strict", "text_tools", "tools", "tool_index")

    def __init__(self, call: Call, responder: Responder, chunks: ChunkStream) -> None:
        self.call = call
        self.responder = responder
        self.chunks = chunks
        self.index = 0
        self.strict: StrictStreamFilter | None = None
        self.text_tools = False
        #: The caller's tools when they go through the text protocol (per run:
        #: the leased provider decides): the whole text decides calls or text.
        self.tools: list[JSONObject] | None = None
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
        retry policy says retry.  The head (and the opening chunk) wait for
        the run's first event.
        """
        tools = leased.body.tools
        text_tools = _text_tools(leased, tools)
        self.text_tools, self.tools = text_tools, tools if text_tools else None
        self.index, self.strict, self.tool_index = index, strict, 0
        run = _tools_run(leased, tools, text_tools, stream=True)
        return await _run_events(leased, run, asm, self, self.responder, produced=index > 0)

    @property
    def visible(self) -> bool:
        return self.responder.started

    async def begin(self) -> None:
        if not self.responder.started:
            await _start_sse(self.call, self.responder)
        await self.responder.write(self.chunks.first(self.index))  # (the held head leaves with it)

    def text(self, delta: str) -> bytes:
        return self.chunks.text(delta)

    def reasoning(self, text: str) -> bytes:
        return self.chunks.reasoning(text)

    def tool_call(self, call: JSONObject) -> bytes:
        self.tool_index += 1
        return self.chunks.tool_call(self.tool_index - 1, call)

    async def complete(self, asm: CompletionAssembler) -> None:
        """The held-back text (or its tool calls), then the choice's finish."""
        responder, chunks = self.responder, self.chunks
        text, calls = _held_back(asm, self.strict, self.tools)
        if text:
            await responder.write(chunks.text(text))
        for call in calls:
            await responder.write(self.tool_call(call))
        finish = "tool_calls" if calls else asm.finish_reason or "stop"
        if self.tool_index and finish == "stop":
            finish = "tool_calls"
        await responder.write(chunks.finish_choice(finish))


def _text_tools(leased: _Normalized, tools: list[JSONObject] | None) -> bool:
    """The caller sent tools and the provider is text-only: the <tool_call> protocol."""
    return bool(tools) and leased.lease.provider_type in TEXT_TOOL_TYPES


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
    call: Call,
    ids: RequestIds,
) -> None:
    """A whole ``response`` object, sent once the run completed."""
    req, out = leased.body, call.out
    tools = req.function_tools
    asm = CompletionAssembler(completion_id="", model=req.model, created=0)
    text_tools, run = False, None

    async def attempt(leased: LeasedRequest[rq.ResponsesRequest]) -> bool:
        nonlocal asm, text_tools, run
        text_tools = _text_tools(leased, tools)
        run = _tools_run(leased, tools, text_tools, stream=False)
        asm = CompletionAssembler(completion_id="", model=req.model, created=0)
        try:
            return await _run_events(leased, run, asm, _WHOLE)
        finally:
            note_run_usage([asm], out)

    leased = await until_done(leased, attempt)
    assert run is not None
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
    the retry policy says so (the stream has not started)."""
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
    stream = _ResponsesStream(call, responder, events, strict)
    try:
        await until_done(leased, stream.run, asm)
    finally:
        note_run_usage([asm], call.out)


class _ResponsesStream(_Answer):
    """One streamed response: run events in, Responses events out."""

    __slots__ = ("call", "responder", "events", "strict", "text_tools", "tools")

    def __init__(
        self, call: Call, responder: Responder, events: ResponseEvents, strict: StrictStreamFilter | None
    ) -> None:
        self.call = call
        self.responder = responder
        self.events = events
        self.strict = strict
        self.text_tools = False
        self.tools: list[JSONObject] | None = None  # as _ChatStream's

    async def run(self, leased: LeasedRequest[rq.ResponsesRequest], asm: CompletionAssembler) -> bool:
        """One attempt of :func:`responses_stream`; False: it failed before any
        event, nothing was written, and the retry policy says retry."""
        tools = leased.body.function_tools
        text_tools = _text_tools(leased, tools)
        self.text_tools, self.tools = text_tools, (tools or []) if text_tools else None
        run = _tools_run(leased, tools, text_tools, stream=True)
        return await _run_events(leased, run, asm, self, self.responder)

    @property
    def visible(self) -> bool:
        return self.responder.started

    async def begin(self) -> None:
        await _start_sse(self.call, self.responder)
        await self.responder.write(self.events.start())  # (the held head leaves with it)

    def text(self, delta: str) -> bytes:
        return self.events.text(delta)

    def reasoning(self, text: str) -> bytes:
        return self.events.reasoning(text) if text else b""

    def tool_call(self, call: JSONObject) -> bytes:
        return self.events.function_call(call)

    async def complete(self, asm: CompletionAssembler) -> None:
        """The held-back text or its tool calls, then ``response.completed``:
        one write, and the stream's end."""
        events = self.events
        text, calls = _held_back(asm, self.strict, self.tools)
        tail = events.text(text) if text else b""
        for tool_call in calls:
            tail += events.function_call(tool_call)
        await self.responder.write(tail + events.finish(asm.finish_reason, asm.usage))
        self.call.out.status = "ok"  # response.completed went out (see chat_stream)
        await self.responder.end()


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
        params=leased.decision.params,
        metadata=md,
        workspace=req.workspace,
        stream=stream,
        long_context=lease.long,
    )


async def _start_sse(call: Call, responder: Responder) -> None:
    """Start the SSE response, held: the head leaves with the first chunk written."""
    await responder.start(200, list(SSE_HEADERS), hold=True)
    call.sse_open = True
    call.out.http_status = 200


def _restore_tool_event(ev: RunEvent, asm: CompletionAssembler) -> RunEvent:
    if ev.kind != "tool_call" or ev.tool_call is None:
        return ev
    index = len(asm.tool_calls)
    return msgspec.structs.replace(ev, tool_call=restore_native_tool_call(ev.tool_call, index))
