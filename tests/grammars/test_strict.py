"""OpenAI strict-mode conversion: a narrowing of the agent's schema, or None (validated only).

The contract (grammars/strict.py): S narrows objects (every property required with its own schema, no
null added, `additionalProperties: false`), drops only keywords that narrow values the narrowing never
touches, merges `allOf` exactly and turns a safe `oneOf` into `anyOf`; anything else gives None.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammars.compile import compile_constraint
from grammars.spec import json_schema_spec
from grammars.strict import OPENAI_FORMATS, openai_strict_schema
from grammars.walk import map_schema
from tests.grammars.samples import USER_SCHEMA

BUILTIN = Path(__file__).resolve().parents[2] / "grammars" / "builtin"
TICKET: dict[str, Any] = json.loads((BUILTIN / "ticket.json").read_text())
S: dict[str, Any] = {"type": "string"}
I: dict[str, Any] = {"type": "integer"}

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
        "note": {"type": "string"},
        "kind": {"anyOf": [{"const": "a"}, {"const": "b"}]},
        "lines": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/line"}},
        "when": {"type": "string", "format": "date-time"},
        "site": {"type": "string"},
        "properties": {"type": "integer"},
    },
    "required": ["id", "note", "kind", "lines", "when", "site", "properties"],
    "additionalProperties": False,
    "$defs": {
        "line": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
}


def obj(properties: dict[str, Any], *required: str, **extra: Any) -> dict[str, Any]:
    """An object schema; `extra` keywords spelled with a trailing underscore for `$`-less Python names."""
    return {"type": "object", "properties": properties, "required": list(required), **extra}


def strict_obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **extra, "required": list(properties),
            "additionalProperties": False}


# ------------------------------------------------------------------------------------------ conversion


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
    assert before_user == USER_SCHEMA


def test_strict_user_schema_makes_everything_required() -> None:
    out = openai_strict_schema(USER_SCHEMA)
    assert out is not None
    assert out["required"] == list(USER_SCHEMA["properties"])
    # already nullable in the agent's schema: kept as it is
    assert out["properties"]["nickname"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert out["properties"]["address"]["additionalProperties"] is False
    assert out["properties"]["orders"]["items"]["additionalProperties"] is False
    assert "minLength" not in out["properties"]["name"]


def test_ticket_optional_properties_become_required_not_nullable() -> None:
    out = openai_strict_schema(TICKET)
    assert out is not None
    assert out["required"] == list(TICKET["properties"])
    assert out["properties"]["customer_email"] == {"type": "string", "format": "email"}
    assert out["properties"]["order_id"] == {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"}
    assert out["properties"]["tags"] == {"type": "array", "items": {"type": "string"}, "maxItems": 5}
    assert "null" not in json.dumps(out)


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # an optional property keeps its own schema: no null is added (a narrowing)
        (obj({"a": I, "b": S}, "a"), strict_obj({"a": I, "b": S})),
        (obj({"b": {"enum": ["x", "y"]}}), strict_obj({"b": {"enum": ["x", "y"]}})),
        (obj({"b": {"$ref": "#/$defs/d"}}, **{"$defs": {"d": S}}),
         strict_obj({"b": {"$ref": "#/$defs/d"}}, **{"$defs": {"d": S}})),
        # a property whose own schema admits null stays as it is
        (obj({"b": {"type": ["string", "null"]}}), strict_obj({"b": {"type": ["string", "null"]}})),
        (obj({"b": {"anyOf": [S, {"type": "null"}]}}), strict_obj({"b": {"anyOf": [S, {"type": "null"}]}})),
        # nested objects, in items, anyOf branches and $defs, are narrowed the same way
        (obj({"o": obj({"x": I})}), strict_obj({"o": strict_obj({"x": I})})),
        (obj({"l": {"type": "array", "items": obj({"x": I})}}),
         strict_obj({"l": {"type": "array", "items": strict_obj({"x": I})}})),
        (obj({"u": {"anyOf": [obj({"x": I}), {"type": "null"}]}}),
         strict_obj({"u": {"anyOf": [strict_obj({"x": I}), {"type": "null"}]}})),
        (obj({"r": {"$ref": "#/$defs/o"}}, **{"$defs": {"o": obj({"x": I})}}),
         strict_obj({"r": {"$ref": "#/$defs/o"}}, **{"$defs": {"o": strict_obj({"x": I})}})),
        # an object with no properties admits {} only
        (obj({"o": {"type": "object"}}), strict_obj({"o": strict_obj({})})),
        # additionalProperties: false is kept
        (obj({"a": I}, additionalProperties=False), strict_obj({"a": I})),
    ],
)
def test_optional_properties_are_narrowed(schema: dict[str, Any], expected: dict[str, Any]) -> None:
    assert openai_strict_schema(schema) == expected


# ------------------------------------------------------------------------------------ dropped keywords

SAFE_KEYWORDS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (keyword, subschema carrying it, the same subschema converted)
    ("minLength", {"type": "string", "minLength": 2}, S),
    ("maxLength", {"type": "string", "maxLength": 2}, S),
    ("format (unknown to strict mode)", {"type": "string", "format": "uri"}, S),
    ("examples", {"type": "string", "examples": ["x"]}, S),
    ("default", {"type": "string", "default": "x"}, S),
    ("$comment", {"type": "string", "$comment": "c"}, S),
    ("readOnly", {"type": "string", "readOnly": True}, S),
    ("writeOnly", {"type": "string", "writeOnly": True}, S),
    ("deprecated", {"type": "string", "deprecated": True}, S),
    ("contentMediaType", {"type": "string", "contentMediaType": "text/html"}, S),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, S),
    ("contentSchema", {"type": "string", "contentSchema": {"type": "object"}}, S),
    ("uniqueItems (scalar items)",
     {"type": "array", "items": S, "uniqueItems": True, "minItems": 3},
     {"type": "array", "items": S, "minItems": 3}),
    ("uniqueItems (object items, at most one needed)",
     {"type": "array", "items": obj({"x": I}), "uniqueItems": True},
     {"type": "array", "items": strict_obj({"x": I})}),
    ("uniqueItems: false", {"type": "array", "items": obj({"x": I}), "uniqueItems": False, "minItems": 3},
     {"type": "array", "items": strict_obj({"x": I}), "minItems": 3}),
    ("contains (shape-blind)", {"type": "array", "items": I, "contains": {"const": 1}}, {"type": "array", "items": I}),
    ("contains over objects, blind to their properties",
     {"type": "array", "items": obj({"x": I}), "contains": {"type": "object"}, "minContains": 2, "maxContains": 3},
     {"type": "array", "items": strict_obj({"x": I})}),
    ("minProperties met by every narrowed object", obj({"x": I, "y": I}, minProperties=2), strict_obj({"x": I, "y": I})),
    ("maxProperties met by every narrowed object", obj({"x": I, "y": I}, maxProperties=2), strict_obj({"x": I, "y": I})),
    ("required on a type that is no object", {"type": "string", "required": ["a"]}, S),
    ("minProperties on a type that is no object", {"type": "string", "minProperties": 1}, S),
    ("uniqueItems on a type that is no array", {"type": "string", "uniqueItems": True}, S),
    ("discriminator (OpenAPI annotation)", {"type": "string", "discriminator": {"propertyName": "k"}}, S),
]


@pytest.mark.parametrize(("keyword", "node", "expected"), SAFE_KEYWORDS, ids=[k for k, _, _ in SAFE_KEYWORDS])
@pytest.mark.parametrize("where", ["property", "items", "anyOf", "$defs"])
def test_safe_keywords_are_dropped(keyword: str, node: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    schema, strict = _placed(node, expected, where)
    assert openai_strict_schema(schema) == strict, keyword


def test_root_only_keywords_are_dropped_at_the_root() -> None:
    schema = {**obj({"a": I}), "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://x.test/s"}
    assert openai_strict_schema(schema) == strict_obj({"a": I})
    assert openai_strict_schema(obj({"a": {**I, "$id": "https://x.test/a"}})) is None  # a new resource
    assert openai_strict_schema(obj({"a": {**I, "$schema": "https://json-schema.org/draft/2020-12/schema"}})) is None


UNSAFE: list[tuple[str, Any]] = [
    ("allOf (not mergeable)", {"type": "integer", "allOf": [{"type": "number"}]}),
    ("not", {"type": "integer", "not": {"const": 1}}),
    ("if/then/else", {"type": "integer", "if": {"minimum": 1}, "then": {"maximum": 3}, "else": {"const": 0}}),
    ("if alone", {"type": "integer", "if": {"minimum": 1}}),
    ("prefixItems", {"type": "array", "prefixItems": [I], "items": S}),
    ("items as a list", {"type": "array", "items": [I, S]}),
    ("additionalItems", {"type": "array", "items": I, "additionalItems": False}),
    ("unevaluatedItems", {"type": "array", "items": I, "unevaluatedItems": False}),
    ("unevaluatedProperties", {**obj({"a": I}), "unevaluatedProperties": False}),
    ("dependentRequired", {**obj({"a": I, "b": I}), "dependentRequired": {"a": ["b"]}}),
    ("dependentSchemas", {**obj({"a": I, "b": I}), "dependentSchemas": {"a": {"required": ["b"]}}}),
    ("dependencies", {**obj({"a": I, "b": I}), "dependencies": {"a": ["b"]}}),
    ("propertyNames", {**obj({"a": I}), "propertyNames": {"maxLength": 3}}),
    ("patternProperties", {**obj({"a": I}), "patternProperties": {"^x": I}}),
    ("additionalProperties: true (a map)", {**obj({"a": I}), "additionalProperties": True}),
    ("additionalProperties: schema (a map)", {"type": "object", "additionalProperties": I}),
    ("required name outside properties", obj({"a": I}, "a", "b")),
    ("required on an untyped node", {"$ref": "#/$defs/x", "required": ["a"]}),
    ("minProperties above the narrowed count", obj({"a": I}, minProperties=2)),
    ("maxProperties below the narrowed count", obj({"a": I, "b": I}, maxProperties=1)),
    ("maxProperties on a node that may be an object", {"$ref": "#/$defs/x", "maxProperties": 1}),
    ("uniqueItems over narrowed objects, two needed",
     {"type": "array", "items": obj({"done": {"type": "boolean"}}), "uniqueItems": True, "minItems": 2}),
    ("uniqueItems over narrowed objects, two contained",
     {"type": "array", "items": {"type": "object"}, "uniqueItems": True, "contains": {"type": "object"},
      "minContains": 2}),
    ("contains reading properties",
     {"type": "array", "items": obj({"a": I, "b": I}), "contains": {"required": ["z"]}}),
    ("contains through a $ref", {"type": "array", "items": I, "contains": {"$ref": "#/$defs/x"}}),
    ("enum of objects the narrowing changes", {**obj({"a": I, "b": I}), "enum": [{"a": 1}]}),
    ("const of objects under narrowed items",
     {"type": "array", "items": obj({"a": I, "b": I}), "const": [{"a": 1}]}),
    ("oneOf over undiscriminated objects", {"oneOf": [obj({"a": I}), obj({"b": I})]}),
    ("oneOf whose discriminator values overlap",
     {"oneOf": [obj({"k": {"enum": ["x", "y"]}}), obj({"k": {"const": "y"}})]}),
    ("oneOf over objects or null", {"oneOf": [obj({"k": {"const": "x"}}), {"type": "null"}]}),
    ("oneOf beside anyOf", {"oneOf": [I], "anyOf": [I]}),
    ("object beside anyOf", {**obj({"a": I}), "anyOf": [obj({"b": I})]}),
    ("object beside $ref", {**obj({"a": I}), "$ref": "#/$defs/x"}),
    ("nested $id", {**I, "$id": "https://x.test/i"}),
    ("$anchor", {**I, "$anchor": "i"}),
    ("$dynamicRef", {"$dynamicRef": "#/$defs/x"}),
    ("$ref to another document", {"$ref": "other.json#/x"}),
    ("$ref to an anchor", {"$ref": "#x"}),
    ("a keyword nobody knows", {**I, "x-order": 3}),
    ("nullable (OpenAPI)", {**I, "nullable": True}),
    ("boolean exclusiveMinimum (draft-04)", {**I, "minimum": 0, "exclusiveMinimum": True}),
    ("boolean subschema", True),
    ("false subschema", False),
    ("untyped subschema", {"description": "anything"}),
    ("empty anyOf", {"anyOf": []}),
]


@pytest.mark.parametrize(("keyword", "node"), UNSAFE, ids=[k for k, _ in UNSAFE])
@pytest.mark.parametrize("where", ["property", "items", "anyOf", "$defs"])
def test_unsafe_keywords_make_the_schema_inexpressible(keyword: str, node: Any, where: str) -> None:
    schema, _ = _placed(node, {}, where)
    schema.setdefault("$defs", {})["x"] = obj({"a": I})
    assert openai_strict_schema(schema) is None, keyword


def _placed(node: Any, expected: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`node` (and its conversion `expected`) placed as a property, array items, an anyOf branch or a
    $def of an object root."""
    if where == "property":
        return obj({"p": node}), strict_obj({"p": expected})
    if where == "items":
        return (obj({"p": {"type": "array", "items": node}}),
                strict_obj({"p": {"type": "array", "items": expected}}))
    if where == "anyOf":
        return obj({"p": {"anyOf": [node, {"type": "null"}]}}), strict_obj({"p": {"anyOf": [expected, {"type": "null"}]}})
    return (obj({"p": {"$ref": "#/$defs/d"}}, **{"$defs": {"d": node}}),
            strict_obj({"p": {"$ref": "#/$defs/d"}}, **{"$defs": {"d": expected}}))


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "array", "items": S}, "root is not an object"),
        ({"anyOf": [obj({"a": I}), {"type": "null"}]}, "root anyOf"),
        ({"$ref": "#/$defs/o", "$defs": {"o": obj({"a": I})}}, "root $ref"),
        ([], "not a schema"),
        (obj({"a": I}, "a", "b"), "root requires a name it does not declare"),
        ({"type": "object", "required": ["a"]}, "no properties at all"),
        ({"type": "object", "properties": None}, "malformed properties"),
        (obj({"a": I}, minProperties=2), "too few properties to meet minProperties"),
        ({**obj({"a": I}), "$defs": {"unused": {"not": I}}}, "an unsupported keyword in an unused $def"),
        ({"$schema": "http://json-schema.org/draft-07/schema#", **obj({"a": {"$ref": "#/definitions/i", "minimum": 1}}),
          "definitions": {"i": I}}, "draft-07 ignores a $ref's siblings"),
        ({**obj({"a": {"$ref": "#/properties/b/oneOf/0"}, "b": {"oneOf": [I, S]}})}, "a $ref to a renamed keyword"),
        ({**obj({"a": {"$ref": "#/properties/b/contentSchema"}, "b": {**S, "contentSchema": I}})},
         "a $ref into a dropped keyword"),
        ({**obj({"a": {"$ref": "#/allOf/0/properties/b"}}), "allOf": [obj({"b": I})]}, "a $ref into a merged allOf"),
    ],
)
def test_inexpressible_schemas(schema: Any, reason: str) -> None:
    assert openai_strict_schema(schema) is None, reason


def test_a_ref_beside_annotations_loses_them() -> None:
    """Strict mode refuses a $ref beside other keywords (the OpenAI SDK inlines the target of a pydantic
    field with a description): the annotations go, a draft-07 $ref's included."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              **obj({"a": {"$ref": "#/definitions/i", "description": "d", "title": "A"}}), "definitions": {"i": I}}
    assert openai_strict_schema(schema) == strict_obj({"a": {"$ref": "#/definitions/i"}}, definitions={"i": I})
    assert openai_strict_schema({**obj({"a": {"$ref": "#/$defs/i", "minimum": 1}}), "$defs": {"i": I}}) is None


# ------------------------------------------------------------------------------------- exact rewrites


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        # the repro of the defect: allOf was dropped and the object narrowed to {}
        ({"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}]}, strict_obj({"a": I})),
        # parts merge in document order (llguidance's grammar of O expects that key order)
        ({"type": "object", "properties": {"z": S}, "allOf": [{"properties": {"a": I}}]},
         strict_obj({"z": S, "a": I})),
        ({"type": "object", "allOf": [{"properties": {"a": I}}], "properties": {"z": S}},
         strict_obj({"a": I, "z": S})),
        ({"type": "object", "properties": {"z": S},
          "allOf": [{"allOf": [{"properties": {"c": I}}], "properties": {"a": I}}, {"properties": {"b": I}}]},
         strict_obj({"z": S, "c": I, "a": I, "b": I})),
        # required lists unite; equal values and annotations merge
        ({"type": "object", "required": ["a"], "allOf": [{"type": "object", "properties": {"a": I, "b": I},
                                                           "required": ["b"], "description": "d"}]},
         strict_obj({"a": I, "b": I}, description="d")),
        # additionalProperties with its own properties, in one part
        ({"type": "object", "allOf": [{"properties": {"a": I}, "additionalProperties": False}, True]},
         strict_obj({"a": I})),
        # a $ref branch beside annotations (pydantic v1's way to describe a referenced model)
        ({**obj({"p": {"allOf": [{"$ref": "#/$defs/o"}], "description": "d"}}), "$defs": {"o": obj({"x": I})}},
         {**strict_obj({"p": {"$ref": "#/$defs/o"}}), "$defs": {"o": strict_obj({"x": I})}}),
        # a nested allOf
        (obj({"n": {"allOf": [{"type": "integer"}, {"minimum": 1}]}}), strict_obj({"n": {"type": "integer", "minimum": 1}})),
    ],
)
def test_all_of_is_merged_exactly(schema: dict[str, Any], expected: dict[str, Any]) -> None:
    assert openai_strict_schema(schema) == expected


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "object", "properties": {"a": I}, "additionalProperties": False, "allOf": [{"properties": {"b": I}}]},
         "the parent's additionalProperties would admit the branch's b"),
        ({"type": "object", "allOf": [{"properties": {"a": I}}, {"properties": {"a": {"minimum": 1}}}]},
         "one property in two parts"),
        ({"type": "object", "allOf": [{"properties": {"a": I}, "additionalProperties": False},
                                      {"properties": {"b": I}, "additionalProperties": False}]},
         "two additionalProperties, each reading its own properties"),
        ({"type": "object", "allOf": [{"type": ["object", "null"], "properties": {"a": I}}]}, "different types"),
        ({"type": "object", "allOf": [{"$defs": {"x": I}, "properties": {"a": {"$ref": "#/allOf/0/$defs/x"}}}]},
         "a branch's $defs"),
        ({"type": "object", "allOf": [False]}, "a false branch"),
        ({"type": "object", "allOf": {"properties": {"a": I}}}, "allOf not a list"),
        ({"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}, {"not": {"required": ["a"]}}]},
         "an unsupported keyword in a branch"),
    ],
)
def test_all_of_that_does_not_merge_exactly(schema: dict[str, Any], reason: str) -> None:
    assert openai_strict_schema(schema) is None, reason


CAT = obj({"kind": {"const": "cat", "type": "string"}, "lives": I}, "kind")
DOG = obj({"kind": {"enum": ["dog", "puppy"]}, "good": {"type": "boolean"}}, "kind")


@pytest.mark.parametrize(
    ("one_of", "expected"),
    [
        ([{"const": "a"}, {"const": "b"}], [{"const": "a"}, {"const": "b"}]),
        ([I, {"type": "string", "minLength": 2}], [I, S]),  # nothing narrowed: exclusivity is checked on the answer
        ([CAT, DOG], [strict_obj(CAT["properties"]), strict_obj(DOG["properties"])]),
        ([{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}], [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]),
        ([{"allOf": [{"$ref": "#/$defs/cat"}]}, {"$ref": "#/$defs/dog"}], [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]),
    ],
)
def test_one_of_becomes_any_of_when_narrowing_keeps_it_exclusive(
    one_of: list[Any], expected: list[Any],
) -> None:
    defs = {"cat": CAT, "dog": DOG}
    out = openai_strict_schema({**obj({"pet": {"oneOf": one_of, "discriminator": {"propertyName": "kind"}}}),
                                "$defs": defs})
    assert out is not None
    assert out["properties"]["pet"] == {"anyOf": expected}


def test_one_of_discriminated_by_numbers_tells_1_from_true() -> None:
    flags = [obj({"k": {"const": 1}, "a": I}), obj({"k": {"const": True}, "b": I})]
    assert openai_strict_schema(obj({"u": {"oneOf": flags}})) is not None
    same = [obj({"k": {"const": 1}, "a": I}), obj({"k": {"const": 1.0}, "b": I})]
    assert openai_strict_schema(obj({"u": {"oneOf": same}})) is None


# ---------------------------------------------------------------------------- the contract, on answers

_DROPPED_VALUE_KEYWORDS = frozenset({"minLength", "maxLength", "uniqueItems", "contains", "minContains", "maxContains"})


def _without_dropped(schema: Any) -> Any:
    """The agent's schema minus the value constraints the conversion may drop (and oneOf's exclusivity):
    every answer the strict schema admits must satisfy it. A schema without such keywords is unchanged."""
    def relax(node: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in node.items() if k not in _DROPPED_VALUE_KEYWORDS}
        if "format" in out and out["format"] not in OPENAI_FORMATS:
            del out["format"]
        if "oneOf" in out:
            out["anyOf"] = out.pop("oneOf")
        return out
    return map_schema(schema, relax)


def _validator(schema: Any) -> Any:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


CONTRACT_SCHEMAS: list[dict[str, Any]] = [
    TICKET,
    USER_SCHEMA,
    NESTED,
    {"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}]},
    {**obj({"pet": {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]}}, "pet"),
     "$defs": {"cat": CAT, "dog": DOG}},
    obj({"o": obj({"x": {"type": ["integer", "null"]}, "y": {"enum": ["a", "b"]}}, "y"),
         "l": {"type": "array", "items": obj({"t": S}), "maxItems": 2},
         "n": {"anyOf": [obj({"v": {"type": "number", "minimum": 0}}), {"type": "null"}]}}),
    obj({"a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True}},
        minProperties=1, maxProperties=3),
]
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(-3, 3, allow_nan=False),
                     st.text(max_size=3), st.sampled_from(["cat", "dog", "billing", "low", "a", "b"]))
_ANY_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["a", "x", "kind", "title"]), inner, max_size=3), max_leaves=6)


def _mostly(shaped: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`shaped` nine times in ten, a random JSON value otherwise."""
    return st.integers(0, 9).flatmap(lambda n: _ANY_JSON if n == 0 else shaped)


def _answers(schema: Any, root: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Answers shaped like `schema` (a strict one), with now and then a random value in place."""
    if depth > 4 or not isinstance(schema, dict):
        return _ANY_JSON
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/") if schema["$ref"] != "#" else ():
            target = target[part]
        return _answers(target, root, depth + 1)
    if "anyOf" in schema:
        return st.one_of([_answers(branch, root, depth + 1) for branch in schema["anyOf"]])
    if "const" in schema:
        return _mostly(st.just(schema["const"]))
    if "enum" in schema:
        return _mostly(st.sampled_from(schema["enum"]))
    declared = schema.get("type")
    options: list[st.SearchStrategy[Any]] = []
    for kind in declared if isinstance(declared, list) else [declared]:
        if kind == "object":
            options.append(st.fixed_dictionaries(
                {name: _answers(sub, root, depth + 1) for name, sub in schema.get("properties", {}).items()}))
        elif kind == "array":
            options.append(st.lists(_answers(schema.get("items", {}), root, depth + 1), max_size=3))
        elif kind == "string":
            if "pattern" in schema:
                options.append(st.from_regex(schema["pattern"], fullmatch=True))
            else:
                example = {"email": "a@b.test", "uuid": "6f1c2a1e-3b7d-4c9a-9e8f-1a2b3c4d5e6f",
                           "date-time": "2024-05-01T10:00:00Z"}.get(schema.get("format", ""))
                options.append(st.just(example) if example else st.text(max_size=4))
        elif kind in ("integer", "number"):
            options.append(st.integers(int(schema.get("minimum", -2)), int(schema.get("maximum", 5))))
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "null":
            options.append(st.none())
    return _mostly(st.one_of(options)) if options else _ANY_JSON


@pytest.mark.parametrize("schema", CONTRACT_SCHEMAS, ids=range(len(CONTRACT_SCHEMAS)))
def test_strict_answers_satisfy_the_agents_schema(schema: dict[str, Any]) -> None:
    """Property: every answer the strict schema admits satisfies the agent's schema (minus the value
    constraints dropped, which the answer's check enforces)."""
    strict = openai_strict_schema(schema)
    assert strict is not None
    strict_check, original = _validator(strict), _validator(_without_dropped(schema))
    admitted: list[int] = []

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    @given(_answers(strict, strict))
    def check(answer: Any) -> None:
        if strict_check.is_valid(answer):
            admitted.append(1)
            assert original.is_valid(answer), answer

    check()
    assert admitted  # the generator reaches admitted answers


@pytest.mark.parametrize(
    ("schema", "answer", "strict_ok", "original_ok"),
    [
        # the d2 defect: strict mode never produces null for an optional non-nullable property
        (TICKET, {"title": "t", "category": "bug", "priority": "low", "summary": "s",
                  "customer_email": None, "order_id": None, "tags": None}, False, False),
        (TICKET, {"title": "t", "category": "bug", "priority": "low", "summary": "s",
                  "customer_email": "a@b.test", "order_id": "AB-123456", "tags": []}, True, True),
        # the original admits the optional properties' absence, strict mode asks for them (a narrowing)
        (TICKET, {"title": "t", "category": "bug", "priority": "low", "summary": "s"}, False, True),
        (obj({"a": I}), {"a": 1, "b": 2}, False, True),
        (obj({"a": I}), {"a": None}, False, False),
        (obj({"a": {"type": ["integer", "null"]}}), {"a": None}, True, True),
        # d1: the merged allOf admits what the agent's schema admits
        ({"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}]}, {"a": 1}, True, True),
        ({"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}]}, {}, False, False),
        (NESTED, {"id": "6f1c2a1e-3b7d-4c9a-9e8f-1a2b3c4d5e6f", "note": "n", "kind": "a",
                  "lines": [{"sku": "s", "qty": 1}], "when": "2024-05-01T10:00:00Z", "site": "https://x.test/",
                  "properties": 3}, True, True),
        (NESTED, {"id": "6f1c2a1e-3b7d-4c9a-9e8f-1a2b3c4d5e6f", "lines": [{"sku": "s", "qty": None}],
                  "properties": 3}, False, False),
    ],
)
def test_sample_answers(schema: dict[str, Any], answer: Any, strict_ok: bool, original_ok: bool) -> None:
    strict = openai_strict_schema(schema)
    assert strict is not None
    assert _validator(strict).is_valid(answer) is strict_ok
    assert _validator(schema).is_valid(answer) is original_ok
    assert not strict_ok or original_ok


ORDER_SCHEMAS: list[dict[str, Any]] = [
    obj({"b": I, "a": I}, "a"),
    {"type": "object", "properties": {"z": I}, "allOf": [{"properties": {"a": I}}]},
    {"type": "object", "allOf": [{"properties": {"a": I}}], "properties": {"z": I}},
    {"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}, {"properties": {"b": I}}],
     "properties": {"z": I}},
    {"type": "object", "properties": {"z": I},
     "allOf": [{"allOf": [{"properties": {"c": I}}], "properties": {"a": I}}, {"properties": {"b": I}}]},
]


@pytest.mark.parametrize("schema", ORDER_SCHEMAS, ids=range(len(ORDER_SCHEMAS)))
def test_property_order_matches_the_agents_grammar(schema: dict[str, Any]) -> None:
    """native_is_exact: a strict answer's stream is cut by the grammar of the agent's own schema, keys
    in schema order: S's order must be that order (allOf merges included), or good answers are cut."""
    strict = openai_strict_schema(schema)
    assert strict is not None
    answer = json.dumps(dict.fromkeys(strict["properties"], 1))
    checker = compile_constraint(json_schema_spec(schema)).checker(native=True)
    assert checker.feed(answer)
    assert checker.finish() is None
