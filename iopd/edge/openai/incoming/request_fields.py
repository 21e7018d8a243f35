"""Checks of single request fields: each a 400 naming its ``param``.

The request views of :mod:`iopd.edge.openai.incoming.requests` are built from these:
one function per field or field family (``messages``, ``tools``, ``stop``,
``metadata``, numbers in a range, ...), each bounded by the size of what it
looks at, each raising :class:`iopd.errors.InvalidRequest` with the field's
path in ``param`` the way OpenAI does.  ``null`` counts as absent; a JSON
boolean is never a number.
"""

from __future__ import annotations

import re
from typing import TypeGuard, cast

import msgspec

from iopd.edge.openai.incoming.json_body import parse_json_object
from iopd.edge.openai.incoming.jsonschema import JSONArray, JSONObject, JSONValue, json_type
from iopd.errors import InvalidRequest

_encode = msgspec.json.Encoder().encode

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICE_MODES = frozenset({"none", "auto", "required"})

MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: ``metadata.workspace`` is a path, not a label: it gets a larger bound and
#: does not count against the 16 entries.
WORKSPACE_KEY = "workspace"
MAX_WORKSPACE_CHARS = 4096
MAX_STOP_SEQUENCES = 4
#: ``n`` on the normalized path: each choice is one more run on the provider,
#: one after the other under the same lease and ``request_timeout``.
MAX_NORMALIZED_CHOICES = 8


# ------------------------------------------------------------------ helpers


def rewrite_model(raw: JSONObject, served: str) -> bytes:
    """``raw`` as JSON with ``model`` replaced by the provider's served name."""
    out = dict(raw)
    out["model"] = served
    return _encode(out)


def is_number(value: JSONValue) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_int(value: JSONValue) -> TypeGuard[int | float]:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and value.is_integer()


def wrong_type(param: str, expected: str, value: JSONValue) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {expected}, got {json_type(value)}", param=param)


def model(raw: JSONObject) -> str:
    if "model" not in raw or raw["model"] is None:
        raise InvalidRequest("'model' is required", param="model")
    model = raw["model"]
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    if not model.strip():
        raise InvalidRequest("'model' must not be empty", param="model")
    return model


def opt_bool(raw: JSONObject, key: str, default: bool, param: str | None = None) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(param or key, "a boolean", value)
    return value


def opt_str(raw: JSONObject, key: str, param: str | None = None) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise wrong_type(param or key, "a string", value)
    return value


def opt_object(raw: JSONObject, key: str, param: str | None = None) -> JSONObject | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(param or key, "an object", value)
    return value


def opt_number(
    raw: JSONObject, key: str, low: float, high: float, param: str | None = None
) -> float | int | None:
    value = raw.get(key)
    if value is None:
        return None
    name = param or key
    if not is_number(value):
        raise wrong_type(name, "a number", value)
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low:g} and {high:g}", param=name)
    return value


def opt_int(
    raw: JSONObject, key: str, minimum: int | None = None, param: str | None = None
) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    name = param or key
    if not is_int(value):
        raise wrong_type(name, "an integer", value)
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"'{name}' must be at least {minimum}", param=name)
    return value


def stop(raw: JSONObject) -> str | JSONArray | None:
    """``stop``: a string or an array of strings (as sent)."""
    value = raw.get("stop")
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences", param="stop"
        )
    for item in value:
        if not isinstance(item, str):
            raise wrong_type("stop", "a string or an array of strings", item)
    return value


def choices(raw: JSONObject) -> int:
    """``n``: an integer of at least 1 (absent: 1)."""
    n = raw.get("n")
    if n is None:
        return 1
    if not is_int(n) or n < 1:
        raise InvalidRequest("'n' must be an integer of at least 1", param="n")
    return int(n)


def metadata(raw: JSONObject) -> dict[str, str]:
    value = raw.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type("metadata", "an object", value)
    out: dict[str, str] = {}
    entries = 0
    for key, item in value.items():
        param = f"metadata.{key}"[:80]
        if not isinstance(item, str):
            raise wrong_type(param, "a string", item)
        if key == WORKSPACE_KEY:
            if len(item) > MAX_WORKSPACE_CHARS:
                raise InvalidRequest(
                    f"'metadata.workspace' must be at most {MAX_WORKSPACE_CHARS} characters",
                    param="metadata.workspace",
                )
        else:
            entries += 1
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise InvalidRequest(
                    f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters",
                    param="metadata",
                )
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise InvalidRequest(
                    f"metadata values must be at most {MAX_METADATA_VALUE_CHARS} characters",
                    param=param,
                )
        out[key] = item
    if entries > MAX_METADATA_ENTRIES:
        raise InvalidRequest(
            f"'metadata' may hold at most {MAX_METADATA_ENTRIES} entries", param="metadata"
        )
    return out


def content_parts(parts: JSONArray, param: str) -> None:
    for j, part in enumerate(parts):
        here = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise wrong_type(here, "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str) or not kind:
            raise InvalidRequest(f"'{here}.type' must be a non-empty string", param=f"{here}.type")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise wrong_type(f"{here}.text", "a string", part.get("text"))


def messages(raw: JSONObject) -> list[JSONObject]:
    if "messages" not in raw or raw["messages"] is None:
        raise InvalidRequest("'messages' is required", param="messages")
    messages = raw["messages"]
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array", messages)
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    for i, msg in enumerate(messages):
        here = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise wrong_type(here, "an object", msg)
        role = msg.get("role")
        if not isinstance(role, str):
            raise wrong_type(f"{here}.role", "a string", role)
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'{here}.role' must be one of {', '.join(sorted(CHAT_ROLES))}",
                param=f"{here}.role",
            )
        content = msg.get("content")
        if isinstance(content, list):
            content_parts(content, f"{here}.content")
        elif content is None:
            has_call = msg.get("tool_calls") or msg.get("function_call")
            if not (role == "assistant" and has_call):
                raise InvalidRequest(
                    f"'{here}.content' is required (only an assistant message with "
                    "tool_calls may omit it)",
                    param=f"{here}.content",
                )
        elif not isinstance(content, str):
            raise wrong_type(f"{here}.content", "a string or an array of parts", content)
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise InvalidRequest(
                    f"'{here}.tool_calls' is only allowed on assistant messages",
                    param=f"{here}.tool_calls",
                )
            if not isinstance(tool_calls, list):
                raise wrong_type(f"{here}.tool_calls", "an array of objects", tool_calls)
            for j, call in enumerate(tool_calls):
                tool_call(call, f"{here}.tool_calls[{j}]")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise wrong_type(f"{here}.tool_call_id", "a string", msg.get("tool_call_id"))
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise wrong_type(f"{here}.name", "a string", name)
    return cast("list[JSONObject]", messages)  # each message checked above


def tool_call(call: JSONValue, here: str) -> None:
    """An assistant message's earlier tool call: ``{id?, type?, function{name, arguments}}``."""
    if not isinstance(call, dict):
        raise wrong_type(here, "an object", call)
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise wrong_type(f"{here}.function", "an object", fn)
    if not isinstance(fn.get("name"), str):
        raise wrong_type(f"{here}.function.name", "a string", fn.get("name"))
    args = fn.get("arguments")
    if args is not None and not isinstance(args, str | dict):
        raise wrong_type(f"{here}.function.arguments", "a JSON string", args)
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise wrong_type(f"{here}.id", "a string", call_id)


def chat_tools(raw: JSONObject) -> list[JSONObject] | None:
    tools = raw.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    for i, tool in enumerate(tools):
        here = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(here, "an object", tool)
        if tool.get("type") != "function":
            raise InvalidRequest(f"'{here}.type' must be 'function'", param=f"{here}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{here}.function", "an object", function)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequest(
                f"'{here}.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
                param=f"{here}.function.name",
            )
        opt_str(function, "description", f"{here}.function.description")
        opt_object(function, "parameters", f"{here}.function.parameters")
        opt_bool(function, "strict", False, f"{here}.function.strict")
    return cast("list[JSONObject]", tools)  # each tool checked above


def opt_array(raw: JSONObject, key: str) -> list[JSONObject] | None:
    """An optional array of objects."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise wrong_type(key, "an array", value)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise wrong_type(f"{key}[{i}]", "an object", item)
    return cast("list[JSONObject]", value)  # each item checked above


#: ``reasoning.effort`` / ``reasoning_effort`` values (OpenAI's, ``xhigh`` included).
REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
#: Sampling fields beyond OpenAI's that open servers take (vLLM, llama.cpp,
#: Ollama): name -> (the parameter it becomes, low, high).
_SAMPLING_EXTRAS: tuple[tuple[str, str, float, float], ...] = (
    ("top_k", "top_k", -1, 1_000_000),
    ("min_p", "min_p", 0, 1),
    ("repeat_penalty", "repeat_penalty", 0, 10),
    ("repetition_penalty", "repeat_penalty", 0, 10),
)
_SAMPLING_KEYS = frozenset({key for key, *_ in _SAMPLING_EXTRAS} | {"chat_template_kwargs"})
MAX_TEMPLATE_KWARGS = 32


def sampling_extras(raw: JSONObject, params: JSONObject) -> None:
    """``top_k``, ``min_p``, ``repeat_penalty`` (or vLLM's ``repetition_penalty``)
    and ``chat_template_kwargs`` into ``params``: checked here, mapped by each
    adapter where its provider has a place for them (ollama: ``options``)."""
    if raw.keys().isdisjoint(_SAMPLING_KEYS):  # the common case: none of them sent
        return
    for key, name, low, high in _SAMPLING_EXTRAS:
        value = opt_number(raw, key, low, high)
        if value is None or (name == "top_k" and value < 0):  # top_k -1: off (vLLM)
            continue
        if name == "top_k" and not is_int(value):
            raise wrong_type(key, "an integer", value)
        params[name] = int(value) if name == "top_k" else value
    kwargs = opt_object(raw, "chat_template_kwargs")
    if kwargs is not None:
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise InvalidRequest(
                f"'chat_template_kwargs' may hold at most {MAX_TEMPLATE_KWARGS} entries",
                param="chat_template_kwargs",
            )
        params["chat_template_kwargs"] = kwargs


def reasoning_effort(value: JSONValue, param: str) -> str | None:
    """A reasoning effort (``none`` ... ``xhigh``), or None when absent."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in REASONING_EFFORTS:
        raise InvalidRequest(
            f"'{param}' must be one of {', '.join(sorted(REASONING_EFFORTS))}", param=param
        )
    return value


def opt_str_array(raw: JSONObject, key: str, max_items: int = 64) -> list[str] | None:
    """An optional, bounded array of strings (``include``)."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wrong_type(key, "an array of strings", value)
    if len(value) > max_items:
        raise InvalidRequest(f"'{key}' may hold at most {max_items} entries", param=key)
    return cast("list[str]", value)  # each item checked above


def text_format(raw: JSONObject) -> JSONObject | None:
    """``text.format`` of a Responses body as chat's ``response_format`` (None: plain text).

    ``{"type": "json_schema", "name", "schema", "strict"}`` is chat's
    ``{"type": "json_schema", "json_schema": {...}}``; other types go as they
    are (each adapter says clearly what it cannot do).
    """
    text = opt_object(raw, "text")
    fmt = opt_object(text, "format", "text.format") if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema: JSONObject = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt


def tool_choice(raw: JSONObject) -> str | JSONObject | None:
    choice = raw.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise InvalidRequest(
                "'tool_choice' must be 'none', 'auto', 'required' or a function object",
                param="tool_choice",
            )
        return choice
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", "a string or an object", choice)
    if not isinstance(choice.get("type"), str):
        raise wrong_type("tool_choice.type", "a string", choice.get("type"))
    function = choice.get("function")
    if function is not None and (
        not isinstance(function, dict) or not isinstance(function.get("name"), str)
    ):
        raise InvalidRequest(
            "'tool_choice.function.name' must be a string", param="tool_choice.function.name"
        )
    return choice


def as_dict(body: JSONObject | bytes) -> JSONObject:
    return parse_json_object(body) if isinstance(body, bytes | bytearray) else body
