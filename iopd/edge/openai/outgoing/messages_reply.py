"""Anthropic's Messages API going out: chat results as ``message`` objects and
events, and errors in Anthropic's envelope.

Pure.  The input is what the chat side produces, whoever produced it: a
``chat.completion`` (:func:`message_from_completion`) or the
``chat.completion.chunk`` stream (:class:`MessageEvents`), from an
OpenAI-compatible provider or from the edge's own normalized path.

The event stream is Anthropic's: ``message_start``, ``ping``, then per
content block ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``) /
``content_block_stop``, one block at a time, then ``message_delta`` (the
``stop_reason`` and the usage) and ``message_stop``.  A tool call's
arguments go out as the ``partial_json`` fragments they arrived in, so a
call split across many chunks reaches the caller whole; parallel calls are
one ``tool_use`` block each.  A fragment for a call whose block was already
closed (a provider interleaving two calls) is still sent, on that block's
index, where an index-keyed client (the SDKs) puts it.

Usage: Anthropic's ``input_tokens`` counts what was not read from the
cache, so it is the provider's prompt tokens less its cached ones, which are
``cache_read_input_tokens``.
"""

from __future__ import annotations

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue
from iopd.edge.openai.outgoing.error_envelope import ErrorShape
from iopd.edge.openai.outgoing.sse import read_chat_payload
from iopd.errors import GatewayError

__all__ = [
    "ANTHROPIC_ERRORS",
    "MAX_SSE_LINE",
    "MESSAGES_SSE_HEADERS",
    "MessageEvents",
    "SseLines",
    "error_envelope",
    "error_event",
    "error_type",
    "message_from_completion",
    "messages_usage",
    "stop_reason",
]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

MESSAGES_SSE_HEADERS: list[tuple[str, str]] = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),
]

#: Chat ``finish_reason`` → Messages ``stop_reason``.
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

#: Anthropic's error ``type`` by HTTP status (another 4xx is an
#: ``invalid_request_error``, another 5xx an ``api_error``).
_ERROR_TYPES = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: The longest SSE line of a chat stream parsed (a longer one is dropped).
MAX_SSE_LINE = 8 * 1024 * 1024


def stop_reason(finish_reason: str | None) -> str:
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def error_type(status: int) -> str:
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "invalid_request_error" if status < 500 else "api_error"


def error_envelope(status: int, message: str) -> JSONObject:
    """``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_event(status: int, message: str) -> bytes:
    """An error after the event stream started: Anthropic's ``error`` event."""
    return _event("error", error_envelope(status, message))


def _error_body(exc: GatewayError) -> bytes:
    return _encode(error_envelope(exc.status, exc.message))


def _error_sse(exc: GatewayError) -> bytes:
    return error_event(exc.status, exc.message)


#: The Messages routes' errors: Anthropic's envelope, and its ``error`` event
#: on a stream that already started.
ANTHROPIC_ERRORS = ErrorShape("anthropic", _error_body, _error_sse)


def messages_usage(usage: JSONValue, input_estimate: int = 0) -> JSONObject:
    """A chat ``usage`` object as Messages usage (the estimate when none was reported)."""
    if not isinstance(usage, dict):
        return {"input_tokens": input_estimate, "output_tokens": 0}
    prompt = _count(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return {
        "input_tokens": max(prompt - cached, 0),
        "output_tokens": _count(usage.get("completion_tokens")),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _count(value: JSONValue) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _tool_input(arguments: JSONValue) -> JSONValue:
    """A call's JSON ``arguments`` as the ``input`` object (not an object: ``{}``)."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = _decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_from_completion(
    doc: JSONObject, *, message_id: str, model: str, input_estimate: int = 0
) -> JSONObject:
    """A whole ``chat.completion`` as a Messages ``message`` (its first choice)."""
    choices = doc.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        message = {}
    content: list[JSONValue] = []
    thinking = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(thinking, str) and thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text = message.get("content")
    calls = message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    if isinstance(text, str) and (text or not calls):
        content.append({"type": "text", "text": text})
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        call_id = call.get("id")
        content.append(
            {
                "type": "tool_use",
                "id": call_id if isinstance(call_id, str) and call_id else f"toolu_{i}",
                "name": function.get("name") if isinstance(function.get("name"), str) else "",
                "input": _tool_input(function.get("arguments")),
            }
        )
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    reason = stop_reason(finish if isinstance(finish, str) else None)
    if calls and reason == "end_turn":
        reason = "tool_use"
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": None,
        "usage": messages_usage(doc.get("usage"), input_estimate),
    }


def _event(name: str, data: JSONValue) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class _Call:
    """One streamed tool call: its block once its name is known."""

    __slots__ = ("id", "name", "pending", "block")

    def __init__(self, index: int) -> None:
        self.id = f"toolu_{index}"
        self.name = ""
        self.pending = ""  # arguments that came before the name
        self.block: int | None = None


class MessageEvents:
    """A chat chunk stream in, Anthropic's event stream out (bytes)."""

    __slots__ = (
        "_message_id",
        "_model",
        "_estimate",
        "_open",
        "_open_kind",
        "_blocks",
        "_calls",
        "_finish",
        "_usage",
        "started",
        "done",
    )

    def __init__(self, *, message_id: str, model: str, input_estimate: int = 0) -> None:
        self._message_id = message_id
        self._model = model
        self._estimate = input_estimate
        self._open: int | None = None  # the index of the open block
        self._open_kind = ""
        self._blocks = 0  # blocks started
        self._calls: dict[int, _Call] = {}
        self._finish: str | None = None
        self._usage: JSONValue = None
        self.started = False
        self.done = False

    def start(self) -> bytes:
        """``message_start`` and a ``ping`` (once)."""
        if self.started:
            return b""
        self.started = True
        message: JSONObject = {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self._estimate,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _event(
            "ping", {"type": "ping"}
        )

    def data(self, payload: bytes) -> bytes:
        """One SSE ``data:`` payload of a chat stream (``[DONE]`` ends it)."""
        read = read_chat_payload(payload)
        if read.done:
            return self.finish()
        if read.error is not None:
            self.done = True
            return self.start() + error_event(500, read.error)
        return self.chunk(read.chunk) if read.chunk is not None else b""

    def chunk(self, doc: JSONObject) -> bytes:
        """One ``chat.completion.chunk``."""
        if self.done:
            return b""
        out = self.start()
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = doc.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict):
            return out
        delta = choice.get("delta")
        if isinstance(delta, dict):
            thinking = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thinking, str) and thinking:
                out += self._text_block("thinking", thinking)
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._text_block("text", text)
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                for position, call in enumerate(calls):
                    if isinstance(call, dict):
                        out += self._tool_fragment(call, position)
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish:
            self._finish = finish
        return out

    def finish(self) -> bytes:
        """The end: the open block's stop, ``message_delta``, ``message_stop`` (once)."""
        if self.done:
            return b""
        out = self.start()
        for call in self._calls.values():  # a call whose name never came: still a block
            if call.block is None:
                out += self._open_call(call)
        out += self._close()
        self.done = True
        reason = stop_reason(self._finish)
        if self._calls and reason == "end_turn":
            reason = "tool_use"
        delta: JSONObject = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": None},
            "usage": messages_usage(self._usage, self._estimate),
        }
        return (
            out + _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"})
        )

    # ------------------------------------------------------------ blocks

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        index, self._open, self._open_kind = self._open, None, ""
        return _event("content_block_stop", {"type": "content_block_stop", "index": index})

    def _begin(self, block: JSONObject, kind: str) -> tuple[bytes, int]:
        out = self._close()
        index = self._blocks
        self._blocks += 1
        self._open, self._open_kind = index, kind
        start: JSONObject = {"type": "content_block_start", "index": index, "content_block": block}
        return out + _event("content_block_start", start), index

    def _text_block(self, kind: str, text: str) -> bytes:
        out = b""
        if self._open_kind != kind:
            block: JSONObject = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            out, _ = self._begin(block, kind)
        assert self._open is not None
        delta: JSONObject = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        return out + _delta(self._open, delta)

    def _tool_fragment(self, fragment: JSONObject, position: int) -> bytes:
        index = fragment.get("index")
        key = index if isinstance(index, int) and not isinstance(index, bool) else position
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = _Call(len(self._calls))
        call_id = fragment.get("id")
        if isinstance(call_id, str) and call_id:
            call.id = call_id
        function = fragment.get("function")
        function = function if isinstance(function, dict) else {}
        name = function.get("name")
        if isinstance(name, str) and name and call.block is None:
            call.name += name
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else ""
        if call.block is None:
            if not call.name:
                call.pending += arguments
                return b""
            out = self._open_call(call)
            arguments, call.pending = call.pending + arguments, ""
        else:
            out = b""
        if arguments:
            out += _delta(call.block, {"type": "input_json_delta", "partial_json": arguments})
        return out

    def _open_call(self, call: _Call) -> bytes:
        block: JSONObject = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        out, call.block = self._begin(block, f"tool:{call.id}")
        if call.pending:
            out += _delta(call.block, {"type": "input_json_delta", "partial_json": call.pending})
            call.pending = ""
        return out


def _delta(index: int | None, delta: JSONObject) -> bytes:
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


class SseLines:
    """The ``data:`` payloads of an SSE byte stream, fed in pieces; a line
    longer than :data:`MAX_SSE_LINE` is dropped, never held whole."""

    __slots__ = ("_buf", "_skipping")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            piece = data[start:end]
            start = end + 1
            if self._skipping:
                self._skipping = False
                self._buf.clear()
                continue
            line = bytes(self._buf + piece) if self._buf else piece
            self._buf.clear()
            if line.endswith(b"\r"):
                line = line[:-1]
            if line.startswith(b"data:"):
                out.append(line[5:].lstrip(b" "))
        rest = data[start:]
        if not self._skipping:
            if len(self._buf) + len(rest) > MAX_SSE_LINE:
                self._skipping = True
                self._buf.clear()
            else:
                self._buf += rest
        return out
