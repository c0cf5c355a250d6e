"""Constraints a request brings: response_format, vLLM guided_* and structured_outputs."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidGrammar
from grammars.requests import (
    VLLM_ONLY_FIELDS,
    anthropic_constraints,
    grammar_kind,
    request_constraints,
    responses_constraints,
    strip_guided_fields,
)
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec, json_schema_spec

SCHEMA = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LARK = 'start: "a"+'
GBNF = 'root ::= "a"+'


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, ()),
        ({"response_format": {"type": "text"}}, ()),
        ({"response_format": None, "guided_json": None}, ()),
        ({"response_format": {"type": "json_object"}}, (JSON_OBJECT,)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA},
                }
            },
            (json_schema_spec(SCHEMA, "thing"),),
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "thing"}}}, (JSON_OBJECT,)),
        ({"guided_json": SCHEMA}, (json_schema_spec(SCHEMA),)),
        (
            {
                "guided_json": '{"type": "object", "properties": '
                '{"z": {"type": "string"}, "a": {"type": "integer"}}}'
            },
            (json_schema_spec(SCHEMA),),
        ),
        ({"guided_regex": "[a-z]+"}, (ConstraintSpec("regex", "[a-z]+"),)),
        ({"guided_grammar": LARK}, (ConstraintSpec("lark", LARK),)),
        ({"guided_grammar": GBNF}, (ConstraintSpec("gbnf", GBNF),)),
        ({"guided_choice": ["yes", "no"]}, (choice_spec(["yes", "no"]),)),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}}, (json_schema_spec(SCHEMA),)),
        ({"structured_outputs": {"regex": "x+"}}, (ConstraintSpec("regex", "x+"),)),
        ({"structured_outputs": {"grammar": GBNF}}, (ConstraintSpec("gbnf", GBNF),)),
        ({"structured_outputs": {"choice": ["a"]}}, (choice_spec(["a"]),)),
        ({"structured_outputs": {"json_object": True}}, (JSON_OBJECT,)),
        ({"structured_outputs": {"json_object": False, "disable_fallback": True}}, ()),
        # several fields: all apply, duplicates (same kind and source) once
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
                "guided_json": SCHEMA,
                "guided_regex": "x",
            },
            (json_schema_spec(SCHEMA, "n"), ConstraintSpec("regex", "x")),
        ),
    ],
)
def test_request_constraints(fields: dict[str, Any], expected: tuple[ConstraintSpec, ...]) -> None:
    got = request_constraints({**BASE, **fields})
    assert got == expected
    assert [s.name for s in got] == [s.name for s in expected]


def test_schema_key_order_is_kept() -> None:
    (spec,) = request_constraints({"guided_json": SCHEMA})
    assert spec.source == '{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}}'


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": "json"}, "response_format", "response_format must be an object"),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type",
            "response_format.type 'xml' is not supported (text, json_object, json_schema)",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "response_format.json_schema must be an object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
            "response_format.json_schema.name",
            "response_format.json_schema.name must be a string",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema must be an object",
        ),
        (
            {"guided_json": "{nope"},
            "guided_json",
            ("guided_json is a string but not valid JSON: "
            "unexpected character, expected a string key at char 1"),
        ),
        (
            {"guided_json": 3},
            "guided_json",
            "guided_json must be a JSON schema (an object, or its JSON text)",
        ),
        (
            {"guided_json": "[1]"},
            "guided_json",
            "guided_json must be a JSON schema (an object, or its JSON text)",
        ),
        ({"guided_regex": 5}, "guided_regex", "guided_regex must be a string"),
        ({"guided_grammar": "  "}, "guided_grammar", "guided_grammar must not be empty"),
        ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a non-empty list of strings"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list of strings"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "guided_choice must be a non-empty list of strings"),
        ({"structured_outputs": ["json"]}, "structured_outputs", "structured_outputs must be an object"),
        (
            {"structured_outputs": {"regex": ["x"]}},
            "structured_outputs.regex",
            "structured_outputs.regex must be a string",
        ),
        (
            {"structured_outputs": {"choice": [None]}},
            "structured_outputs.choice",
            "structured_outputs.choice must be a non-empty list of strings",
        ),
    ],
)
def test_malformed_fields(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        request_constraints({**BASE, **fields})
    assert (caught.value.param, caught.value.message) == (param, message)


def test_strip_guided_fields() -> None:
    body = {
        **BASE,
        "response_format": {"type": "json_object"},
        "guided_json": SCHEMA,
        "guided_regex": "x",
        "guided_grammar": LARK,
        "guided_choice": ["a"],
        "guided_decoding_backend": "xgrammar",
        "guided_whitespace_pattern": " ",
        "structured_outputs": {"regex": "x"},
    }
    stripped = strip_guided_fields(body)
    assert stripped == {**BASE, "response_format": {"type": "json_object"}}
    assert "guided_json" in body  # the input is untouched
    assert strip_guided_fields(BASE) == BASE and strip_guided_fields(BASE) is not BASE
    assert set(VLLM_ONLY_FIELDS) == set(body) - set(stripped) - {"response_format"}


@pytest.mark.parametrize(
    ("text", "kind"), [(LARK, "lark"), (GBNF, "gbnf"), ("root::=x", "gbnf"), ("?start: a", "lark")]
)
def test_grammar_kind(text: str, kind: str) -> None:
    assert grammar_kind(text) == kind


N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, ()),
        ({"text": {"verbosity": "low"}}, ()),
        ({"text": {"format": {"type": "text"}}}, ()),
        ({"text": {"format": {"type": "json_object"}}}, (JSON_OBJECT,)),
        ({"text": {"format": {"type": "json_schema", "name": "n", "schema": N_SCHEMA, "strict": True}}},
         (json_schema_spec(N_SCHEMA, "n"),)),
        ({"response_format": {"type": "json_object"}}, ()),  # Chat Completions' field: not this API's
    ],
)
def test_responses_constraints(body: dict[str, Any], expected: tuple[ConstraintSpec, ...]) -> None:
    assert responses_constraints(body) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "json"}, "text"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": {"format": {"type": "regex"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": 3, "schema": N_SCHEMA}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": "{}"}}}, "text.format.schema"),
    ],
)
def test_responses_constraints_malformed(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        responses_constraints(body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, ()),
        ({"output_config": {"effort": "low"}}, ()),  # other settings of output_config are no constraint
        ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, (json_schema_spec(SCHEMA),)),
        ({"output_format": {"type": "json_schema", "schema": SCHEMA}}, (json_schema_spec(SCHEMA),)),  # the beta's
        ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
          "output_format": {"type": "json_schema", "schema": SCHEMA}}, (json_schema_spec(SCHEMA),)),
        ({"output_config": {"format": None}, "output_format": None}, ()),
    ],
)
def test_anthropic_constraints(body: dict[str, Any], expected: tuple[ConstraintSpec, ...]) -> None:
    assert anthropic_constraints(body) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"output_config": "json"}, "output_config"),
        ({"output_config": {"format": "json"}}, "output_config.format"),
        ({"output_config": {"format": {"type": "regex", "schema": SCHEMA}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"output_format": {"type": "json_schema", "schema": "{}"}}, "output_format.schema"),
    ],
)
def test_anthropic_constraints_malformed(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        anthropic_constraints(body)
    assert caught.value.param == param
