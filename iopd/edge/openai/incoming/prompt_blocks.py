"""The prompt of a request as its provider will see it, as bytes in order.

Why: the pool routes a request to the provider that most likely still holds
its prompt's prefix in its KV / prompt cache (``iopd.edge.pool.prefix_index``
cuts these bytes into chained blocks).  An inference server caches the
tokens of the prompt it was sent, in the order its chat template lays them
out: tools first, then the system prompt / instructions, then the messages.
So the serialization follows that order, one JSON value per line, whatever
order the caller wrote the body's keys in, and a field that does not reach
the prompt (``temperature``, ``stream``) never breaks a match.

Per endpoint, ``ORDER`` names the body fields in prompt order; a request of
an endpoint without an entry has no prompt bytes (it is routed by load).
A ``cache_salt`` the caller sends comes first, so two callers that salt
differently never share a block.  Pure and bounded: at most ``limit`` bytes
are produced (the values past it are not even encoded), and a caller's body
was already bounded by ``openai.max_body_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

__all__ = ["ORDER", "prompt_bytes"]

#: The fields of each endpoint's body that make its prompt, in prompt order.
#: A list field (``messages``, ``input``, ``tools``) is serialized item by
#: item, so the bytes of a conversation only grow at the end as it goes on.
ORDER: Final[Mapping[str, tuple[str, ...]]] = {
    "/v1/chat/completions": ("tools", "messages"),
    "/v1/responses": ("tools", "instructions", "input"),
    "/v1/messages": ("tools", "system", "messages"),
    "/v1/completions": ("prompt",),
    "/api/chat": ("tools", "messages"),
    "/api/generate": ("system", "prompt"),
}

_encode = msgspec.json.Encoder().encode


def prompt_bytes(endpoint: str, body: Mapping[str, object] | None, limit: int) -> bytes:
    """The prompt fields of ``body`` (the parsed JSON object), at most ``limit`` bytes.

    Empty for an endpoint ``ORDER`` does not list, for no body, or ``limit`` 0.
    A value that cannot be encoded (not JSON) ends the prompt there.
    """
    fields = ORDER.get(endpoint)
    if not fields or body is None or limit <= 0:
        return b""
    parts: list[bytes] = []
    size = 0
    salt = body.get("cache_salt")
    values: list[object] = [salt] if isinstance(salt, str) and salt else []
    for name in fields:
        value = body.get(name)
        if isinstance(value, list):
            values.extend(value)
        elif value is not None:
            values.append(value)
    for value in values:
        try:
            piece = _encode(value)
        except (TypeError, ValueError, OverflowError):
            break
        parts.append(piece)
        parts.append(b"\n")
        size += len(piece) + 1
        if size >= limit:
            break
    return b"".join(parts)[:limit]
