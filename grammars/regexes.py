"""Regex searches on model output for JSON Schema (`pattern`, `patternProperties`), in bounded time.

Why: jsonschema runs Python's backtracking `re` on the event loop. A pattern the agent sends, such as
`^(a+)+$`, over an answer the model was asked to write, such as 28 `a`s and a `!`, then stalls every
request of the process for seconds, doubling with each character. Here a pattern runs on RE2, whose
time is linear in the text. A pattern RE2 has no construct for (lookaround, backreference) runs on
the `regex` module against the deadline of the current check (`deadline()`), and a check that cannot
finish in time fails closed (`PatternTimeout`, a violation), never a stall.

Patterns are compiled when the schema is (`compile_pattern` via `check_patterns`), so one that neither
engine accepts is a 400 at request time.
"""

from __future__ import annotations

import contextvars
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import re2  # type: ignore[import-untyped]
import regex  # type: ignore[import-untyped]

__all__ = ["PatternTimeout", "compile_pattern", "deadline", "search"]

CHECK_BUDGET_S: Final = 0.05  # what patterns RE2 cannot run may take, per output check
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("pattern_deadline", default=None)
Search = Callable[[str], bool]


class PatternTimeout(Exception):
    """A pattern outside RE2's syntax did not finish within the check's budget."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"pattern {pattern!r} could not be checked within {CHECK_BUDGET_S * 1000:g} ms")
        self.pattern = pattern


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a pattern RE2 lacks a construct for goes to `regex`, silently
    options.never_capture = True
    return options


@functools.lru_cache(maxsize=512)
def compile_pattern(pattern: str) -> Search:
    """`search(text)` for an ECMA-style JSON Schema pattern. Raises `regex.error` when neither engine
    accepts it."""
    try:
        linear = re2.compile(pattern, _re2_options())
    except re2.error:
        backtracking = regex.compile(pattern)
        return functools.partial(_bounded, backtracking, pattern)
    return lambda text: linear.search(text) is not None


def _bounded(compiled: Any, pattern: str, text: str) -> bool:
    until = _DEADLINE.get()
    left = CHECK_BUDGET_S if until is None else until - time.monotonic()
    try:
        return compiled.search(text, timeout=max(left, 0.0005)) is not None
    except TimeoutError:
        raise PatternTimeout(pattern) from None


def search(pattern: str, text: str) -> bool:
    return compile_pattern(pattern)(text)


@contextmanager
def deadline(budget_s: float = CHECK_BUDGET_S) -> Iterator[None]:
    """Within: patterns RE2 cannot run share `budget_s` of time, from now."""
    token = _DEADLINE.set(time.monotonic() + budget_s)
    try:
        yield
    finally:
        _DEADLINE.reset(token)
