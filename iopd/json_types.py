"""The type of a decoded JSON value, for the whole tree.

A caller's body, a tool schema, a provider's answer: JSON decoded by msgspec
is ``null``, a boolean, a number, a string, a list or a dict with string
keys, nested.  Code reads a value by narrowing it (``isinstance``) before it
uses it, so the type checker sees every unchecked read: none of these is
``Any``.

Why ``list``/``dict`` and not the read-only ``Sequence``/``Mapping``:
narrowing a ``Sequence[JSONValue]`` with ``isinstance(v, list)`` gives mypy
``list[Any]``, which would let every read below it go unchecked.  The price
is invariance: a ``list[JSONObject]`` is not a ``list[JSONValue]``, so a list
of objects built to go into a document is typed ``JSONArray`` where it is
made, or goes in through :func:`json_list`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias, cast

__all__ = ["JSONArray", "JSONObject", "JSONScalar", "JSONValue", "json_list"]

#: A JSON leaf.
JSONScalar: TypeAlias = None | bool | int | float | str
#: A decoded JSON value.
JSONValue: TypeAlias = "JSONScalar | list[JSONValue] | dict[str, JSONValue]"
#: A decoded JSON object.
JSONObject: TypeAlias = dict[str, JSONValue]
#: A decoded JSON array.
JSONArray: TypeAlias = list[JSONValue]


def json_list(items: Sequence[JSONValue]) -> JSONValue:
    """``items`` (a list of objects, of strings...) as a JSON value, not copied.

    A ``list[JSONObject]`` is a JSON array, but ``list`` is invariant, so the
    type checker does not take it for a ``list[JSONValue]``; this says so in
    one place (a ``Sequence`` is covariant).  Only for lists: a tuple would
    stay a tuple.
    """
    return cast("JSONValue", items)
