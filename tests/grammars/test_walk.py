"""Schema-aware rebuilding."""

from __future__ import annotations

import copy
from typing import Any

from grammars.walk import map_schema, without_keywords

SCHEMA: dict[str, Any] = {
    "type": "object",
    "format": "x",
    "properties": {"format": {"type": "string", "format": "email"}, "n": {"enum": [{"format": "data"}]}},
    "items": [{"format": "a"}, True],
    "anyOf": [{"format": "b"}],
    "$defs": {"d": {"not": {"format": "c"}}},
    "dependencies": {"a": ["b"], "c": {"format": "d"}},
    "additionalProperties": {"format": "e"},
}


def test_without_keywords_knows_properties_from_keywords() -> None:
    before = copy.deepcopy(SCHEMA)
    assert without_keywords(SCHEMA, frozenset({"format"})) == {
        "type": "object",
        "properties": {"format": {"type": "string"}, "n": {"enum": [{"format": "data"}]}},
        "items": [{}, True],
        "anyOf": [{}],
        "$defs": {"d": {"not": {}}},
        "dependencies": {"a": ["b"], "c": {}},
        "additionalProperties": {},
    }
    assert before == SCHEMA


def test_map_schema_copies_leaves() -> None:
    out = map_schema(SCHEMA, lambda node: node)
    assert out == SCHEMA
    out["properties"]["n"]["enum"][0]["format"] = "changed"
    assert SCHEMA["properties"]["n"]["enum"][0]["format"] == "data"


def test_map_schema_visits_bottom_up() -> None:
    seen: list[str] = []

    def visit(node: dict[str, Any]) -> dict[str, Any]:
        seen.append(node["title"])
        return node

    map_schema({"title": "root", "properties": {"a": {"title": "a", "items": {"title": "i"}}}}, visit)
    assert seen == ["i", "a", "root"]
