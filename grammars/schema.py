"""The final verdict on JSON outputs: parse, then jsonschema (Draft 2020-12 unless `$schema` says
otherwise) with a format checker. Key order is irrelevant here, unlike in any grammar engine.

Messages name the path and the rule, sorted by path: `at address/zip: 'ABCDE' does not match
'^[0-9]{5}$'`. Parsing tolerates whitespace around the document (JSON allows it) and rejects NaN,
Infinity and lone surrogates (orjson), as the streaming checker does. `parse_json` lives in
`grammars.spec`, which needs no jsonschema (importing this module costs tens of milliseconds); it is
re-exported here.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

import jsonschema
import jsonschema.validators
import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from jsonschema_specifications import REGISTRY as _SPECIFICATIONS  # type: ignore[import-untyped]

from gateway import exact_json
from gateway.errors import InvalidGrammar
from gateway.frozen_init import fast_init
from grammars.fanout import in_place_cycle, in_place_fanout, object_count
from grammars.regexes import UnsupportedPattern, compile_pattern, search
from grammars.spec import Violation, parse_json

__all__ = ["SchemaCheck", "build_check", "describe_errors", "format_checker", "parse_json"]

_MAX_ERRORS_SCANNED: Final[int] = 100
_MAX_ERRORS_SHOWN: Final[int] = 5
_MAX_MESSAGE: Final[int] = 240
# subschemas jsonschema may apply to one value (`grammars.fanout`): legit unions apply tens to hundreds
MAX_FANOUT: Final[int] = 5000


def _pattern(validator: Validator, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Validator, patterns: dict[str, Any], instance: Any, schema: Any,
                        ) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Validator, additional: Any, instance: Any, schema: Any,
                           ) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    known, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [k for k in instance if k not in known and not any(search(p, k) for p in patterns)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        listed = ", ".join(repr(e) for e in sorted(extras, key=str))
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            regexes = ", ".join(repr(p) for p in sorted(patterns))
            yield ValidationError(f"{listed} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({listed} {verb} unexpected)")


def _multiple_of(validator: Validator, multiple: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """`multipleOf` on the decimal values the JSON spelled. jsonschema divides binary floats, so
    `0.3` is "not a multiple of 0.1" (0.3 / 0.1 = 2.9999999999999996)."""
    if not validator.is_type(instance, "number") or not validator.is_type(multiple, "number"):
        return  # bools are not numbers (is_type); a non-number multipleOf fails check_schema first
    if not _is_multiple(instance, multiple):
        yield ValidationError(f"{instance!r} is not a multiple of {multiple}")


def _is_multiple(instance: float, multiple: float) -> bool:
    """Whether `instance` is an integer times `multiple` (> 0), exactly. A non-finite float (JSON has
    none; a caller's own value might) is a multiple of nothing."""
    if isinstance(instance, int) and isinstance(multiple, int):
        return instance % multiple == 0  # the common case, exact and cheap
    if isinstance(instance, float) and not math.isfinite(instance):
        return False
    return (_decimal(instance) / _decimal(multiple)).denominator == 1


def _decimal(number: float) -> Fraction:
    """The exact value of the decimal a float was read from: its repr is the shortest decimal that
    reads back as the same float, so `0.1` is 1/10, not the binary float's 3602879701896397/2**55.
    Exponents stay small (a float's repr has at most 3 exponent digits), so the Fraction does too."""
    return Fraction(repr(number)) if isinstance(number, float) else Fraction(number)


# jsonschema's own keywords, with patterns run on model output in linear time (grammars.regexes)
# and multipleOf decided on decimals
_BOUNDED: Final = {"pattern": _pattern, "patternProperties": _pattern_properties,
                   "additionalProperties": _additional_properties, "multipleOf": _multiple_of}


class _Work(threading.local):
    """The keyword applications the check running on this thread may still make (`SchemaCheck`)."""

    left: int = 0


_WORK = _Work()
# keyword applications a check may make (5-20 us each), plus WORK_PER_BYTE a byte of its value (a valid
# answer takes under one a byte)
WORK_BASE: Final[int] = 20_000
WORK_PER_BYTE: Final[int] = 2


class _TooCostly(Exception):
    pass


def _metered(keyword: Any) -> Any:
    """`keyword` counting against the running check's work (schemas whose applicators multiply through
    refs the static bound, `grammars.fanout`, cannot follow: relative to a nested `$id`, `$dynamicRef`,
    `unevaluated*` re-walking them)."""
    @functools.wraps(keyword)
    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        _WORK.left -= 1
        if _WORK.left < 0:
            raise _TooCostly
        return keyword(validator, value, instance, schema)

    return counted


def _draft(cls: Any) -> type[Validator]:
    keywords = {**cls.VALIDATORS, **_BOUNDED}
    return jsonschema.validators.extend(cls, {name: _metered(fn) for name, fn in keywords.items()})


_DRAFTS: Final[dict[str, type[Validator]]] = {
    uri.rstrip("#"): _draft(cls)
    for cls in (
        jsonschema.Draft4Validator,
        jsonschema.Draft6Validator,
        jsonschema.Draft7Validator,
        jsonschema.Draft201909Validator,
        jsonschema.Draft202012Validator,
    )
    for uri in (str(cls.META_SCHEMA.get("$id", cls.META_SCHEMA.get("id", ""))),)
}
_DEFAULT_DRAFT: Final = _DRAFTS[str(Draft202012Validator.META_SCHEMA["$id"]).rstrip("#")]
_DATE_TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(?:\.\d+)?(?:[Zz]|[+-](\d\d):(\d\d))", re.ASCII
)
_TIME = re.compile(r"(\d\d):(\d\d):(\d\d)(?:\.\d+)?(?:[Zz]|[+-](\d\d):(\d\d))", re.ASCII)
# No `retrieve` function: a URI that is not in the schema itself or a metaschema is Unresolvable.
_NO_RETRIEVAL: Final[referencing.Registry[Any]] = referencing.Registry()
# Data-valued keywords: their contents are instances, not schemas, so a "$ref" inside is just data.
_DATA_KEYWORDS: Final[frozenset[str]] = frozenset({"enum", "const", "default", "examples"})


@fast_init
@dataclass(frozen=True, slots=True)
class SchemaCheck:
    """A compiled schema verdict: `check(text)` for a whole output, `check_value(value)` once parsed."""

    validator: Validator

    def check(self, text: str) -> Violation | None:
        value, violation = parse_json(text)
        if violation is not None:
            return violation
        return self.check_value(value, len(text))

    def check_value(self, value: Any, size: int | None = None) -> Violation | None:
        """`size`: of the value's JSON text (measured when not given). Raises InvalidGrammar when the
        check makes more than `WORK_BASE + WORK_PER_BYTE * size` keyword applications: the schema, not
        the value, is at fault."""
        if size is None:
            size = len(exact_json.dumps(value))
        _WORK.left = WORK_BASE + WORK_PER_BYTE * size
        try:
            errors = list(itertools.islice(self.validator.iter_errors(value), _MAX_ERRORS_SCANNED))
        except _TooCostly:
            raise InvalidGrammar("json_schema: validating one answer against the schema takes too long (its "
                                 "subschemas, through $refs, apply too many times to each value)") from None
        except RecursionError:
            return Violation("at <root>: the document is nested too deeply to validate")
        except referencing.exceptions.Unresolvable as exc:
            raise InvalidGrammar(f"json_schema: cannot resolve $ref: {exc}") from exc
        if not errors:
            return None
        return Violation(describe_errors(errors), summary=summarize_errors(errors))


def describe_errors(errors: list[ValidationError]) -> str:
    """`at <path>: <message>` for each error, sorted by path, at most `_MAX_ERRORS_SHOWN`, joined by "; "."""
    ordered = sorted(
        errors, key=lambda e: [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in e.absolute_path]
    )
    parts = []
    for error in ordered[:_MAX_ERRORS_SHOWN]:
        path = "/".join(str(p) for p in error.absolute_path) or "<root>"
        message = error.message
        if len(message) > _MAX_MESSAGE:
            message = message[: _MAX_MESSAGE - 3] + "..."
        parts.append(f"at {path}: {message}")
    if len(ordered) > _MAX_ERRORS_SHOWN:
        more = len(ordered) - _MAX_ERRORS_SHOWN
        parts.append(f"and {more}{'+' if len(ordered) == _MAX_ERRORS_SCANNED else ''} more")
    return "; ".join(parts)


def summarize_errors(errors: list[ValidationError]) -> str:
    """`describe_errors` without the document's content: the schema rules broken (their paths in the
    schema, which the operator or the agent wrote), never the values or keys that broke them."""
    rules = sorted({"/".join(str(p) for p in error.absolute_schema_path) or "<root>" for error in errors})
    shown = ", ".join(rules[:_MAX_ERRORS_SHOWN])
    more = f" and {len(rules) - _MAX_ERRORS_SHOWN} more" if len(rules) > _MAX_ERRORS_SHOWN else ""
    return f"breaks schema rule(s) {shown}{more}"


def build_check(schema: Any) -> SchemaCheck:
    """Compile a schema (dict or bool) into a SchemaCheck. Raises InvalidGrammar with the reason."""
    if not isinstance(schema, dict | bool):
        raise InvalidGrammar(f"json_schema: a schema must be a JSON object or boolean, not {_type(schema)}")
    cls = _validator_class(schema)
    try:
        # the stubs forget boolean schemas
        cls.check_schema(schema, format_checker=_metaschema_formats())  # type: ignore[arg-type]
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "<root>"
        raise InvalidGrammar(f"json_schema: invalid schema at {where}: {exc.message}") from exc
    # An explicit registry: jsonschema's default one fetches unknown remote $refs over HTTP (a
    # client-supplied schema must never make tollgate open a connection).
    validator = cls(schema, format_checker=format_checker(), registry=_NO_RETRIEVAL)
    if _check_refs(schema, cls):
        _check_ref_graph(schema)
    _check_patterns(schema)
    return SchemaCheck(validator)


def _check_ref_graph(schema: Any) -> None:
    """Refuse a schema whose refs never descend (`fanout.in_place_cycle`) or multiply past `MAX_FANOUT`."""
    try:
        if in_place_cycle(schema):  # every answer would fail "nested too deeply", after paid re-asks
            raise InvalidGrammar("json_schema: the schema refers to itself without descending into the document "
                                 "(a $ref cycle through in-place keywords alone: $ref, allOf, anyOf, if/then): "
                                 "no answer could be validated")
        bound = max(MAX_FANOUT, 4 * object_count(schema))  # a large flat union is no multiplication
        if in_place_fanout(schema, bound) > bound:
            raise InvalidGrammar(f"json_schema: more than {MAX_FANOUT} subschemas may apply to one value "
                                 "(allOf / anyOf / oneOf over $refs multiply): validating could take minutes")
    except RecursionError:  # a chain of refs hundreds deep: no validation of it would end either
        raise InvalidGrammar("json_schema: its $refs nest too deeply to validate") from None


def _validator_class(schema: Any) -> type[Validator]:
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(declared, str):
        return _DRAFTS.get(declared.rstrip("#"), _DEFAULT_DRAFT)
    return _DEFAULT_DRAFT


def _check_patterns(schema: Any) -> None:
    """Compile every pattern now (`grammars.regexes`, RE2): one it cannot run is a 400 at request time.
    `unevaluatedProperties` with `patternProperties` is refused too: jsonschema matches those with
    Python's backtracking `re` inside its own helper, out of this module's reach."""
    pattern_maps = [m for m in _walk(schema, "patternProperties") if isinstance(m, dict) and m]
    if pattern_maps and any(True for _ in _walk(schema, "unevaluatedProperties")):
        raise InvalidGrammar("json_schema: unevaluatedProperties together with patternProperties is not "
                             "supported (use additionalProperties)")
    patterns = [p for p in _walk(schema, "pattern") if isinstance(p, str)]
    for pattern in patterns + [k for m in pattern_maps for k in m]:
        try:
            compile_pattern(pattern)
        except UnsupportedPattern as exc:
            raise InvalidGrammar(
                f"json_schema: pattern {pattern!r} cannot be checked in linear time ({exc}): "
                "lookaround, backreferences and repetitions over 1000 are not supported"
            ) from None


def _check_refs(schema: Any, cls: type[Validator]) -> bool:
    """Reject refs that cannot be resolved inside the schema (or to a JSON Schema metaschema):
    jsonschema would only fail at answer time. Nothing is ever fetched. True when it has refs."""
    refs = list(_refs(schema))
    if not refs:
        return False
    meta = cls.META_SCHEMA
    dialect = str(meta.get("$id", meta.get("id", "")))
    specification = referencing.jsonschema.specification_with(
        dialect, default=referencing.Specification.OPAQUE
    )
    resolver = _SPECIFICATIONS.combine(_NO_RETRIEVAL).resolver_with_root(
        specification.create_resource(schema)
    )
    has_ids = any(True for _ in _walk(schema, "$id"))
    for ref in refs:
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable as exc:
            # A relative ref may be based on a nested $id that a root lookup does not see: let those
            # through rather than reject a valid schema; a bad one still fails at validation time.
            if has_ids and not ref.startswith("#"):
                continue
            raise InvalidGrammar(f"json_schema: cannot resolve $ref {ref!r} inside the schema") from exc
    return True


def _refs(schema: Any) -> Iterator[str]:
    return (v for v in _walk(schema, "$ref") if isinstance(v, str))


def _walk(node: Any, keyword: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == keyword:
                yield value
            if key not in _DATA_KEYWORDS:
                yield from _walk(value, keyword)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, keyword)


def _type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


@functools.cache
def _metaschema_formats() -> FormatChecker:
    """The formats a schema is checked with against its metaschema: jsonschema's own but `regex`, which
    it checks with Python's `re` (no `\\p{Lu}`, say); patterns run on RE2, and `_check_patterns` judges
    them with RE2 itself."""
    return FormatChecker([name for name in Draft202012Validator.FORMAT_CHECKER.checkers if name != "regex"])


@functools.cache
def format_checker() -> FormatChecker:
    """Draft 2020-12 formats jsonschema checks on its own, plus `date-time` and `time` (RFC 3339),
    which it only checks when optional packages are installed."""
    checker = FormatChecker(list(Draft202012Validator.FORMAT_CHECKER.checkers))
    if "date-time" not in checker.checkers:
        checker.checks("date-time")(_is_date_time)
    if "time" not in checker.checkers:
        checker.checks("time")(_is_time)
    return checker


def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    match = _DATE_TIME.fullmatch(value)
    if match is None:
        return False
    year, month, day, hour, minute, second, off_h, off_m = match.groups()
    return _valid_date(year, month, day) and _valid_clock(hour, minute, second, off_h, off_m)


def _is_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    match = _TIME.fullmatch(value)
    return match is not None and _valid_clock(*match.groups())


def _valid_date(year: str, month: str, day: str) -> bool:
    try:
        dt.date(int(year), int(month), int(day))
    except ValueError:
        return False
    return True


def _valid_clock(hour: str, minute: str, second: str, off_h: str | None, off_m: str | None) -> bool:
    # 60 is a leap second, which RFC 3339 allows.
    if int(hour) > 23 or int(minute) > 59 or int(second) > 60:
        return False
    return off_h is None or (int(off_h) <= 23 and int(off_m or 0) <= 59)
