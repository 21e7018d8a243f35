"""A request body and what came back: a chat body, a function tool, an error envelope asserted, the JSON
payloads of an SSE body and the text it streamed."""

from __future__ import annotations

import json
from typing import Any

from tests.support.gateway import RawResponse


def chat_body(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def function_tool(
    name: str, properties: dict[str, Any], required: list[str] | None = None
) -> dict[str, Any]:
    """A Chat Completions ``tools[]`` entry: function ``name`` taking an object of
    ``properties`` (``required`` left out when None)."""
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def assert_error(resp: RawResponse, status: int, code: str, param: str | None = None) -> None:
    assert resp.status == status, (resp.status, resp.body)
    err = resp.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body (``[DONE]`` excluded)."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def streamed_text(body: bytes) -> str:
    text = ""
    for ev in sse_events(body):
        for choice in ev.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    return text
