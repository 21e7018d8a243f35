"""Tool calls on the normalized path.

Two sources of tool calls reach the edge:

- **provider-native** calls (Ollama ``tool_calls``, a node event's
  ``tool_call`` or its ``openai_tool_calls`` metadata): already structured,
  only reshaped into the OpenAI form by :func:`restore_native_tool_call`;
- **text protocol** for text-only providers (``cli``): the request's
  ``tools[]`` are described in a system instruction (:func:`tool_instruction`)
  that asks for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, and :func:`parse_text_tool_calls` turns the answer back into calls.

The parser is deliberately unforgiving: a call is only produced from an
explicit block whose name is a declared tool and whose arguments validate
against that tool's ``parameters`` schema.  If any block is unusable the whole
answer is returned as plain text (``fallback=True``; the edge records
``openai_text_tool_fallback``) — never a call guessed from prose.

The text is the model's answer, and with an ``echo`` model it is the caller's
own message, so parsing is bounded like any caller-controlled work: blocks are
found by one left-to-right scan with ``str.find`` (linear, however many
unclosed tags), and all the blocks of one answer share one
:class:`~iopd.edge.openai.incoming.jsonschema.ValidationBudget`; a block over it is an
invalid block.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import NoReturn

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue, ValidationBudget, validate
from iopd.errors import ProviderError

__all__ = [
    "TextToolResult",
    "new_call_id",
    "parse_text_tool_calls",
    "restore_native_tool_call",
    "tool_instruction",
]

_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"
_FENCE = "```"
_FENCE_INFO = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> JSONValue:
    """Strict JSON: NaN/Infinity are rejected like any other invalid JSON (and so
    is nesting deeper than the interpreter's recursion limit)."""
    try:
        value: JSONValue = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value


def _unfence(body: str) -> str:
    """The inside of a Markdown code fence (```json ... ```), or ``body`` as is.

    Written without a regular expression: the lazy pattern this replaces
    backtracked polynomially on long runs of whitespace.  ``body`` is already
    stripped; the info string (``json``) is dropped.
    """
    if len(body) < 2 * len(_FENCE) or not (body.startswith(_FENCE) and body.endswith(_FENCE)):
        return body
    return body[len(_FENCE) : -len(_FENCE)].lstrip(_FENCE_INFO).strip()


def _split_blocks(text: str) -> tuple[list[str], list[str]] | None:
    """The contents of the ``<tool_call>`` blocks and the text between them.

    None when an opening tag is never closed.  One left-to-right pass: each
    search starts where the previous one ended, so the cost is linear in
    ``text`` (a regular expression with a lazy ``.*?`` rescans the rest of the
    text from every unclosed tag: quadratic).
    """
    blocks: list[str] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(_OPEN_TAG, pos)
        if start < 0:
            outside.append(text[pos:])
            return blocks, outside
        end = text.find(_CLOSE_TAG, start + len(_OPEN_TAG))
        if end < 0:
            return None
        outside.append(text[pos:start])
        blocks.append(text[start + len(_OPEN_TAG) : end])
        pos = end + len(_CLOSE_TAG)


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id (``call_`` + 24 hex chars)."""
    return "call_" + secrets.token_hex(12)


def _encode_arguments(arguments: JSONValue) -> str:
    return msgspec.json.encode(arguments).decode()


def _function_of(tool: JSONValue) -> JSONObject | None:
    """The function definition of a ``tools[]`` entry (chat or Responses shape)."""
    if not isinstance(tool, dict):
        return None
    if tool.get("type", "function") != "function":
        return None
    fn = tool.get("function", tool)  # Responses puts name/parameters at the top level
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return None
    return fn


def _functions(tools: list[JSONObject]) -> dict[str, JSONObject]:
    found: dict[str, JSONObject] = {}
    for tool in tools:
        fn = _function_of(tool)
        if fn is not None:
            found.setdefault(str(fn["name"]), fn)  # (a str: _function_of checked it)
    return found


def tool_instruction(tools: list[JSONObject]) -> str:
    """A system instruction describing ``tools`` and the ``<tool_call>`` protocol.

    Each function tool is listed with its name, description and ``parameters``
    JSON schema; tools that are not functions are skipped.
    """
    lines = [
        "You can call the following tools. Each tool is given with its name, "
        "description and the JSON schema of its arguments.",
        "",
    ]
    for name, fn in _functions(tools).items():
        lines.append(f"Tool: {name}")
        description = fn.get("description")
        if isinstance(description, str) and description.strip():
            lines.append(f"Description: {description.strip()}")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        lines.append("Arguments JSON schema: " + _schema_text(parameters))
        lines.append("")
    lines += [
        "To call a tool, answer with one or more blocks of exactly this form and "
        "nothing that imitates them:",
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON '
        "object matching the tool's schema>}}</tool_call>",
        "Use one block per call. The content of each block must be a single valid "
        "JSON object. If you do not need a tool, answer in plain text without any "
        "<tool_call> block.",
    ]
    return "\n".join(lines)


def _schema_text(parameters: JSONValue) -> str:
    """``parameters`` as JSON for the instruction (a schema nested deeper than the
    encoder can go is described, not shown: it could not validate anything either)."""
    try:
        return json.dumps(parameters, ensure_ascii=False)
    except RecursionError:
        return '{"type": "object"} (the declared schema is nested too deeply to show)'


@dataclass(frozen=True, slots=True)
class TextToolResult:
    """The outcome of :func:`parse_text_tool_calls`.

    ``calls``: OpenAI ``tool_calls`` when every block was valid, else None.
    ``content``: the text to return as the message content (None when the
    calls stand alone).  ``fallback``: blocks were present but at least one was
    unusable, so the original text is returned as plain content.
    ``problem``: why the fallback happened (for logs; never shown to callers).
    """

    calls: list[JSONObject] | None
    content: str | None
    fallback: bool
    problem: str = ""


def _block_call(
    raw: str, functions: dict[str, JSONObject], budget: ValidationBudget
) -> JSONObject | str:
    """One block → an OpenAI tool call, or a string saying why it is unusable."""
    body = _unfence(raw.strip())
    try:
        payload = _loads(body)
    except ValueError:
        return "a <tool_call> block is not valid JSON"
    if not isinstance(payload, dict):
        return "a <tool_call> block is not a JSON object"
    name = payload.get("name")
    if not isinstance(name, str) or name not in functions:
        return f"a <tool_call> block names an unknown tool {str(name)[:64]!r}"
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return f"the arguments of {name!r} are not valid JSON"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} are not a JSON object"
    schema = functions[name].get("parameters")
    if schema is not None:
        errors = validate(arguments, schema, budget)
        if errors:
            return f"the arguments of {name!r} do not match its schema: {errors[0]}"
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": _encode_arguments(arguments)},
    }


def parse_text_tool_calls(
    text: str, tools: list[JSONObject], budget: ValidationBudget | None = None
) -> TextToolResult:
    """Turn ``<tool_call>`` blocks in a text answer into OpenAI tool calls.

    - no block at all → ``calls=None, content=text, fallback=False``;
    - every block valid (declared tool name, arguments an object — or a JSON
      string of one — valid against the tool's ``parameters``) → the calls,
      and the text outside the blocks as content (None when only whitespace);
    - any block invalid (validation over ``budget`` included), or an opening
      tag never closed → ``calls=None``, ``content=text`` unchanged,
      ``fallback=True``.

    ``budget`` bounds the schema validation of all blocks together (a fresh
    default :class:`~iopd.edge.openai.incoming.jsonschema.ValidationBudget` when omitted).
    """
    split = _split_blocks(text)
    if split is None:
        return TextToolResult(None, text, True, "a <tool_call> block is not closed")
    blocks, outside = split
    if not blocks:
        return TextToolResult(None, text, False)
    functions = _functions(tools)
    budget = budget if budget is not None else ValidationBudget()
    calls: list[JSONObject] = []
    for block in blocks:
        call = _block_call(block, functions, budget)
        if isinstance(call, str):
            return TextToolResult(None, text, True, call)
        calls.append(call)
    rest = "".join(outside).strip()
    return TextToolResult(calls, rest or None, False)


def restore_native_tool_call(call: JSONObject, index: int) -> JSONObject:
    """Reshape a provider-native tool call into the OpenAI ``tool_calls`` item.

    Accepts the OpenAI shape, Ollama's ``{"function": {"name", "arguments":
    {...}}}`` (no id, arguments as an object) and a flat ``{"name",
    "arguments"}``.  Arguments that are an object are encoded as a JSON
    string, missing arguments become ``"{}"``, a missing id is generated.
    ``index`` is the call's position in the message, used in the error raised
    (:class:`~iopd.errors.ProviderError`) for a call without a function name.
    """
    fn = call.get("function")
    if not isinstance(fn, dict):
        fn = call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ProviderError(f"the provider returned tool call #{index} without a function name")
    arguments = fn.get("arguments")
    if arguments is None:
        encoded = "{}"
    elif isinstance(arguments, str):
        encoded = arguments
    else:
        encoded = _encode_arguments(arguments)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        call_id = new_call_id()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": encoded}}
