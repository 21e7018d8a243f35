"""The normalized path: a ``RunRequest`` to the node, its ``RunEvent``s back as
OpenAI objects (SPEC §4).

Three shapes of answer, one run each: a whole ``chat.completion``
(:func:`chat_once`), a ``chat.completion.chunk`` SSE stream
(:func:`chat_stream`), and a whole ``/v1/responses`` object
(:func:`responses_once`).  The pure rendering lives in ``chat.py`` and
``responses.py``; here are the run, the edge's system messages (strict
output, the text tool protocol), text tool parsing, and the usage record.
"""

from __future__ import annotations

import time

import msgspec

from iopd import errors
from iopd.edge.node_session import NodeSession
from iopd.edge.openai import requests as rq
from iopd.edge.openai.chat import ChunkStream, CompletionAssembler
from iopd.edge.openai.jsonschema import JSONObject
from iopd.edge.openai.lifecycle import TEXT_TOOL_TYPES, Call, Outcome, RequestIds
from iopd.edge.openai.prepare import LeasedRequest
from iopd.edge.openai.responses import build_response
from iopd.edge.openai.sse import SSE_HEADERS
from iopd.edge.openai.strict import StrictStreamFilter, extract_completion, strict_system_message
from iopd.edge.openai.tools import parse_text_tool_calls, restore_native_tool_call, tool_instruction
from iopd.edge.usage import run_event_usage
from iopd.http.server import Responder
from wire.messages import RunEvent, RunRequest

__all__ = ["chat_once", "chat_stream", "responses_once"]

#: A request on the normalized path (``/api/*`` is only ever relayed).
_Normalized = LeasedRequest[rq.ChatRequest] | LeasedRequest[rq.ResponsesRequest]

JSON = "application/json"
_json_encode = msgspec.json.Encoder().encode


# ------------------------------------------------------------------ chat


async def chat_once(
    leased: LeasedRequest[rq.ChatRequest], responder: Responder, out: Outcome, ids: RequestIds
) -> None:
    """A whole ``chat.completion``, sent once the run completed."""
    req = leased.body
    text_tools = _text_tools(leased)
    asm = CompletionAssembler(
        completion_id=ids.new("chatcmpl"), model=req.model, created=int(time.time())
    )
    run = _chat_run(leased, text_tools)
    await _collect(leased.session, run, asm, out)
    text_override: str | None = None
    calls_override: list[JSONObject] | None = None
    text = asm.text
    if leased.snap.config.openai.strict_output:
        text = extract_completion(text)
        text_override = text
    if text_tools:
        res = parse_text_tool_calls(text, req.tools or [])
        if res.calls:
            calls_override = res.calls
            text_override = res.content
        elif res.fallback:
            run.metadata["openai_text_tool_fallback"] = "true"
    result = asm.result(text_override=text_override, tool_calls_override=calls_override)
    out.answered(200)
    await responder.send(200, [("content-type", JSON)], _json_encode(result))


async def chat_stream(
    leased: LeasedRequest[rq.ChatRequest], responder: Responder, call: Call, ids: RequestIds
) -> None:
    """A ``chat.completion.chunk`` SSE stream, written as the run's events arrive."""
    req = leased.body
    text_tools = _text_tools(leased)
    stream = _ChatStream(
        call,
        responder,
        ChunkStream(
            completion_id=ids.new("chatcmpl"),
            model=req.model,
            created=int(time.time()),
            include_usage=req.include_usage,
        ),
        # accounting only: the caller sees the chunks
        CompletionAssembler(completion_id="", model=req.model, created=0),
        StrictStreamFilter() if leased.snap.config.openai.strict_output else None,
        req.tools if text_tools else None,
    )
    try:
        await stream.run(leased.session, _chat_run(leased, text_tools))
    finally:
        _account_run_usage(stream.asm, call.out)


class _ChatStream:
    """One streamed completion: run events in, SSE chunks out."""

    __slots__ = ("call", "responder", "chunks", "asm", "strict", "text_tools", "tool_index")

    def __init__(
        self,
        call: Call,
        responder: Responder,
        chunks: ChunkStream,
        asm: CompletionAssembler,
        strict: StrictStreamFilter | None,
        text_tools: list[JSONObject] | None,
    ) -> None:
        self.call = call
        self.responder = responder
        self.chunks = chunks
        self.asm = asm
        self.strict = strict
        #: The caller's tools when they go through the text protocol: the
        #: whole text then decides between tool calls and text.
        self.text_tools = text_tools
        self.tool_index = 0

    async def run(self, session: NodeSession, run: RunRequest) -> None:
        responder, chunks, asm, strict = self.responder, self.chunks, self.asm, self.strict
        text_tools = self.text_tools is not None
        async with session.open_stream(run) as events:
            await responder.start(200, list(SSE_HEADERS))
            self.call.sse_open = True
            self.call.out.http_status = 200
            await responder.write(chunks.first())
            async for ev in events:
                kind = ev.kind
                if kind == "text":
                    asm.feed(ev)
                    if text_tools:
                        continue  # the whole text decides: tool calls or text
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
                    await self._complete()
                    self.call.out.status = "ok"
                    return
                elif kind == "error":
                    raise _run_error(ev)

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
        await responder.write(chunks.finish(finish, asm.usage))
        await responder.end()


def _text_tools(leased: LeasedRequest[rq.ChatRequest]) -> bool:
    """The caller sent tools and the provider is text-only: the <tool_call> protocol."""
    return bool(leased.body.tools) and leased.lease.provider_type in TEXT_TOOL_TYPES


def _chat_run(leased: LeasedRequest[rq.ChatRequest], text_tools: bool) -> RunRequest:
    req = leased.body
    prefix = _system_prefix(leased)
    if text_tools:
        prefix.append({"role": "system", "content": tool_instruction(req.tools or [])})
    return _run_request(
        leased,
        messages=prefix + leased.messages,
        tools=None if text_tools else req.tools,
        stream=req.stream,
    )


# ------------------------------------------------------------- responses


async def responses_once(
    leased: LeasedRequest[rq.ResponsesRequest],
    responder: Responder,
    out: Outcome,
    ids: RequestIds,
) -> None:
    """A whole ``response`` for a non-streaming string ``input``."""
    req = leased.body
    run = _run_request(
        leased, messages=_system_prefix(leased) + leased.messages, tools=None, stream=False
    )
    asm = CompletionAssembler(completion_id="", model=req.model, created=0)
    await _collect(leased.session, run, asm, out)
    text = asm.text
    if leased.snap.config.openai.strict_output:
        text = extract_completion(text)
    doc = build_response(
        response_id=ids.new("resp"),
        model=req.model,
        created_at=int(time.time()),
        text=text,
        reasoning_text=asm.reasoning_text,
        usage=asm.usage,
        metadata={k: v for k, v in req.metadata.items() if k != "workspace"},
    )
    out.answered(200)
    await responder.send(200, [("content-type", JSON)], _json_encode(doc))


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
        adapter=lease.provider_type,  # type: ignore[arg-type]
        target=lease.target,
        messages=messages,
        tools=tools,
        params=leased.params,
        metadata=md,
        workspace=req.workspace,
        stream=stream,
    )


async def _collect(
    session: NodeSession, run: RunRequest, asm: CompletionAssembler, out: Outcome
) -> None:
    """Run a normalized request to its end, feeding every event to ``asm``."""
    try:
        async with session.open_stream(run) as events:
            async for ev in events:
                if ev.kind == "complete":
                    asm.finish(ev)
                elif ev.kind == "error":
                    raise _run_error(ev)
                else:
                    asm.feed(_restore_tool_event(ev, asm))
    finally:
        _account_run_usage(asm, out)


def _account_run_usage(asm: CompletionAssembler, out: Outcome) -> None:
    usage = asm.usage
    out.usage = run_event_usage(usage)
    out.reasoning_reported = bool(usage and usage.reasoning_tokens)
    out.reasoning_chars = len(asm.reasoning_text)


def _restore_tool_event(ev: RunEvent, asm: CompletionAssembler) -> RunEvent:
    if ev.kind != "tool_call" or ev.tool_call is None:
        return ev
    index = len(asm.tool_calls)
    return msgspec.structs.replace(ev, tool_call=restore_native_tool_call(ev.tool_call, index))


def _run_error(ev: RunEvent) -> errors.GatewayError:
    msg = ev.message or "the provider failed"
    if ev.code == "provider_timeout":
        return errors.ProviderTimeout(msg)
    if ev.code == "bad_request":
        return errors.InvalidRequest(msg)
    if ev.code in ("node_lost", "node_dispatch_error"):
        return errors.NodeDispatchError(msg)
    return errors.ProviderError(msg)
