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
- ``minLength``/``maxLength`` (code points), ``pattern`` (``re.search``)
- ``items`` (a schema, or a list for tuple form), ``prefixItems``,
  ``minItems``/``maxItems``, ``uniqueItems``
- ``properties``, ``required``, ``additionalProperties`` (bool or schema),
  ``patternProperties``, ``minProperties``/``maxProperties``
- ``anyOf``/``oneOf``/``allOf``/``not``
- local ``$ref`` (``#/$defs/...``, ``#/definitions/...``, ``#``), as produced
  by pydantic for nested models.

``validate(instance, schema)`` returns a list of messages, each prefixed with
a JSON-pointer path of the offending value (``/`` is the root).
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeGuard

__all__ = ["validate"]

_MAX_REF_DEPTH = 64


def validate(instance: Any, schema: Any) -> list[str]:
    """Validate ``instance`` against ``schema``; return error messages (empty = valid)."""
    errors: list[str] = []
    _Validator(schema).check(instance, schema, "", errors, 0)
    return errors


def json_type(value: Any) -> str:
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


def _is_type(value: Any, name: str) -> bool:
    actual = json_type(value)
    if name == "integer":
        return actual == "integer" or (
            actual == "number" and math.isfinite(value) and float(value).is_integer()
        )
    if name == "number":
        return actual in ("integer", "number")
    return actual == name


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_equal(a: Any, b: Any) -> bool:
    """Equality with JSON semantics (``True != 1``, ``1 == 1.0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _pointer(path: str, key: str | int) -> str:
    token = str(key).replace("~", "~0").replace("/", "~1")
    return f"{path}/{token}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Validator:
    """Walks one schema; holds the root so local ``$ref``s resolve."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def _resolve(self, ref: str) -> Any:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None  # remote refs are out of scope: ignored
        node: Any = self.root
        for raw in ref[2:].split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node

    def check(self, value: Any, schema: Any, path: str, errors: list[str], depth: int) -> None:
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
                errors.append(f"{where}: cannot resolve $ref {ref!r}")
            else:
                self.check(value, target, path, errors, depth + 1)

        if value is None and schema.get("nullable") is True:
            return

        if not self._check_type(value, schema, where, errors):
            return  # the remaining keywords would only repeat the type error

        if "enum" in schema and isinstance(schema["enum"], list):
            if not any(_json_equal(value, option) for option in schema["enum"]):
                errors.append(f"{where}: {_short(value)} is not one of {_short(schema['enum'])}")
        if "const" in schema and not _json_equal(value, schema["const"]):
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

    def _check_type(
        self, value: Any, schema: dict[str, Any], where: str, errors: list[str]
    ) -> bool:
        declared = schema.get("type")
        if declared is None:
            return True
        names = declared if isinstance(declared, list) else [declared]
        names = [n for n in names if isinstance(n, str)]
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
        self, value: int | float, schema: dict[str, Any], where: str, errors: list[str]
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
            quotient = value / multiple
            if not (math.isfinite(quotient) and abs(quotient - round(quotient)) < 1e-9):
                errors.append(f"{where}: {value} is not a multiple of {multiple}")

    def _check_string(
        self, value: str, schema: dict[str, Any], where: str, errors: list[str]
    ) -> None:
        min_len, max_len = schema.get("minLength"), schema.get("maxLength")
        if isinstance(min_len, int) and len(value) < min_len:
            errors.append(f"{where}: shorter than {min_len} characters")
        if isinstance(max_len, int) and len(value) > max_len:
            errors.append(f"{where}: longer than {max_len} characters")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                matched = re.search(pattern, value) is not None
            except re.error:
                matched = True  # a pattern Python cannot compile is ignored, like unknown keywords
            if not matched:
                errors.append(f"{where}: {_short(value)} does not match {pattern!r}")

    def _check_array(
        self,
        value: list[Any] | tuple[Any, ...],
        schema: dict[str, Any],
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
            for i in range(len(value)):
                if any(_json_equal(value[i], value[j]) for j in range(i)):
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
        value: dict[str, Any],
        schema: dict[str, Any],
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
                try:
                    hit = re.search(pattern, key) is not None
                except re.error:
                    continue
                if hit:
                    matched = True
                    self.check(item, sub, item_path, errors, depth + 1)
            if matched:
                continue
            if additional is False:
                errors.append(f"{where}: unexpected property {key!r}")
            elif isinstance(additional, dict):
                self.check(item, additional, item_path, errors, depth + 1)

    def _check_combinators(
        self, value: Any, schema: dict[str, Any], path: str, errors: list[str], depth: int
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

    def _passes(self, value: Any, schema: Any, path: str, depth: int) -> bool:
        scratch: list[str] = []
        self.check(value, schema, path, scratch, depth + 1)
        return not scratch
