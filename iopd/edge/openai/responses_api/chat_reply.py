"""A chat provider's answer as a ``/v1/responses`` answer.  Pure.

The objects and events are the normalized path's (``outgoing/responses.py``:
``build_response`` and ``ResponseEvents``), so a caller cannot tell a
translated provider from a normalized one: a whole ``chat.completion``
becomes the ``response`` object (:func:`response_from_completion`); a
``chat.completion.chunk`` stream becomes the Responses event stream
(:class:`ChunkEvents`).  Text and reasoning deltas go out as they arrive; a
tool call's arguments arrive in fragments (keyed by the call's ``index``,
several calls possibly interleaved) and each call goes out whole, as a
``function_call`` item (a ``custom_tool_call`` for a custom tool, with its
``namespace`` for a flattened one) once the provider's stream ended, then
``response.completed`` (``response.incomplete`` at the token limit) with the
usage of the stream's last chunk.
"""

from __future__ import annotations

from iopd import errors
from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue
from iopd.edge.openai.outgoing.error_envelope import OPENAI_ERRORS
from iopd.edge.openai.outgoing.responses import ResponseEvents, build_response
from iopd.edge.openai.outgoing.sse import read_chat_payload
from wire.messages import Usage

__all__ = ["MAX_CALLS", "ChunkEvents", "chat_usage", "response_from_completion"]

#: Most distinct tool calls kept from one stream (more are dropped).
MAX_CALLS = 128
#: Most characters of tool-call arguments held from one stream.
MAX_ARGUMENT_CHARS = 32 * 1024 * 1024


def chat_usage(value: JSONValue) -> Usage | None:
    """Chat's ``usage`` (``prompt_tokens``, ``completion_tokens``, their details)."""
    if not isinstance(value, dict):
        return None
    usage = Usage(input_tokens=_count(value.get("prompt_tokens")))
    usage.output_tokens = _count(value.get("completion_tokens"))
    details = value.get("prompt_tokens_details")
    if isinstance(details, dict):
        usage.cached_input_tokens = _count(details.get("cached_tokens"))
    details = value.get("completion_tokens_details")
    if isinstance(details, dict):
        usage.reasoning_tokens = _count(details.get("reasoning_tokens"))
    return usage


def _count(value: JSONValue) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return max(0, int(value))


def _reasoning(fields: JSONObject) -> str:
    value = fields.get("reasoning_content") or fields.get("reasoning")
    return value if isinstance(value, str) else ""


def response_from_completion(
    doc: JSONObject,
    *,
    response_id: str,
    model: str,
    created_at: int,
    metadata: dict[str, str] | None,
    tools: list[JSONObject] | None,
) -> JSONObject:
    """A whole ``chat.completion`` as the ``response`` object."""
    choices = doc.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    choice = choice if isinstance(choice, dict) else {}
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    calls = message.get("tool_calls")
    finish = choice.get("finish_reason")
    return build_response(
        response_id=response_id,
        model=model,
        created_at=created_at,
        text=content if isinstance(content, str) else "",
        reasoning_text=_reasoning(message),
        usage=chat_usage(doc.get("usage")),
        metadata=metadata,
        finish_reason=finish if isinstance(finish, str) else None,
        tool_calls=[c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else None,
        tools=tools,
    )


class _Call:
    """One streamed tool call, its fragments joined."""

    __slots__ = ("id", "name", "arguments")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []

    def whole(self) -> JSONObject:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": "".join(self.arguments)},
        }


class ChunkEvents:
    """Chat chunks in, Responses events out (see the module docstring).

    :meth:`data` takes each SSE ``data:`` payload of the chat stream
    (``[DONE]`` ends it); :meth:`finish` ends it where the stream ended
    without one.  Each gives the bytes to write to the caller.
    """

    __slots__ = ("_events", "_started", "_calls", "_chars", "_finish", "_usage", "done")

    def __init__(self, events: ResponseEvents) -> None:
        self._events = events
        self._started = False
        self._calls: dict[int, _Call] = {}  # by the chunks' index, in arrival order
        self._chars = 0
        self._finish: str | None = None
        self._usage: Usage | None = None
        self.done = False

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self._events.start()

    def data(self, payload: bytes) -> bytes:
        """One SSE ``data:`` payload of a chat stream."""
        if self.done:
            return b""
        read = read_chat_payload(payload)
        if read.done:
            return self.finish()
        if read.error is not None:
            self.done = True
            exc = errors.ProviderError(read.error or "the provider failed")
            return self._start() + OPENAI_ERRORS.sse_event(exc)
        return self.chunk(read.chunk) if read.chunk is not None else b""

    def chunk(self, doc: JSONObject) -> bytes:
        """One ``chat.completion.chunk``."""
        out = self._start()
        usage = chat_usage(doc.get("usage"))
        if usage is not None:
            self._usage = usage
        choices = doc.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return out
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self._finish = finish
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return out
        thinking = _reasoning(delta)
        if thinking:
            out += self._events.reasoning(thinking)
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._events.text(text)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for fragment in calls:
                if isinstance(fragment, dict):
                    self._fragment(fragment)
        return out

    def _fragment(self, fragment: JSONObject) -> None:
        index = fragment.get("index")
        key = index if isinstance(index, int) and not isinstance(index, bool) else len(self._calls)
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) >= MAX_CALLS:
                return
            call = self._calls[key] = _Call()
        call_id = fragment.get("id")
        if isinstance(call_id, str) and call_id:
            call.id = call_id
        fn = fragment.get("function")
        if isinstance(fn, dict):
            name = fn.get("name")
            if isinstance(name, str) and name:
                call.name = name
            arguments = fn.get("arguments")
            if isinstance(arguments, str):
                self._chars += len(arguments)
                if self._chars > MAX_ARGUMENT_CHARS:
                    raise errors.ProviderError("the provider's tool calls are too large")
                call.arguments.append(arguments)

    def finish(self) -> bytes:
        """The tool calls, then ``response.completed`` (once; b"" after)."""
        if self.done:
            return b""
        self.done = True
        out = self._start()
        for position, call in enumerate(self._calls.values()):
            if not call.name:
                continue  # a fragment without its call: nothing to run
            if not call.id:
                call.id = f"call_{position}"
            out += self._events.function_call(call.whole())
        finish = self._finish
        if finish == "stop" and self._calls:
            finish = "tool_calls"
        return out + self._events.finish(finish, self._usage)
