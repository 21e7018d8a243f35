"""Anthropic's Messages API coming in: a ``/v1/messages`` body, validated and
translated to a Chat Completions body.

Pure.  :class:`MessagesBody` is a :class:`~iopd.edge.openai.incoming.requests.ChatRequest`
over the translation (so the request path treats it as chat: estimate,
limits, the normalized run, a relay to an OpenAI-compatible provider) that
keeps the caller's own body as :attr:`MessagesBody.anthropic`, which a
provider speaking Messages itself gets as sent.

What is translated, field by field (what is ignored is listed in
docs/compatibility.md):

* ``system`` (a string or text blocks) → the first ``system`` message, with
  the text of any ``system`` turn among the messages appended to it;
* ``messages[]``: ``text`` and ``image`` blocks (base64 → a ``data:`` URL, or
  a ``url``) → content parts; an assistant's ``tool_use`` blocks → its
  ``tool_calls`` (``input`` as the JSON ``arguments``); a user's
  ``tool_result`` blocks → ``tool`` messages before the rest of its content;
  ``thinking`` and ``redacted_thinking`` blocks are dropped (no chat provider
  takes them back);
* ``tools[]`` (``name``, ``description``, ``input_schema``) → function tools;
  typed server tools (``web_search_…``, ``bash_…``) have no chat form and are
  dropped; ``tool_choice`` ``auto``/``any``/``tool``/``none`` → ``auto``/
  ``required``/the named function/``none``, ``disable_parallel_tool_use`` →
  ``parallel_tool_calls: false``;
* ``max_tokens``, ``stop_sequences`` → ``stop``, ``temperature``, ``top_p``,
  ``top_k``, ``metadata.user_id`` → ``user``, ``stream`` (with usage asked for);
* ``thinking`` ``enabled`` → ``reasoning_effort`` (``output_config.effort``,
  else by ``budget_tokens``), which providers that think take (``adaptive``
  and ``between_tools`` leave thinking to the model: nothing is asked);
  ``output_config.format`` (a JSON schema) → ``response_format``.

A block the chat form cannot carry (a PDF ``document``) is not refused here:
a Messages-native provider takes it as sent, so :attr:`MessagesBody.untranslatable`
says why, and the translated path refuses it (400) once it knows the provider.

Work is linear in the body, which :mod:`~iopd.edge.openai.incoming.json_body`
already bounds in size and nesting.
"""

from __future__ import annotations

from typing import Self

import msgspec

from iopd.edge.openai.incoming import request_fields as f
from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue
from iopd.edge.openai.incoming.requests import ChatRequest
from iopd.errors import InvalidRequest

__all__ = ["MessagesBody", "count_tokens_messages", "to_chat"]

_encode = msgspec.json.Encoder().encode

_ROLES = frozenset({"user", "assistant"})
_IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
#: Blocks with no chat form that change nothing a chat provider could use.
_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
#: ``tool_choice.type`` → chat ``tool_choice`` (``tool`` names a function).
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
#: ``thinking.budget_tokens`` below each bound → that ``reasoning_effort``.
_EFFORTS = ((4096, "low"), (16384, "medium"))
#: ``output_config.effort`` → ``reasoning_effort`` (chat's three levels).
_OUTPUT_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
#: The most of ``metadata.user_id`` kept as chat's ``user`` (an agent's id
#: may be long; the rest names nothing a provider uses).
MAX_USER_CHARS = 256
#: Anthropic's stop sequences are as many as a caller sends; chat's are four.
MAX_STOP_SEQUENCES = f.MAX_STOP_SEQUENCES


class MessagesBody(ChatRequest):
    """A validated ``POST /v1/messages`` body, seen as the chat request it translates to.

    ``raw`` is the translated chat body (what an OpenAI-compatible provider
    is sent); ``anthropic`` is the caller's body (what a Messages-native
    provider is sent).
    """

    __slots__ = ("anthropic", "untranslatable", "wants_stream")

    #: ``count_tokens`` bodies carry no ``max_tokens``.
    _count_only = False

    def __init__(self, raw: JSONObject) -> None:
        chat, untranslatable = to_chat(raw, count_only=self._count_only)
        super().__init__(chat)
        self.anthropic: JSONObject = raw
        #: Why the chat form cannot carry this request (None: it can).
        self.untranslatable: str | None = untranslatable
        #: The caller asked for the event stream.
        self.wants_stream: bool = self.stream
        top_k = chat.get("top_k")
        if top_k is not None:
            self._params["top_k"] = top_k
        effort = chat.get("reasoning_effort")
        if effort is not None:
            self._params["reasoning_effort"] = effort

    @classmethod
    def parse(cls, body: JSONObject | bytes) -> Self:
        return cls(f.as_dict(body))


class CountTokensBody(MessagesBody):
    """A ``POST /v1/messages/count_tokens`` body: a Messages body without ``max_tokens``."""

    __slots__ = ()
    _count_only = True


def count_tokens_messages(raw: JSONObject) -> list[JSONObject]:
    """The chat messages of a ``count_tokens`` body (for the token estimate)."""
    chat, _ = to_chat(raw, count_only=True)
    messages = chat["messages"]
    assert isinstance(messages, list)
    return [m for m in messages if isinstance(m, dict)]


# ------------------------------------------------------------------ the body


def to_chat(raw: JSONObject, *, count_only: bool = False) -> tuple[JSONObject, str | None]:
    """The Chat Completions body of a Messages body, and why it cannot carry
    all of it (None when it can).  Raises ``InvalidRequest`` naming the
    caller's field."""
    notes: list[str] = []
    chat: JSONObject = {"model": f.model(raw)}
    messages: list[JSONValue] = []
    system = _system(raw.get("system"), "system")
    given = raw.get("messages")
    if not isinstance(given, list):
        raise f.wrong_type("messages", "an array", given)
    if not given and not count_only:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    for i, msg in enumerate(given):
        here = f"messages[{i}]"
        if isinstance(msg, dict) and msg.get("role") == "system":
            # A system turn among the messages (Claude Code sends them): into
            # the leading system message, where every chat template takes one.
            more = _system(msg.get("content"), f"{here}.content")
            system = f"{system}\n\n{more}" if system and more else system or more
            continue
        messages.extend(_message(msg, here, notes))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    if not messages:  # count_tokens of nothing: one empty turn keeps chat's shape
        messages.append({"role": "user", "content": ""})
    chat["messages"] = messages
    max_tokens = f.opt_int(raw, "max_tokens", 1)
    if max_tokens is None and not count_only:
        raise InvalidRequest("'max_tokens' is required", param="max_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    stream = f.opt_bool(raw, "stream", False)
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    _sampling(raw, chat)
    tools = _tools(raw.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(raw.get("tool_choice"), chat, bool(tools))
    _metadata(raw.get("metadata"), chat)
    effort = _output_config(raw.get("output_config"), chat)
    _thinking(raw.get("thinking"), chat, effort)
    return chat, (notes[0] if notes else None)


def _system(value: JSONValue, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise f.wrong_type(param, "a string or an array of text blocks", value)
    texts = []
    for i, block in enumerate(value):
        here = f"{param}[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequest(f"'{here}' must be a text block", param=here)
        texts.append(_text(block, here))
    return "\n\n".join(texts)


def _text(block: JSONObject, here: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise f.wrong_type(f"{here}.text", "a string", text)
    return text


def _message(msg: JSONValue, here: str, notes: list[str]) -> list[JSONValue]:
    """One Messages turn as chat messages (a user turn with tool results is several)."""
    if not isinstance(msg, dict):
        raise f.wrong_type(here, "an object", msg)
    role = msg.get("role")
    if role not in _ROLES:
        raise InvalidRequest(
            f"'{here}.role' must be 'user', 'assistant' or 'system'", param=f"{here}.role"
        )
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise f.wrong_type(f"{here}.content", "a string or an array of blocks", content)
    if role == "assistant":
        return [_assistant(content, f"{here}.content", notes)]
    return _user(content, f"{here}.content", notes)


def _assistant(blocks: list[JSONValue], here: str, notes: list[str]) -> JSONValue:
    texts: list[str] = []
    calls: list[JSONValue] = []
    for i, block in enumerate(blocks):
        at = f"{here}[{i}]"
        kind = _block_type(block, at)
        assert isinstance(block, dict)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind not in _DROPPED_BLOCKS:
            _other_block(kind, at, notes, assistant=True)
    text = "".join(texts) if texts or not calls else None
    out: JSONObject = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_use(block: JSONObject, at: str) -> JSONValue:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise f.wrong_type(f"{at}.id", "a non-empty string", call_id)
    if not isinstance(name, str) or not name:
        raise f.wrong_type(f"{at}.name", "a non-empty string", name)
    tool_input = block.get("input", {})
    if not isinstance(tool_input, dict):
        raise f.wrong_type(f"{at}.input", "an object", tool_input)
    arguments = _encode(tool_input).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _user(blocks: list[JSONValue], here: str, notes: list[str]) -> list[JSONValue]:
    """Tool results first (chat's ``tool`` messages answer the assistant's
    calls right after it), then the turn's own content."""
    results: list[JSONValue] = []
    parts: list[JSONValue] = []
    for i, block in enumerate(blocks):
        at = f"{here}[{i}]"
        kind = _block_type(block, at)
        assert isinstance(block, dict)
        if kind == "tool_result":
            result_id = block.get("tool_use_id")
            if not isinstance(result_id, str) or not result_id:
                raise f.wrong_type(f"{at}.tool_use_id", "a non-empty string", result_id)
            text, images = _result_content(block.get("content"), f"{at}.content", notes)
            results.append({"role": "tool", "tool_call_id": result_id, "content": text})
            parts.extend(images)  # chat tool messages carry text only
        elif kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind not in _DROPPED_BLOCKS:
            part = _other_block(kind, at, notes, assistant=False, block=block)
            if part is not None:
                parts.append(part)
    if parts or not results:
        results.append({"role": "user", "content": _user_content(parts)})
    return results


def _user_content(parts: list[JSONValue]) -> JSONValue:
    """Text only: one string (every chat provider takes it); else the parts."""
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    if len(texts) == len(parts):
        return "\n".join(t for t in texts if isinstance(t, str))
    return parts


def _result_content(content: JSONValue, here: str, notes: list[str]) -> tuple[str, list[JSONValue]]:
    """A ``tool_result``'s content: its text, and its images (for the user turn)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise f.wrong_type(here, "a string or an array of blocks", content)
    texts: list[str] = []
    images: list[JSONValue] = []
    for i, block in enumerate(content):
        at = f"{here}[{i}]"
        kind = _block_type(block, at)
        assert isinstance(block, dict)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "image":
            images.append(_image(block, at))
        else:
            part = _other_block(kind, at, notes, assistant=False, block=block)
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(str(part["text"]))
    return "\n".join(texts), images


def _block_type(block: JSONValue, at: str) -> str:
    if not isinstance(block, dict):
        raise f.wrong_type(at, "a content block (an object)", block)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise f.wrong_type(f"{at}.type", "a string", kind)
    return kind


def _image(block: JSONObject, at: str) -> JSONValue:
    source = block.get("source")
    if not isinstance(source, dict):
        raise f.wrong_type(f"{at}.source", "an object", source)
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _IMAGE_TYPES:
            raise InvalidRequest(
                f"'{at}.source.media_type' must be one of {', '.join(sorted(_IMAGE_TYPES))}",
                param=f"{at}.source.media_type",
            )
        if not isinstance(data, str):
            raise f.wrong_type(f"{at}.source.data", "a base64 string", data)
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url_value = source.get("url")
        if not isinstance(url_value, str) or not url_value:
            raise f.wrong_type(f"{at}.source.url", "a URL string", url_value)
        url = url_value
    else:
        raise InvalidRequest(
            f"'{at}.source.type' must be 'base64' or 'url'", param=f"{at}.source.type"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _other_block(
    kind: str, at: str, notes: list[str], *, assistant: bool, block: JSONObject | None = None
) -> JSONValue | None:
    """A block beyond text, image and tools: a text ``document`` becomes text;
    anything else is noted as untranslatable (a native provider may take it)."""
    if kind == "document" and block is not None and not assistant:
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text":
            data = source.get("data")
            if isinstance(data, str):
                return {"type": "text", "text": data}
    notes.append(f"'{at}' is a '{kind[:40]}' block, which only a Messages-native provider takes")
    return None


# ------------------------------------------------------------------ the fields


def _sampling(raw: JSONObject, chat: JSONObject) -> None:
    for key, value in (
        ("temperature", f.opt_number(raw, "temperature", 0, 1)),
        ("top_p", f.opt_number(raw, "top_p", 0, 1)),
        ("top_k", f.opt_int(raw, "top_k", 0)),
    ):
        if value is not None:
            chat[key] = value
    stops = raw.get("stop_sequences")
    if stops is None:
        return
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise f.wrong_type("stop_sequences", "an array of strings", stops)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} sequences here",
            param="stop_sequences",
        )
    if stops:
        chat["stop"] = stops


def _tools(value: JSONValue) -> list[JSONValue]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise f.wrong_type("tools", "an array", value)
    tools: list[JSONValue] = []
    for i, tool in enumerate(value):
        here = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise f.wrong_type(here, "an object", tool)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            continue  # a server tool (web search, bash, …): no chat form
        name = tool.get("name")
        if not isinstance(name, str) or not f.TOOL_NAME.fullmatch(name):
            raise InvalidRequest(
                f"'{here}.name' must be 1 to 64 letters, digits, '_' or '-'", param=f"{here}.name"
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise f.wrong_type(f"{here}.input_schema", "an object (a JSON Schema)", schema)
        function: JSONObject = {"name": name, "parameters": schema}
        description = tool.get("description")
        if isinstance(description, str):
            function["description"] = description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: JSONValue, chat: JSONObject, has_tools: bool) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise f.wrong_type("tool_choice", "an object", value)
    kind = value.get("type")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise f.wrong_type("tool_choice.name", "a non-empty string", name)
        choice: JSONValue = {"type": "function", "function": {"name": name}}
    elif isinstance(kind, str) and kind in _TOOL_CHOICES:
        choice = _TOOL_CHOICES[kind]
    else:
        raise InvalidRequest(
            "'tool_choice.type' must be one of auto, any, tool, none", param="tool_choice.type"
        )
    if has_tools:
        chat["tool_choice"] = choice
        param = "tool_choice.disable_parallel_tool_use"
        if f.opt_bool(value, "disable_parallel_tool_use", False, param):
            chat["parallel_tool_calls"] = False


def _metadata(value: JSONValue, chat: JSONObject) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise f.wrong_type("metadata", "an object", value)
    user = value.get("user_id")
    if user is None:
        return
    if not isinstance(user, str):
        raise f.wrong_type("metadata.user_id", "a string", user)
    chat["user"] = user[:MAX_USER_CHARS]


def _thinking(value: JSONValue, chat: JSONObject, effort: str | None) -> None:
    """Only ``enabled`` asks a provider to think (``reasoning_effort``: the
    ``output_config.effort`` sent with it, else by ``budget_tokens``).
    ``adaptive`` and ``between_tools`` leave it to the model, so they ask
    nothing: Claude Code sends them on every request, and a provider whose
    model does not think refuses a ``reasoning_effort`` (Ollama's ``think``)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise f.wrong_type("thinking", "an object", value)
    kind = value.get("type")
    if kind in ("disabled", "adaptive", "between_tools"):
        return
    if kind != "enabled":
        raise InvalidRequest(
            "'thinking.type' must be one of enabled, adaptive, between_tools, disabled",
            param="thinking.type",
        )
    budget = f.opt_int(value, "budget_tokens", 1, "thinking.budget_tokens")
    if effort is None:
        effort = "high"
        for bound, name in _EFFORTS:
            if budget is not None and budget < bound:
                effort = name
                break
    chat["reasoning_effort"] = effort


def _output_config(value: JSONValue, chat: JSONObject) -> str | None:
    """``format`` (a JSON schema) → ``response_format``; the ``effort`` (as
    chat's level) for :func:`_thinking`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise f.wrong_type("output_config", "an object", value)
    given = value.get("effort")
    effort: str | None = None
    if given is not None:
        if given not in _OUTPUT_EFFORTS:
            raise InvalidRequest(
                "'output_config.effort' must be one of low, medium, high, xhigh, max",
                param="output_config.effort",
            )
        effort = _OUTPUT_EFFORTS[str(given)]
    fmt = value.get("format")
    if fmt is None:
        return effort
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequest(
            "'output_config.format.type' must be 'json_schema'", param="output_config.format.type"
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise f.wrong_type("output_config.format.schema", "an object", schema)
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    return effort
