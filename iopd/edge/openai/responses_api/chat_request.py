"""A ``/v1/responses`` body as a Chat Completions body, for a provider that
speaks only chat (``openai_responses: false``).  Pure.

The conversation is the normalized path's (``outgoing/responses.py``'s
``responses_input_to_messages``: ``instructions`` first, message items, the
``function_call`` / ``custom_tool_call`` items of a tool loop and their
outputs, ``reasoning`` items left out), with every ``system`` and
``developer`` turn joined into one leading ``system`` message, where every
chat template takes one.  The tools are the normalized path's plan
(``incoming/responses_tools.py``): function tools in chat's shape, ``custom``
tools as a function of one string, ``namespace`` tools flattened; built-in
tools (``web_search``…) follow ``openai.unsupported_tools`` (``drop``: left
out and named; ``reject``: a 400 naming the tool).

Fields with a chat equivalent are mapped: ``max_output_tokens`` →
``max_tokens``, ``temperature``, ``top_p``, the sampling extras (``top_k``,
``min_p``, ``repetition_penalty``, ``chat_template_kwargs``), ``text.format``
→ ``response_format``, ``reasoning.effort`` → ``reasoning_effort``,
``tool_choice``, ``parallel_tool_calls``, ``user``; a stream asks for its
usage (``stream_options.include_usage``).  The rest (``store``,
``include``, ``prompt_cache_key``, ``metadata``, ``client_metadata``…) has
no place in a chat body and is left out.
"""

from __future__ import annotations

from typing import NamedTuple, cast

from iopd.edge.openai.incoming import requests as rq
from iopd.edge.openai.incoming.jsonschema import JSONArray, JSONObject, JSONValue
from iopd.edge.openai.incoming.responses_tools import tool_choice_plan, unsupported_refusal
from iopd.edge.openai.outgoing.responses import responses_input_to_messages

__all__ = ["ChatBody", "chat_body"]

#: The caller's parameters (``ResponsesRequest.params``) that go into a chat
#: body under the same name.
_SAME_NAME = ("temperature", "top_p", "max_tokens", "top_k", "min_p", "chat_template_kwargs")
_SYSTEM_ROLES = frozenset({"system", "developer"})


class ChatBody(NamedTuple):
    """The chat body, and the built-in tool types it was made without."""

    body: JSONObject
    dropped_tools: tuple[str, ...]


def chat_body(body: rq.ResponsesRequest, target: str, *, unsupported_tools: str) -> ChatBody:
    """The Chat Completions body for ``body`` on the provider's ``target`` model.

    Raises ``InvalidRequest`` (400 naming the field) for what chat cannot
    carry (``previous_response_id``, an item type it has no form for, a
    malformed custom or namespace tool, a built-in tool under ``reject``).
    """
    raw = body.raw
    messages = _one_system(responses_input_to_messages(raw))
    chat: JSONObject = {"model": target, "messages": cast(JSONArray, messages)}
    plan = body.tool_plan
    dropped: tuple[str, ...] = ()
    refusal = unsupported_refusal(plan)
    if refusal is not None:
        if plan.problem is not None or unsupported_tools == "reject":
            raise refusal
        dropped = tuple(plan.dropped_types)
    tools = body.function_tools
    if tools:
        chat["tools"] = cast(JSONArray, list(tools))
        mode, forced = tool_choice_plan(raw.get("tool_choice"), plan)
        if forced is not None:
            chat["tool_choice"] = {"type": "function", "function": {"name": forced}}
        elif mode is not None:
            chat["tool_choice"] = mode
        parallel = raw.get("parallel_tool_calls")
        if isinstance(parallel, bool):
            chat["parallel_tool_calls"] = parallel
    if body.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    params = body.params()
    for key in _SAME_NAME:
        if key in params:
            chat[key] = params[key]
    if "repeat_penalty" in params:
        chat["repetition_penalty"] = params["repeat_penalty"]
    if "response_format" in params:
        chat["response_format"] = params["response_format"]
    if "reasoning_effort" in params:
        chat["reasoning_effort"] = params["reasoning_effort"]
    user = raw.get("user")
    if isinstance(user, str):
        chat["user"] = user
    return ChatBody(chat, dropped)


def _one_system(messages: list[JSONObject]) -> list[JSONObject]:
    """Every ``system``/``developer`` turn's text joined into one leading
    ``system`` message (chat templates take one, first); the rest in order."""
    system: list[str] = []
    rest: list[JSONObject] = []
    for msg in messages:
        if msg.get("role") in _SYSTEM_ROLES:
            text = _text(msg.get("content"))
            if text:
                system.append(text)
        else:
            rest.append(msg)
    if system:
        rest.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return rest


def _text(content: JSONValue) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        return "\n".join(t for t in texts if isinstance(t, str) and t)
    return ""
