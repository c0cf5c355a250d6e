"""Complete-output validation per constraint kind, compile errors, the cache."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from gateway.errors import InvalidGrammar, InvalidRequest
from grammars import compile as compile_mod
from grammars.compile import (
    Constraint,
    Violation,
    compile_async,
    compile_constraint,
)
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec, json_schema_spec
from tests.grammars.samples import (
    BAD_AGE,
    COMPACT,
    EXPONENTIAL,
    PRETTY,
    USER_SCHEMA,
    exponential_answer,
    user_with,
)

ZIP = {
    "type": "object",
    "properties": {
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
    },
}
SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


def v(message: str, offset: int | None = None) -> Violation:
    return Violation(message, offset)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # valid
        (COMPACT, None),
        (PRETTY, None),
        ("  \n" + COMPACT + "\n\t ", None),  # whitespace around the document
        (user_with(name="Caf\u00e9"), None),  # \u00e9 escape (json.dumps default)
        (user_with(score=1e5), None),
        (user_with(extra={"deep": [1, 2, {"x": None}]}), None),  # extra property (allowed by default)
        (json.dumps(dict(reversed(json.loads(COMPACT).items()))), None),  # other key order
        (user_with(nickname="zo"), None),
        # invalid, with exact messages
        (BAD_AGE, v("at age: '36' is not of type 'integer'")),
        (user_with(id=None), v("at <root>: 'id' is a required property")),
        (
            user_with(address={"street": "s", "city": "c", "zip": "ABCDE", "country": "US"}),
            v("at address/zip: 'ABCDE' does not match '^[0-9]{5}$'"),
        ),
        (
            user_with(email="nope", role="root", tags=["a"] * 6),
            v(
                "at email: 'nope' is not a 'email'; "
                "at role: 'root' is not one of ['admin', 'user', 'guest']; "
                "at tags: ['a', 'a', 'a', 'a', 'a', 'a'] is too long"
            ),
        ),
        (
            user_with(orders=[{"sku": "A", "qty": 0, "price": 1, "created_at": "2024-02-30T00:00:00Z"}]),
            v(
                "at orders/0/created_at: '2024-02-30T00:00:00Z' is not a 'date-time'; "
                "at orders/0/qty: 0 is less than the minimum of 1"
            ),
        ),
        (
            user_with(age=-1, id=None),
            v("at <root>: 'id' is a required property; at age: -1 is less than the minimum of 0"),
        ),
        ('{"id": 1', v("not valid JSON: unexpected end of data at char 8", 8)),
        ("```json\n{}\n```", v("not valid JSON: unexpected character, expected a JSON value at char 0", 0)),
        ('{"a": NaN}', v("not valid JSON: unexpected character, expected a JSON value at char 6", 6)),
        ("{} {}", v("not valid JSON: unexpected content after document at char 3", 3)),
        ("", v("not valid JSON: Input is a zero-length, empty document at char 0", 0)),
        ("[1]", v("at <root>: [1] is not of type 'object'")),
    ],
)
def test_json_schema_validate(text: str, expected: Violation | None) -> None:
    assert compile_constraint(json_schema_spec(USER_SCHEMA)).validate(text) == expected


def test_json_schema_errors_sorted_by_path_and_capped() -> None:
    schema = {"type": "array", "items": {"type": "integer"}}
    got = compile_constraint(json_schema_spec(schema)).validate(json.dumps(["x"] * 12))
    assert got == v(
        "at 0: 'x' is not of type 'integer'; at 1: 'x' is not of type 'integer'; "
        "at 2: 'x' is not of type 'integer'; at 3: 'x' is not of type 'integer'; "
        "at 4: 'x' is not of type 'integer'; and 7 more"
    )


def test_deep_nesting() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"child": {"$ref": "#/$defs/node"}, "v": {"type": "integer"}},
            }
        },
        "$ref": "#/$defs/node",
    }
    c = compile_constraint(json_schema_spec(tree))
    doc = '{"v":1}'
    for _ in range(60):
        doc = '{"v":1,"child":' + doc + "}"
    assert c.validate(doc) is None
    assert c.validate(doc.replace('{"v":1}', '{"v":"x"}')) == v(
        "at " + "/".join(["child"] * 60) + "/v: 'x' is not of type 'integer'"
    )
    too_deep = "[" * 5000 + "]" * 5000
    assert compile_constraint(JSON_OBJECT).validate(too_deep) == v(
        "not valid JSON: depth limit exceeded at char 1025", 1025
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{}", None),
        (' {"b": [1, {"c": "\\u00e9"}], "a": 1e5} ', None),
        ("[]", v("at <root>: [] is not of type 'object'")),
        ('"x"', v("at <root>: 'x' is not of type 'object'")),
        ("{", v("not valid JSON: unexpected end of data at char 1", 1)),
    ],
)
def test_json_object_validate(text: str, expected: Violation | None) -> None:
    assert compile_constraint(JSON_OBJECT).validate(text) == expected


@pytest.mark.parametrize(
    ("spec", "text", "expected"),
    [
        # regex: the whole output must match; anchors are allowed and change nothing
        (ConstraintSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), "2024-01-02", None),
        (ConstraintSpec("regex", r"^[a-z]+$"), "abc", None),
        (
            ConstraintSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
            "2024-1-02",
            v("at char 6: unexpected '-'; expected '0'-'9'", 6),
        ),
        (
            ConstraintSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
            "2024-01",
            v("at char 7: output ended too early; expected '-'", 7),
        ),
        (
            ConstraintSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
            "2024-01-023",
            v("at char 10: unexpected '3'; expected end of output", 10),
        ),
        (ConstraintSpec("regex", r"[0-9]+"), " 12", v("at char 0: unexpected ' '; expected '0'-'9'", 0)),
        (ConstraintSpec("regex", r"caf\u00e9|tea"), "café", None),
        (
            ConstraintSpec("regex", r"caf\u00e9|tea"),
            "cafe",
            v("at char 3: unexpected 'e'; expected non-ASCII characters", 3),
        ),
        (
            ConstraintSpec("regex", r"[a-z]+"),
            "ab\u00e9",
            v("at char 2: unexpected 'é'; expected one of: 'a'-'z', end of output", 2),
        ),
        (ConstraintSpec("regex", r"(?i)yes"), "YeS", None),
        # choice
        (choice_spec(["yes", "no"]), "yes", None),
        (choice_spec(["yes", "no"]), "maybe", v("at char 0: unexpected 'm'; expected one of: 'n', 'y'", 0)),
        (choice_spec(["yes", "no"]), "ye", v("at char 2: output ended too early; expected 's'", 2)),
        (choice_spec(["yes", "no"]), "yes\n", v("at char 3: unexpected '\\n'; expected end of output", 3)),
        (choice_spec(["a", "ab"]), "a", None),
        (choice_spec(["\u00e9t\u00e9", 'say "hi"']), 'say "hi"', None),
        (choice_spec(["\u00e9t\u00e9", 'say "hi"']), "\u00e9t\u00e9", None),
        # lark
        (ConstraintSpec("lark", 'start: "(" start ")" | "x"'), "((x))", None),
        (
            ConstraintSpec("lark", 'start: "(" start ")" | "x"'),
            "((x)",
            v("at char 4: output ended too early; expected ')'", 4),
        ),
        (
            ConstraintSpec("lark", 'start: "(" start ")" | "x"'),
            "(x))",
            v("at char 3: unexpected ')'; expected end of output", 3),
        ),
        (
            ConstraintSpec("lark", 'start: /[^"]+/'),
            'a"b',
            v("at char 1: unexpected '\"'; expected one of: any character except '\"', end of output", 1),
        ),
        # gbnf
        (ConstraintSpec("gbnf", 'root ::= "x" [0-9]+'), "x12", None),
        (
            ConstraintSpec("gbnf", 'root ::= "x" [0-9]+'),
            "xx",
            v("at char 1: unexpected 'x'; expected '0'-'9'", 1),
        ),
        (
            ConstraintSpec("gbnf", 'root ::= "x" [0-9]+'),
            "",
            v("at char 0: output ended too early; expected 'x'", 0),
        ),
    ],
)
def test_grammar_validate(spec: ConstraintSpec, text: str, expected: Violation | None) -> None:
    assert compile_constraint(spec).validate(text) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            ConstraintSpec("regex", "a(?=b)"),
            ('regex: at 1(8): invalid regex "a(?=b)" (in regex): regex parse '
            "error: a(?=b) error: look-around, including look-ahead and look-behind, is not supported"),
        ),
        (
            ConstraintSpec("regex", "(a)\\1"),
            ('regex: at 1(8): invalid regex "(a)\\\\1" (in regex): regex parse '
            "error: (a)\\1 error: backreferences are not supported"),
        ),
        (
            ConstraintSpec("regex", "["),
            ('regex: at 1(8): invalid regex "[" (in regex): regex parse error: '
            "[ error: unclosed character class"),
        ),
        (
            ConstraintSpec("regex", "[0-9]+\\"),
            (
                "regex: invalid regex '[0-9]+\\\\': it ends in an incomplete escape sequence (a lone "
                "trailing backslash; write \\\\ for a literal backslash)"
            ),
        ),
        (ConstraintSpec("lark", "start: foo"), 'lark: at 1(8): unknown name: "foo"'),
        (
            ConstraintSpec("gbnf", "root ::= x"),
            "gbnf: Failed to convert the grammar from GBNF to Lark: Rule 'x' not found",
        ),
        (ConstraintSpec("choice", "[]"), "choice: options must be a non-empty JSON array of strings"),
        (ConstraintSpec("choice", '["a", 1]'), "choice: options must be a non-empty JSON array of strings"),
        (
            ConstraintSpec("choice", "yes|no"),
            ("choice: options must be a JSON array of strings (not valid JSON: unexpected character, "
            "expected a JSON value at char 0)"),
        ),
        (
            ConstraintSpec("json_schema", '{"type": "foo"}'),
            "json_schema: invalid schema at type: 'foo' is not valid under any of the given schemas",
        ),
        (
            ConstraintSpec("json_schema", '{"properties": {"a": {"minimum": "1"}}}'),
            "json_schema: invalid schema at properties/a/minimum: '1' is not of type 'number'",
        ),
        (
            ConstraintSpec("json_schema", "[1]"),
            "json_schema: a schema must be a JSON object or boolean, not an array",
        ),
        (
            ConstraintSpec("json_schema", '{"$ref": "#/$defs/missing"}'),
            "json_schema: cannot resolve $ref '#/$defs/missing' inside the schema",
        ),
        (
            ConstraintSpec("json_schema", '{"$ref": "https://example.com/s.json"}'),
            "json_schema: cannot resolve $ref 'https://example.com/s.json' inside the schema",
        ),
        (
            ConstraintSpec("json_schema", "{bad"),
            ("json_schema: the schema is not valid JSON: "
            "unexpected character, expected a string key at char 1"),
        ),
    ],
)
def test_compile_errors(spec: ConstraintSpec, message: str) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        compile_constraint(spec)
    assert caught.value.message == message
    assert isinstance(caught.value, InvalidRequest) and caught.value.status == 400
    with pytest.raises(InvalidGrammar, match=re.escape(message)):
        compile_constraint(spec)  # the cached failure raises the same error


def test_schema_with_a_pattern_no_linear_engine_runs_is_refused() -> None:
    # Look-around needs a backtracking engine, and one agent's pattern must not stall the gateway on
    # another's answer (grammars/regexes.py): a 400 when the constraint compiles, not a verdict later.
    spec = json_schema_spec({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?!x)"}}})
    with pytest.raises(InvalidGrammar) as info:
        compile_constraint(spec)
    assert "cannot be checked in linear time" in info.value.message


def test_unsupported_keywords_are_warnings() -> None:
    c = compile_constraint(json_schema_spec({"type": "array", "uniqueItems": True}))
    assert c.warnings == ('Unimplemented keys: ["uniqueItems"]',)
    assert c.validate("[1, 1]") == v("at <root>: [1, 1] has non-unique elements")


def test_boolean_schemas() -> None:
    assert compile_constraint(json_schema_spec(True)).validate("[1]") is None
    assert compile_constraint(json_schema_spec(False)).validate("1") == v(
        "at <root>: False schema does not allow 1"
    )


def test_declared_draft_is_honoured() -> None:
    # Draft 7 tuple `items`; under 2020-12 this schema would be invalid.
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "array",
        "items": [{"type": "integer"}, {"type": "string"}],
    }
    c = compile_constraint(json_schema_spec(schema))
    assert c.validate('[1, "a"]') is None
    assert c.validate('["a", "a"]') == v("at 0: 'a' is not of type 'integer'")


def test_cache_hits_share_the_compiled_core() -> None:
    compile_mod.clear_cache()
    a = compile_constraint(json_schema_spec(SMALL, name="first"))
    b = compile_constraint(json_schema_spec(SMALL, name="second"))
    assert a._core is b._core
    assert (a.spec.name, b.spec.name) == ("first", "second")
    assert compile_constraint(ConstraintSpec("json_schema", json.dumps(SMALL, indent=1)))._core is not a._core


def test_cache_is_bounded() -> None:
    compile_mod.clear_cache()
    first = compile_constraint(ConstraintSpec("regex", "r0"))
    for i in range(1, compile_mod.CACHE_SIZE + 1):
        compile_constraint(ConstraintSpec("regex", f"r{i}"))
    assert compile_constraint(ConstraintSpec("regex", "r0"))._core is not first._core
    assert (
        compile_constraint(ConstraintSpec("regex", f"r{compile_mod.CACHE_SIZE}"))._core
        is compile_constraint(ConstraintSpec("regex", f"r{compile_mod.CACHE_SIZE}"))._core
    )


async def test_compile_async_hits_without_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    compile_mod.clear_cache()
    spec = json_schema_spec(SMALL)
    first = await compile_async(spec)  # miss: compiled in a worker thread
    assert isinstance(first, Constraint)

    def no_thread(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a cache hit must not leave the event loop")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    assert (await compile_async(spec))._core is first._core
    with pytest.raises(InvalidGrammar):
        compile_constraint(ConstraintSpec("regex", "("))
    with pytest.raises(InvalidGrammar, match="unclosed group"):
        await compile_async(ConstraintSpec("regex", "("))  # the cached failure, no thread either


def test_constraints_work_across_threads() -> None:
    compile_mod.clear_cache()
    box: list[Constraint] = []
    worker = threading.Thread(target=lambda: box.append(compile_constraint(json_schema_spec(SMALL))))
    worker.start()
    worker.join()
    checker = box[0].checker(native=True)
    assert checker.feed('{"a": 1, "b": "x"}') and checker.finish() is None


def check_a_long_answer(constraint: Constraint, *, streamed: bool) -> None:
    """Check an answer long enough to run the EXPONENTIAL regex's lexer out of states, whole or streamed."""
    answer = exponential_answer(30_000)
    if not streamed:
        constraint.validate(answer)
        return
    checker = constraint.checker(native=False)
    for start in range(0, len(answer), 100):
        checker.feed(answer[start:start + 100])


@pytest.mark.parametrize("streamed", [False, True])
def test_a_constraint_whose_lexer_ran_out_of_states_is_rebuilt_for_the_next_answer(streamed: bool) -> None:
    """Copies of a pristine matcher share its lexer: once one long answer spent its states, every later
    answer against that constraint was refused at char 0 until the cache evicted it. The compile after
    such a check builds a fresh matcher."""
    compile_mod.clear_cache()
    spec = ConstraintSpec("regex", EXPONENTIAL)
    spent = compile_constraint(spec)
    with pytest.raises(InvalidGrammar, match="too complex to check the answer with"):
        check_a_long_answer(spent, streamed=streamed)
    fresh = compile_constraint(spec)
    assert fresh._core is not spent._core
    assert fresh.validate(exponential_answer(100)) is None
    assert compile_constraint(spec)._core is fresh._core  # a healthy one stays cached


def test_a_stream_under_way_survives_another_answer_spending_the_shared_lexer() -> None:
    """Copies of a compile share its lexer: another request's long answer spent it, and a stream already
    under way (or a step planned before) then refused its own short, valid answer. Such a check now
    replays on a fresh compile."""
    compile_mod.clear_cache()
    spec = ConstraintSpec("regex", EXPONENTIAL)
    planned = compile_constraint(spec)
    stream = planned.checker(native=False)
    ok = exponential_answer(50)
    assert stream.feed(ok[:10])
    with pytest.raises(InvalidGrammar, match="too complex"):
        compile_constraint(spec).validate(exponential_answer(30_000))
    assert not planned.current
    assert stream.feed(ok[10:]) and stream.finish() is None
    assert planned.validate(ok) is None  # the non-streamed step planned before
    with pytest.raises(InvalidGrammar, match="too complex"):  # an answer that spends a fresh compile too
        planned.validate(exponential_answer(30_000))
    assert compile_constraint(spec).validate(ok) is None


@pytest.mark.parametrize("streamed", [False, True])
def test_an_answer_that_spends_a_fresh_lexer_by_itself_is_checked_once(
    streamed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first replay on a fresh compile is for a lexer other answers had nearly spent. A check that was
    the only one of its compile spent a fresh lexer by itself: replaying it would only spend another
    (a second compile and check, ~35 ms for 30 KB), so it is refused at once."""
    compile_mod.clear_cache()
    compiles: list[ConstraintSpec] = []
    real = compile_mod.compile_constraint

    def counted(spec: ConstraintSpec) -> Constraint:
        compiles.append(spec)
        return real(spec)

    monkeypatch.setattr(compile_mod, "compile_constraint", counted)
    spec = ConstraintSpec("regex", EXPONENTIAL)
    fresh = real(spec)
    with pytest.raises(InvalidGrammar, match="too complex"):
        check_a_long_answer(fresh, streamed=streamed)
    assert compiles == []
    assert not fresh.current and real(spec).validate(exponential_answer(50)) is None


def test_a_stream_survives_other_answers_spending_each_fresh_compile_under_it() -> None:
    """The replay gave up at the second spend, taking it for its own: another answer's may spend the
    fresh compile too."""
    compile_mod.clear_cache()
    spec = ConstraintSpec("regex", EXPONENTIAL)
    stream = compile_constraint(spec).checker(native=False)
    ok = exponential_answer(50)
    assert stream.feed(ok[:10])
    for upto in (20, 30):  # two other answers spend the current compile, one after the other
        with pytest.raises(InvalidGrammar):
            compile_constraint(spec).validate(exponential_answer(30_000))
        assert stream.feed(ok[upto - 10:upto])
    assert stream.feed(ok[30:]) and stream.finish() is None


def test_a_compile_the_cache_evicted_is_still_current() -> None:
    """Only a spoiled compile is replanned: an agent grammar whose plan is hit every step was recompiled
    once 256 other constraints had gone through the cache."""
    compile_mod.clear_cache()
    held = compile_constraint(ConstraintSpec("regex", "[a-z]+"))
    for i in range(compile_mod.CACHE_SIZE + 1):
        compile_constraint(ConstraintSpec("regex", f"x{i}"))
    assert held.current and held.validate("abc") is None
