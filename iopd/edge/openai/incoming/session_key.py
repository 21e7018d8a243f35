"""A request's session key: which conversation of which agent it belongs to.

Pure and bounded: :func:`session_key` looks at a few named headers and a few
top-level body fields, in a fixed order, and returns at most
``MAX_SESSION_KEY_CHARS`` characters (a longer value, or one with characters
outside ``[A-Za-z0-9._:-]``, is replaced by a digest of it), or None when the
request names no session.  The order, first found wins:

1. the operator's header (``openai.session_header``), when configured;
2. the coding agents' own session headers (:data:`SESSION_HEADERS`: Codex's
   ``session_id``/``session-id``, ``conversation_id``, ``thread-id``;
   opencode's ``x-session-id`` and ``x-session-affinity``; Claude Code's
   ``x-claude-code-session-id``);
3. the body's ``prompt_cache_key`` (what OpenAI routes its prompt cache by),
   ``metadata.user_id`` (Anthropic's), ``user``, ``safety_identifier``.

Never a credential: the headers looked at are these names only, none of
which carries one (``openai.session_header`` may not name a credential
header: the config check refuses it).  The key is for routing (session
affinity) and the request's record; its log line shows a digest of it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping

__all__ = ["MAX_SESSION_KEY_CHARS", "SESSION_HEADERS", "session_digest", "session_key"]

#: The coding agents' session headers (lower-case), in the order they count.
SESSION_HEADERS: tuple[str, ...] = (
    "session_id",
    "session-id",
    "conversation_id",
    "thread-id",
    "x-session-id",
    "x-session-affinity",
    "x-claude-code-session-id",
)
_SESSION_HEADER_SET = frozenset(SESSION_HEADERS)
#: Body fields that name a session, in the order they count (``metadata.user_id``:
#: a nested one).
_BODY_FIELDS: tuple[str, ...] = (
    "prompt_cache_key",
    "metadata.user_id",
    "user",
    "safety_identifier",
)
#: The longest key returned; a longer value becomes its digest.
MAX_SESSION_KEY_CHARS = 64
#: A value returned as it is; any other (longer, or with other characters) is
#: digested whole (a cut one could join two sessions that share a prefix).
_SAFE = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _digest(value: str) -> str:
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:32]


def _bounded(value: str) -> str | None:
    value = value.strip()
    if not value:
        return None
    return value if _SAFE.fullmatch(value) else _digest(value)


def session_key(
    headers: Iterable[tuple[str, str]],
    body: Mapping[str, object] | None,
    *,
    header: str | None = None,
) -> str | None:
    """The session key of a request, or None.

    ``headers``: the request's (names lower-case, as the HTTP server gives
    them); ``body``: its decoded JSON object (None without one); ``header``:
    ``openai.session_header``.  Linear in the number of headers.
    """
    wanted = (header.lower(),) + SESSION_HEADERS if header else SESSION_HEADERS
    names = frozenset(wanted) if header else _SESSION_HEADER_SET
    found: dict[str, str] = {}
    for name, text in headers:
        if name in names and name not in found:
            found[name] = text
    if not found and body is None:
        return None
    for name in wanted:
        if name in found:
            key = _bounded(found[name])
            if key is not None:
                return key
    if body is None:
        return None
    for field in _BODY_FIELDS:
        value: object
        if field == "metadata.user_id":
            metadata = body.get("metadata")
            value = metadata.get("user_id") if isinstance(metadata, Mapping) else None
        else:
            value = body.get(field)
        if isinstance(value, str):
            key = _bounded(value)
            if key is not None:
                return key
    return None


def session_digest(key: str | None) -> str:
    """What a log line shows of a session key: 12 hex characters of its digest (or ``-``)."""
    if key is None:
        return "-"
    return hashlib.sha256(key.encode()).hexdigest()[:12]
