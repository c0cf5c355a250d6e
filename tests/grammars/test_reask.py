"""The re-ask instruction."""

from __future__ import annotations

from grammars.reask import MAX_CONSTRAINT_CHARS, reask_instruction, restate
from grammars.spec import JSON_OBJECT, ConstraintSpec, Violation, choice_spec, json_schema_spec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_json_schema() -> None:
    text = reask_instruction(Violation("at a: '1' is not of type 'integer'"), json_schema_spec(SCHEMA))
    assert text == (
        "Your previous answer did not conform to the required output format.\n"
        "Error: at a: '1' is not of type 'integer'\n"
        "Answer again. Reply with only a JSON document (no prose, no code fences) that validates against "
        'this JSON Schema:\n{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    )


def test_other_kinds() -> None:
    assert restate(JSON_OBJECT) == "Reply with a single JSON object and nothing else."
    assert restate(choice_spec(["yes", 'say "no"'])) == (
        'Reply with exactly one of these options and nothing else: "yes", "say \\"no\\""'
    )
    assert restate(ConstraintSpec("regex", "[0-9]+")) == (
        "Reply with only text that fully matches this regular expression: [0-9]+"
    )
    assert restate(ConstraintSpec("lark", '\nstart: "x"\n')) == (
        'Reply with only text that this Lark grammar accepts:\nstart: "x"'
    )
    assert restate(ConstraintSpec("gbnf", 'root ::= "x"')) == (
        'Reply with only text that this GBNF grammar accepts:\nroot ::= "x"'
    )


def test_huge_constraints_and_errors_are_truncated() -> None:
    big = json_schema_spec(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    )
    text = reask_instruction(Violation("x" * 5000), big)
    assert len(text) < 1000 + MAX_CONSTRAINT_CHARS + 300
    assert "characters in all]" in text
    assert "Error: " + "x" * 960 + " ... [truncated, 5000 characters in all]" in text
