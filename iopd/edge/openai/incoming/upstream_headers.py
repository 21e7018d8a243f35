"""Which caller headers reach a passthrough provider: an allow-list.

Why an allow-list: the edge is a proxy in front of someone else's API, and
every header a caller can slip through is one the provider (or a proxy in
front of it) may trust — cookies, ``Forwarded``/``X-Forwarded-*`` client
addresses, ``X-Original-URL`` routing overrides, a ``Content-Encoding: gzip``
over a body the edge already re-encoded as plain JSON.  A deny-list misses the
next such header; an allow-list names the few the OpenAI API uses.

Pure: config and header lists in, header list out.  What may never be
forwarded (``forbidden_reason``) is in :mod:`iopd.vocabulary`, with the other
header sets: the config check refuses the same names in
``openai.forward_headers``, and the config layer imports nothing of the edge.
"""

from __future__ import annotations

from collections.abc import Iterable

from iopd.edge.openai.incoming.session_key import SESSION_HEADERS

__all__ = ["AGENT_SESSION_HEADERS", "DEFAULT_FORWARDED", "upstream_headers"]

#: The coding agents' headers that keep a session whole upstream (a provider's
#: prompt cache, its own session routing): forwarded by default, none carries
#: a credential.  Codex: ``session_id``/``session-id``, ``thread-id``,
#: ``conversation_id``, ``originator``, ``x-client-request-id``; opencode:
#: ``x-session-id``, ``x-session-affinity``; Claude Code:
#: ``x-claude-code-session-id``, ``anthropic-version``, ``anthropic-beta``.
AGENT_SESSION_HEADERS: frozenset[str] = frozenset(
    {
        *SESSION_HEADERS,
        "originator",
        "x-client-request-id",
        "anthropic-version",
        "anthropic-beta",
    }
)
#: Caller headers forwarded by default (lower-case).  ``content-type`` is set
#: by the edge itself: the relayed body is always the re-encoded JSON.
DEFAULT_FORWARDED: frozenset[str] = frozenset(
    {
        "accept",
        "openai-beta",
        "openai-organization",
        "openai-project",
        "x-request-id",
        "idempotency-key",
        "user-agent",
        *AGENT_SESSION_HEADERS,
    }
)

def _connection_nominated(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Names the caller's ``Connection:`` lists: hop-by-hop by its own word (RFC 9110 §7.6.1)."""
    names: set[str] = set()
    for name, value in headers:
        if name == "connection":
            names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return names


def upstream_headers(
    headers: list[tuple[str, str]],
    *,
    extra: Iterable[str] = (),
    provider_auth_header: str,
) -> list[tuple[str, str]]:
    """The caller's ``headers`` (names lower-case) that may reach the provider.

    Allowed: ``DEFAULT_FORWARDED`` plus ``extra`` (``openai.forward_headers``);
    never a header the caller's ``Connection:`` names, nor the provider-auth
    source header (its value travels under the target header instead).
    """
    allowed = DEFAULT_FORWARDED | {h.lower() for h in extra} if extra else DEFAULT_FORWARDED
    blocked = _connection_nominated(headers)
    blocked.add(provider_auth_header.lower())
    return [(k, v) for k, v in headers if k in allowed and k not in blocked]
