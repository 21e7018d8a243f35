"""The health probe's second look: is every served model name in the provider's list?

A provider whose server answers ``GET /v1/models`` (``/api/tags`` for
Ollama) with 200 but does not serve a name of ``nodes[].providers[].models``
fails every request for that name; the probe reports it ``unhealthy`` with
``model 'x' not served`` instead of ``healthy``.

A list that names no model at all is not checked: some OpenAI-compatible
proxies answer every name and list none, so an empty list says nothing.

Pure and bounded: the probe reads at most ``MAX_LIST_BYTES`` of the body
(a longer list is not checked: the probe's first look, the 200, decides),
at most ``MAX_LIST_ITEMS`` entries are looked at, and the names quoted in the
error are few and cut short (they come from the provider).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["MAX_LIST_BYTES", "MAX_LIST_ITEMS", "listed_names", "not_served"]

#: Bytes of a model list the probe reads; past it the names are not checked.
MAX_LIST_BYTES = 1024 * 1024
#: Entries of a model list looked at.
MAX_LIST_ITEMS = 10000
#: Listed names quoted in the error, and the characters kept of each.
QUOTED_NAMES = 3
QUOTED_CHARS = 64


def listed_names(body: bytes, flavour: str) -> set[str] | None:
    """The model names of an OpenAI ``/v1/models`` (``data[].id``) or Ollama
    ``/api/tags`` (``models[].name`` and ``.model``) body; None when the body
    is not such a list (then nothing is checked)."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    ollama = flavour == "ollama"
    items = doc.get("models" if ollama else "data")
    keys = ("name", "model") if ollama else ("id",)
    if not isinstance(items, list):
        return None
    names: set[str] = set()
    for item in items[:MAX_LIST_ITEMS]:
        if isinstance(item, dict):
            names.update(v for k in keys if isinstance(v := item.get(k), str))
    return names


def _served(name: str, listed: set[str], flavour: str) -> bool:
    # Ollama resolves a name without a tag to its ``:latest``.
    if name in listed:
        return True
    return flavour == "ollama" and ":" not in name and f"{name}:latest" in listed


def not_served(models: Sequence[str], listed: set[str], flavour: str, path: str) -> str | None:
    """The probe's ``last_error`` when a name of ``models`` is not listed, else
    None (also for an empty list: it says nothing about what is served)."""
    if not listed:
        return None
    missing = next((m for m in models if not _served(m, listed, flavour)), None)
    if missing is None:
        return None
    shown = ", ".join(repr(n[:QUOTED_CHARS]) for n in sorted(listed)[:QUOTED_NAMES])
    more = f" and {len(listed) - QUOTED_NAMES} more" if len(listed) > QUOTED_NAMES else ""
    return (
        f"model {missing[:QUOTED_CHARS]!r} not served: {path} lists {shown}{more}; "
        "fix nodes[].providers[].models or the server's model name"
    )
