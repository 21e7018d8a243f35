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

Decoding is bounded by the body's size: see :mod:`iopd.edge.openai.incoming.json_body`.
"""

from __future__ import annotations

from typing import ClassVar, Self

import msgspec

from iopd.edge.openai.incoming import request_fields as f
from iopd.edge.openai.incoming.json_body import parse_json_object
from iopd.edge.openai.incoming.jsonschema import JSONArray, JSONObject
from iopd.edge.openai.incoming.request_fields import (
    MAX_NORMALIZED_CHOICES,
    WORKSPACE_KEY,
    rewrite_model,
)
from iopd.edge.openai.incoming.responses_tools import ToolPlan, plan_tools, tool_choice_plan

__all__ = [
    "MAX_NORMALIZED_CHOICES",
    "ChatRequest",
    "OllamaRequest",
    "RelayedRequest",
    "ResponsesRequest",
    "parse_json_object",
    "rewrite_model",
]

_encode = msgspec.json.Encoder().encode

# ----------------------------------------------------------------- requests


class _Body:
    """What the validated request bodies share: ``parse`` from bytes or a dict."""

    __slots__ = ()

    def __init__(self, raw: JSONObject) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @classmethod
    def parse(cls, body: JSONObject | bytes) -> Self:
        """Validate a decoded body (or raw bytes); raises ``InvalidRequest``."""
        return cls(f.as_dict(body))


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
        self.model: str = f.model(raw)
        self.messages: list[JSONObject] = f.messages(raw)
        self.stream: bool = f.opt_bool(raw, "stream", False)
        options = f.opt_object(raw, "stream_options")
        self.include_usage: bool = (
            f.opt_bool(options, "include_usage", False, "stream_options.include_usage")
            if options is not None
            else False
        )
        self.tools: list[JSONObject] | None = f.chat_tools(raw)
        self.tool_choice: str | JSONObject | None = f.tool_choice(raw)
        #: Caller metadata, ``workspace`` included (see :attr:`workspace`).
        self.metadata: dict[str, str] = f.metadata(raw)

        #: How many choices (``n``): relayed as sent; the normalized path runs
        #: the request once per choice (at most ``MAX_NORMALIZED_CHOICES``).
        self.n: int = f.choices(raw)
        f.opt_str(raw, "user")
        response_format = f.opt_object(raw, "response_format")
        f.opt_bool(raw, "parallel_tool_calls", True)
        params: JSONObject = {}
        if response_format is not None:
            # To the normalized run as sent: each adapter maps it to its
            # provider's form (ollama: ``format``) or says clearly it cannot.
            params["response_format"] = response_format
        for key, value in (
            ("temperature", f.opt_number(raw, "temperature", 0, 2)),
            ("top_p", f.opt_number(raw, "top_p", 0, 1)),
            ("presence_penalty", f.opt_number(raw, "presence_penalty", -2, 2)),
            ("frequency_penalty", f.opt_number(raw, "frequency_penalty", -2, 2)),
            ("seed", f.opt_int(raw, "seed")),
            ("stop", f.stop(raw)),
        ):
            if value is not None:
                params[key] = value
        f.sampling_extras(raw, params)
        effort = f.reasoning_effort(raw.get("reasoning_effort"), "reasoning_effort")
        if effort is not None:
            params["reasoning_effort"] = effort
        max_tokens = f.opt_int(raw, "max_tokens", 1)
        max_completion = f.opt_int(raw, "max_completion_tokens", 1)
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
        "tool_plan",
        "function_tools",
        "metadata",
        "field_names",
        "_params",
    )

    def __init__(self, raw: JSONObject) -> None:
        self.raw = raw
        self.model: str = f.model(raw)
        value = raw.get("input")
        if value is not None and not isinstance(value, str | list):
            raise f.wrong_type("input", "a string or an array", value)
        self.input: str | JSONArray | None = value
        self.instructions: str | None = f.opt_str(raw, "instructions")
        self.stream: bool = f.opt_bool(raw, "stream", False)
        self.tools: list[JSONObject] | None = f.opt_array(raw, "tools")
        #: The tools as a normalized provider takes them (``responses_tools``):
        #: function, custom and namespace tools flattened; the rest unsupported.
        self.tool_plan: ToolPlan = plan_tools(self.tools)
        mode, forced = tool_choice_plan(raw.get("tool_choice"), self.tool_plan)
        #: The function tools in the chat shape the normalized run gets:
        #: none under ``tool_choice: none``, only the forced one when one is.
        self.function_tools: list[JSONObject] | None = _chosen(
            self.tool_plan.function_tools, mode, forced
        )
        self.metadata: dict[str, str] = f.metadata(raw)
        f.opt_bool(raw, "parallel_tool_calls", True)
        f.opt_bool(raw, "store", False)
        for key in ("prompt_cache_key", "user", "safety_identifier"):
            f.opt_str(raw, key)
        f.opt_str_array(raw, "include")
        params: JSONObject = {}
        response_format = f.text_format(raw)
        if response_format is not None:
            params["response_format"] = response_format
        for key, param_value in (
            ("temperature", f.opt_number(raw, "temperature", 0, 2)),
            ("top_p", f.opt_number(raw, "top_p", 0, 1)),
            ("max_tokens", f.opt_int(raw, "max_output_tokens", 1)),
        ):
            if param_value is not None:
                params[key] = param_value
        f.sampling_extras(raw, params)
        reasoning = f.opt_object(raw, "reasoning")
        effort = f.reasoning_effort(
            reasoning.get("effort") if reasoning is not None else raw.get("reasoning_effort"),
            "reasoning.effort" if reasoning is not None else "reasoning_effort",
        )
        if effort is not None:
            params["reasoning_effort"] = effort
        #: Generation parameter -> the field the caller sent it as (for 400s).
        self.field_names: dict[str, str] = {"max_tokens": "max_output_tokens"}
        self._params = params


def _chosen(
    tools: list[JSONObject] | None, mode: str | None, forced: str | None
) -> list[JSONObject] | None:
    """The tools a ``tool_choice`` leaves the run (no provider here enforces a choice)."""
    if tools is None or mode == "none":
        return None
    if forced is not None:
        kept = [t for t in tools if isinstance(fn := t.get("function"), dict) and fn.get("name") == forced]
        return kept or tools
    return tools


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
        self.model: str = f.model(raw)
        self.stream: bool = f.opt_bool(raw, "stream", True)  # Ollama streams by default
        self.options: JSONObject = f.opt_object(raw, "options") or {}
        messages = raw.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise f.wrong_type("messages", "an array", messages)
        f.opt_str(raw, "prompt")

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
        self.model: str = f.model(raw)
        self.stream: bool = f.opt_bool(raw, "stream", False)

    def params(self) -> JSONObject:
        """The numeric generation parameters sent (checked against ``models[].generation.limits``)."""
        return {key: raw for key in self._PARAMS if f.is_number(raw := self.raw.get(key))}

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
