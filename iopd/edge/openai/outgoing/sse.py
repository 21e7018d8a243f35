"""Server-sent events framing for the OpenAI streaming responses.

Every event is one ``data: <compact JSON>\\n\\n`` line; a stream ends with
``data: [DONE]\\n\\n`` exactly as OpenAI sends it.  JSON is encoded with
msgspec (compact, UTF-8, no spaces), which is what the SDK's SSE decoder
expects and several times faster than ``json.dumps`` on the hot path.
"""

from __future__ import annotations

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue

SSE_DONE = b"data: [DONE]\n\n"
"""The terminal event of an OpenAI stream."""

SSE_HEADERS: list[tuple[str, str]] = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),
]
"""Response headers for an SSE stream (``x-accel-buffering`` stops proxy buffering)."""

_encoder = msgspec.json.Encoder()


def sse_data(obj: JSONValue) -> bytes:
    """One SSE ``data:`` event carrying ``obj`` as compact JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


_decode = msgspec.json.Decoder().decode


class ChatPayload(msgspec.Struct, frozen=True):
    """What one ``data:`` payload of a provider's chat stream says, read once
    for every translation of that stream: its end (``[DONE]``), a chunk, an
    error event (``{"error": ...}`` without ``choices``), or nothing a chat
    client would have read (not JSON, not an object)."""

    done: bool = False
    chunk: JSONObject | None = None
    error: str | None = None


def read_chat_payload(payload: bytes) -> ChatPayload:
    """``payload`` (one SSE ``data:`` value) as :class:`ChatPayload`."""
    if payload.strip() == b"[DONE]":
        return ChatPayload(done=True)
    try:
        doc = _decode(payload)
    except msgspec.DecodeError:
        return ChatPayload()
    if not isinstance(doc, dict):
        return ChatPayload()
    error = doc.get("error")
    if error is not None and "choices" not in doc:
        message = error.get("message") if isinstance(error, dict) else error
        return ChatPayload(error=str(message)[:2000])
    return ChatPayload(chunk=doc)
