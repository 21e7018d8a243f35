"""A small, dependency-free JSON Schema validator for tool arguments.

Why not the ``jsonschema`` package: it pulls in ``attrs``, ``referencing``,
``rpds-py`` (a compiled extension) and ``jsonschema-specifications`` for
every draft's metaschemas, while tool ``parameters`` schemas written for
function calling use a small, stable subset.  This module implements that
subset and ignores every keyword it does not know (so an unusual schema
validates *more* leniently, never rejects a valid call for a keyword we lack):

- ``type`` (a name or a list of names; ``integer`` accepts integral floats;
  a bool is neither an integer nor a number), OpenAPI-style ``nullable: true``
- ``enum``, ``const`` (JSON equality: ``1`` is not ``true``)
- ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` (numeric
  and draft-4 boolean forms), ``multipleOf``
- ``minLength``/``maxLength`` (code points), ``pattern`` (a search with RE2,
  a linear-time engine: see "Bounded work" below)
- ``items`` (a schema, or a list for tuple form), ``prefixItems``,
  ``minItems``/``maxItems``, ``uniqueItems``
- ``properties``, ``required``, ``additionalProperties`` (bool or schema),
  ``patternProperties``, ``minProperties``/``maxProperties``
- ``anyOf``/``oneOf``/``allOf``/``not``
- local ``$ref`` (``#/$defs/...``, ``#/definitions/...``, ``#``), as produced
  by pydantic for nested models.

``validate(instance, schema)`` returns a list of messages, each prefixed with
a JSON-pointer path of the offending value (``/`` is the root).

Bounded work.  Both the schema and the instance come from the caller (an
``echo`` model answers with the caller's own text), and validation runs on the
edge's only event loop, so every validation has a hard budget
(:class:`ValidationBudget`: a step count and a wall-clock deadline, read every
few hundred steps).  A step is one schema applied to one value, one element
compared, or a slice of string scanned by a pattern, so no single step is
unbounded.  Over budget, validation stops with one error: the call counts as
invalid, exactly as if the arguments did not match.  On top of that:

- a ``$ref`` is resolved once per reference string (memoised), and the result
  of applying a ``$ref`` target to a value is remembered, so a schema that
  refers to the same definition many times costs its size, not its expansion;
  a ``$ref`` that comes back to the same schema for the same value without
  descending into it (``{"allOf": [{"$ref": "#"}]}``) is reported as an error
  instead of being expanded;
- ``pattern`` and ``patternProperties`` use RE2 (``google-re2``), whose
  matching time is linear in the text whatever the pattern.  RE2 refuses
  backreferences and lookaround; such a pattern, or one longer than
  :data:`MAX_PATTERN_CHARS`, is not checked (ignored, like an unknown
  keyword), so a valid call is never refused for a pattern we cannot run.
  Compiled patterns are cached (at most :data:`PATTERN_CACHE_SIZE`) and each
  is compiled with a small memory cap;
- error messages show a bounded preview of values, patterns and keys.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any, TypeGuard

import re2

from iopd.json_types import JSONArray, JSONObject, JSONValue

__all__ = ["JSONArray", "JSONObject", "JSONValue", "ValidationBudget", "json_type", "validate"]

_MAX_REF_DEPTH = 64

#: Steps one validation may take (see :class:`ValidationBudget`).  A tool
#: schema of a few dozen properties over arguments with arrays of hundreds of
#: items takes a few thousand.
MAX_STEPS = 100_000
#: Wall-clock seconds one validation may take, whatever the steps.
MAX_SECONDS = 0.1
#: Steps between two reads of the clock.
_CLOCK_EVERY = 256
#: Longer patterns are not checked.
MAX_PATTERN_CHARS = 4096
#: Compiled patterns kept (per process).
PATTERN_CACHE_SIZE = 256
#: Memory cap of one compiled pattern (RE2 ``max_mem``, bytes).
_PATTERN_MAX_MEM = 1 << 20
#: Characters compared per budget step.
_CHARS_PER_STEP = 256
#: Steps one pattern search costs, plus one per this many characters scanned
#: (measured: a step is 1-5 µs; RE2 scans ~90 ns per character).
_PATTERN_STEPS = 4
_PATTERN_CHARS_PER_STEP = 32
#: Remembered ``$ref`` results per validation (beyond it, no new entries).
_MAX_MEMO = 4096
#: Errors remembered per ``$ref`` result (replayed on a hit).
_MAX_MEMO_ERRORS = 16
#: Characters of one object key or pattern shown in a message.
_MAX_SHOWN = 64


class _OverBudget(Exception):
    """Raised inside the validator when its budget is spent."""


class ValidationBudget:
    """A step count and a deadline shared by the validations of one answer.

    ``tick(n)`` spends ``n`` steps; past ``max_steps``, or once the clock is
    past the deadline (read every few hundred steps), validation stops.  The
    deadline starts with the first :func:`validate` that uses the budget.
    """

    __slots__ = ("max_steps", "max_seconds", "steps", "_deadline", "_next_clock")

    def __init__(self, max_steps: int = MAX_STEPS, max_seconds: float = MAX_SECONDS) -> None:
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.steps = 0
        self._deadline: float | None = None
        self._next_clock = 0

    def start(self) -> None:
        """Start the clock (once)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.max_seconds

    def tick(self, n: int = 1) -> None:
        """Spend ``n`` steps; raise once the budget is spent."""
        self.steps += n
        if self.steps > self.max_steps:
            raise _OverBudget
        if self.steps >= self._next_clock:
            self._next_clock = self.steps + _CLOCK_EVERY
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise _OverBudget


def validate(instance: JSONValue, schema: JSONValue, budget: ValidationBudget | None = None) -> list[str]:
    """Validate ``instance`` against ``schema``; return error messages (empty = valid).

    ``budget`` bounds the work (a fresh default budget when omitted); when it
    runs out, the result is one error saying so, never a partial "valid".
    """
    budget = budget if budget is not None else ValidationBudget()
    budget.start()
    errors: list[str] = []
    try:
        _Validator(schema, budget).check(instance, schema, "", errors, 0)
    except (_OverBudget, RecursionError):
        return [
            f"/: validation stopped: over its budget of {budget.max_steps} steps or "
            f"{budget.max_seconds:g} s (the schema or the arguments are too costly to check)"
        ]
    return errors


def _compiled(pattern: str) -> Any:  # re2 ships no types: its compiled pattern
    """``pattern`` compiled by RE2, or None when it cannot be checked (see module doc)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return None  # (before the cache: it would keep the long string alive)
    return _compile(pattern)


@functools.lru_cache(maxsize=PATTERN_CACHE_SIZE)
def _compile(pattern: str) -> Any:  # (re2 ships no types)
    options = re2.Options()
    options.max_mem = _PATTERN_MAX_MEM
    options.log_errors = False  # a caller's bad pattern is not the operator's log line
    try:
        return re2.compile(pattern, options)
    except re2.error:
        return None


def json_type(value: JSONValue) -> str:
    """The JSON type name of a decoded JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is_type(value: JSONValue, name: str) -> bool:
    actual = json_type(value)
    if name == "integer":
        return actual == "integer" or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer()
        )
    if name == "number":
        return actual in ("integer", "number")
    return actual == name


def _is_number(value: JSONValue) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_equal(a: JSONValue, b: JSONValue, tick: Callable[..., None]) -> bool:
    """Equality with JSON semantics (``True != 1``, ``1 == 1.0``); ``tick()`` per value."""
    tick()
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_json_equal(x, y, tick) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k], tick) for k in a)
    if isinstance(a, str) and isinstance(b, str):
        tick(min(len(a), len(b)) // _CHARS_PER_STEP)
    return type(a) is type(b) and bool(a == b)


def _pointer(path: str, key: str | int) -> str:
    """``path`` extended by ``key``; a long key is cut (paths are for messages)."""
    text = str(key)
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    token = text.replace("~", "~0").replace("/", "~1")
    return f"{path}/{token}"


def _short(value: JSONValue) -> str:
    """``repr(value)`` cut to 60 characters, without rendering the whole of a big value."""
    text = _bounded_repr(value, 61)
    return text if len(text) <= 60 else text[:57] + "..."


def _bounded_repr(value: JSONValue, limit: int) -> str:
    """``repr(value)`` when it is at most ``limit`` characters, else a longer prefix-like text."""
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit])
    if isinstance(value, (list, tuple, dict)):
        opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
        if isinstance(value, tuple):
            opening, closing = "(", ")"
        pieces = [opening]
        size = 1
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        for i, (key, item) in enumerate(items):
            if size > limit:
                break
            piece = (", " if i else "") + (
                f"{_bounded_repr(key, limit - size)}: " if isinstance(value, dict) else ""
            )
            piece += _bounded_repr(item, limit - size - len(piece))
            pieces.append(piece)
            size += len(piece)
        else:
            if isinstance(value, tuple) and len(value) == 1:
                pieces.append(",")
            pieces.append(closing)
        return "".join(pieces)
    try:
        return repr(value)
    except ValueError:  # an int too long to render
        return "<a very large number>"


class _Validator:
    """Walks one schema; holds the root so local ``$ref``s resolve."""

    def __init__(self, root: JSONValue, budget: ValidationBudget) -> None:
        self.root = root
        self.tick = budget.tick
        self._targets: dict[str, JSONValue] = {}
        #: (id(target), id(value)) of the ``$ref`` checks under way (cycle guard).
        self._active: set[tuple[int, int]] = set()
        #: (id(target), id(value), path) -> the errors found (memoised ``$ref`` results).
        self._memo: dict[tuple[int, int, str], list[str]] = {}

    def _resolve(self, ref: str) -> JSONValue:
        """``ref``'s target (None when it does not resolve), memoised per reference."""
        if ref not in self._targets:
            self.tick(1 + len(ref) // _CHARS_PER_STEP)
            self._targets[ref] = self._resolve_uncached(ref)
        return self._targets[ref]

    def _resolve_uncached(self, ref: str) -> JSONValue:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None  # remote refs are out of scope: ignored
        node: JSONValue = self.root
        for raw in ref[2:].split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node

    def check(self, value: JSONValue, schema: JSONValue, path: str, errors: list[str], depth: int) -> None:
        self.tick()
        where = path or "/"
        if schema is True or schema is None:
            return
        if schema is False:
            errors.append(f"{where}: no value is allowed here")
            return
        if not isinstance(schema, dict):
            return
        if depth > _MAX_REF_DEPTH:
            errors.append(f"{where}: schema nesting too deep (recursive $ref?)")
            return

        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref)
            if target is None:
                errors.append(f"{where}: cannot resolve $ref {_short(ref)}")
            else:
                self._check_ref(value, target, path, errors, depth + 1)

        if value is None and schema.get("nullable") is True:
            return

        if not self._check_type(value, schema, where, errors):
            return  # the remaining keywords would only repeat the type error

        tick = self.tick
        if "enum" in schema and isinstance(schema["enum"], list):
            if not any(_json_equal(value, option, tick) for option in schema["enum"]):
                errors.append(f"{where}: {_short(value)} is not one of {_short(schema['enum'])}")
        if "const" in schema and not _json_equal(value, schema["const"], tick):
            errors.append(f"{where}: expected {_short(schema['const'])}, got {_short(value)}")

        if _is_number(value):
            self._check_number(value, schema, where, errors)
        elif isinstance(value, str):
            self._check_string(value, schema, where, errors)
        elif isinstance(value, (list, tuple)):
            self._check_array(value, schema, path, errors, depth)
        elif isinstance(value, dict):
            self._check_object(value, schema, path, errors, depth)

        self._check_combinators(value, schema, path, errors, depth)

    def _check_ref(self, value: JSONValue, target: JSONValue, path: str, errors: list[str], depth: int) -> None:
        """Apply a ``$ref`` target: remembered per (target, value, path), cycles reported."""
        active = (id(target), id(value))
        if active in self._active:
            errors.append(
                f"{path or '/'}: a $ref leads back to the same schema for the same value "
                "(recursive $ref)"
            )
            return
        key = (id(target), id(value), path)
        found = self._memo.get(key)
        if found is not None:
            self.tick(len(found))
            errors.extend(found)
            return
        local: list[str] = []
        self._active.add(active)
        try:
            self.check(value, target, path, local, depth)
        finally:
            self._active.discard(active)
        if len(self._memo) < _MAX_MEMO:
            self._memo[key] = local[:_MAX_MEMO_ERRORS]
        errors.extend(local)

    def _check_type(
        self, value: JSONValue, schema: dict[str, JSONValue], where: str, errors: list[str]
    ) -> bool:
        declared = schema.get("type")
        if declared is None:
            return True
        listed = declared if isinstance(declared, list) else [declared]
        names = [n for n in listed if isinstance(n, str)]
        if not names:
            return True
        if value is None and schema.get("nullable") is True:
            return True
        if any(_is_type(value, n) for n in names):
            return True
        wanted = names[0] if len(names) == 1 else " or ".join(names)
        errors.append(f"{where}: expected {wanted}, got {json_type(value)}")
        return False

    def _check_number(
        self, value: int | float, schema: dict[str, JSONValue], where: str, errors: list[str]
    ) -> None:
        minimum, maximum = schema.get("minimum"), schema.get("maximum")
        exc_min, exc_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if _is_number(minimum):
            if exc_min is True and value <= minimum:
                errors.append(f"{where}: {value} is not greater than {minimum}")
            elif value < minimum:
                errors.append(f"{where}: {value} is less than the minimum {minimum}")
        if _is_number(maximum):
            if exc_max is True and value >= maximum:
                errors.append(f"{where}: {value} is not less than {maximum}")
            elif value > maximum:
                errors.append(f"{where}: {value} is greater than the maximum {maximum}")
        if _is_number(exc_min) and value <= exc_min:
            errors.append(f"{where}: {value} is not greater than {exc_min}")
        if _is_number(exc_max) and value >= exc_max:
            errors.append(f"{where}: {value} is not less than {exc_max}")
        multiple = schema.get("multipleOf")
        if _is_number(multiple) and multiple > 0:
            try:
                quotient = value / multiple
            except OverflowError:  # a huge integer: not checkable, so not accepted
                quotient = math.inf
            if not (math.isfinite(quotient) and abs(quotient - round(quotient)) < 1e-9):
                errors.append(f"{where}: {value} is not a multiple of {multiple}")

    def _check_string(
        self, value: str, schema: dict[str, JSONValue], where: str, errors: list[str]
    ) -> None:
        min_len, max_len = schema.get("minLength"), schema.get("maxLength")
        if isinstance(min_len, int) and len(value) < min_len:
            errors.append(f"{where}: shorter than {min_len} characters")
        if isinstance(max_len, int) and len(value) > max_len:
            errors.append(f"{where}: longer than {max_len} characters")
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and self._search(pattern, value) is False:
            errors.append(f"{where}: {_short(value)} does not match {_short(pattern)}")

    def _search(self, pattern: str, text: str) -> bool | None:
        """Whether ``pattern`` occurs in ``text``; None when it cannot be checked."""
        self.tick(_PATTERN_STEPS + (len(pattern) + len(text)) // _PATTERN_CHARS_PER_STEP)
        compiled = _compiled(pattern)
        if compiled is None:
            return None  # ignored, like an unknown keyword
        return compiled.search(text) is not None

    def _check_array(
        self,
        value: list[JSONValue] | tuple[JSONValue, ...],
        schema: dict[str, JSONValue],
        path: str,
        errors: list[str],
        depth: int,
    ) -> None:
        where = path or "/"
        min_items, max_items = schema.get("minItems"), schema.get("maxItems")
        if isinstance(min_items, int) and len(value) < min_items:
            errors.append(f"{where}: fewer than {min_items} items")
        if isinstance(max_items, int) and len(value) > max_items:
            errors.append(f"{where}: more than {max_items} items")
        if schema.get("uniqueItems") is True:
            tick = self.tick
            for i in range(len(value)):
                if any(_json_equal(value[i], value[j], tick) for j in range(i)):
                    errors.append(f"{where}: items are not unique")
                    break

        items = schema.get("items")
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # draft-4 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        start = 0
        if isinstance(prefix, list):
            for i, sub in enumerate(prefix[: len(value)]):
                self.check(value[i], sub, _pointer(path, i), errors, depth + 1)
            start = len(prefix)
        if items is not None and not isinstance(items, list):
            for i in range(start, len(value)):
                self.check(value[i], items, _pointer(path, i), errors, depth + 1)

    def _check_object(
        self,
        value: dict[str, JSONValue],
        schema: dict[str, JSONValue],
        path: str,
        errors: list[str],
        depth: int,
    ) -> None:
        where = path or "/"
        required = schema.get("required")
        if isinstance(required, list):
            for name in required:
                if isinstance(name, str) and name not in value:
                    errors.append(f"{where}: missing required property {name!r}")
        min_props, max_props = schema.get("minProperties"), schema.get("maxProperties")
        if isinstance(min_props, int) and len(value) < min_props:
            errors.append(f"{where}: fewer than {min_props} properties")
        if isinstance(max_props, int) and len(value) > max_props:
            errors.append(f"{where}: more than {max_props} properties")

        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        patterns = schema.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        additional = schema.get("additionalProperties", True)
        for key, item in value.items():
            item_path = _pointer(path, key)
            matched = False
            if key in properties:
                matched = True
                self.check(item, properties[key], item_path, errors, depth + 1)
            for pattern, sub in patterns.items():
                if self._search(pattern, key):
                    matched = True
                    self.check(item, sub, item_path, errors, depth + 1)
            if matched:
                continue
            if additional is False:
                errors.append(f"{where}: unexpected property {_short(key)}")
            elif isinstance(additional, dict):
                self.check(item, additional, item_path, errors, depth + 1)

    def _check_combinators(
        self, value: JSONValue, schema: dict[str, JSONValue], path: str, errors: list[str], depth: int
    ) -> None:
        where = path or "/"
        all_of = schema.get("allOf")
        if isinstance(all_of, list):
            for sub in all_of:
                self.check(value, sub, path, errors, depth + 1)
        any_of = schema.get("anyOf")
        if isinstance(any_of, list) and any_of:
            if not any(self._passes(value, sub, path, depth) for sub in any_of):
                errors.append(f"{where}: does not match any of the allowed schemas (anyOf)")
        one_of = schema.get("oneOf")
        if isinstance(one_of, list) and one_of:
            matches = sum(1 for sub in one_of if self._passes(value, sub, path, depth))
            if matches != 1:
                errors.append(f"{where}: must match exactly one schema (oneOf), matched {matches}")
        not_schema = schema.get("not")
        if isinstance(not_schema, (dict, bool)) and self._passes(value, not_schema, path, depth):
            errors.append(f"{where}: must not match the 'not' schema")

    def _passes(self, value: JSONValue, schema: JSONValue, path: str, depth: int) -> bool:
        scratch: list[str] = []
        self.check(value, schema, path, scratch, depth + 1)
        return not scratch
