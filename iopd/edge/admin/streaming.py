"""Streaming responses on the admin app (the console's ``GET /events``).

A streaming route returns ``streaming_response(chunks, ...)``: the response
has no framework timeout (Quart would otherwise cut it after
``RESPONSE_TIMEOUT`` without a word), and a client that disconnects cancels
the handler — quart-trio runs the ASGI receive loop and the response in one
nursery, so ``http.disconnect`` cancels the send, and the async generator
behind ``chunks`` is closed (its ``finally`` runs) at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping

from quart import Response


def streaming_response(
    chunks: AsyncIterable[bytes],
    *,
    content_type: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A response that sends ``chunks`` as they come, for as long as they come."""
    response = Response(chunks, content_type=content_type, headers=dict(headers or {}))
    response.timeout = None  # this response never times out, whatever RESPONSE_TIMEOUT says
    return response
