"""The jsonschema verdict: parsing, messages, formats, refs."""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest

from gateway.errors import InvalidGrammar
from grammars.schema import build_check, format_checker, parse_json
from grammars.spec import Violation


@pytest.mark.parametrize(
    ("fmt", "value", "ok"),
    [
        ("date-time", "2024-05-01T10:00:00Z", True),
        ("date-time", "2024-05-01t10:00:00.123456+02:00", True),
        ("date-time", "2016-12-31T23:59:60Z", True),  # leap second
        ("date-time", "2024-05-01 10:00:00Z", False),
        ("date-time", "2024-05-01T10:00:00", False),  # RFC 3339 needs an offset
        ("date-time", "2024-02-30T10:00:00Z", False),
        ("date-time", "2024-05-01T24:00:00Z", False),
        ("date-time", "2024-05-01T10:00:00+25:00", False),
        ("date-time", 5, True),  # formats apply to strings only
        ("time", "10:00:00Z", True),
        ("time", "10:00:00.5-03:30", True),
        ("time", "10:00", False),
        ("date", "2024-02-29", True),
        ("date", "2023-02-29", False),
        ("email", "a@b", True),
        ("email", "ab", False),
        ("uuid", "6f1c2a1e-3b7d-4c9a-9e8f-1a2b3c4d5e6f", True),
        ("ipv4", "256.1.1.1", False),
    ],
)
def test_formats(fmt: str, value: Any, ok: bool) -> None:
    assert format_checker().conforms(value, fmt) is ok


@pytest.mark.parametrize(
    ("text", "value", "violation"),
    [
        (' {"a": [1, 2.5e3]} \n', {"a": [1, 2500.0]}, None),
        ('"\\u00e9"', "\u00e9", None),
        ('"\\ud800"', None, Violation("not valid JSON: no low surrogate in string at char 1", 1)),
        (
            "Infinity",
            None,
            Violation("not valid JSON: unexpected character, expected a JSON value at char 0", 0),
        ),
    ],
)
def test_parse_json(text: str, value: Any, violation: Violation | None) -> None:
    assert parse_json(text) == (value, violation)


def test_messages_truncate_huge_values() -> None:
    check = build_check({"type": "array", "maxItems": 1})
    got = check.check_value(list(range(1000)))
    assert got is not None
    assert got.message.startswith("at <root>: [0, 1, 2,") and got.message.endswith("...")
    assert len(got.message) == len("at <root>: ") + 240


def test_nested_ids_let_relative_refs_through() -> None:
    schema = {
        "$id": "https://example.com/root.json",
        "$defs": {"item": {"$id": "item.json", "type": "integer"}},
        "items": {"$ref": "item.json"},
        "type": "array",
    }
    assert build_check(schema).check_value([1, "x"]) == Violation("at 1: 'x' is not of type 'integer'")


def test_unresolvable_ref_found_at_validation_time() -> None:
    schema = {
        "$defs": {"x": {"$id": "https://example.com/x", "type": "string"}},
        "properties": {"y": {"$ref": "other.json"}},
    }
    check = build_check(schema)  # let through: relative refs next to nested $ids
    with pytest.raises(InvalidGrammar, match="json_schema: cannot resolve \\$ref"):
        check.check_value({"y": 1})


def test_ref_like_data_is_not_a_ref() -> None:
    build_check({"enum": [{"$ref": "nowhere"}], "const": {"$ref": "x"}})


def test_remote_refs_are_never_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[object] = []

    def no_network(*args: object, **_kwargs: object) -> None:
        opened.append(args)  # recorded: the retriever would swallow an exception raised here
        raise OSError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(InvalidGrammar, match=re.escape("cannot resolve $ref 'https://example.com/s.json'")):
        build_check({"$ref": "https://example.com/s.json"})
    # let through at compile time (relative ref next to nested $ids), refused at validation time
    check = build_check(
        {
            "$id": "https://example.com/root",
            "$defs": {"a": {"$id": "a.json"}},
            "properties": {"b": {"$ref": "b.json"}},
        }
    )
    with pytest.raises(InvalidGrammar, match="cannot resolve"):
        check.check_value({"b": 1})
    assert opened == []


def test_metaschema_refs_resolve_offline() -> None:
    check = build_check({"$ref": "https://json-schema.org/draft/2020-12/schema"})
    assert check.check_value({"type": "string"}) is None
    assert check.check_value({"type": 5}) is not None


# -- patterns run in bounded time (grammars/regexes.py) -------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "document"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}},
         {"a": "a" * 40 + "!"}),
        ({"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}, "additionalProperties": False},
         {"a" * 40 + "!": 1}),
        ({"type": "array", "items": {"type": "string", "pattern": "^(a|aa)+$"}}, ["a" * 60 + "!"] * 200),
    ],
)
def test_catastrophic_patterns_are_checked_in_linear_time(schema: dict[str, Any], document: Any) -> None:
    """Python's `re` would take hours over these (seconds at 28 characters, doubling with each)."""
    started = time.perf_counter()
    violation = build_check(schema).check_value(document)
    assert violation is not None
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("schema", "document", "message"),
    [
        ({"type": "string", "pattern": "^[0-9]{5}$"}, "ABCDE", "at <root>: 'ABCDE' does not match '^[0-9]{5}$'"),
        ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False},
         {"x_a": 1, "b": 2, "c": 3}, "at <root>: 'b', 'c' do not match any of the regexes: '^x_'"),
        ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}, {"x_a": "no"},
         "at x_a: 'no' is not of type 'integer'"),
        ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, {"a": 1, "b": 2},
         "at <root>: Additional properties are not allowed ('b' was unexpected)"),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1, "b": "x"},
         "at b: 'x' is not of type 'integer'"),
    ],
)
def test_pattern_keywords_keep_jsonschemas_verdicts(schema: dict[str, Any], document: Any, message: str) -> None:
    violation = build_check(schema).check_value(document)
    assert violation is not None and violation.message == message


@pytest.mark.parametrize(
    ("schema", "document"),
    [({"type": "string", "pattern": "^[A-Z][a-z]{3}$"}, "Abcd"),
     ({"patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False}, {"x_a": 1})],
)
def test_matching_documents_pass(schema: dict[str, Any], document: Any) -> None:
    assert build_check(schema).check_value(document) is None


@pytest.mark.parametrize(
    "schema",
    [{"type": "string", "pattern": "(?<name>x)(?P=name"}, {"patternProperties": {"(unclosed": {}}},
     {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"a": {"pattern": "[z-a]"}}},
     # what RE2 cannot run: refused at request time, never run on a backtracking engine
     {"type": "string", "pattern": "^(?=.*[A-Z]).{4,}$"}, {"patternProperties": {"(a)\\1": {}}},
     {"type": "string", "pattern": "(((a{50}){50}){50}){50}"}],
)
def test_a_pattern_that_cannot_be_checked_in_linear_time_is_an_invalid_grammar(schema: dict[str, Any]) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidGrammar) as info:
        build_check(schema)
    assert "pattern" in info.value.message or "regex" in info.value.message
    assert time.perf_counter() - started < 0.5


def test_unevaluated_properties_with_pattern_properties_is_refused() -> None:
    """jsonschema matches those with Python's backtracking `re` in its own helper."""
    with pytest.raises(InvalidGrammar) as info:
        build_check({"patternProperties": {"^(a+)+$": {}}, "unevaluatedProperties": False})
    assert "unevaluatedProperties" in info.value.message
    assert build_check({"properties": {"a": {}}, "unevaluatedProperties": False}).check_value({"b": 1}) is not None


@pytest.mark.parametrize(
    ("multiple", "document", "ok"),
    [
        (0.1, 0.3, True),  # 0.3 / 0.1 is 2.9999999999999996 in binary floats
        (0.1, 0.7, True),
        (0.01, 19.99, True),
        (0.1, 0.35, False),
        (0.1, 3, True),
        (0.5, 2.5, True),
        (0.5, 2.25, False),
        (3, 9, True),
        (3, 10, False),
        (3, 9.0, True),
        (2, 1e300, True),  # 10**300, exactly
        (3, 1e300, False),
        (0.1, 1e308, True),  # jsonschema's float quotient overflows here
        (1e-300, 3e-300, True),
        (7, 2**80 * 7, True),  # integers of any size
        (7, 2**80 * 7 + 1, False),
        (0.1, True, True),  # a boolean is not a number: multipleOf does not apply
        (0.1, float("inf"), False),  # JSON has no infinity; a caller's own value is a multiple of nothing
    ],
)
def test_multiple_of_is_decided_on_decimals(multiple: float, document: Any, ok: bool) -> None:
    violation = build_check({"multipleOf": multiple}).check_value(document)
    if ok:
        assert violation is None
    else:
        assert violation == Violation(f"at <root>: {document!r} is not a multiple of {multiple}")


def test_multiple_of_applies_in_every_draft() -> None:
    draft4 = build_check({"$schema": "http://json-schema.org/draft-04/schema#", "multipleOf": 0.1})
    assert draft4.check("0.3") is None
    assert draft4.check("0.35") == Violation("at <root>: 0.35 is not a multiple of 0.1")


@pytest.mark.parametrize(("schema", "refused"), [
    ({"$ref": "#"}, True),  # every answer failed "nested too deeply", after paid re-asks
    ({"anyOf": [{"type": "object"}, {"$ref": "#"}]}, True),
    ({"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#"}}}, True),
    ({"if": {"type": "string"}, "then": {"$ref": "#"}}, True),  # gated by type: strings never finish
    ({"anyOf": [{"type": "null"}, {"type": "string", "allOf": [{"$ref": "#"}]}]}, True),
    ({"type": "object", "properties": {"child": {"$ref": "#"}}}, False),  # descends: a tree
    ({"$defs": {"n": {"type": ["null", "object"], "properties": {"next": {"$ref": "#/$defs/n"}}}},
      "$ref": "#/$defs/n"}, False),  # a linked list
])
def test_a_schema_that_refers_to_itself_in_place_is_refused(schema: dict[str, Any], refused: bool) -> None:
    if refused:
        with pytest.raises(InvalidGrammar, match="without descending into the document"):
            build_check(schema)
    else:
        check = build_check(schema)
        assert check.check_value({"child": {"child": {}}} if "properties" in schema else {"next": None}) is None


def nested_id_chain(levels: int) -> dict[str, Any]:
    """`levels` of `anyOf` over two refs, resolved against a nested `$id` (which the static bound,
    `grammars.fanout`, resolves against the root instead, counting a fan-out of a few)."""
    inner: dict[str, Any] = {"$defs": {f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}] * 2} for i in range(levels)}}
    inner["$defs"][f"a{levels}"] = {"type": "string", "minLength": 99}
    inner["$ref"], inner["$id"] = "#/$defs/a0", "urn:inner"
    decoys = {f"a{i}": {"type": "string"} for i in range(levels + 1)}
    return {"$defs": {**decoys, "inner": inner}, "$ref": "urn:inner"}


def test_a_check_that_applies_too_many_keywords_is_cut_as_the_schema_s_fault() -> None:
    """16 levels took 5.4 s to check one small value; the keyword budget (`WORK_BASE` plus `WORK_PER_BYTE`
    a byte) ends it in a fraction of that, as the schema's fault (InvalidGrammar), not the answer's."""
    check = build_check(nested_id_chain(16))
    started = time.perf_counter()
    with pytest.raises(InvalidGrammar, match="takes too long"):
        check.check('{"p": 5}')
    assert time.perf_counter() - started < 1
    assert build_check(nested_id_chain(4)).check_value("x" * 99) is None  # 2 ** 4: fine


def test_a_ref_chain_too_deep_to_follow_is_refused_not_a_500() -> None:
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(1500)}
    defs["a1500"] = {"type": "string"}
    with pytest.raises(InvalidGrammar, match="nest too deeply"):
        build_check({"$defs": defs, "$ref": "#/$defs/a0"})
