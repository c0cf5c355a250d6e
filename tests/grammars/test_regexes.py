"""grammars/regexes.py: JSON Schema patterns on model output run in bounded time (RE2, else `regex`
against the check's deadline)."""

from __future__ import annotations

import time

import pytest
import regex

from grammars.regexes import CHECK_BUDGET_S, PatternTimeout, compile_pattern, deadline, search


@pytest.mark.parametrize(
    ("pattern", "text", "found"),
    [
        (r"^[0-9]{5}$", "12345", True),
        (r"^[0-9]{5}$", "1234", False),
        (r"\d+", "ab12", True),  # a search, not a full match, as JSON Schema says
        (r"é+", "xéé", True),
        (r"^(?=.*[A-Z]).{4,}$", "abcD", True),  # lookahead: not RE2 syntax, runs on `regex`
        (r"^(?=.*[A-Z]).{4,}$", "abcd", False),
        (r"^(a)\1$", "aa", True),  # a backreference, likewise
        (r"^(a+)+$", "a" * 5, True),
    ],
)
def test_search(pattern: str, text: str, found: bool) -> None:
    assert search(pattern, text) is found


@pytest.mark.parametrize("text", ["a" * 30 + "!", "a" * 100_000 + "!"])
def test_catastrophic_backtracking_patterns_run_in_linear_time(text: str) -> None:
    """Python's `re` takes seconds for 28 characters here, doubling with each one."""
    started = time.perf_counter()
    assert search(r"^(a+)+$", text) is False
    assert search(r"^(\w+\s?)*$", text) is False
    assert time.perf_counter() - started < 0.5


def test_a_pattern_re2_cannot_run_fails_closed_when_the_check_budget_is_spent() -> None:
    pattern = r"^(?=a)(a|aa|a?a)+$"  # lookahead keeps it off RE2; nested alternation backtracks
    with deadline(0.0), pytest.raises(PatternTimeout) as info:
        for _ in range(1000):  # the budget is gone at once: some search must give up
            search(pattern, "a" * 5000 + "!")
    assert info.value.pattern == pattern
    assert f"{CHECK_BUDGET_S * 1000:g} ms" in str(info.value)


def test_a_pattern_no_engine_accepts_raises_at_compile_time() -> None:
    with pytest.raises(regex.error):
        compile_pattern(r"(unclosed")


def test_compiled_patterns_are_cached() -> None:
    assert compile_pattern(r"^x+$") is compile_pattern(r"^x+$")
