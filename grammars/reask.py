"""The instruction sent when an answer broke its constraint.

It is appended as one user message to the *original* request (never to an earlier re-ask), says
that the previous answer did not conform, quotes the error and restates the constraint compactly,
truncated for huge schemas or grammars so a re-ask never balloons the prompt.
"""

from __future__ import annotations

from typing import Final

import orjson

from grammars.spec import ConstraintSpec, Violation

MAX_CONSTRAINT_CHARS: Final[int] = 2000
MAX_ERROR_CHARS: Final[int] = 1000


def reask_instruction(violation: Violation, spec: ConstraintSpec) -> str:
    """The re-ask message for `violation` of `spec`."""
    error = _truncate(violation.message, MAX_ERROR_CHARS)
    return (
        "Your previous answer did not conform to the required output format.\n"
        f"Error: {error}\n"
        f"Answer again. {restate(spec)}"
    )


def restate(spec: ConstraintSpec) -> str:
    """One compact sentence (plus the constraint text) saying what a valid answer looks like."""
    kind = spec.kind
    if kind == "json_object":
        return "Reply with a single JSON object and nothing else."
    if kind == "json_schema":
        schema = orjson.dumps(orjson.loads(spec.source)).decode()  # compact, whatever the source layout
        return (
            "Reply with only a JSON document (no prose, no code fences) that validates against this "
            f"JSON Schema:\n{_truncate(schema, MAX_CONSTRAINT_CHARS)}"
        )
    if kind == "choice":
        options = orjson.loads(spec.source)
        listed = _truncate(", ".join(orjson.dumps(o).decode() for o in options), MAX_CONSTRAINT_CHARS)
        return f"Reply with exactly one of these options and nothing else: {listed}"
    if kind == "regex":
        return (
            "Reply with only text that fully matches this regular expression: "
            f"{_truncate(spec.source, MAX_CONSTRAINT_CHARS)}"
        )
    dialect = "Lark" if kind == "lark" else "GBNF"
    return (
        f"Reply with only text that this {dialect} grammar accepts:\n"
        f"{_truncate(spec.source.strip(), MAX_CONSTRAINT_CHARS)}"
    )


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 40] + f" ... [truncated, {len(text)} characters in all]"
