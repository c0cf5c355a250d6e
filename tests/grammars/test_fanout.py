"""`grammars.fanout`: how many subschemas may apply to one value, counted through local refs."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.errors import InvalidGrammar
from grammars.fanout import in_place_cycle, in_place_fanout, resolve_local
from grammars.schema import MAX_FANOUT, build_check


def chain(levels: int, width: int = 2) -> dict[str, Any]:
    """`levels` of `anyOf` over `width` refs to the next level: width ** levels subschemas in place."""
    defs: dict[str, Any] = {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}] * width} for i in range(levels)}
    defs[f"a{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


@pytest.mark.parametrize(("schema", "fanout"), [
    ({"type": "object"}, 1),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 3),
    (chain(3), 30),  # ref nodes count too: a3 = 1, a2 = 1 + 2 * (1 + 1) = 5, a1 = 13, a0 = 29, the root 30
    ({"type": "object", "properties": {"child": {"$ref": "#"}}}, 2),  # descends: the ref and the root
    ({"allOf": [{"$ref": "#/$defs/x~1y"}], "$defs": {"x/y": {"type": "null"}}}, 3),
])
def test_in_place_fanout(schema: dict[str, Any], fanout: int) -> None:
    assert in_place_fanout(schema, 10**6) == fanout


def test_counting_stops_past_the_limit() -> None:
    started = time.perf_counter()
    assert in_place_fanout(chain(60), 1000) > 1000  # 2 ** 60, counted only up to the limit
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize(("ref", "found"), [
    ("#", True), ("#/$defs/a", True), ("#/$defs/missing", False), ("other.json#/a", False), ("#anchor", False),
    ("#/list/1", True), ("#/list/9", False), ("#/%24defs/a", True),
])
def test_resolve_local(ref: str, found: bool) -> None:
    root = {"$defs": {"a": {"type": "null"}}, "list": [{}, {"type": "string"}]}
    assert (resolve_local(root, ref) is not None) is found


def test_a_schema_whose_refs_multiply_past_the_bound_is_refused_when_it_compiles() -> None:
    """16 levels (1 KB) took 6 s to validate one value, on the event loop; 24, minutes."""
    assert in_place_fanout(chain(12), 10**6) > MAX_FANOUT
    started = time.perf_counter()
    with pytest.raises(InvalidGrammar, match="subschemas may apply to one value"):
        build_check(chain(24))
    assert time.perf_counter() - started < 1
    assert build_check(chain(8)).check_value("ok") is None  # 2 ** 8: fine


@pytest.mark.parametrize(("schema", "cycle"), [
    ({"$ref": "#"}, True),
    ({"anyOf": [{"type": "object"}, {"$ref": "#"}]}, True),
    ({"if": {"type": "string"}, "then": {"$ref": "#"}}, True),
    ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"oneOf": [{"$ref": "#/$defs/a"}]}}, "type": "null"}, True),
    ({"type": "object", "properties": {"child": {"$ref": "#"}}}, False),  # a tree
    ({"$defs": {"n": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/n"}}]}},
      "$ref": "#/$defs/n"}, False),
    (chain(30), False),  # deep, and no cycle
])
def test_in_place_cycle(schema: dict[str, Any], cycle: bool) -> None:
    assert in_place_cycle(schema) is cycle


@pytest.mark.parametrize("schema", [
    {"$defs": {"a": {"$anchor": "loop", "anyOf": [{"type": "string"}, {"$ref": "#loop"}]}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$id": "a.json", "allOf": [{"$ref": "a.json"}]}}, "$ref": "a.json"},
    {"$defs": {"a": {"$id": "#old", "allOf": [{"$ref": "#old"}]}}, "type": "null"},
    {"$defs": {"a": {"$id": "a.json", "$defs": {"b": {"allOf": [{"$ref": "a.json#/$defs/b"}]}}}}, "type": "null"},
])
def test_refs_by_anchor_or_id_are_followed(schema: dict[str, Any]) -> None:
    """A ref by name is no way around the cycle and fan-out bounds."""
    assert in_place_cycle(schema)


def test_a_large_flat_union_is_no_multiplication() -> None:
    """5,500 labels under one `oneOf` apply 5,500 subschemas, as many as the schema has: with an unrelated
    ref elsewhere it used to be refused as refs multiplying."""
    labels = [{"const": f"label-{i}", "title": f"Label {i}"} for i in range(5500)]
    schema = {"oneOf": labels, "$defs": {"x": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/x"}}}
    assert build_check(schema).check_value("label-7") is None
