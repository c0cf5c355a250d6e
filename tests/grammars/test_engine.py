"""The llguidance byte engine: expected-set descriptions, offsets, error text."""

from __future__ import annotations

import time

import pytest

from gateway.errors import InvalidGrammar
from grammars import engine
from tests.grammars.samples import EXPONENTIAL, exponential_answer


def mask(*allowed: int) -> bytes:
    bits = bytearray(36)
    for b in allowed:
        bits[b >> 3] |= 1 << (b & 7)
    return bytes(bits)


@pytest.mark.parametrize(
    ("allowed", "text"),
    [
        ([ord("a")], "expected 'a'"),
        ([engine.EOS], "expected end of output"),
        ([*range(ord("0"), ord("9") + 1), engine.EOS], "expected one of: '0'-'9', end of output"),
        ([9, 10, 13, 32], "expected one of: '\\t'-'\\n', '\\r', ' '"),
        ([ord("'"), ord('"')], "expected one of: '\"', \"'\""),
        ([0xC3, 0xE2], "expected non-ASCII characters"),
        (
            [b for b in range(256) if b not in (ord('"'), ord("\\"))],
            "expected any character except '\"', '\\\\'",
        ),
        ([*range(0x20, 0x80), *range(0x80, 0x100)], "expected any character except '\\x00'-'\\x1f'"),
        ([*range(0x80)], "expected any character"),
        ([], "expected nothing (no continuation is possible)"),
        (
            [ord(c) for c in "acegikmoqsuwy"],
            "expected one of: 'a', 'c', 'e', 'g', 'i', 'k', 'm', 'o', 'q', 's', 'u', 'w', ... (1 more)",
        ),
    ],
)
def test_expected_from_mask(allowed: list[int], text: str) -> None:
    assert engine.expected_from_mask(mask(*allowed)) == text


@pytest.mark.parametrize(
    ("text", "byte_pos", "char_pos"),
    [
        ("abc", 2, 2),
        ("\u00e9a", 2, 1),
        ("\u00e9a", 1, 0),  # inside a multibyte character: that character
        ("\U0001f600x", 4, 1),
    ],
)
def test_char_offset(text: str, byte_pos: int, char_pos: int) -> None:
    assert engine.char_offset(text.encode(), byte_pos) == char_pos


def test_grammar_errors_are_short() -> None:
    matcher, error = engine.build_matcher(engine.grammar_for("lark", "start: foo"))
    assert matcher is None
    assert error == 'at 1(8): unknown name: "foo"'


def test_grammar_for_unknown_kind() -> None:
    with pytest.raises(ValueError, match="no llguidance grammar for kind 'json_schema'"):
        engine.grammar_for("json_schema", "{}")


def test_tokenizer_is_built_once() -> None:
    assert engine.tokenizer() is engine.tokenizer()
    assert engine.tokenizer().vocab_size == 257


@pytest.mark.parametrize("source", ["\\", "[0-9]+\\", "a\\\\\\", "(a\\"])
def test_a_regex_ending_in_a_lone_backslash_is_refused(source: str) -> None:
    # llguidance would silently drop the backslash and compile another regex
    with pytest.raises(ValueError, match="incomplete escape sequence"):
        engine.grammar_for("regex", source)


@pytest.mark.parametrize(("source", "text"), [("a\\\\", "a\\"), ("x\\\\\\\\", "x\\\\"), ("\\d+", "12")])
def test_escaped_trailing_backslashes_still_compile(source: str, text: str) -> None:
    matcher, error = engine.build_matcher(engine.grammar_for("regex", source))
    assert matcher is not None, error
    assert engine.check_complete(matcher, text) is None


AMBIGUOUS = 'start: a\na: "x" | a a\n'  # each text of n x's has Catalan(n) parses
LINEAR = 'start: item ("," item)*\nitem: /[a-z]+/\n'


def lark_matcher(source: str) -> object:
    matcher, error = engine.build_matcher(engine.grammar_for("lark", source))
    assert matcher is not None, error
    return matcher


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize(("text", "verdict"), [
    ("ab,cd", None),
    ("ab,,cd", "at char 3: unexpected ','"),
    ("ab,", "at char 3: output ended too early"),
    ("x" * 5000 + ",y", None),  # many calls, each sized by the cost of the last
    ("x" * 5000 + ",Y", "at char 5001: unexpected 'Y'"),
])
def test_a_bounded_check_gives_the_verdict_of_a_plain_one(bounded: bool, text: str, verdict: str | None) -> None:
    violation = engine.check_complete(lark_matcher(LINEAR), text, bounded=bounded)  # type: ignore[arg-type]
    assert (violation.message.split(";")[0] if violation else None) == verdict


def test_an_ambiguous_grammar_s_check_is_cut_at_its_time_not_run_for_minutes() -> None:
    """llguidance's parse of 1,000 x's against `a: "x" | a a` took 27 s on the event loop (its
    `LLParserLimits` do not bound it): the bounded check gives up after `CHECK_S` of matcher time."""
    matcher = lark_matcher(AMBIGUOUS)
    assert engine.check_complete(matcher, "x" * 20, bounded=True) is None  # short texts are fine
    fuel = engine.Fuel()
    with pytest.raises(InvalidGrammar, match="ambiguous grammar"):
        engine.check_complete(matcher, "x" * 1000, bounded=True)
    with pytest.raises(InvalidGrammar, match="ambiguous grammar"):
        streamed = matcher.deep_copy()  # type: ignore[attr-defined]
        for _ in range(100):  # a stream, 10 characters per chunk
            engine.advance(streamed, list(b"x" * 10), fuel)
    assert -0.05 < fuel.left < 0  # gave up once the time was spent, within the last call's cost


def test_a_linear_grammar_s_long_answer_never_runs_out_of_time() -> None:
    """The budget grows with the answer (`_PER_TOKEN_S` a token): a megabyte a linear grammar accepts is
    no "ambiguous grammar" (a flat 250 ms cut valid answers past ~350 KB)."""
    text = ",".join(["abcdefgh"] * 110_000)  # ~1 MB
    assert engine.check_complete(lark_matcher(LINEAR), text, bounded=True) is None  # type: ignore[arg-type]


def test_a_grammar_that_hits_llguidance_s_parser_limits_is_the_grammar_s_fault_not_the_answer_s() -> None:
    """40 mutually recursive ambiguous rules: one 64-token call took 17.8 s. Calls now grow from one token,
    and the Earley row limit llguidance hits within ten tokens says the grammar is too complex (it used to
    read as the answer's violation at char 10)."""
    rules = "\n".join(f's{i}: "x" | s{i} s{i} | s{(i + 1) % 40} | s{i} s{(i + 1) % 40}' for i in range(40))
    matcher = lark_matcher("start: s0\n" + rules)
    started = time.perf_counter()
    with pytest.raises(InvalidGrammar, match="too complex to check the answer with"):
        engine.check_complete(matcher, "x" * 64, bounded=True)  # type: ignore[arg-type]
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("text", ["abxz", "yxz", "qbaxz", "abcdexz", "abcdefxz"])
def test_a_stop_lexeme_s_verdict_does_not_depend_on_how_the_bytes_are_batched(text: str) -> None:
    """llguidance refused the byte after a `stop=` lexeme when it came in the same call: a bounded check
    (calls of 1, 2, 4, ... bytes) refused "yxz" with "unexpected 'z'; expected 'z'", a stream took it."""
    matcher = lark_matcher('start: foo "z"\nfoo[stop="x"]: /[a-y]*/\n')
    assert engine.check_complete(matcher, text, bounded=True) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_lexer_out_of_states_is_the_grammar_s_fault_not_a_refused_answer(streamed: bool) -> None:
    """llguidance's lexer stops at `max_lexer_states`, refusing the next byte without an error state: a
    valid 30 KB answer read as "unexpected 'b' at char 22526". It is now the grammar's 400."""
    matcher, error = engine.build_matcher(engine.grammar_for("regex", EXPONENTIAL))
    assert matcher is not None, error
    answer = exponential_answer(30_000)
    with pytest.raises(InvalidGrammar, match=r"too complex to check the answer with \(lexer error"):
        if streamed:
            stream = matcher.deep_copy()
            for start in range(0, len(answer), 100):
                engine.advance(stream, list(answer[start:start + 100].encode()))
        else:
            engine.check_complete(matcher, answer)
    fresh, _ = engine.build_matcher(engine.grammar_for("regex", EXPONENTIAL))
    assert engine.advance(fresh, list(b"abc")) == 2  # a genuine refusal is still the answer's fault


def test_a_genuine_refusal_after_many_bytes_is_still_a_violation() -> None:
    matcher, _ = engine.build_matcher(engine.grammar_for("regex", "[a-z]*"))
    violation = engine.check_complete(matcher, "x" * 50_000 + "1")  # type: ignore[arg-type]
    assert violation is not None and violation.message.startswith("at char 50000: unexpected '1'")
