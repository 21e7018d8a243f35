"""``/v1/responses`` on the normalized path: pure logic.

Providers without a native Responses API (``ollama``, ``cli``, ``echo``) run a
Responses request the way they run a chat completion, translated here:

- ``input``: a string, or a list of items as the SDK and LangChain send
  them: messages (roles ``user``, ``system``, ``developer``, ``assistant``;
  string content or ``input_text``/``output_text``/``input_image`` parts),
  the ``function_call``/``custom_tool_call`` items of a tool loop and their
  ``*_output`` items, and ``reasoning`` items (dropped: a provider cannot
  take its earlier thinking back; so is the record of a built-in tool's
  call).  ``instructions`` becomes the first system message
  (:func:`responses_input_to_messages`).
- ``tools``, as :mod:`iopd.edge.openai.incoming.responses_tools` plans them
  (function tools, custom tools as a function of one string, namespaces
  flattened), take the chat tools' path (native on ``ollama``, the
  ``<tool_call>`` protocol on text-only providers); the calls come back as
  ``function_call`` output items, or ``custom_tool_call`` ones for a custom
  tool, with their ``namespace``.
- ``stream: true`` gets the Responses event sequence (:class:`ResponseEvents`):
  ``response.created``, ``response.in_progress``, per output item
  ``response.output_item.added`` … ``response.output_item.done`` (text:
  ``content_part.added``, ``output_text.delta``…, ``output_text.done``,
  ``content_part.done``), then ``response.completed`` (``response.incomplete``
  when the output was cut at ``max_output_tokens``), every event with its
  ``sequence_number``.

What needs state the edge does not keep (``previous_response_id``,
``conversation``) and other item types are refused with a 400 naming the
field; built-in tools (``web_search``, ``file_search``…) are dropped or
refused by ``openai.unsupported_tools`` (``needs``).  A group with a
passthrough provider relays such a request there instead (``prepare``).  The
objects are the ones the official SDK parses (``openai.types.responses``).
"""

from __future__ import annotations

import secrets
from typing import cast

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONArray, JSONObject, JSONValue
from iopd.edge.openai.incoming.responses_tools import CUSTOM_INPUT, ToolPlan, plan_tools
from iopd.errors import InvalidRequest
from iopd.json_types import json_list
from wire.messages import Usage

__all__ = [
    "ResponseEvents",
    "build_response",
    "new_response_id",
    "responses_input_to_messages",
]

_encode = msgspec.json.Encoder().encode

_UNSUPPORTED = (
    "{what} is not supported on this model's providers ({why}); "
    "use a model with an OpenAI-compatible provider for it"
)
#: Message roles of ``input`` items (``tool`` results arrive as items).
_ROLES = frozenset({"user", "system", "developer", "assistant"})
#: Content part types that are text.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
#: Input items with no chat form that the conversation goes on without:
#: the model's earlier thinking (a provider cannot take it back; its text is
#: not passed on either) and the record of a built-in tool's run (a tool
#: this path never offers, so only an earlier turn elsewhere made one).
_SKIPPED_ITEMS = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "tool_search_call",
        "tool_search_output",
    }
)


def new_response_id() -> str:
    """A fresh ``resp_`` id."""
    return "resp_" + secrets.token_hex(24)


def _unsupported(what: str, why: str, param: str) -> InvalidRequest:
    return InvalidRequest(_UNSUPPORTED.format(what=what, why=why), param=param)


def _wrong(param: str, expected: str, value: JSONValue) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {expected}, got {_json_kind(value)}", param=param)


# ------------------------------------------------------------------- input


def responses_input_to_messages(req: JSONObject) -> list[JSONObject]:
    """Chat messages for a ``/v1/responses`` body on the normalized path.

    Raises :class:`~iopd.errors.InvalidRequest` (400, ``param`` naming the
    field) for anything the normalized path cannot run: state kept by OpenAI
    (``previous_response_id``, ``conversation``), a tool other than a function,
    an input item or content part it has no chat form for.  Linear in the
    size of the (already size-bounded) body.
    """
    for key, why in (
        ("previous_response_id", "the edge keeps no responses: send the whole conversation"),
        ("conversation", "the edge keeps no conversations: send the whole conversation"),
    ):
        if req.get(key) is not None:
            raise _unsupported(f"'{key}'", why, key)
    plan = tool_plan_of(req)
    instructions = req.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _unsupported(
            "non-string 'instructions'", f"got {_json_kind(instructions)}", "instructions"
        )
    if "input" not in req or req["input"] is None:
        raise InvalidRequest("`input` is required", param="input")
    messages: list[JSONObject] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    value = req["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        _items(value, messages, plan)
    else:
        raise _wrong("input", "a string or an array", value)
    return messages


def tool_plan_of(req: JSONObject) -> ToolPlan:
    """The tool plan of a (parsed, so well-formed) body's ``tools``."""
    tools = req.get("tools")
    if not isinstance(tools, list):
        return ToolPlan()
    return plan_tools([t for t in tools if isinstance(t, dict)])


def _items(items: JSONArray, messages: list[JSONObject], plan: ToolPlan) -> None:
    for i, item in enumerate(items):
        here = f"input[{i}]"
        if not isinstance(item, dict):
            raise _wrong(here, "an object", item)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, here))
        elif kind == "function_call":
            _function_call(item, here, messages, plan)
        elif kind == "custom_tool_call":
            _custom_tool_call(item, here, messages, plan)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(_function_call_output(item, here))
        elif kind in _SKIPPED_ITEMS:
            continue  # no chat form, and not needed to go on (see _SKIPPED_ITEMS)
        else:
            raise _unsupported(
                f"the input item type '{str(kind)[:40]}'",
                "messages, function_call, custom_tool_call, their outputs and "
                "reasoning items are",
                f"{here}.type",
            )


def _message(item: JSONObject, here: str) -> JSONObject:
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise InvalidRequest(
            f"'{here}.role' must be one of {', '.join(sorted(_ROLES))}", param=f"{here}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise _wrong(f"{here}.content", "a string or an array of parts", content)
    parts: list[JSONValue] = []
    for j, part in enumerate(content):
        where = f"{here}.content[{j}]"
        if not isinstance(part, dict):
            raise _wrong(where, "an object", part)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise _wrong(f"{where}.text", "a string", text)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "refusal":
            continue
        else:
            raise _unsupported(
                f"the content part '{str(kind)[:40]}'",
                "text parts and input_image with an image_url are",
                f"{where}.type",
            )
    return {"role": role, "content": parts}


def _strings(item: JSONObject, here: str, keys: tuple[str, ...]) -> dict[str, str]:
    fields = {}
    for key in keys:
        value = item.get(key)
        if not isinstance(value, str):
            raise _wrong(f"{here}.{key}", "a string", value)
        fields[key] = value
    return fields


def _namespace(item: JSONObject) -> str | None:
    value = item.get("namespace")
    return value if isinstance(value, str) else None


def _function_call(
    item: JSONObject, here: str, messages: list[JSONObject], plan: ToolPlan
) -> None:
    """An earlier call of the model: an assistant ``tool_calls`` entry (joined to
    the assistant message just before it, as chat has them in one message)."""
    fields = _strings(item, here, ("call_id", "name", "arguments"))
    name = plan.flat_name(fields["name"], _namespace(item))
    _append_call(messages, fields["call_id"], name, fields["arguments"])


def _custom_tool_call(
    item: JSONObject, here: str, messages: list[JSONObject], plan: ToolPlan
) -> None:
    """An earlier call of a custom tool: the function call it was made as."""
    fields = _strings(item, here, ("call_id", "name", "input"))
    name = plan.flat_name(fields["name"], _namespace(item))
    arguments = _encode({CUSTOM_INPUT: fields["input"]}).decode()
    _append_call(messages, fields["call_id"], name, arguments)


def _append_call(messages: list[JSONObject], call_id: str, name: str, arguments: str) -> None:
    call: JSONObject = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        calls = last.setdefault("tool_calls", [])
        if isinstance(calls, list):
            calls.append(call)
            return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_call_output(item: JSONObject, here: str) -> JSONObject:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise _wrong(f"{here}.call_id", "a string", call_id)
    output = item.get("output")
    if isinstance(output, list):  # parts: their text
        output = _message({"role": "user", "content": output}, here)["content"]
    elif not isinstance(output, str):
        raise _wrong(f"{here}.output", "a string or an array of parts", output)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _json_kind(value: JSONValue) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


# ------------------------------------------------------------------ output


def _usage(usage: Usage) -> JSONObject:
    input_tokens = usage.input_tokens or 0
    output_tokens = usage.output_tokens or 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_input_tokens or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _message_item(text: str, status: str, item_id: str | None = None) -> JSONObject:
    return {
        "type": "message",
        "id": item_id or "msg_" + secrets.token_hex(24),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning_item(text: str, item_id: str | None = None) -> JSONObject:
    return {
        "type": "reasoning",
        "id": item_id or "rs_" + secrets.token_hex(24),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _function_call_item(call: JSONObject, plan: ToolPlan | None = None) -> JSONObject:
    """A chat-shaped tool call (``{id, function{name, arguments}}``) as an output
    item: a ``function_call``, or the ``custom_tool_call`` of a custom tool
    (``plan``: what the flattened names were), each with its ``namespace``."""
    fn = call.get("function")
    fn = fn if isinstance(fn, dict) else {}
    name, arguments = fn.get("name"), fn.get("arguments") or "{}"
    origin = plan.origin(name) if plan is not None and isinstance(name, str) else None
    if origin is not None and origin.kind == "custom":
        item: JSONObject = {
            "type": "custom_tool_call",
            "id": "ctc_" + secrets.token_hex(24),
            "call_id": call.get("id"),
            "name": origin.name,
            "input": _custom_input(arguments),
            "status": "completed",
        }
    else:
        item = {
            "type": "function_call",
            "id": "fc_" + secrets.token_hex(24),
            "call_id": call.get("id"),
            "name": origin.name if origin is not None else name,
            "arguments": arguments,
            "status": "completed",
        }
    if origin is not None and origin.namespace is not None:
        item["namespace"] = origin.namespace
    return item


def _custom_input(arguments: JSONValue) -> str:
    """A custom tool's free input from the arguments of the function it ran as:
    ``input`` (or the one string argument the model gave), else the text as sent."""
    if not isinstance(arguments, str):
        return ""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get(CUSTOM_INPUT), str):
            return str(value[CUSTOM_INPUT])
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return value if isinstance(value, str) else arguments


def _response(
    head: JSONObject, status: str, output: list[JSONObject], usage: Usage | None
) -> JSONObject:
    doc = dict(head)
    doc["status"] = status
    doc["incomplete_details"] = {"reason": "max_output_tokens"} if status == "incomplete" else None
    doc["output"] = json_list(output)
    doc["usage"] = _usage(usage) if usage is not None else None
    return doc


def _head(
    response_id: str,
    model: str,
    created_at: int,
    metadata: dict[str, str] | None,
    tools: list[JSONObject] | None,
) -> JSONObject:
    """The fields of a ``response`` object that do not change while it runs."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": False,
        "tool_choice": "auto" if tools else "none",
        "tools": list(tools or []),
        "metadata": dict(metadata or {}),
        "usage": None,
    }


def build_response(
    *,
    response_id: str,
    model: str,
    created_at: int,
    text: str,
    reasoning_text: str,
    usage: Usage | None,
    metadata: dict[str, str] | None = None,
    finish_reason: str | None = None,
    tool_calls: list[JSONObject] | None = None,
    tools: list[JSONObject] | None = None,
) -> JSONObject:
    """A ``response`` object for a finished normalized run.

    ``output`` holds a ``reasoning`` item (when reasoning text was seen), one
    assistant ``message`` with a single ``output_text`` part (left out when
    the answer is only tool calls), and a ``function_call`` item per tool call
    (chat-shaped ``tool_calls``).  ``model`` is the caller's requested model;
    ``tools`` the caller's function tools, echoed.  ``finish_reason="length"``
    marks the response ``incomplete`` (``max_output_tokens``) as OpenAI does;
    otherwise it is ``completed``.  ``usage`` is omitted (null) when the
    provider reported none.
    """
    status = "incomplete" if finish_reason == "length" else "completed"
    output: list[JSONObject] = []
    if reasoning_text:
        output.append(_reasoning_item(reasoning_text))
    if text or not tool_calls:
        output.append(_message_item(text, status))
    plan = plan_tools(tools) if tools else None
    output.extend(_function_call_item(call, plan) for call in tool_calls or ())
    head = _head(response_id, model, created_at, metadata, tools)
    return _response(head, status, output, usage)


class ResponseEvents:
    """Renders one streamed normalized response as Responses API SSE events.

    Pure, like ``chat.ChunkStream``: :meth:`start` once, then :meth:`text`,
    :meth:`reasoning` and :meth:`function_call` as the run's events arrive
    (each opens the output item it needs and closes the one before), then
    :meth:`finish` (closes the last item, ``response.completed``).  Every
    event is ``event: <type>`` + ``data: <json>`` with the next
    ``sequence_number``, as OpenAI sends them; the stream has no ``[DONE]``.
    """

    __slots__ = ("_head", "_seq", "output", "_open", "_parts", "_plan")

    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        created_at: int,
        metadata: dict[str, str] | None = None,
        tools: list[JSONObject] | None = None,
    ) -> None:
        self._head = _head(response_id, model, created_at, metadata, tools)
        self._plan = plan_tools(tools) if tools else None
        self._seq = 0
        #: The output items so far (the one being streamed is the last).
        self.output: list[JSONObject] = []
        self._open: str | None = None  # "message" or "reasoning" while its text streams
        self._parts: list[str] = []

    def _event(self, kind: str, fields: JSONObject) -> bytes:
        doc: JSONObject = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(doc) + b"\n\n"

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        return self._event("response.created", {"response": self._head}) + self._event(
            "response.in_progress", {"response": self._head}
        )

    def text(self, delta: str) -> bytes:
        """An ``output_text`` delta (opening the message item first if needed)."""
        out = b"" if self._open == "message" else self._begin("message")
        self._parts.append(delta)
        return out + self._event(
            "response.output_text.delta",
            {**self._where(), "content_index": 0, "delta": delta, "logprobs": []},
        )

    def reasoning(self, delta: str) -> bytes:
        """A ``reasoning_text`` delta (opening a reasoning item first if needed)."""
        out = b"" if self._open == "reasoning" else self._begin("reasoning")
        self._parts.append(delta)
        return out + self._event(
            "response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": delta}
        )

    def function_call(self, call: JSONObject) -> bytes:
        """One whole tool call (chat shape) as a ``function_call`` item (a
        ``custom_tool_call`` for a custom tool, its input as one delta)."""
        out = self._close("completed")
        item = _function_call_item(call, self._plan)
        index = len(self.output)
        self.output.append(item)
        where: JSONObject = {"item_id": item["id"], "output_index": index}
        if item["type"] == "custom_tool_call":
            added = {**item, "input": "", "status": "in_progress"}
            kind, key = "response.custom_tool_call_input", "input"
            done: JSONObject = {**where, "input": item["input"]}
        else:
            added = {**item, "arguments": "", "status": "in_progress"}
            kind, key = "response.function_call_arguments", "arguments"
            done = {**where, "name": item["name"], "arguments": item["arguments"]}
        return (
            out
            + self._event("response.output_item.added", {"output_index": index, "item": added})
            + self._event(f"{kind}.delta", {**where, "delta": item[key]})
            + self._event(f"{kind}.done", done)
            + self._event("response.output_item.done", {"output_index": index, "item": item})
        )

    def finish(self, finish_reason: str | None, usage: Usage | None) -> bytes:
        """Close the last item; ``response.completed`` (or ``response.incomplete``
        when the output was cut at the token limit) with the whole response.
        A run that produced nothing still answers one (empty) message."""
        status = "incomplete" if finish_reason == "length" else "completed"
        out = b""
        if not self.output:
            out += self._begin("message")
        out += self._close(status)
        doc = _response(self._head, status, list(self.output), usage)
        return out + self._event(f"response.{status}", {"response": doc})

    # -------------------------------------------------------------- items

    def _where(self) -> JSONObject:
        index = len(self.output) - 1
        return {"item_id": self.output[index]["id"], "output_index": index}

    def _begin(self, kind: str) -> bytes:
        out = self._close("completed")
        if kind == "message":
            item = _message_item("", "in_progress")
            item["content"] = []
            part: JSONObject = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = _reasoning_item("")
            item["content"] = []
            item["status"] = "in_progress"
            part = {"type": "reasoning_text", "text": ""}
        index = len(self.output)
        self.output.append(item)
        self._open = kind
        self._parts = []
        return (
            out
            + self._event("response.output_item.added", {"output_index": index, "item": item})
            + self._event(
                "response.content_part.added",
                {**self._where(), "content_index": 0, "part": part},
            )
        )

    def _close(self, status: str) -> bytes:
        """End the item whose text is streaming (if any): its ``*.done`` events."""
        kind = self._open
        if kind is None:
            return b""
        self._open = None
        text = "".join(self._parts)
        where = self._where()
        index = len(self.output) - 1
        if kind == "message":
            item = _message_item(text, status, cast(str, self.output[index]["id"]))
            part = cast(JSONArray, item["content"])[0]
            done = self._event(
                "response.output_text.done",
                {**where, "content_index": 0, "text": text, "logprobs": []},
            )
        else:
            item = _reasoning_item(text, cast(str, self.output[index]["id"]))
            part = cast(JSONArray, item["content"])[0]
            done = self._event(
                "response.reasoning_text.done", {**where, "content_index": 0, "text": text}
            )
        self.output[index] = item
        return (
            done
            + self._event(
                "response.content_part.done", {**where, "content_index": 0, "part": part}
            )
            + self._event("response.output_item.done", {"output_index": index, "item": item})
        )
