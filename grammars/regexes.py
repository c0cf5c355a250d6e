"""Regex searches on model output for JSON Schema (`pattern`, `patternProperties`), in linear time.

Why: jsonschema runs Python's backtracking `re` on the event loop. A pattern the agent sends, such as
`^(a+)+$`, over an answer the model was asked to write, such as 28 `a`s and a `!`, then stalls every
request of the process for seconds, doubling with each character. Here every pattern runs on RE2,
whose time is linear in the text.

What RE2 has no construct for (lookaround, backreferences) is refused when the schema compiles (a 400
at request time), as are repetition counts over 1000: no backtracking engine runs in their place,
because none is bounded (even compiling `(((a{50}){50}){50}){50}` takes seconds on one). Those
constructs are outside the regex subset JSON Schema recommends to schema authors anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import re2  # type: ignore[import-untyped]

__all__ = ["UnsupportedPattern", "compile_pattern", "search"]

Search = Callable[[str], bool]


class UnsupportedPattern(ValueError):
    """A pattern RE2 cannot run: lookaround, a backreference, a repetition over 1000, or bad syntax."""


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # refused patterns are reported to the caller, not logged by RE2
    options.never_capture = True
    return options


@functools.lru_cache(maxsize=512)
def compile_pattern(pattern: str) -> Search:
    """`search(text)` for a JSON Schema pattern. Raises `UnsupportedPattern` with RE2's reason."""
    try:
        compiled = re2.compile(pattern, _options())
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        raise UnsupportedPattern(text) from None
    return lambda text: compiled.search(text) is not None


def search(pattern: str, text: str) -> bool:
    return compile_pattern(pattern)(text)
