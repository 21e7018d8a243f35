"""A provider's ``base_url`` as users write it, and the root the node appends paths to.

Users copy ``base_url`` from their client's settings, where the OpenAI SDK
and LiteLLM want the API root *with* ``/v1`` (``http://host:8000/v1``) and
the ``ollama`` client wants the server root.  The node joins the path of
every request to the provider's root (the relayed ``/v1/chat/completions``,
the probe's ``/v1/models``, Ollama's ``/api/chat``), so a ``/v1`` left in
``base_url`` became ``/v1/v1/...``: an unhealthy provider and a 502 for every
request.

This module is the one place that knows the two forms.  The edge validates
``base_url`` with ``base_url_problem`` and pushes ``provider_root`` to the
node in the provider's ``ProviderSpec``, so the node (its health probe and
its requests alike) only ever sees the root and needs no change, and an
older node works with a newer edge.  ``config check`` prints
``request_url`` so the operator sees where requests will go.

Rules, per provider type:

* ``openai``: ``http://host:8000``, ``http://host:8000/v1`` and
  ``http://host:8000/v1/`` are the same provider; a prefix is kept
  (``https://host/openai/v1`` → root ``https://host/openai``).
* ``ollama``: ``http://host:11434`` and ``http://host:11434/api`` are the
  same; ``/v1`` (Ollama's OpenAI-compatible API) is refused with a hint,
  since this type speaks Ollama's native ``/api``.
* A query string or fragment is refused: every request path is appended to
  the URL, so a query would never reach the provider.
* A full endpoint URL (``.../v1/chat/completions``, ``.../api/chat``) is
  refused: iopd chooses the endpoint per request.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import SplitResult, urlsplit, urlunsplit

from iopd.vocabulary import ProviderType

__all__ = ["HTTP_PROVIDER_TYPES", "base_url_problem", "provider_root", "request_url"]

#: Provider types that talk HTTP to ``base_url``.
HTTP_PROVIDER_TYPES: Final[frozenset[ProviderType]] = frozenset({"openai", "ollama"})

#: The API prefix a user may leave on ``base_url``; the node adds it back per request.
_API_PREFIX = {"openai": "/v1", "ollama": "/api"}

#: The path ``config check`` shows: the one a chat request goes to.
_CHAT_PATH = {"openai": "/v1/chat/completions", "ollama": "/api/chat"}

#: Path endings that mean "this is an endpoint, not a base URL".
_ENDPOINT_SUFFIXES = {
    "openai": ("/chat/completions", "/completions", "/responses", "/embeddings", "/models"),
    "ollama": ("/api/chat", "/api/generate", "/api/tags", "/api/embed"),
}

_SCHEME_HINT = "must be an http:// or https:// URL with a host"


def _split(base_url: str) -> SplitResult | None:
    """The parts of an http(s) URL with a host and a valid port, else None."""
    try:
        parts = urlsplit(base_url)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts


def base_url_problem(provider_type: str, base_url: str) -> str | None:
    """Why ``base_url`` cannot serve a provider of ``provider_type``; None when it can."""
    parts = _split(base_url)
    if parts is None:
        return _SCHEME_HINT
    if parts.query or parts.fragment or base_url.endswith(("?", "#")):
        return (
            "must not have a query string or fragment: iopd appends each request's "
            "path to base_url, so they would never reach the provider"
        )
    path = parts.path.rstrip("/")
    for endpoint in _ENDPOINT_SUFFIXES.get(provider_type, ()):
        if path.endswith(endpoint):
            example = "http://host:8000/v1" if provider_type == "openai" else "http://host:11434"
            return (
                f"ends in the endpoint {endpoint}; give the server's base URL "
                f"(e.g. {example}): iopd picks the endpoint per request"
            )
    if provider_type == "ollama" and path.endswith("/v1"):
        return (
            "/v1 is Ollama's OpenAI-compatible API: use type 'openai' with this URL, or "
            "drop /v1 for type 'ollama' (Ollama's native /api)"
        )
    return None


def provider_root(provider_type: str, base_url: str) -> str:
    """The URL the node joins request paths to (``base_url`` without ``/v1`` or ``/api``).

    ``base_url`` must be valid (``base_url_problem`` returned None); types
    other than ``openai`` and ``ollama`` get it back unchanged.
    """
    prefix = _API_PREFIX.get(provider_type)
    if prefix is None:
        return base_url
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith(prefix):
        path = path[: -len(prefix)]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def request_url(provider_type: str, base_url: str) -> str:
    """Where a chat request to this provider goes, without any userinfo (for display)."""
    parts = urlsplit(provider_root(provider_type, base_url))
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")) + _CHAT_PATH.get(
        provider_type, ""
    )
