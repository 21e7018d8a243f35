"""Parsing and validation of OpenAI (and Ollama) request bodies.

Bodies arrive as raw bytes.  Everything a caller can get wrong becomes an
:class:`iopd.errors.InvalidRequest` (400) naming the offending field in
``param`` the way OpenAI does (``messages[2].role``, ``tools[0].function.name``);
nothing here ever lets a ``KeyError``/``TypeError`` reach the caller.

The request classes are *validated views* over the decoded dict: they check
the fields the gateway relies on and keep the original dict as ``.raw``, so
fields we do not know (Codex's extensions on ``/v1/responses``, new OpenAI
parameters) travel unchanged on the passthrough path.  ``null`` counts as
"absent" for optional parameters, as in the OpenAI API.  JSON booleans are
never numbers here (``true`` is not ``1``).

Decoding is bounded by the body's size: see :mod:`iopd.edge.openai.json_body`.
"""

from __future__ import annotations

import re
from typing import ClassVar, Self

import msgspec

from iopd.edge.openai.json_body import parse_json_object
from iopd.edge.openai.jsonschema import JSONArray, JSONObject, JSONValue, json_type
from iopd.errors import InvalidRequest

_encode = msgspec.json.Encoder().encode

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICE_MODES = frozenset({"none", "auto", "required"})

MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: ``metadata.workspace`` is a path, not a label: it gets a larger bound and
#: does not count against the 16 entries (SPEC §4 Metadata).
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


def _is_number(value: JSONValue) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: JSONValue) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and value.is_integer()


def _wrong_type(param: str, expected: str, value: JSONValue) -> InvalidRequest:
    return InvalidRequest(f"'{param}' must be {expected}, got {json_type(value)}", param=param)


def _model(raw: JSONObject) -> str:
    if "model" not in raw or raw["model"] is None:
        raise InvalidRequest("'model' is required", param="model")
    model = raw["model"]
    if not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    if not model.strip():
        raise InvalidRequest("'model' must not be empty", param="model")
    return model


def _opt_bool(raw: JSONObject, key: str, default: bool, param: str | None = None) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(param or key, "a boolean", value)
    return value


def _opt_str(raw: JSONObject, key: str, param: str | None = None) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong_type(param or key, "a string", value)
    return value


def _opt_object(raw: JSONObject, key: str, param: str | None = None) -> JSONObject | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _wrong_type(param or key, "an object", value)
    return value


def _opt_number(
    raw: JSONObject, key: str, low: float, high: float, param: str | None = None
) -> float | int | None:
    value = raw.get(key)
    if value is None:
        return None
    name = param or key
    if not _is_number(value):
        raise _wrong_type(name, "a number", value)
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low:g} and {high:g}", param=name)
    return value  # type: ignore[no-any-return]


def _opt_int(
    raw: JSONObject, key: str, minimum: int | None = None, param: str | None = None
) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    name = param or key
    if not _is_int(value):
        raise _wrong_type(name, "an integer", value)
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"'{name}' must be at least {minimum}", param=name)
    return value


def _stop(raw: JSONObject) -> str | list[str] | None:
    value = raw.get("stop")
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _wrong_type("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences", param="stop"
        )
    for item in value:
        if not isinstance(item, str):
            raise _wrong_type("stop", "a string or an array of strings", item)
    return value


def _choices(raw: JSONObject) -> int:
    """``n``: an integer of at least 1 (absent: 1)."""
    n = raw.get("n")
    if n is None:
        return 1
    if not _is_int(n) or n < 1:
        raise InvalidRequest("'n' must be an integer of at least 1", param="n")
    return int(n)


def _metadata(raw: JSONObject) -> dict[str, str]:
    value = raw.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _wrong_type("metadata", "an object", value)
    out: dict[str, str] = {}
    entries = 0
    for key, item in value.items():
        param = f"metadata.{key}"[:80]
        if not isinstance(item, str):
            raise _wrong_type(param, "a string", item)
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


def _content_parts(parts: JSONArray, param: str) -> None:
    for j, part in enumerate(parts):
        here = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _wrong_type(here, "an object", part)
        kind = part.get("type")
        if not isinstance(kind, str) or not kind:
            raise InvalidRequest(f"'{here}.type' must be a non-empty string", param=f"{here}.type")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise _wrong_type(f"{here}.text", "a string", part.get("text"))


def _messages(raw: JSONObject) -> list[JSONObject]:
    if "messages" not in raw or raw["messages"] is None:
        raise InvalidRequest("'messages' is required", param="messages")
    messages = raw["messages"]
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    for i, msg in enumerate(messages):
        here = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _wrong_type(here, "an object", msg)
        role = msg.get("role")
        if not isinstance(role, str):
            raise _wrong_type(f"{here}.role", "a string", role)
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'{here}.role' must be one of {', '.join(sorted(CHAT_ROLES))}",
                param=f"{here}.role",
            )
        content = msg.get("content")
        if isinstance(content, list):
            _content_parts(content, f"{here}.content")
        elif content is None:
            has_call = msg.get("tool_calls") or msg.get("function_call")
            if not (role == "assistant" and has_call):
                raise InvalidRequest(
                    f"'{here}.content' is required (only an assistant message with "
                    "tool_calls may omit it)",
                    param=f"{here}.content",
                )
        elif not isinstance(content, str):
            raise _wrong_type(f"{here}.content", "a string or an array of parts", content)
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise InvalidRequest(
                    f"'{here}.tool_calls' is only allowed on assistant messages",
                    param=f"{here}.tool_calls",
                )
            if not isinstance(tool_calls, list):
                raise _wrong_type(f"{here}.tool_calls", "an array of objects", tool_calls)
            for j, call in enumerate(tool_calls):
                _tool_call(call, f"{here}.tool_calls[{j}]")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise _wrong_type(f"{here}.tool_call_id", "a string", msg.get("tool_call_id"))
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise _wrong_type(f"{here}.name", "a string", name)
    return messages


def _tool_call(call: JSONValue, here: str) -> None:
    """An assistant message's earlier tool call: ``{id?, type?, function{name, arguments}}``."""
    if not isinstance(call, dict):
        raise _wrong_type(here, "an object", call)
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _wrong_type(f"{here}.function", "an object", fn)
    if not isinstance(fn.get("name"), str):
        raise _wrong_type(f"{here}.function.name", "a string", fn.get("name"))
    args = fn.get("arguments")
    if args is not None and not isinstance(args, str | dict):
        raise _wrong_type(f"{here}.function.arguments", "a JSON string", args)
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise _wrong_type(f"{here}.id", "a string", call_id)


def _chat_tools(raw: JSONObject) -> list[JSONObject] | None:
    tools = raw.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array", tools)
    for i, tool in enumerate(tools):
        here = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _wrong_type(here, "an object", tool)
        if tool.get("type") != "function":
            raise InvalidRequest(f"'{here}.type' must be 'function'", param=f"{here}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _wrong_type(f"{here}.function", "an object", function)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequest(
                f"'{here}.function.name' must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
                param=f"{here}.function.name",
            )
        _opt_str(function, "description", f"{here}.function.description")
        _opt_object(function, "parameters", f"{here}.function.parameters")
        _opt_bool(function, "strict", False, f"{here}.function.strict")
    return tools


def _opt_array(raw: JSONObject, key: str) -> list[JSONObject] | None:
    """An optional array of objects."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise _wrong_type(key, "an array", value)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _wrong_type(f"{key}[{i}]", "an object", item)
    return value


def _responses_function_tools(tools: list[JSONObject] | None) -> list[JSONObject] | None:
    """Responses' flat function tools (``{"type": "function", "name", "parameters"}``)
    validated like chat's and reshaped to chat's ``{"type", "function": {...}}``."""
    if tools is None:
        return None
    out: list[JSONObject] = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            continue  # a built-in tool: only a passthrough provider runs it
        here = f"tools[{i}]"
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequest(
                f"'{here}.name' must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
                param=f"{here}.name",
            )
        function: JSONObject = {"name": name}
        for key, check in (("description", _opt_str), ("parameters", _opt_object)):
            value = check(tool, key, f"{here}.{key}")
            if value is not None:
                function[key] = value
        if _opt_bool(tool, "strict", False, f"{here}.strict"):
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out


def _text_format(raw: JSONObject) -> JSONObject | None:
    """``text.format`` of a Responses body as chat's ``response_format`` (None: plain text).

    ``{"type": "json_schema", "name", "schema", "strict"}`` is chat's
    ``{"type": "json_schema", "json_schema": {...}}``; other types go as they
    are (each adapter says clearly what it cannot do).
    """
    text = _opt_object(raw, "text")
    fmt = _opt_object(text, "format", "text.format") if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt


def _tool_choice(raw: JSONObject) -> str | JSONObject | None:
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
        raise _wrong_type("tool_choice", "a string or an object", choice)
    if not isinstance(choice.get("type"), str):
        raise _wrong_type("tool_choice.type", "a string", choice.get("type"))
    function = choice.get("function")
    if function is not None and (
        not isinstance(function, dict) or not isinstance(function.get("name"), str)
    ):
        raise InvalidRequest(
            "'tool_choice.function.name' must be a string", param="tool_choice.function.name"
        )
    return choice


def _as_dict(body: JSONObject | bytes) -> JSONObject:
    return parse_json_object(body) if isinstance(body, bytes | bytearray) else body


# ----------------------------------------------------------------- requests


class _Body:
    """What the validated request bodies share: ``parse`` from bytes or a dict."""

    __slots__ = ()

    def __init__(self, raw: JSONObject) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @classmethod
    def parse(cls, body: JSONObject | bytes) -> Self:
        """Validate a decoded body (or raw bytes); raises ``InvalidRequest``."""
        return cls(_as_dict(body))


class _OpenAIBody(_Body):
    """Chat and Responses bodies: caller metadata and generation parameters."""

    __slots__ = ()
    metadata: dict[str, str]
    _params: JSONObject

    @property
    def workspace(self) -> str | None:
        """``metadata.workspace``, if sent."""
        return self.metadata.get(WORKSPACE_KEY)

    def params(self) -> JSONObject:
        """Generation parameters for a ``RunRequest`` (a fresh dict each call)."""
        return dict(self._params)


class ChatRequest(_OpenAIBody):
    """A validated ``POST /v1/chat/completions`` body; ``.raw`` is the original dict."""

    __slots__ = (
        "raw",
        "model",
        "messages",
        "stream",
        "include_usage",
        "tools",
        "tool_choice",
        "n",
        "metadata",
        "field_names",
        "_params",
    )

    def __init__(self, raw: JSONObject) -> None:
        self.raw = raw
        self.model: str = _model(raw)
        self.messages: list[JSONObject] = _messages(raw)
        self.stream: bool = _opt_bool(raw, "stream", False)
        options = _opt_object(raw, "stream_options")
        self.include_usage: bool = (
            _opt_bool(options, "include_usage", False, "stream_options.include_usage")
            if options is not None
            else False
        )
        self.tools: list[JSONObject] | None = _chat_tools(raw)
        self.tool_choice: str | JSONObject | None = _tool_choice(raw)
        #: Caller metadata, ``workspace`` included (see :attr:`workspace`).
        self.metadata: dict[str, str] = _metadata(raw)

        #: How many choices (``n``): relayed as sent; the normalized path runs
        #: the request once per choice (at most ``MAX_NORMALIZED_CHOICES``).
        self.n: int = _choices(raw)
        _opt_str(raw, "user")
        response_format = _opt_object(raw, "response_format")
        _opt_bool(raw, "parallel_tool_calls", True)
        params: JSONObject = {}
        if response_format is not None:
            # To the normalized run as sent: each adapter maps it to its
            # provider's form (ollama: ``format``) or says clearly it cannot.
            params["response_format"] = response_format
        for key, value in (
            ("temperature", _opt_number(raw, "temperature", 0, 2)),
            ("top_p", _opt_number(raw, "top_p", 0, 1)),
            ("presence_penalty", _opt_number(raw, "presence_penalty", -2, 2)),
            ("frequency_penalty", _opt_number(raw, "frequency_penalty", -2, 2)),
            ("seed", _opt_int(raw, "seed")),
            ("stop", _stop(raw)),
        ):
            if value is not None:
                params[key] = value
        max_tokens = _opt_int(raw, "max_tokens", 1)
        max_completion = _opt_int(raw, "max_completion_tokens", 1)
        if max_tokens is not None or max_completion is not None:
            # max_completion_tokens is the newer name; when both are sent the
            # smaller one is the binding limit.
            params["max_tokens"] = min(v for v in (max_tokens, max_completion) if v is not None)
        #: Generation parameter -> the field the caller sent it as (for 400s).
        self.field_names: dict[str, str] = {}
        if max_completion is not None and (max_tokens is None or max_completion < max_tokens):
            self.field_names["max_tokens"] = "max_completion_tokens"
        self._params = params


class ResponsesRequest(_OpenAIBody):
    """A validated ``POST /v1/responses`` body; unknown fields stay in ``.raw``."""

    __slots__ = (
        "raw",
        "model",
        "input",
        "instructions",
        "stream",
        "tools",
        "function_tools",
        "metadata",
        "field_names",
        "_params",
    )

    def __init__(self, raw: JSONObject) -> None:
        self.raw = raw
        self.model: str = _model(raw)
        value = raw.get("input")
        if value is not None and not isinstance(value, str | list):
            raise _wrong_type("input", "a string or an array", value)
        self.input: str | JSONArray | None = value
        self.instructions: str | None = _opt_str(raw, "instructions")
        self.stream: bool = _opt_bool(raw, "stream", False)
        self.tools: list[JSONObject] | None = _opt_array(raw, "tools")
        #: The function tools in the chat shape, for the normalized path
        #: (built-in tools are the passthrough's: see ``responses.py``).
        self.function_tools: list[JSONObject] | None = _responses_function_tools(self.tools)
        self.metadata: dict[str, str] = _metadata(raw)
        params: JSONObject = {}
        response_format = _text_format(raw)
        if response_format is not None:
            params["response_format"] = response_format
        for key, param_value in (
            ("temperature", _opt_number(raw, "temperature", 0, 2)),
            ("top_p", _opt_number(raw, "top_p", 0, 1)),
            ("max_tokens", _opt_int(raw, "max_output_tokens", 1)),
        ):
            if param_value is not None:
                params[key] = param_value
        #: Generation parameter -> the field the caller sent it as (for 400s).
        self.field_names: dict[str, str] = {"max_tokens": "max_output_tokens"}
        self._params = params


class OllamaRequest(_Body):
    """A ``POST /api/chat`` or ``/api/generate`` body (relayed raw; ``model`` required)."""

    __slots__ = ("raw", "model", "stream", "options")

    #: Ollama ``options`` keys -> generation parameter names.
    _OPTION_PARAMS = (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("num_predict", "max_tokens"),
        ("stop", "stop"),
        ("seed", "seed"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    )
    #: Generation parameter -> the field the caller sent it as (for 400s).
    field_names: ClassVar[dict[str, str]] = {name: f"options.{key}" for key, name in _OPTION_PARAMS}

    def __init__(self, raw: JSONObject) -> None:
        self.raw = raw
        self.model: str = _model(raw)
        self.stream: bool = _opt_bool(raw, "stream", True)  # Ollama streams by default
        self.options: JSONObject = _opt_object(raw, "options") or {}
        messages = raw.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise _wrong_type("messages", "an array", messages)
        _opt_str(raw, "prompt")

    def params(self) -> JSONObject:
        """Generation parameters found in Ollama ``options``."""
        return {
            name: self.options[key]
            for key, name in self._OPTION_PARAMS
            if self.options.get(key) is not None
        }


class RelayedRequest(_Body):
    """A ``POST /v1/embeddings`` or ``/v1/completions`` body: relayed raw, so
    only ``model`` is required (and ``stream``, if sent, a boolean); every
    other field is the provider's to judge."""

    __slots__ = ("raw", "model", "stream")

    #: The generation parameters these endpoints share with chat (same names).
    _PARAMS = ("max_tokens", "temperature", "top_p")
    #: Generation parameter -> the field the caller sent it as (for 400s).
    field_names: ClassVar[dict[str, str]] = {}

    def __init__(self, raw: JSONObject) -> None:
        self.raw = raw
        self.model: str = _model(raw)
        self.stream: bool = _opt_bool(raw, "stream", False)

    def params(self) -> JSONObject:
        """The numeric generation parameters sent (checked against ``models[].generation.limits``)."""
        return {key: raw for key in self._PARAMS if _is_number(raw := self.raw.get(key))}

    def as_messages(self) -> list[JSONObject]:
        """The text inputs (``input`` or ``prompt``: a string or strings) as
        message-shaped items, for the token estimate; token arrays count nothing."""
        texts: list[JSONObject] = []
        for key in ("input", "prompt"):
            value = self.raw.get(key)
            if isinstance(value, str):
                texts.append({"content": value})
            elif isinstance(value, list):
                texts.extend({"content": v} for v in value if isinstance(v, str))
        return texts
