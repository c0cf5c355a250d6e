"""Native structured-output parameters: every dialect x every kind, exact request fields."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from grammars.compile import compile_constraint
from grammars.native import DIALECTS, native_is_exact, native_params, schema_name
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec, json_schema_spec

SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}
SCHEMA = json_schema_spec(SMALL, name="thing")
REGEX = ConstraintSpec("regex", "[0-9]{3}-[0-9]{4}")
LARK = ConstraintSpec("lark", 'start: "a"+')
GBNF = ConstraintSpec("gbnf", 'root ::= "a"+')
CHOICE = choice_spec(["yes", "no", "a.b"])
STRICT_SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}

TABLE: list[tuple[str, ConstraintSpec, dict[str, Any] | None]] = [
    (
        "openai",
        SCHEMA,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "thing", "strict": True, "schema": STRICT_SMALL},
            }
        },
    ),
    ("openai", JSON_OBJECT, {"response_format": {"type": "json_object"}}),
    ("openai", REGEX, None),
    ("openai", LARK, None),
    ("openai", GBNF, None),
    ("openai", CHOICE, None),
    ("vllm", SCHEMA, {"structured_outputs": {"json": SMALL}}),
    ("vllm", JSON_OBJECT, {"structured_outputs": {"json": ANY_OBJECT}}),
    ("vllm", REGEX, {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}),
    ("vllm", LARK, {"structured_outputs": {"grammar": 'start: "a"+'}}),
    ("vllm", GBNF, {"structured_outputs": {"grammar": 'root ::= "a"+'}}),
    ("vllm", CHOICE, {"structured_outputs": {"choice": ["yes", "no", "a.b"]}}),
    ("vllm-legacy", SCHEMA, {"guided_json": SMALL}),
    ("vllm-legacy", JSON_OBJECT, {"guided_json": ANY_OBJECT}),
    ("vllm-legacy", REGEX, {"guided_regex": "[0-9]{3}-[0-9]{4}"}),
    ("vllm-legacy", LARK, {"guided_grammar": 'start: "a"+'}),
    ("vllm-legacy", GBNF, {"guided_grammar": 'root ::= "a"+'}),
    ("vllm-legacy", CHOICE, {"guided_choice": ["yes", "no", "a.b"]}),
    ("llamacpp", SCHEMA, {"json_schema": SMALL}),
    ("llamacpp", JSON_OBJECT, {"json_schema": ANY_OBJECT}),
    ("llamacpp", REGEX, {"grammar": 'root ::= ([0-9]){3} "-" ([0-9]){4}'}),
    ("llamacpp", LARK, None),
    ("llamacpp", GBNF, {"grammar": 'root ::= "a"+'}),
    ("llamacpp", CHOICE, {"grammar": 'root ::= "yes" | "no" | "a.b"'}),
    (
        "ollama",
        SCHEMA,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SMALL}}},
    ),
    ("ollama", JSON_OBJECT, {"response_format": {"type": "json_object"}}),
    ("ollama", REGEX, None),
    ("ollama", LARK, None),
    ("ollama", GBNF, None),
    ("ollama", CHOICE, None),
    (
        "sglang",
        SCHEMA,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SMALL}}},
    ),
    (
        "sglang",
        JSON_OBJECT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "json_object", "schema": ANY_OBJECT},
            }
        },
    ),
    ("sglang", REGEX, {"regex": "[0-9]{3}-[0-9]{4}"}),
    ("sglang", LARK, None),
    ("sglang", GBNF, {"ebnf": 'root ::= "a"+'}),
    ("sglang", CHOICE, {"regex": "(yes|no|a\\.b)"}),
    *[("none", spec, None) for spec in (SCHEMA, JSON_OBJECT, REGEX, LARK, GBNF, CHOICE)],
]


@pytest.mark.parametrize(("dialect", "spec", "expected"), TABLE)
def test_native_params(dialect: str, spec: ConstraintSpec, expected: dict[str, Any] | None) -> None:
    assert native_params(dialect, spec) == expected


def test_table_covers_every_dialect_and_kind() -> None:
    assert {(d, s.kind) for d, s, _ in TABLE} == {
        (d, k) for d in DIALECTS for k in ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")
    }


def test_returned_dicts_are_fresh() -> None:
    first = native_params("openai", SCHEMA)
    assert first is not None
    first["response_format"]["json_schema"]["schema"]["properties"].clear()
    assert native_params("openai", SCHEMA) == TABLE[0][2]


def test_unknown_dialect() -> None:
    with pytest.raises(ValueError, match="unknown structured-output dialect 'tgi'"):
        native_params("tgi", SCHEMA)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (None, "output"),
        ("", "output"),
        ("ticket", "ticket"),
        ("my schema/v2", "my_schema_v2"),
        ("x" * 80, "x" * 64),
    ],
)
def test_schema_name(name: str | None, expected: str) -> None:
    assert schema_name(name) == expected


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "array", "items": {"type": "string"}}, "root is not an object"),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, "a map"),
        (
            {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": True}}},
            "nested map",
        ),
        ({"anyOf": [{"type": "object"}, {"type": "null"}]}, "root anyOf"),
        ({"type": "object", "properties": {"x": {}}}, "untyped property"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}, "not"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
         "a required name outside properties"),
        ({"type": "object", "properties": {"a": {"type": "array", "prefixItems": [{"type": "integer"}]}}},
         "prefixItems"),
        ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "properties": {"a": {"type": "integer"}},
          "if": {"required": ["a"]}, "then": {"minProperties": 1}}, "if/then"),
    ],
)
def test_openai_falls_back_to_validation_only(schema: dict[str, Any], reason: str) -> None:
    spec = json_schema_spec(schema)
    assert native_params("openai", spec) is None, reason
    assert native_is_exact("openai", spec) is False


def test_regex_gbnf_cannot_express_falls_back() -> None:
    # (?i) is fine for llguidance (validation) but has no GBNF form: llama.cpp gets no grammar.
    assert native_params("llamacpp", ConstraintSpec("regex", "(?i)yes")) is None


@pytest.mark.parametrize(
    ("dialect", "spec", "exact"),
    [
        ("openai", SCHEMA, True),
        ("vllm", SCHEMA, True),
        ("vllm-legacy", SCHEMA, True),
        ("sglang", SCHEMA, True),
        # llama.cpp's schema converter (and Ollama's) puts required properties before optional ones
        ("llamacpp", SCHEMA, False),
        ("ollama", SCHEMA, False),
        ("none", SCHEMA, False),
        ("openai", REGEX, False),
        ("llamacpp", REGEX, True),
        ("sglang", CHOICE, True),
        ("llamacpp", LARK, False),
        ("vllm", JSON_OBJECT, True),
        ("ollama", JSON_OBJECT, False),
    ],
)
def test_native_is_exact(dialect: str, spec: ConstraintSpec, exact: bool) -> None:
    assert native_is_exact(dialect, spec) is exact


def test_answers_to_the_strict_rewrite_pass_the_agents_own_schema() -> None:
    """Strict mode's rewrite only narrows (optional properties become required, not nullable): answers
    are checked against the spec itself, so a null for an optional property is refused."""
    original = compile_constraint(SCHEMA)
    assert original.validate('{"a": 1, "b": null}') is not None  # what the old nullable rewrite let through
    answer = '{"a": 1, "b": "x"}'  # what strict mode produces: every property, in schema order
    assert original.validate(answer) is None
    checker = original.checker(native=native_is_exact("openai", SCHEMA))
    assert checker.feed(answer) and checker.finish() is None


@pytest.mark.parametrize(
    ("schema", "sent"),
    [
        # allOf is merged into its object, not dropped (it was sent as an object admitting only {})
        ({"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
         {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}),
        # a property that admits null keeps admitting it; the others get no null
        ({"type": "object", "properties": {"a": {"type": ["integer", "null"]}, "b": {"type": "string"}}},
         {"type": "object", "properties": {"a": {"type": ["integer", "null"]}, "b": {"type": "string"}},
          "required": ["a", "b"], "additionalProperties": False}),
    ],
)
def test_openai_sends_a_narrowing_of_the_schema(schema: dict[str, Any], sent: dict[str, Any]) -> None:
    spec = json_schema_spec(schema, name="s")
    params = native_params("openai", spec)
    assert params is not None
    assert params["response_format"]["json_schema"]["schema"] == sent


def test_native_params_do_not_mutate_the_spec_schema() -> None:
    source = copy.deepcopy(SCHEMA.source)
    for dialect in DIALECTS:
        native_params(dialect, SCHEMA)
    assert SCHEMA.source == source
