"""Regex -> GBNF: the converted grammar parses with llguidance's GBNF reader and accepts exactly the
strings the regex fully matches (ASCII semantics for \\d \\w \\s, as GBNF has no Unicode classes)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidGrammar
from grammars.compile import compile_constraint
from grammars.gbnf import choice_to_gbnf, gbnf_literal, regex_alternatives, regex_escape, regex_to_gbnf
from grammars.spec import ConstraintSpec

PATTERNS = [
    r"[0-9]{3}-[0-9]{4}",
    r"\+[1-9]\d{1,14}",
    r"^[a-z]+$",
    r"(ab|cd)*e?",
    r'[^"\\]{0,5}x',
    r"a.b",
    r"[\]\-^\\]+",
    r"colou?r|gr[ae]y",
    r"[A-Za-z_][A-Za-z0-9_]*",
    r"(?:\d{1,3}\.){3}\d{1,3}",
    r"[\w.-]+@[\w-]+\.[a-z]{2,}",
    r"\s*yes\s*",
    r"[^\d]+",
    r'say "hi"\\',
    r"a|",
    r"\u00e9+t\u00e9",
    r"x{2,}y{0,2}z{3}",
    r"\t\n\x01",
    r"a*?b+?",
]
ALPHABET = 'abcdexyzAZ_019-+.@"\\ \t\n\x01]^\u00e9\u0663'


@pytest.mark.parametrize(
    ("pattern", "grammar"),
    [
        (r"[0-9]{3}-[0-9]{4}", 'root ::= ([0-9]){3} "-" ([0-9]){4}'),
        (r"\+[1-9]\d{1,14}", 'root ::= "+" [1-9] ([0-9]){1,14}'),
        (r"^[a-z]+$", "root ::= ([a-z])+"),
        (r"a|b|", 'root ::= ("a" | "b" | "")'),
        (r"[^\d]", "root ::= [^0-9]"),
        (r"[\]\-^\\]x", 'root ::= [\\x5D\\x2D\\x5E\\x5C] "x"'),
        (r"a.b", 'root ::= "a" [^\\n] "b"'),
        (r"a*?", 'root ::= ("a")*'),
        (r"(?:ab){2,}", 'root ::= ("a" "b"){2,}'),
        ('\u00e9"\n', 'root ::= "\u00e9" "\\"" "\\n"'),
        (r"\s", "root ::= [ \\t\\n\\r\\x0B\\x0C]"),
        ("", 'root ::= ""'),
    ],
)
def test_regex_to_gbnf(pattern: str, grammar: str) -> None:
    assert regex_to_gbnf(pattern) == grammar


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(?i)abc", "regex: cannot convert to GBNF: inline flags such as (?i) are not supported"),
        ("(?s).", "regex: cannot convert to GBNF: inline flags such as (?i) are not supported"),
        ("(?i:a)b", "regex: cannot convert to GBNF: scoped flags such as (?i:...)"),
        ("a(?=b)", "regex: cannot convert to GBNF: look-ahead/look-behind is not supported"),
        ("(?<!a)b", "regex: cannot convert to GBNF: negative look-around is not supported"),
        ("a(?!b)", "regex: cannot convert to GBNF: negative look-around is not supported"),
        (r"(a)\1", "regex: cannot convert to GBNF: a backreference is not supported"),
        (r"(a)?(?(1)b|c)", "regex: cannot convert to GBNF: a conditional group is not supported"),
        (
            r"\bx",
            "regex: cannot convert to GBNF: a word boundary or anchor in this position is not supported",
        ),
        ("(?>ab)", "regex: cannot convert to GBNF: an atomic group is not supported"),
        ("a++", "regex: cannot convert to GBNF: a possessive quantifier is not supported"),
        (r"[a\D]", "regex: cannot convert to GBNF: a negated category inside a class"),
        ("[[:alpha:]]", "regex: cannot convert to GBNF: Possible nested set at position 1"),
        ("(", "regex: cannot convert to GBNF: missing ), unterminated subpattern at position 0"),
    ],
)
def test_regex_to_gbnf_rejects(pattern: str, message: str) -> None:
    with pytest.raises(InvalidGrammar) as caught:
        regex_to_gbnf(pattern)
    assert caught.value.message == message


@pytest.mark.parametrize("pattern", PATTERNS)
def test_converted_grammar_compiles_with_llguidance(pattern: str) -> None:
    compile_constraint(ConstraintSpec("gbnf", regex_to_gbnf(pattern)))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), pattern=st.sampled_from(PATTERNS))
def test_gbnf_matches_what_the_regex_matches(data: st.DataObject, pattern: str) -> None:
    gbnf = compile_constraint(ConstraintSpec("gbnf", regex_to_gbnf(pattern)))
    regex = compile_constraint(ConstraintSpec("regex", pattern))
    compiled = re.compile(pattern, re.ASCII)
    member = data.draw(
        st.from_regex(compiled, fullmatch=True).filter(lambda s: s.isascii() or "\u00e9" in pattern)
    )
    assert gbnf.validate(member) is None, member
    anything = data.draw(st.text(alphabet=ALPHABET, max_size=12))
    expected = compiled.fullmatch(anything) is not None
    assert (gbnf.validate(anything) is None) == expected, anything
    if anything.isascii():  # the llguidance regex is Unicode-aware, like Python without re.ASCII
        assert (regex.validate(anything) is None) == expected, anything


def test_choice_to_gbnf() -> None:
    grammar = choice_to_gbnf(["yes", 'a "b"', "c\\d", "\u00e9\n", ""])
    assert grammar == 'root ::= "yes" | "a \\"b\\"" | "c\\\\d" | "\u00e9\\n" | ""'
    constraint = compile_constraint(ConstraintSpec("gbnf", grammar))
    for option in ["yes", 'a "b"', "c\\d", "\u00e9\n", ""]:
        assert constraint.validate(option) is None
    assert constraint.validate("no") is not None


@pytest.mark.parametrize(
    ("text", "literal"), [("a", '"a"'), ('"', '"\\""'), ("\x7f", '"\\x7F"'), ("\t", '"\\t"')]
)
def test_gbnf_literal(text: str, literal: str) -> None:
    assert gbnf_literal(text) == literal


def test_regex_alternatives_match_exactly_the_options() -> None:
    options = ["a.b", "c d", "(x)", "1+1=2", "[y]", "$5 ^_^", "tab\there", "back\\slash", "q?"]
    pattern = regex_alternatives(options)
    assert regex_escape("c d") == "c d"  # no needless escapes (xgrammar warns on "\ ")
    constraint = compile_constraint(ConstraintSpec("regex", pattern))
    for option in options:
        assert constraint.validate(option) is None, option
        assert re.fullmatch(pattern, option)
    for other in ["axb", "c  d", "x", "11=2", "y", "q"]:
        assert constraint.validate(other) is not None, other
