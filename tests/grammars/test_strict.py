"""OpenAI strict-mode conversion and its validation superset."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from grammars.strict import nullable, nullable_optionals, openai_strict_schema
from tests.grammars.samples import USER_SCHEMA

NESTED: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Order",
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid", "minLength": 36},
        "note": {"type": "string", "maxLength": 10, "default": ""},
        "kind": {"oneOf": [{"const": "a"}, {"const": "b"}]},
        "lines": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"$ref": "#/$defs/line"}},
        "when": {"type": "string", "format": "date-time"},
        "site": {"type": "string", "format": "uri"},
        "properties": {"type": "integer"},  # a property named like a keyword
    },
    "required": ["id", "lines", "properties"],
    "$defs": {
        "line": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku"],
        }
    },
}

NESTED_STRICT: dict[str, Any] = {
    "title": "Order",
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "note": {"type": ["string", "null"]},
        "kind": {"anyOf": [{"const": "a"}, {"const": "b"}, {"type": "null"}]},
        "lines": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/line"}},
        "when": {"type": ["string", "null"], "format": "date-time"},
        "site": {"type": ["string", "null"]},
        "properties": {"type": "integer"},
    },
    "required": ["id", "note", "kind", "lines", "when", "site", "properties"],
    "additionalProperties": False,
    "$defs": {
        "line": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": ["integer", "null"]}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
}


def test_strict_conversion() -> None:
    assert openai_strict_schema(NESTED) == NESTED_STRICT


def test_strict_conversion_does_not_mutate_input() -> None:
    before = copy.deepcopy(NESTED)
    out = openai_strict_schema(NESTED)
    assert before == NESTED
    assert out is not None
    out["$defs"]["line"]["properties"]["sku"]["type"] = "mutated"
    out["properties"]["lines"]["items"]["$ref"] = "mutated"
    assert before == NESTED
    before_user = copy.deepcopy(USER_SCHEMA)
    openai_strict_schema(USER_SCHEMA)
    nullable_optionals(USER_SCHEMA)
    assert before_user == USER_SCHEMA


def test_strict_user_schema_makes_everything_required() -> None:
    out = openai_strict_schema(USER_SCHEMA)
    assert out is not None
    assert out["required"] == list(USER_SCHEMA["properties"])
    assert out["properties"]["nickname"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert out["properties"]["address"]["additionalProperties"] is False
    assert out["properties"]["orders"]["items"]["additionalProperties"] is False
    assert "minLength" not in out["properties"]["name"]


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        ({"type": "string"}, {"type": ["string", "null"]}),
        ({"type": ["string", "integer"]}, {"type": ["string", "integer", "null"]}),
        ({"type": ["string", "null"]}, {"type": ["string", "null"]}),
        ({"type": "null"}, {"type": "null"}),
        ({"enum": ["a"]}, {"anyOf": [{"enum": ["a"]}, {"type": "null"}]}),
        ({"type": "string", "enum": ["a"]}, {"anyOf": [{"type": "string", "enum": ["a"]}, {"type": "null"}]}),
        ({"$ref": "#/x"}, {"anyOf": [{"$ref": "#/x"}, {"type": "null"}]}),
        (
            {"anyOf": [{"type": "string"}], "description": "d"},
            {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "d"},
        ),
        (
            {"anyOf": [{"type": "null"}, {"type": "string"}]},
            {"anyOf": [{"type": "null"}, {"type": "string"}]},
        ),
        (
            {"anyOf": [{"type": "string"}], "minLength": 1},
            {"anyOf": [{"anyOf": [{"type": "string"}], "minLength": 1}, {"type": "null"}]},
        ),
    ],
)
def test_nullable(node: dict[str, Any], expected: dict[str, Any]) -> None:
    assert nullable(node) == expected


def test_nullable_optionals() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {
                "type": "object",
                "properties": {"c": {"type": "string"}, "format": {"enum": [1]}},
                "required": ["c"],
            },
        },
        "required": ["a"],
    }
    assert nullable_optionals(schema) == {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {
                "type": ["object", "null"],
                "properties": {
                    "c": {"type": "string"},
                    "format": {"anyOf": [{"enum": [1]}, {"type": "null"}]},
                },
                "required": ["c"],
            },
        },
        "required": ["a"],
    }
