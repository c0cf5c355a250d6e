"""grammars/regexes.py: JSON Schema patterns on model output run on RE2, in linear time; what RE2
cannot run is refused, never handed to a backtracking engine."""

from __future__ import annotations

import time

import pytest

from grammars.regexes import UnsupportedPattern, compile_pattern, search


@pytest.mark.parametrize(
    ("pattern", "text", "found"),
    [
        (r"^[0-9]{5}$", "12345", True),
        (r"^[0-9]{5}$", "1234", False),
        (r"\d+", "ab12", True),  # a search, not a full match, as JSON Schema says
        (r"é+", "xéé", True),
        (r"\p{L}+", "été", True),
        (r"^(a+)+$", "a" * 5, True),
        (r"(?P<n>a)b", "ab", True),
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


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"^(?=.*[A-Z]).{4,}$", "(?="),  # lookahead
        (r"(?<!x)y", "(?<!"),  # lookbehind
        (r"^(a)\1$", "\\1"),  # backreference
        (r"(((a{50}){50}){50}){50}", "repetition"),  # seconds to compile on a backtracking engine
        (r"a{1001}", "repetition"),
        (r"(unclosed", "missing"),
    ],
)
def test_what_re2_cannot_run_is_refused_quickly(pattern: str, reason: str) -> None:
    started = time.perf_counter()
    with pytest.raises(UnsupportedPattern) as info:
        compile_pattern(pattern)
    assert reason in str(info.value)
    assert time.perf_counter() - started < 0.5


def test_compiled_patterns_are_cached() -> None:
    assert compile_pattern(r"^x+$") is compile_pattern(r"^x+$")
