"""Chat Completions on the normalized path: RunEvents → OpenAI objects.

Pure logic, no I/O.  :class:`CompletionAssembler` folds a run's events into
one ``chat.completion`` dict; :class:`ChunkStream` renders events as
``chat.completion.chunk`` SSE events as they arrive.  The shapes are the ones
the official ``openai`` SDK parses (checked in the tests with its pydantic
models).  ``model`` is always the caller's requested model (the group id),
never the provider's served name.

Reasoning text goes in ``reasoning_content`` (the vLLM/DeepSeek convention;
the SDK keeps unknown fields).  Usage maps the wire's ``Usage`` to OpenAI's
``prompt_tokens``/``completion_tokens`` with the detail objects only when the
provider reported reasoning or cached tokens.
"""

from __future__ import annotations

import secrets

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONObject
from iopd.edge.openai.outgoing.sse import SSE_DONE, sse_data
from iopd.edge.openai.outgoing.tools import restore_native_tool_call
from iopd.errors import ProviderError
from iopd.json_types import json_list
from wire.messages import RunEvent, Usage

__all__ = [
    "ChunkStream",
    "add_usage",
    "CompletionAssembler",
    "merge_usage",
    "new_completion_id",
    "openai_finish_reason",
    "usage_dict",
]

FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
TOOL_CALLS_METADATA_KEY = "openai_tool_calls"


def new_completion_id() -> str:
    """A fresh ``chatcmpl-`` id."""
    return "chatcmpl-" + secrets.token_hex(12)


def openai_finish_reason(reason: str | None, *, has_tool_calls: bool) -> str:
    """The OpenAI ``finish_reason`` for a run's reported reason.

    ``length`` and ``content_filter`` pass through; with tool calls the reason
    is ``tool_calls``; anything else (None, ``stop``, provider-specific values
    such as Ollama's ``load``) is ``stop``.  ``tool_calls`` without calls
    (e.g. after a text-protocol fallback) becomes ``stop``.
    """
    if reason in ("length", "content_filter"):
        return reason
    return "tool_calls" if has_tool_calls else "stop"


def merge_usage(current: Usage | None, update: Usage | None) -> Usage | None:
    """Later reports win field by field; a field reported as None keeps the earlier value."""
    if update is None:
        return current
    if current is None:
        return update
    return Usage(
        input_tokens=_pick(update.input_tokens, current.input_tokens),
        output_tokens=_pick(update.output_tokens, current.output_tokens),
        reasoning_tokens=_pick(update.reasoning_tokens, current.reasoning_tokens),
        cached_input_tokens=_pick(update.cached_input_tokens, current.cached_input_tokens),
    )


def _pick(new: int | None, old: int | None) -> int | None:
    return old if new is None else new


def add_usage(total: Usage | None, more: Usage | None) -> Usage | None:
    """The usage of two runs together (``n > 1``): each field summed, None where
    neither run reported it."""
    if more is None:
        return total
    if total is None:
        return more
    return Usage(
        input_tokens=_add(total.input_tokens, more.input_tokens),
        output_tokens=_add(total.output_tokens, more.output_tokens),
        reasoning_tokens=_add(total.reasoning_tokens, more.reasoning_tokens),
        cached_input_tokens=_add(total.cached_input_tokens, more.cached_input_tokens),
    )


def _add(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


def usage_dict(usage: Usage | None) -> JSONObject | None:
    """The OpenAI ``usage`` object for a wire ``Usage`` (None when nothing was reported).

    Unreported input/output count as 0; ``total_tokens`` = prompt + completion;
    ``completion_tokens_details.reasoning_tokens`` and
    ``prompt_tokens_details.cached_tokens`` appear only when known.
    """
    if usage is None:
        return None
    prompt = usage.input_tokens or 0
    completion = usage.output_tokens or 0
    out: JSONObject = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if usage.reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    if usage.cached_input_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_input_tokens}
    return out


def _metadata_tool_calls(event: RunEvent) -> list[JSONObject]:
    """Tool calls a node put in event metadata (``openai_tool_calls``, a JSON list)."""
    raw = event.metadata.get(TOOL_CALLS_METADATA_KEY)
    if not raw:
        return []
    try:
        calls = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise ProviderError("the provider's tool calls are not valid JSON") from None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ProviderError("the provider's tool calls are not a list of objects")
    return calls


class CompletionAssembler:
    """Folds the events of one normalized run into a ``chat.completion``.

    Call :meth:`feed` for every non-terminal event (text, reasoning,
    tool_call, usage), :meth:`finish` with the ``complete`` event, then
    :meth:`result`.  ``error`` events are not handled here: the caller maps
    them to a :class:`~iopd.errors.GatewayError`.

    The accumulated ``text``, ``reasoning_text``, ``tool_calls`` (OpenAI
    shape), ``usage`` (wire ``Usage`` or None), ``finish_reason`` (as the
    provider reported it) and ``metadata`` (merged event metadata) are public
    for the caller (metrics, text tool parsing, strict output).
    """

    def __init__(self, *, completion_id: str, model: str, created: int) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self.tool_calls: list[JSONObject] = []
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.metadata: dict[str, str] = {}
        self.finished = False

    @property
    def text(self) -> str:
        """All text deltas so far."""
        return "".join(self._text)

    @property
    def reasoning_text(self) -> str:
        """All reasoning deltas so far."""
        return "".join(self._reasoning)

    @property
    def saw_reasoning(self) -> bool:
        """True when any non-empty reasoning delta arrived."""
        return any(self._reasoning)

    def _add_tool_call(self, call: JSONObject) -> None:
        restored = restore_native_tool_call(call, len(self.tool_calls))
        if any(known["id"] == restored["id"] for known in self.tool_calls):
            return  # the same call reported both as an event and in metadata
        self.tool_calls.append(restored)

    def _absorb(self, event: RunEvent) -> None:
        if event.usage is not None:
            self.usage = merge_usage(self.usage, event.usage)
        if event.metadata:
            for call in _metadata_tool_calls(event):
                self._add_tool_call(call)
            self.metadata.update(event.metadata)

    def feed(self, event: RunEvent) -> None:
        """Take one non-terminal event (a ``complete`` event is passed to :meth:`finish`)."""
        match event.kind:
            case "text":
                self._text.append(event.text)
            case "reasoning":
                self._reasoning.append(event.text)
            case "tool_call":
                if event.tool_call is not None:
                    self._add_tool_call(event.tool_call)
            case "usage":
                pass
            case "complete":
                self.finish(event)
                return
            case _:
                raise ValueError(f"CompletionAssembler cannot take a {event.kind!r} event")
        self._absorb(event)

    def finish(self, event: RunEvent) -> None:
        """Take the terminal ``complete`` event (its usage, finish reason, metadata)."""
        if event.kind != "complete":
            raise ValueError(f"finish() needs the complete event, got {event.kind!r}")
        self.finish_reason = event.finish_reason
        self.finished = True
        self._absorb(event)

    def result(
        self,
        text_override: str | None = None,
        tool_calls_override: list[JSONObject] | None = None,
        index: int = 0,
    ) -> JSONObject:
        """The ``chat.completion`` dict.

        ``text_override`` replaces the accumulated text (strict output, text
        tool parsing); ``tool_calls_override`` replaces the native tool calls
        (parsed text tool calls; ``[]`` means none).  With tool calls, empty
        content is returned as None.  Parsed calls without a text override
        also give None content: the raw text holds the ``<tool_call>`` blocks,
        so ``result(res.content, res.calls)`` is right for a
        :class:`~iopd.edge.openai.outgoing.tools.TextToolResult` ``res`` either way.
        ``index`` is the choice's (``n > 1``: one assembler per choice).
        """
        calls = self.tool_calls if tool_calls_override is None else tool_calls_override
        if text_override is not None:
            content: str | None = text_override
        elif tool_calls_override:
            content = None
        else:
            content = self.text
        message: JSONObject = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = json_list(calls)
            if not content:
                message["content"] = None
        if self.saw_reasoning:
            message["reasoning_content"] = self.reasoning_text
        out: JSONObject = {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": openai_finish_reason(
                        self.finish_reason, has_tool_calls=bool(calls)
                    ),
                }
            ],
        }
        usage = usage_dict(self.usage)
        if usage is not None:
            out["usage"] = usage
        return out


class ChunkStream:
    """Renders one streamed completion as ``chat.completion.chunk`` SSE events.

    Call :meth:`first` once, then :meth:`text`/:meth:`reasoning`/
    :meth:`tool_call` per delta, then :meth:`finish` which also returns the
    usage chunk (when ``include_usage``) and ``data: [DONE]``.  With
    ``include_usage`` every other chunk carries ``"usage": null``, as OpenAI's
    do.

    With ``n > 1`` choices one after the other: :meth:`first` with each
    choice's index, its deltas, :meth:`finish_choice`, and after the last one
    :meth:`end` (usage and ``[DONE]``).  Every chunk carries its choice index.
    """

    def __init__(
        self, *, completion_id: str, model: str, created: int, include_usage: bool
    ) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.tool_calls_sent = 0
        #: The choice the chunks belong to (set by :meth:`first`).
        self.index = 0

    def _chunk(self, delta: JSONObject, finish_reason: str | None = None) -> bytes:
        chunk: JSONObject = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
        }
        if self.include_usage:
            chunk["usage"] = None
        return sse_data(chunk)

    def first(self, index: int = 0) -> bytes:
        """The opening chunk of choice ``index``: ``delta: {role: assistant, content: ""}``."""
        self.index = index
        self.tool_calls_sent = 0
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, delta: str) -> bytes:
        """A content delta."""
        return self._chunk({"content": delta})

    def reasoning(self, delta: str) -> bytes:
        """A reasoning delta (``delta.reasoning_content``)."""
        return self._chunk({"reasoning_content": delta})

    def tool_call(self, index: int, call: JSONObject) -> bytes:
        """One whole tool call (OpenAI shape, or native: it is restored) at ``index``."""
        restored = restore_native_tool_call(call, index)
        self.tool_calls_sent += 1
        return self._chunk({"tool_calls": [{"index": index, **restored}]})

    def finish(self, finish_reason: str | None, usage: Usage | None) -> bytes:
        """The finishing chunk, the usage chunk (if asked for) and ``[DONE]``.

        ``finish_reason`` is normalised like the non-streaming one: with tool
        calls sent it becomes ``tool_calls`` unless it is ``length``.
        """
        return self.finish_choice(finish_reason) + self.end(usage)

    def finish_choice(self, finish_reason: str | None) -> bytes:
        """The finishing chunk of the current choice (its reason normalised)."""
        reason = openai_finish_reason(finish_reason, has_tool_calls=self.tool_calls_sent > 0)
        return self._chunk({}, reason)

    def end(self, usage: Usage | None) -> bytes:
        """After the last choice: the usage chunk (if asked for) and ``[DONE]``."""
        out = b""
        if self.include_usage:
            out += sse_data(
                {
                    "id": self.completion_id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage_dict(usage),
                }
            )
        return out + SSE_DONE
