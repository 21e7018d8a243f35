"""Generation policy: ``models[].generation`` defaults and limits.

- **normalized** path: ``defaults`` fill the fields the caller left out (or
  sent as null); ``limits`` cap the numeric fields the caller (or a default)
  set.  A limit never adds a field: a request without ``max_tokens`` stays
  without it (use a default for that).
- **passthrough** path: the body is the caller's; nothing is added, and a
  field over its limit is refused with a 400 naming the field.

``max_tokens`` and ``max_completion_tokens`` are one setting under two names:
a limit or default given for either applies to whichever the caller used, and
a default is not added when the caller set the other name.  Limits are upper
bounds; a limited field that is not a number is a 400 on both paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeGuard

from iopd.config.schema import Generation
from iopd.edge.openai.incoming.jsonschema import JSONObject, JSONValue
from iopd.errors import InvalidRequest

__all__ = ["apply_generation"]

_ALIASES: dict[str, tuple[str, ...]] = {
    "max_tokens": ("max_tokens", "max_completion_tokens"),
    "max_completion_tokens": ("max_tokens", "max_completion_tokens"),
}


def _names(field: str) -> tuple[str, ...]:
    return _ALIASES.get(field, (field,))


def _is_number(value: JSONValue) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _limit_for(field: str, limits: dict[str, float | int]) -> float | int | None:
    """The tightest limit configured for ``field`` under any of its names."""
    found = [limits[name] for name in _names(field) if name in limits]
    return min(found) if found else None


def apply_generation(
    params: JSONObject,
    policy: Generation,
    *,
    passthrough: bool,
    field_names: Mapping[str, str] | None = None,
) -> JSONObject:
    """Apply ``policy`` to the request fields ``params``; return a new dict.

    Raises :class:`~iopd.errors.InvalidRequest` (``param`` = the field) for a
    limited field that is not a number, and on passthrough for a field over
    its limit.  ``field_names`` maps a parameter to the name the caller sent
    it under (``max_tokens`` -> ``max_output_tokens`` on ``/v1/responses``),
    so the error names the caller's field.
    """
    names = field_names or {}
    out = dict(params)
    if not passthrough:
        for field, default in policy.defaults.items():
            if all(out.get(name) is None for name in _names(field)):
                out[field] = default
    for field in sorted({name for key in policy.limits for name in _names(key)}):
        value = out.get(field)
        limit = _limit_for(field, policy.limits)
        if value is None or limit is None:
            continue
        shown = names.get(field, field)
        if not _is_number(value):
            raise InvalidRequest(f"`{shown}` must be a number", param=shown)
        if value <= limit:
            continue
        if passthrough:
            raise InvalidRequest(
                f"`{shown}` is {value}, over this model's limit of {limit}", param=shown
            )
        out[field] = limit
    return out
