"""``/v1/responses`` on the normalized path (SPEC §4 "Responses").

Providers without a native Responses API (``ollama``, ``cli``, ``echo``) get a
deliberately small subset: non-streaming requests whose ``input`` is a string,
with optional string ``instructions``.  Everything else is relayed raw to a
passthrough provider by the edge, or refused here with a 400 that says why.
The reply is a ``response`` object the official SDK parses
(``openai.types.responses.Response``).
"""

from __future__ import annotations

import secrets

from iopd.edge.openai.jsonschema import JSONObject, JSONValue
from iopd.errors import InvalidRequest
from wire.messages import Usage

__all__ = ["build_response", "new_response_id", "responses_input_to_messages"]

_UNSUPPORTED = (
    "this model's providers only support non-streaming string input; "
    "{detail} (send a string `input`, or use a model with an OpenAI-compatible provider)"
)


def new_response_id() -> str:
    """A fresh ``resp_`` id."""
    return "resp_" + secrets.token_hex(24)


def responses_input_to_messages(req: JSONObject) -> list[JSONObject]:
    """Chat messages for a normalized ``/v1/responses`` request.

    ``instructions`` (a string) becomes a system message, string ``input`` a
    user message.  Streaming, non-string input and non-string instructions
    raise :class:`~iopd.errors.InvalidRequest` (400).
    """
    if req.get("stream") is True:
        raise InvalidRequest(
            _UNSUPPORTED.format(detail="streaming is not supported"), param="stream"
        )
    if "input" not in req or req["input"] is None:
        raise InvalidRequest("`input` is required", param="input")
    text = req["input"]
    if not isinstance(text, str):
        raise InvalidRequest(
            _UNSUPPORTED.format(detail=f"`input` is a {_json_kind(text)}"), param="input"
        )
    instructions = req.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest(
            _UNSUPPORTED.format(detail=f"`instructions` is a {_json_kind(instructions)}"),
            param="instructions",
        )
    messages: list[JSONObject] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.append({"role": "user", "content": text})
    return messages


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
) -> JSONObject:
    """A ``response`` object for a finished normalized run.

    ``output`` holds a ``reasoning`` item (when reasoning text was seen) and
    one assistant ``message`` with a single ``output_text`` part.  ``model``
    is the caller's requested model.  ``finish_reason="length"`` marks the
    response ``incomplete`` (``max_output_tokens``) as OpenAI does; otherwise
    it is ``completed``.  ``usage`` is omitted (null) when the provider
    reported none.
    """
    incomplete = finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[JSONObject] = []
    if reasoning_text:
        output.append(
            {
                "type": "reasoning",
                "id": "rs_" + secrets.token_hex(24),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning_text}],
                "status": "completed",
            }
        )
    output.append(
        {
            "type": "message",
            "id": "msg_" + secrets.token_hex(24),
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    )
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model,
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "metadata": dict(metadata or {}),
        "usage": _usage(usage) if usage is not None else None,
    }
