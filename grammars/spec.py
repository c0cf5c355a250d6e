"""What a constraint is, independent of how it is compiled or enforced.

A `ConstraintSpec` is plain data: the kind, the source text and an optional name. Its `key` is a
content hash of kind + source (never the name), so two requests that bring the same schema share one
compiled constraint. `Violation` is the verdict type every checker returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from gateway.frozen_init import fast_init

Kind = Literal["json_schema", "json_object", "regex", "lark", "gbnf", "choice"]
KINDS: Final[tuple[Kind, ...]] = ("json_schema", "json_object", "regex", "lark", "gbnf", "choice")
JSON_KINDS: Final[frozenset[str]] = frozenset({"json_schema", "json_object"})


@fast_init
@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """One output constraint.

    `source` is: the JSON text of the schema (json_schema), `""` (json_object), the regex (regex), the
    grammar text (lark, gbnf), or a JSON array of strings (choice). Nothing is checked here: compiling
    (`grammars.compile.compile_constraint`) is what rejects a bad source.
    """

    kind: Kind
    source: str
    name: str | None = None
    # Computed once in __post_init__: specs are hashed on every request that carries one.
    _key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}")
        digest = hashlib.sha256(f"{self.kind}\x00{self.source}".encode("utf-8", "surrogatepass"))
        object.__setattr__(self, "_key", digest.hexdigest())

    @property
    def key(self) -> str:
        """Content hash of kind and source (hex sha256); the cache key of the compiled constraint."""
        return self._key

    @property
    def is_json(self) -> bool:
        """True for json_schema and json_object."""
        return self.kind in JSON_KINDS


@fast_init
@dataclass(frozen=True, slots=True)
class Violation:
    """Why an output does not satisfy its constraint.

    `message` is written for a human and for the model (it is quoted in the re-ask). `offset` is the
    character index (Python `str` index) in the output where it went wrong, when that is known.
    `summary` is the same without any of the output's own text, when `message` quotes some: telemetry
    and the ledger carry `redacted`, never the output (content capture is opt-in).
    """

    message: str
    offset: int | None = None
    summary: str | None = field(default=None, compare=False)  # derived from message: not part of equality

    @property
    def redacted(self) -> str:
        return self.message if self.summary is None else self.summary


def json_schema_spec(schema: Mapping[str, Any] | bool, name: str | None = None) -> ConstraintSpec:
    """A json_schema spec from a schema object; key order is kept (it is the order engines emit)."""
    return ConstraintSpec("json_schema", orjson.dumps(schema).decode(), name)


def choice_spec(options: Sequence[str], name: str | None = None) -> ConstraintSpec:
    """A choice spec from its options."""
    return ConstraintSpec("choice", orjson.dumps(list(options)).decode(), name)


JSON_OBJECT: Final[ConstraintSpec] = ConstraintSpec("json_object", "")


def parse_json(text: str) -> tuple[Any, Violation | None]:
    """Parse one JSON document (surrounding whitespace allowed); a Violation says why not. NaN,
    Infinity and lone surrogates are rejected (orjson), as the streaming checker does."""
    try:
        return orjson.loads(text), None
    except orjson.JSONDecodeError as exc:
        return None, Violation(f"not valid JSON: {exc.msg} at char {exc.pos}", exc.pos)
