"""The JSON Schema subset validator used for tool arguments: a table of cases."""

from __future__ import annotations

from typing import Any

import pytest

from iopd.edge.openai.incoming.jsonschema import ValidationBudget, validate

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


# ------------------------------------------------------------ bounded work
# Schema and arguments both come from the caller: every validation has a
# budget, and the known blow-ups are cut long before it.


def test_self_referring_allof_is_reported_not_expanded() -> None:
    # 3^depth checks before: the edge froze at 100 % CPU with growing memory.
    budget = ValidationBudget()
    schema = {"type": "object", "allOf": [{"$ref": "#"}, {"$ref": "#"}, {"$ref": "#"}]}
    errors = validate({}, schema, budget)
    assert errors and "recursive $ref" in errors[0]
    assert budget.steps < 100


def test_ref_results_are_memoised() -> None:
    # a0 -> 3 x a1 -> 3 x a2 ... : 3^20 checks without memoisation.
    defs: dict[str, Any] = {
        f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}] * 3} for i in range(20)
    }
    defs["a20"] = {"type": "object", "required": ["x"]}
    budget = ValidationBudget()
    errors = validate({}, {"$defs": defs, "$ref": "#/$defs/a0"}, budget)
    assert errors and all("missing required property 'x'" in e for e in errors)
    assert budget.steps < 1_000


def test_pattern_is_matched_in_linear_time() -> None:
    # Catastrophic backtracking in Python's re: hours for 40 characters.
    schema = {"properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    assert validate({"a": "a" * 40}, schema) == []
    errors = validate({"a": "a" * 40 + "!"}, schema)
    assert len(errors) == 1
    assert errors[0].startswith("/a: 'aaaa") and errors[0].endswith("does not match '^(a+)+$'")


@pytest.mark.parametrize("pattern", [r"^(?=a)", r"(a)\1", "a{2000}", "x" * 5000])
def test_pattern_re2_cannot_run_is_ignored(pattern: str) -> None:
    # Lookaround, backreferences, huge repeats, very long patterns: not checked,
    # like an unknown keyword (a valid call is never refused for them).
    assert validate("b", {"pattern": pattern}) == []
    assert validate({"b": 1}, {"patternProperties": {pattern: False}}) == []


def test_over_the_step_budget_is_one_error() -> None:
    budget = ValidationBudget(max_steps=1_000)
    errors = validate(list(range(5_000)), {"uniqueItems": True}, budget)
    assert len(errors) == 1 and "validation stopped" in errors[0]


def test_over_budget_inside_not_does_not_pass() -> None:
    # A budget error inside "not"/"anyOf" must not turn into "the subschema failed".
    budget = ValidationBudget(max_steps=1_000)
    errors = validate(list(range(5_000)), {"not": {"uniqueItems": True}}, budget)
    assert len(errors) == 1 and "validation stopped" in errors[0]


def test_over_the_time_budget_is_one_error() -> None:
    budget = ValidationBudget(max_steps=10**9, max_seconds=-1.0)  # deadline already past
    errors = validate(list(range(5_000)), {"items": {"type": "integer"}}, budget)
    assert len(errors) == 1 and "validation stopped" in errors[0]


def test_budget_is_shared_by_validations() -> None:
    budget = ValidationBudget(max_steps=3_000)
    schema = {"items": {"type": "integer"}}
    assert validate(list(range(2_000)), schema, budget) == []
    assert "validation stopped" in validate(list(range(2_000)), schema, budget)[0]


def test_messages_show_bounded_previews() -> None:
    big = [list(range(1_000))] * 1_000
    key = "k" * 100_000
    errors = validate(
        {"v": big, key: 1},
        {"properties": {"v": {"const": 1}}, "additionalProperties": False},
    )
    assert len(errors) == 2
    assert all(len(e) < 200 for e in errors), [len(e) for e in errors]


def test_huge_integer_multiple_of_is_refused_not_raised() -> None:
    assert "not a multiple" in validate(10**400, {"multipleOf": 3})[0]
