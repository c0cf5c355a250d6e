"""Incremental checks: the first chunk after which the output can no longer be valid is flagged, and
only that one; whitespace, multibyte text and key order are handled."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grammars.compile import Violation, compile_constraint
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec, json_schema_spec
from tests.grammars.samples import (
    BAD_AGE,
    COMPACT,
    EXPONENTIAL,
    PRETTY,
    USER_SCHEMA,
    chunks,
    exponential_answer,
)

SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}
USER = json_schema_spec(USER_SCHEMA)
DATE = ConstraintSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
ARITH = ConstraintSpec("lark", 'start: expr\nexpr: NUM | expr "+" expr | "(" expr ")"\nNUM: /[0-9]+/')
LIST = ConstraintSpec("gbnf", 'root ::= item+\nitem ::= "- " [a-z]+ "\\n"')


def feed_all(spec: ConstraintSpec, parts: list[str], *, native: bool) -> tuple[int | None, Violation | None]:
    """Index of the first chunk `feed` refused (None if none) and the final verdict."""
    checker = compile_constraint(spec).checker(native=native)
    first_bad = None
    for index, part in enumerate(parts):
        if not checker.feed(part) and first_bad is None:
            first_bad = index
    verdict = checker.finish()
    assert checker.violation == verdict
    return first_bad, verdict


@pytest.mark.parametrize(
    ("spec", "parts", "native", "bad_chunk", "verdict"),
    [
        # JSON schema, native: the schema grammar cuts the stream at the chunk with the bad value
        (USER, chunks(COMPACT, 7), True, None, None),
        (
            USER,
            chunks(BAD_AGE, 7),
            True,
            10,
            Violation("at char 71: unexpected '\"'; expected one of: '\\t'-'\\n', '\\r', ' ', '0'-'9'", 71),
        ),
        # ... not native: syntax only while streaming, the schema verdict at the end
        (USER, chunks(BAD_AGE, 7), False, None, Violation("at age: '36' is not of type 'integer'")),
        (USER, chunks(PRETTY, 5), True, None, None),
        (
            USER,
            chunks(COMPACT.replace('"age":36', '"age":36]'), 7),
            False,
            10,
            Violation(
                "at char 73: unexpected ']'; expected one of: '\\t'-'\\n', '\\r', ' ', ',', '.', '0'-'9', "
                "'E', 'e', '}'",
                73,
            ),
        ),
        # key order: a valid document with keys in another order than the schema's
        (json_schema_spec(SMALL), ['{"b": "x", ', '"a": 1}'], False, None, None),
        (
            json_schema_spec(SMALL),
            ['{"b": "x", ', '"a": 1}'],
            True,
            0,
            Violation("at char 2: unexpected 'b'; expected 'a'", 2),
        ),
        # surrounding whitespace, in its own chunks or glued to the document
        (json_schema_spec(SMALL), ["\n ", ' \t{"a"', ": 1}  ", "\n", ""], True, None, None),
        (
            json_schema_spec(SMALL),
            ["\n ", ' {"a"', ": 1}  ", "\n", "x"],
            True,
            4,
            Violation(
                "at char 14: unexpected 'x' after the end of the JSON document; expected end of output", 14
            ),
        ),
        (
            json_schema_spec(SMALL),
            ['{"a": 1} x'],
            False,
            0,
            Violation(
                "at char 9: unexpected 'x' after the end of the JSON document; expected end of output", 9
            ),
        ),
        (
            json_schema_spec({"type": "integer"}),
            ["12", " ", "3"],
            True,
            2,
            Violation(
                "at char 3: unexpected '3' after the end of the JSON document; expected end of output", 3
            ),
        ),
        (json_schema_spec({"type": "integer"}), ["12", "3 \n"], True, None, None),
        # multibyte text split across chunks (chunks are str, so a character is never split)
        (json_schema_spec(SMALL), ['{"a": 1, "b": "Zo', "\u00eb\u00e9\U0001f600", '"}'], True, None, None),
        (
            json_schema_spec(SMALL),
            ['{"a": 1, "b": "\u00e9', '\u00e9"', "x"],
            True,
            2,
            Violation("at char 18: unexpected 'x'; expected one of: '\\t'-'\\n', '\\r', ' ', ',', '}'", 18),
        ),
        # unicode escapes and exponents are JSON like any other
        (json_schema_spec(SMALL), ['{"a": 1, "b": "\\u00', 'e9"}'], True, None, None),
        (json_schema_spec({"type": "number"}), ["1e", "5"], True, None, None),
        # json_object
        (JSON_OBJECT, ['{"z": 1, ', '"a": [1, 2]}'], False, None, None),
        (JSON_OBJECT, ["[", "1]"], True, 0, Violation("at char 0: unexpected '['; expected '{'", 0)),
        (
            JSON_OBJECT,
            ['{"a": ', "1"],
            False,
            None,
            Violation("not valid JSON: unexpected end of data at char 7", 7),
        ),
        # regex
        (DATE, ["20", "24-0", "1-02"], False, None, None),
        # "2024-1" could still become "2024-10-..."; the chunk with the "-" is the one that breaks it
        (DATE, ["20", "24-1", "-02"], False, 2, Violation("at char 6: unexpected '-'; expected '0'-'9'", 6)),
        (DATE, ["2024", "-01"], False, None, Violation("at char 7: output ended too early; expected '-'", 7)),
        (
            DATE,
            ["2024-01-02", "\n"],
            False,
            1,
            Violation("at char 10: unexpected '\\n'; expected end of output", 10),
        ),
        # choice
        (choice_spec(["yes", "no"]), ["y", "e", "s"], False, None, None),
        (
            choice_spec(["yes", "no"]),
            ["y", "o"],
            False,
            1,
            Violation("at char 1: unexpected 'o'; expected 'e'", 1),
        ),
        (choice_spec(["\u00e9t\u00e9", "hiver"]), ["\u00e9", "t\u00e9"], False, None, None),
        # lark
        (ARITH, ["(1+", "2)+3"], False, None, None),
        (
            ARITH,
            ["(1+", "2))"],
            False,
            1,
            Violation("at char 5: unexpected ')'; expected one of: '+', end of output", 5),
        ),
        (
            ARITH,
            ["(1+"],
            False,
            None,
            Violation("at char 3: output ended too early; expected one of: '(', '0'-'9'", 3),
        ),
        # gbnf
        (LIST, ["- a\n", "- bc\n"], False, None, None),
        (LIST, ["- a\n", "- B\n"], False, 1, Violation("at char 6: unexpected 'B'; expected 'a'-'z'", 6)),
    ],
)
def test_first_bad_chunk(
    spec: ConstraintSpec, parts: list[str], native: bool, bad_chunk: int | None, verdict: Violation | None
) -> None:
    assert feed_all(spec, parts, native=native) == (bad_chunk, verdict)


def test_feed_keeps_failing_and_finish_is_stable() -> None:
    checker = compile_constraint(DATE).checker(native=True)
    assert checker.feed("x") is False
    assert checker.feed("2024-01-02") is False
    first = checker.finish()
    assert first == Violation("at char 0: unexpected 'x'; expected '0'-'9'", 0)
    assert checker.finish() == first


def test_checkers_are_independent() -> None:
    constraint = compile_constraint(DATE)
    one, two = constraint.checker(native=False), constraint.checker(native=False)
    assert one.feed("2024-") and not two.feed("x")
    assert one.feed("01-02") and one.finish() is None


def test_finish_gives_the_full_schema_verdict_even_when_native() -> None:
    # uniqueItems is beyond llguidance (a warning), jsonschema catches it at the end.
    spec = json_schema_spec({"type": "array", "uniqueItems": True})
    first_bad, verdict = feed_all(spec, ["[1, ", "1]"], native=True)
    assert (first_bad, verdict) == (None, Violation("at <root>: [1, 1] has non-unique elements"))


def test_formats_never_cut_a_stream() -> None:
    # llguidance's email format is stricter than jsonschema's: formats are left to the verdict.
    spec = json_schema_spec({"type": "object", "properties": {"e": {"type": "string", "format": "email"}}})
    assert feed_all(spec, ['{"e": "a@b"}'], native=True) == (None, None)
    assert feed_all(spec, ['{"e": "ab"}'], native=True) == (None, Violation("at e: 'ab' is not a 'email'"))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_chunking_flags_the_chunk_holding_the_first_bad_character(data: st.DataObject) -> None:
    text = data.draw(st.sampled_from([COMPACT, BAD_AGE, PRETTY, COMPACT[:200] + "x" + COMPACT[200:]]))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=40)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = compile_constraint(USER).checker(native=True)
    whole.feed(text)
    bad_at = whole.violation.offset if whole.violation else None
    first_bad, verdict = feed_all(USER, parts, native=True)
    if bad_at is None:
        assert first_bad is None
    else:
        ends = [*cuts, len(text)]
        assert first_bad == next(i for i, end in enumerate(ends) if bad_at < end)
        assert verdict == whole.violation


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="0123456789-x\u00e9 ", max_size=14), size=st.integers(1, 5))
def test_streaming_and_complete_agree_for_regex(text: str, size: int) -> None:
    constraint = compile_constraint(DATE)
    checker = constraint.checker(native=False)
    for part in chunks(text, size):
        checker.feed(part)
    assert checker.finish() == constraint.validate(text)


def test_json_syntax_check_follows_json() -> None:
    # Deep nesting and big numbers stream fine through the any-JSON grammar.
    deep = "[" * 300 + "]" * 300
    assert feed_all(json_schema_spec({}), chunks(deep, 16), native=False) == (None, None)
    big = json.dumps({"n": 10**30, "f": -1.5e-300})
    assert feed_all(JSON_OBJECT, chunks(big, 3), native=False) == (None, None)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    value=st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=5),
    indent=st.sampled_from([None, 0, 2, "\t"]),
    ascii_only=st.booleans(),
    cuts=st.lists(st.integers(1, 400), max_size=8),
    pad=st.sampled_from(["", " ", "\n", " \r\n\t"]),
)
def test_json_syntax_stream_never_cuts_valid_json(
    value: dict[str, object], indent: int | str | None, ascii_only: bool, cuts: list[int], pad: str
) -> None:
    text = pad + json.dumps(value, indent=indent, ensure_ascii=ascii_only) + pad
    edges = sorted({c for c in cuts if c < len(text)})
    parts = [text[a:b] for a, b in zip([0, *edges], [*edges, len(text)], strict=True)]
    constraint = compile_constraint(JSON_OBJECT)
    assert feed_all(JSON_OBJECT, parts, native=False) == (None, None)
    assert constraint.validate(text) is None


@pytest.mark.parametrize(
    ("schema", "parts", "verdict"),
    [
        # the schema grammar wants the literal bytes; JSON may escape them: no cut, jsonschema decides
        ({"enum": ["caf\u00e9"]}, ['"caf', '\\u00e9"'], None),
        ({"const": "a/b"}, ['"a\\/b"'], None),
        (
            {"type": "object", "properties": {"\u00e9": {"type": "integer"}}, "additionalProperties": False},
            ['{"\\u00e9": 1}'],
            None,
        ),
        (
            {"enum": ["caf\u00e9"]},
            ['"caf\\u00e8"'],
            Violation("at <root>: 'caf\u00e8' is not one of ['caf\u00e9']"),
        ),
    ],
)
def test_native_check_tolerates_escaped_literals(
    schema: dict[str, object], parts: list[str], verdict: Violation | None
) -> None:
    assert feed_all(json_schema_spec(schema), parts, native=True) == (None, verdict)


def test_native_check_still_cuts_after_degrading() -> None:
    spec = json_schema_spec({"enum": ["caf\u00e9"]})
    assert feed_all(spec, ['"caf\\u00e9"', "x"], native=True) == (
        1,
        Violation("at char 11: unexpected 'x'; expected end of output", 11),
    )


@pytest.mark.parametrize(
    "parts",
    [
        ['{"url": "http:\\/\\/example.com\\/a"}'],
        ['{"url": "http:\\', "/", '\\/x"}'],  # escapes split across chunks
        ['{"a": "\\\\', '/"}'],  # an escaped backslash, then a plain slash
        ['{"del": "\x7f"}'],  # raw DEL is valid JSON in a string
    ],
)
def test_json_spellings_llguidance_lacks_do_not_cut(parts: list[str]) -> None:
    assert feed_all(JSON_OBJECT, parts, native=False) == (None, None)


def test_escaped_slash_outside_a_string_still_fails() -> None:
    first_bad, verdict = feed_all(JSON_OBJECT, ['{"a": 1, \\', "/}"], native=False)
    assert first_bad == 0
    assert verdict == Violation(
        "at char 9: unexpected '\\\\'; expected one of: '\\t'-'\\n', '\\r', ' ', '\"'", 9
    )


def test_escaped_property_name_does_not_break_key_order() -> None:
    spec = json_schema_spec({"type": "object", "properties": {"\u00e9": {}, "b": {}}})
    assert feed_all(spec, ['{"\\u00e9": 1, "b": 2}'], native=True) == (None, None)


def test_trailing_garbage_is_quoted_as_written() -> None:
    assert feed_all(JSON_OBJECT, ["{} \x7f"], native=False) == (
        0,
        Violation(
            "at char 3: unexpected '\\x7f' after the end of the JSON document; expected end of output", 3
        ),
    )


SECRET = "zq-secret-4417"


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (USER, f'{{"name": "{SECRET}", "age": "{SECRET}"}}'),  # a schema rule broken by a value
        (json_schema_spec({"type": "object", "additionalProperties": False}), f'{{"{SECRET}": 1}}'),  # by a key
        (DATE, f"{SECRET}"),  # a regex refusing a character
        (USER, f'{{"name": "a", "age": 3}} {SECRET}'),  # text after the JSON document
    ],
)
def test_a_violation_has_a_summary_without_the_output(spec: ConstraintSpec, text: str) -> None:
    """`message` quotes the output (for the agent and the re-ask); `redacted`, which telemetry and the
    ledger carry, never does."""
    for violation in (compile_constraint(spec).validate(text), feed_all(spec, [text], native=False)[1]):
        assert violation is not None
        assert "secret" not in violation.redacted and "z" not in violation.redacted.replace("size", "")
        assert violation.redacted


def test_a_summary_names_the_broken_schema_rules() -> None:
    spec = json_schema_spec({"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]})
    violation = compile_constraint(spec).validate('{"age": "x"}')
    assert violation is not None and violation.redacted == "breaks schema rule(s) properties/age/type"
    assert "'x'" in violation.message


BOUNDED = {"type": "number", "minimum": 0, "maximum": 1}


def field(schema: dict[str, object]) -> ConstraintSpec:
    return json_schema_spec({"type": "object", "properties": {"x": schema, "y": {"type": "string"}},
                             "required": ["x"], "additionalProperties": False})


@pytest.mark.parametrize(
    ("schema", "parts", "verdict"),
    [
        # llguidance's bounded numbers have no exponent; jsonschema judges the value
        (BOUNDED, ['{"x": 1', "e-05}"], None),
        (BOUNDED, ['{"x": 5', "e-1}"], None),
        (BOUNDED, ['{"x": 1E-5, "y": "a"}'], None),
        (BOUNDED, ['{"x": 0.1e1}'], None),
        (BOUNDED, ['{"x": -0.0}'], None),
        ({"type": "number", "exclusiveMinimum": 0}, ['{"x": 5e-1}'], None),
        ({"type": "number", "minimum": 0}, ['{"x": -', "0}"], None),
        # integers are numbers with a zero fraction
        ({"type": "integer", "minimum": 1}, ['{"x": 4', ".0}"], None),
        ({"type": "integer"}, ['{"x": 4e2}'], None),
        ({"type": "integer", "maximum": 100}, ['{"x": 40.00}'], None),
        # const and enum numbers have one spelling in the grammar, many in JSON
        ({"const": 1}, ['{"x": 1.0}'], None),
        ({"const": 100}, ['{"x": 1e2}'], None),
        ({"enum": [1.0, 2]}, ['{"x": 2.0}'], None),
        # not cut mid-number (a later exponent could still make it valid), but the verdict refuses it
        (BOUNDED, ['{"x": 2', "}"], Violation("at x: 2 is greater than the maximum of 1")),
        ({"type": "integer"}, ['{"x": 1.5}'], Violation("at x: 1.5 is not of type 'integer'")),
        ({"enum": [1.0, 2]}, ['{"x": 3.0}'], Violation("at x: 3.0 is not one of [1.0, 2]")),
    ],
)
def test_native_check_tolerates_respelled_numbers(
    schema: dict[str, object], parts: list[str], verdict: Violation | None
) -> None:
    assert feed_all(field(schema), parts, native=True) == (None, verdict)


@pytest.mark.parametrize(
    ("schema", "parts", "bad_chunk", "offset"),
    [
        (BOUNDED, ['{"x": ', '"0.5"}'], 1, 6),  # a string where a number belongs
        ({"type": "integer"}, ['{"x": 4 ', "5}"], 1, 8),  # a second number after a complete one
        ({"type": "integer"}, ['{"x": tru', "e}"], 0, 6),  # a literal where a number belongs
        ({"type": "number"}, ['{"x": 1, "y": 2}'], 0, 14),  # a number where a string belongs
        ({"type": "number"}, ['{"x": 1, "y1', '": "a"}'], 0, 11),  # a digit in a property name
        ({"enum": [1]}, ['{"x": 1', ', "y": "a"}', "x"], 2, 18),  # after the document
    ],
)
def test_native_check_still_cuts_what_no_number_spelling_saves(
    schema: dict[str, object], parts: list[str], bad_chunk: int, offset: int
) -> None:
    first_bad, verdict = feed_all(field(schema), parts, native=True)
    assert first_bad == bad_chunk
    assert verdict is not None and verdict.offset == offset


def test_a_digit_in_a_string_literal_still_cuts() -> None:
    spec = json_schema_spec({"type": "object", "properties": {"x": {"enum": ["a1"]}}})
    first_bad, verdict = feed_all(spec, ['{"x": "a', '2e"}'], native=True)
    assert (first_bad, verdict) == (1, Violation("at char 8: unexpected '2'; expected '1'", 8))


def test_a_schema_pattern_that_spends_the_native_lexer_degrades_to_syntax_not_an_error() -> None:
    """A `pattern` whose automaton is exponential runs the schema grammar's lexer out of states on a long
    string: the stream was ended as the grammar's 400 though RE2, which gives the final verdict, accepts
    it. The check now goes on with JSON syntax, and still cuts what syntax refuses."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": f"^{EXPONENTIAL}$"}}}
    spec = json_schema_spec(schema)
    doc = json.dumps({"s": exponential_answer(30_000)})
    assert feed_all(spec, chunks(doc, 100), native=True) == (None, None)
    bad = doc[:-1] + "]"
    assert feed_all(spec, chunks(bad, 100), native=True)[0] == len(chunks(bad, 100)) - 1
