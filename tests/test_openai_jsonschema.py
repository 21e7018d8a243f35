"""The JSON Schema subset validator used for tool arguments: a table of cases."""

from __future__ import annotations

from typing import Any

import pytest

from iopd.edge.openai.jsonschema import validate

OBJ = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}

# (instance, schema, expected error substrings; [] = valid)
CASES: list[tuple[Any, Any, list[str]]] = [
    # type
    ("x", {"type": "string"}, []),
    (1, {"type": "string"}, ["/: expected string, got integer"]),
    (1, {"type": "integer"}, []),
    (1.0, {"type": "integer"}, []),
    (1.5, {"type": "integer"}, ["/: expected integer, got number"]),
    (1.5, {"type": "number"}, []),
    (3, {"type": "number"}, []),
    (True, {"type": "number"}, ["/: expected number, got boolean"]),
    (True, {"type": "integer"}, ["/: expected integer, got boolean"]),
    (False, {"type": "boolean"}, []),
    (0, {"type": "boolean"}, ["expected boolean, got integer"]),
    (None, {"type": "null"}, []),
    ([], {"type": "array"}, []),
    ({}, {"type": "array"}, ["expected array, got object"]),
    ({}, {"type": "object"}, []),
    # list of types / nullable
    (None, {"type": ["string", "null"]}, []),
    ("a", {"type": ["string", "null"]}, []),
    (2, {"type": ["string", "null"]}, ["/: expected string or null, got integer"]),
    (None, {"type": "string", "nullable": True}, []),
    (None, {"type": "string"}, ["expected string, got null"]),
    # enum / const (JSON equality: true is not 1)
    ("c", {"enum": ["c", "f"]}, []),
    ("k", {"enum": ["c", "f"]}, ["/: 'k' is not one of ['c', 'f']"]),
    (True, {"enum": [1, 2]}, ["is not one of"]),
    (1.0, {"enum": [1, 2]}, []),
    ({"a": [1]}, {"const": {"a": [1]}}, []),
    (1, {"const": True}, ["/: expected True, got 1"]),
    # numbers
    (5, {"minimum": 5, "maximum": 5}, []),
    (4, {"minimum": 5}, ["less than the minimum 5"]),
    (6, {"maximum": 5}, ["greater than the maximum 5"]),
    (5, {"exclusiveMinimum": 5}, ["not greater than 5"]),
    (5, {"exclusiveMaximum": 5}, ["not less than 5"]),
    (5, {"minimum": 5, "exclusiveMinimum": True}, ["not greater than 5"]),  # draft 4
    (5, {"maximum": 5, "exclusiveMaximum": True}, ["not less than 5"]),
    (0.3, {"multipleOf": 0.1}, []),
    (7, {"multipleOf": 2}, ["not a multiple of 2"]),
    ("5", {"minimum": 10}, []),  # numeric keywords only apply to numbers
    # strings
    ("ab", {"minLength": 2, "maxLength": 2}, []),
    ("a", {"minLength": 2}, ["shorter than 2"]),
    ("abc", {"maxLength": 2}, ["longer than 2"]),
    ("é", {"maxLength": 1}, []),  # code points, not bytes
    ("2024-01-02", {"pattern": r"^\d{4}-\d{2}-\d{2}$"}, []),
    ("tomorrow", {"pattern": r"^\d{4}"}, ["does not match"]),
    ("x", {"pattern": "("}, []),  # an uncompilable pattern is ignored
    # arrays
    ([1, 2], {"type": "array", "items": {"type": "integer"}}, []),
    ([1, "b"], {"items": {"type": "integer"}}, ["/1: expected integer, got string"]),
    ([], {"minItems": 1}, ["fewer than 1 items"]),
    ([1, 2, 3], {"maxItems": 2}, ["more than 2 items"]),
    ([1, 1], {"uniqueItems": True}, ["not unique"]),
    ([1, True], {"uniqueItems": True}, []),
    (["a", 1], {"prefixItems": [{"type": "string"}, {"type": "integer"}]}, []),
    ([1, 1], {"items": [{"type": "string"}]}, ["/0: expected string"]),  # tuple form
    ([1, 1], {"items": [{"type": "integer"}], "additionalItems": False}, ["/1: no value"]),
    # objects
    ({"city": "Paris", "days": 3, "unit": "c"}, OBJ, []),
    ({"days": 3}, OBJ, ["/: missing required property 'city'"]),
    ({"city": "Paris", "extra": 1}, OBJ, ["/: unexpected property 'extra'"]),
    (
        {"city": "", "days": 0},
        OBJ,
        ["/city: shorter than 1", "/days: 0 is less than the minimum 1"],
    ),
    ({"city": "Paris", "days": "3"}, OBJ, ["/days: expected integer, got string"]),
    ({"a": 1, "b": "x"}, {"additionalProperties": {"type": "integer"}}, ["/b: expected integer"]),
    (
        {"x_1": 1, "y": 2},
        {"patternProperties": {"^x_": {"type": "string"}}},
        ["/x_1: expected string"],
    ),
    ({"x_1": "s"}, {"patternProperties": {"^x_": {}}, "additionalProperties": False}, []),
    ({}, {"minProperties": 1}, ["fewer than 1 properties"]),
    ({"a": 1, "b": 2}, {"maxProperties": 1}, ["more than 1 properties"]),
    ({"a/b": 1}, {"properties": {"a/b": {"type": "string"}}}, ["/a~1b: expected string"]),
    (
        {"outer": {"inner": [{"n": "x"}]}},
        {
            "properties": {
                "outer": {
                    "properties": {"inner": {"items": {"properties": {"n": {"type": "integer"}}}}}
                }
            }
        },
        ["/outer/inner/0/n: expected integer, got string"],
    ),
    # combinators
    (1, {"anyOf": [{"type": "string"}, {"type": "integer"}]}, []),
    (1.5, {"anyOf": [{"type": "string"}, {"type": "integer"}]}, ["does not match any"]),
    (1, {"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["matched 2"]),
    (1.5, {"oneOf": [{"type": "integer"}, {"type": "number"}]}, []),
    ("x", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["matched 0"]),
    (5, {"allOf": [{"minimum": 1}, {"maximum": 3}]}, ["greater than the maximum 3"]),
    ("x", {"not": {"type": "string"}}, ["must not match"]),
    # boolean schemas, refs, unknown keywords
    ("anything", True, []),
    ("anything", False, ["/: no value is allowed here"]),
    ({"a": 1}, {"properties": {"a": False}}, ["/a: no value"]),
    (
        {"p": {"name": 3}},
        {
            "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}}},
            "properties": {"p": {"$ref": "#/$defs/Person"}},
        },
        ["/p/name: expected string, got integer"],
    ),
    ({"p": 1}, {"properties": {"p": {"$ref": "#/$defs/Missing"}}}, ["cannot resolve $ref"]),
    ({"x": 1}, {"format": "email", "x-custom": 1, "title": "T", "description": "d"}, []),
]


@pytest.mark.parametrize(("instance", "schema", "expected"), CASES)
def test_validate_table(instance: Any, schema: Any, expected: list[str]) -> None:
    errors = validate(instance, schema)
    if not expected:
        assert errors == []
    else:
        assert len(errors) == len(expected), errors
        for error, fragment in zip(errors, expected, strict=True):
            assert fragment in error, (error, fragment)


def test_recursive_ref_terminates() -> None:
    tree = {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
    }
    assert validate({"children": [{"children": []}]}, tree) == []
    assert validate({"children": [{"children": 1}]}, tree) == [
        "/children/0/children: expected array, got integer"
    ]
    assert validate(1, {"$ref": "#"}) != []  # a self-ref loop reports instead of recursing forever


def test_type_error_stops_further_keywords() -> None:
    # One clear message, not a cascade of keyword errors for the wrong type.
    assert validate("x", {"type": "object", "required": ["a"]}) == [
        "/: expected object, got string"
    ]
