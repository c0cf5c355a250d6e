"""Compile a ConstraintSpec once (cached by content hash) into a Constraint that validates complete
outputs and makes incremental checkers for streams.

Engines: jsonschema gives the final verdict on JSON (order-insensitive, per-path messages); llguidance
over a byte tokenizer matches regex, Lark, GBNF and choice, and checks JSON while it streams. Compiling
costs milliseconds (llguidance drops the GIL), so the event loop uses `compile_async`, which only
leaves the loop on a cache miss.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import llguidance as llg

from gateway.errors import GrammarTooComplex, InvalidGrammar
from gateway.frozen_init import fast_init
from grammars import engine
from grammars.checker import IncrementalChecker
from grammars.spec import ConstraintSpec, Kind, Violation, parse_json
from grammars.walk import without_keywords

if TYPE_CHECKING:
    from grammars.schema import SchemaCheck

__all__ = [
    "LRU",
    "Constraint",
    "IncrementalChecker",
    "Violation",
    "compile_async",
    "compile_constraint",
    "object_check",
]

CACHE_SIZE: Final[int] = 256
# Formats are left to jsonschema: engines disagree on them (llguidance's email is stricter than
# jsonschema's), and a stream must never be cut for a reason the final verdict would not share.
_STREAM_IGNORED: Final[frozenset[str]] = frozenset({"format"})
# kinds whose matching may grow faster than the output (an ambiguous grammar): their checks are bounded in
# time (`engine.Fuel`); regexes and choices are matched by a lexer, in time linear in the output
_CONTEXT_FREE: Final[frozenset[str]] = frozenset({"lark", "gbnf"})
V = TypeVar("V")


@fast_init
@dataclass(frozen=True, slots=True, eq=False)
class _Core:
    """What compiling produced; shared by every Constraint with the same key."""

    kind: Kind
    exact: llg.LLMatcher | None  # the full grammar (for json_schema: None if llguidance can't build it)
    syntax: llg.LLMatcher | None  # JSON kinds: any JSON of the schema's top-level type
    schema: SchemaCheck | None  # JSON kinds: the final verdict
    warnings: tuple[str, ...]
    # set once a check ran a copy of `exact` out of lexer states: every copy shares them (`Constraint.spoiled`)
    spent: threading.Event = field(default_factory=threading.Event)
    # numbers the checks of `exact` (a thread-safe count): a check that was the first and is still the only
    # one when it spends the lexer spent a fresh lexer by itself, which a fresh compile would not help
    uses: Iterator[int] = field(default_factory=itertools.count)


@fast_init
@dataclass(frozen=True, slots=True, eq=False)
class Constraint:
    """A compiled constraint. Thread-safe; each `checker()` is for one stream."""

    spec: ConstraintSpec
    _core: _Core

    @property
    def warnings(self) -> tuple[str, ...]:
        """Parts of the constraint the streaming check cannot enforce (the final verdict still does)."""
        return self._core.warnings

    def validate(self, text: str) -> Violation | None:
        """Check a complete output; None when it satisfies the constraint."""
        core = self._core
        if core.schema is not None:
            return core.schema.check(text)
        constraint, renewals = self, 0
        while True:
            try:
                return constraint._check(text)
            except GrammarTooComplex as exc:
                # other answers may have spent (or nearly spent) the lexer this check shares: again, on a
                # fresh compile; more than once only while another check spent that fresh one
                if exc.spent_alone or not _renew(renewals, exc.spent_by_another):
                    raise
                constraint, renewals = compile_constraint(self.spec), renewals + 1

    def _check(self, text: str) -> Violation | None:
        core = self._core
        assert core.exact is not None  # non-JSON kinds always have their grammar
        first = next(core.uses) == 0
        try:
            return engine.check_complete(core.exact, text, bounded=core.kind in _CONTEXT_FREE)
        except GrammarTooComplex as exc:
            exc.spent_by_another = core.spent.is_set()
            exc.spent_alone = first and next(core.uses) == 1
            self.spoiled()
            raise

    def spoiled(self) -> None:
        """A check hit a parser limit. A lexer that ran out of states stays out of them in every copy of
        the pristine matcher, which would refuse every later answer: the compile is marked spent, and the
        next compile of this spec builds a fresh one."""
        self._core.spent.set()
        _CACHE.discard(self.spec.key, self._core)

    @property
    def current(self) -> bool:
        """False once a check spoiled this compile: a holder of compiled constraints compiles again."""
        return not self._core.spent.is_set()

    def checker(self, *, native: bool) -> IncrementalChecker:
        """A streaming checker. `native=True` means the upstream was constrained natively with the same
        schema (keys come in schema order), so the schema grammar itself can cut the stream; with
        `native=False` JSON kinds are checked for JSON syntax only while streaming. Either way a JSON
        checker's `finish()` returns the full jsonschema verdict."""
        core = self._core
        if core.schema is None:
            assert core.exact is not None
            return IncrementalChecker(core.exact.deep_copy(), json_document=False, final=None,
                                      bounded=core.kind in _CONTEXT_FREE,
                                      on_limit=_Renewal(self, first=next(core.uses) == 0))
        assert core.syntax is not None
        if native and core.exact is not None and core.exact is not core.syntax:
            return IncrementalChecker(core.exact.deep_copy(), json_document=True, final=core.schema.check,
                                      fallback=core.syntax, on_limit=self.spoiled)
        return IncrementalChecker(core.syntax.deep_copy(), json_document=True, final=core.schema.check)


_RENEWALS: Final[int] = 3  # fresh compiles one check may take while other checks keep spending them


def _renew(renewals: int, by_another: bool) -> bool:
    """Whether a check that hit a lexer limit goes on with a fresh compile: the first time always (the
    lexer may have been nearly spent by other answers), later only when another check spent it."""
    return renewals == 0 or (by_another and renewals < _RENEWALS)


class _Renewal:
    """A stream's way out of a spent lexer (`IncrementalChecker`'s `on_limit`): the first call spoils the
    constraint's compile and answers a fresh matcher to replay the output on (other answers may have
    spent the lexer); later calls do so only while another check spent the fresh one (`_renew`), else
    answer None: this answer spends a fresh lexer by itself. So does a stream whose check was the only one
    of its compile (`first`, and no other since): no replay then."""

    __slots__ = ("_constraint", "_first", "_renewals")

    def __init__(self, constraint: Constraint, *, first: bool) -> None:
        self._constraint = constraint
        self._first = first
        self._renewals = 0

    def __call__(self) -> llg.LLMatcher | None:
        core = self._constraint._core
        by_another = core.spent.is_set()
        alone = self._first and next(core.uses) == 1
        self._constraint.spoiled()
        if alone or not _renew(self._renewals, by_another):
            return None
        self._renewals += 1
        self._constraint = compile_constraint(self._constraint.spec)
        # the replay is this stream's check of the fresh compile: alone on it if it stays the only one
        self._first = next(self._constraint._core.uses) == 0
        fresh = self._constraint._core.exact
        return fresh.deep_copy() if fresh is not None else None


class LRU(Generic[V]):
    """A small thread-safe LRU of compiled things, or of compile error messages (so a client resending
    a broken schema does not cost a compile each time)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, V | str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | str | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: str, item: V | str) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def discard(self, key: str, item: V) -> None:
        """Forget `key` if it still holds `item` (a newer compile may have replaced it)."""
        with self._lock:
            if self._items.get(key) is item:
                del self._items[key]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_CACHE: LRU[_Core] = LRU(CACHE_SIZE)


def _from_cache(spec: ConstraintSpec) -> Constraint | None:
    item = _CACHE.get(spec.key)
    if item is None:
        return None
    if isinstance(item, str):
        raise InvalidGrammar(item)
    return Constraint(spec, item)


def compile_constraint(spec: ConstraintSpec) -> Constraint:
    """Compile `spec` (cached by `spec.key`). Raises InvalidGrammar saying what is wrong."""
    hit = _from_cache(spec)
    if hit is not None:
        return hit
    try:
        core = _compile(spec.kind, spec.source)
    except InvalidGrammar as exc:
        _CACHE.put(spec.key, exc.message)
        raise
    _CACHE.put(spec.key, core)
    return Constraint(spec, core)


async def compile_async(spec: ConstraintSpec) -> Constraint:
    """`compile_constraint` for the event loop: a cache hit returns at once, a miss compiles in a
    worker thread."""
    hit = _from_cache(spec)
    if hit is not None:
        return hit
    return await asyncio.to_thread(compile_constraint, spec)


def clear_cache() -> None:
    """Forget every compiled constraint (tests and benchmarks)."""
    _CACHE.clear()


def _compile(kind: Kind, source: str) -> _Core:
    if kind == "json_object":
        return _Core(kind, _syntax("object"), _syntax("object"), object_check(), ())
    if kind == "json_schema":
        return _compile_schema(source)
    if kind == "choice":
        _check_choice(source)
    try:
        grammar = engine.grammar_for(kind, source)
    except ValueError as exc:
        raise InvalidGrammar(f"{kind}: {exc}") from exc
    matcher, error = engine.build_matcher(grammar)
    if matcher is None:
        raise InvalidGrammar(f"{kind}: {error}")
    return _Core(kind, matcher, None, None, tuple(matcher.get_grammar_warnings()))


def _compile_schema(source: str) -> _Core:
    # jsonschema loads with the first JSON constraint, not at import: a gateway whose grammars are all
    # regex/choice/Lark/GBNF never pays its import time and memory
    from grammars.schema import build_check

    schema, violation = parse_json(source)
    if violation is not None:
        raise InvalidGrammar(f"json_schema: the schema is {violation.message}")
    check = build_check(schema)
    if isinstance(schema, bool):
        # llguidance takes object schemas only: `true` is any JSON, `false` leaves only the verdict.
        matcher = _syntax("any") if schema else None
    else:
        try:
            grammar = engine.grammar_for_schema(without_keywords(schema, _STREAM_IGNORED))
        except ValueError:
            grammar = None
        matcher = engine.build_matcher(grammar)[0] if grammar is not None else None
    # A schema llguidance cannot turn into a grammar (e.g. look-around in a pattern) is still a valid
    # schema: stream-check its JSON syntax only and leave the rest to jsonschema.
    warnings = (
        tuple(matcher.get_grammar_warnings())
        if matcher is not None
        else ("the schema cannot be checked while streaming; only JSON syntax is",)
    )
    return _Core("json_schema", matcher, _syntax(_top_type(schema)), check, warnings)


def _top_type(schema: Any) -> str:
    declared = schema.get("type") if isinstance(schema, dict) else None
    return declared if declared in ("object", "array") else "any"


@functools.cache
def _syntax(top: str) -> llg.LLMatcher:
    """A pristine any-JSON matcher (of one top-level type); shared, only ever deep-copied."""
    schema: dict[str, Any] = {} if top == "any" else {"type": top}
    matcher, error = engine.build_matcher(engine.grammar_for_schema(schema))
    if matcher is None:  # pragma: no cover - a fixed, tested grammar
        raise RuntimeError(f"llguidance rejected the any-JSON grammar: {error}")
    return matcher


@functools.cache
def object_check() -> SchemaCheck:
    """The check of "any JSON object" (arguments of a tool that declares no schema)."""
    from grammars.schema import build_check  # loaded on first use (see _compile_schema)

    return build_check({"type": "object"})


def _check_choice(source: str) -> None:
    options, violation = parse_json(source)
    if violation is not None:
        raise InvalidGrammar(f"choice: options must be a JSON array of strings ({violation.message})")
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise InvalidGrammar("choice: options must be a non-empty JSON array of strings")
