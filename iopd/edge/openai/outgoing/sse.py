"""Server-sent events framing for the OpenAI streaming responses.

Every event is one ``data: <compact JSON>\\n\\n`` line; a stream ends with
``data: [DONE]\\n\\n`` exactly as OpenAI sends it.  JSON is encoded with
msgspec (compact, UTF-8, no spaces), which is what the SDK's SSE decoder
expects and several times faster than ``json.dumps`` on the hot path.
"""

from __future__ import annotations

import msgspec

from iopd.edge.openai.incoming.jsonschema import JSONValue

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
