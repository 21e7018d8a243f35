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

``model_infos`` keeps what an Ollama list says of each served model (size,
digest, date, ``details``) for the edge's ``/api/tags``: only the served
names, at most ``MAX_MODEL_INFOS`` of them, each string cut to
``MAX_MODEL_TEXT_CHARS`` and at most ``MAX_MODEL_FAMILIES`` families.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from wire.messages import (
    MAX_MODEL_FAMILIES,
    MAX_MODEL_INFOS,
    MAX_MODEL_SIZE,
    MAX_MODEL_TEXT_CHARS,
    ModelDetails,
    ModelInfo,
)

__all__ = ["MAX_LIST_BYTES", "MAX_LIST_ITEMS", "listed_names", "model_infos", "not_served"]

#: Bytes of a model list the probe reads; past it the names are not checked.
MAX_LIST_BYTES = 1024 * 1024
#: Entries of a model list looked at.
MAX_LIST_ITEMS = 10000
#: Listed names quoted in the error, and the characters kept of each.
QUOTED_NAMES = 3
QUOTED_CHARS = 64


def _items(body: bytes, flavour: str) -> list[dict[str, object]] | None:
    """The entries of a model list body (at most ``MAX_LIST_ITEMS``), None when it is none."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    items = doc.get("models" if flavour == "ollama" else "data")
    if not isinstance(items, list):
        return None
    return [item for item in items[:MAX_LIST_ITEMS] if isinstance(item, dict)]


def _names(item: dict[str, object], flavour: str) -> list[str]:
    keys = ("name", "model") if flavour == "ollama" else ("id",)
    return [v for k in keys if isinstance(v := item.get(k), str)]


def listed_names(body: bytes, flavour: str) -> set[str] | None:
    """The model names of an OpenAI ``/v1/models`` (``data[].id``) or Ollama
    ``/api/tags`` (``models[].name`` and ``.model``) body; None when the body
    is not such a list (then nothing is checked)."""
    items = _items(body, flavour)
    if items is None:
        return None
    return {name for item in items for name in _names(item, flavour)}


def _text(value: object) -> str:
    return value[:MAX_MODEL_TEXT_CHARS] if isinstance(value, str) else ""


def _info(name: str, item: dict[str, object]) -> ModelInfo:
    raw = item.get("details")
    details = raw if isinstance(raw, dict) else {}
    families = details.get("families")
    size = item.get("size")
    return ModelInfo(
        name=name,
        size=size if type(size) is int and 0 <= size <= MAX_MODEL_SIZE else 0,
        digest=_text(item.get("digest")),
        modified_at=_text(item.get("modified_at")),
        details=ModelDetails(
            format=_text(details.get("format")),
            family=_text(details.get("family")),
            families=[
                _text(f) for f in families[:MAX_MODEL_FAMILIES] if isinstance(f, str)
            ]
            if isinstance(families, list)
            else [],
            parameter_size=_text(details.get("parameter_size")),
            quantization_level=_text(details.get("quantization_level")),
            parent_model=_text(details.get("parent_model")),
        ),
    )


def model_infos(body: bytes, models: Sequence[str]) -> list[ModelInfo]:
    """What an Ollama ``/api/tags`` body says of each of ``models`` (the served
    names, as Ollama resolves them: ``x`` is ``x:latest``), in their order;
    a name it does not list is left out."""
    items = _items(body, "ollama")
    if not items:
        return []
    by_name: dict[str, dict[str, object]] = {}
    for item in items:
        for listed in _names(item, "ollama"):
            by_name.setdefault(listed, item)
    infos = []
    for name in dict.fromkeys(models):
        if len(name) > MAX_MODEL_TEXT_CHARS:
            continue  # the wire cannot name it
        entry = by_name.get(name)
        if entry is None and ":" not in name:
            entry = by_name.get(f"{name}:latest")
        if entry is not None:
            infos.append(_info(name, entry))
            if len(infos) == MAX_MODEL_INFOS:
                break
    return infos


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
