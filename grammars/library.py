"""Named grammars: the ones shipped in `grammars/builtin/` plus a user folder from config.

A grammar's name is its file stem and its kind comes from the suffix: `.json` (JSON Schema), `.regex`
(the file's text without its final line break), `.lark`, `.gbnf`, `.choice` (one option per line;
surrounding whitespace is trimmed and blank lines are skipped). Other files, and names starting with
a dot, are ignored. A user grammar replaces a shipped one of the same name. Every user grammar is
compiled at load, so a broken file is a config error, not a surprise at request time; the shipped ones
compile on first use (tests/grammars/test_library.py keeps each of them compiling), so startup pays
neither their compile time nor jsonschema's import for `ticket.json`.

`resolve(ref)` also accepts inline constraints (for `output.grammar` in config, and the
`x-tollgate-grammar` header):
- `regex:<pattern>`          e.g. `regex:^[a-z]+$`
- `choice:<JSON array>`      e.g. `choice:["yes","no"]`
- `json_schema:<JSON>`       e.g. `json_schema:{"type":"object","required":["id"]}`
- `lark:<grammar>` / `gbnf:<grammar>`
- `json_object`              any JSON object (unless a grammar is named so)
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Final

import orjson

from gateway.errors import ConfigError, InvalidGrammar
from gateway.frozen_init import fast_init
from grammars.compile import compile_constraint
from grammars.spec import JSON_OBJECT, ConstraintSpec, Kind, parse_json

SUFFIXES: Final[dict[str, Kind]] = {
    ".json": "json_schema",
    ".regex": "regex",
    ".lark": "lark",
    ".gbnf": "gbnf",
    ".choice": "choice",
}
_MAX_LISTED: Final[int] = 20
INLINE_PREFIXES: Final[dict[str, Kind]] = {
    "json_schema": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "lark": "lark",
    "gbnf": "gbnf",
}


@fast_init
@dataclass(frozen=True, slots=True, eq=False)
class GrammarLibrary:
    """An immutable name -> spec table; every spec in it compiles (see the module doc for when)."""

    grammars: Mapping[str, ConstraintSpec]

    @classmethod
    def load(cls, user_dir: Path | None = None) -> GrammarLibrary:
        """The shipped grammars plus those in `user_dir` (a missing folder counts as empty).
        Raises ConfigError naming each broken grammar as `grammars.<name>`."""
        problems: list[tuple[str, str]] = []
        table = _read_folder(importlib.resources.files("grammars.builtin"), problems)
        user: dict[str, ConstraintSpec] = {}
        if user_dir is not None:
            if user_dir.exists() and not user_dir.is_dir():
                raise ConfigError([("grammars.dir", f"{user_dir} is not a folder")])
            if user_dir.is_dir():
                user = _read_folder(user_dir, problems)
                table.update(user)
        for name, spec in user.items():
            try:
                compile_constraint(spec)
            except InvalidGrammar as exc:
                problems.append((f"grammars.{name}", exc.message))
        if problems:
            raise ConfigError(problems)
        return cls(MappingProxyType(dict(sorted(table.items()))))

    def names(self) -> tuple[str, ...]:
        """Every grammar name, sorted."""
        return tuple(self.grammars)

    def get(self, name: str) -> ConstraintSpec:
        """The named grammar. Raises InvalidGrammar when there is none."""
        spec = self.grammars.get(name)
        if spec is None:
            names = list(self.grammars)
            known = ", ".join(names[:_MAX_LISTED]) + (", ..." if len(names) > _MAX_LISTED else "")
            raise InvalidGrammar(f"unknown grammar {name!r} (known: {known or 'none'})")
        return spec

    def resolve(self, ref: str, *, check: bool = True) -> ConstraintSpec:
        """A grammar name or an inline constraint (see the module doc). Raises InvalidGrammar when the
        name is unknown or, with `check`, when the inline constraint does not compile. On the event
        loop pass `check=False` and `await compile_async(spec)`: compiling may take milliseconds."""
        prefix, sep, source = ref.partition(":")
        kind = INLINE_PREFIXES.get(prefix) if sep else None
        if kind is not None:
            spec = _inline(kind, source)
        elif ref in self.grammars:
            spec = self.grammars[ref]
        elif ref == "json_object":
            spec = JSON_OBJECT
        else:
            spec = self.get(ref)
        if check:
            compile_constraint(spec)
        return spec


def _inline(kind: Kind, source: str) -> ConstraintSpec:
    if kind in ("json_schema", "choice"):
        value, violation = parse_json(source)
        if violation is not None:
            raise InvalidGrammar(f"inline {kind}: {violation.message}")
        # Re-serialised so that the same schema written differently shares one cache entry.
        source = orjson.dumps(value).decode()
    return ConstraintSpec(kind, source)


def _read_folder(folder: Traversable, problems: list[tuple[str, str]]) -> dict[str, ConstraintSpec]:
    table: dict[str, ConstraintSpec] = {}
    files: dict[str, str] = {}
    for entry in sorted(_grammar_files(folder.iterdir()), key=lambda e: e.name):
        name, suffix = _split(entry.name)
        if name in files:
            problems.append((f"grammars.{name}", f"defined twice: {files[name]} and {entry.name}"))
            continue
        files[name] = entry.name
        try:
            text = entry.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append((f"grammars.{name}", f"cannot read {entry.name}: {exc}"))
            continue
        spec = _spec_from_file(name, SUFFIXES[suffix], text)
        if isinstance(spec, str):
            problems.append((f"grammars.{name}", spec))
        else:
            table[name] = spec
    return table


def _grammar_files(entries: Iterable[Traversable]) -> Iterable[Traversable]:
    for entry in entries:
        name, suffix = _split(entry.name)
        if name and not name.startswith(".") and suffix in SUFFIXES and entry.is_file():
            yield entry


def _split(filename: str) -> tuple[str, str]:
    stem, dot, suffix = filename.rpartition(".")
    return (stem, dot + suffix) if dot else (filename, "")


def _spec_from_file(name: str, kind: Kind, text: str) -> ConstraintSpec | str:
    """The spec a file defines, or the problem with it."""
    if kind == "regex":
        return ConstraintSpec(kind, text.removesuffix("\n").removesuffix("\r"), name)
    if kind == "choice":
        options = [line.strip() for line in text.splitlines() if line.strip()]
        if not options:
            return "a .choice file needs at least one option (one per line)"
        return ConstraintSpec(kind, orjson.dumps(options).decode(), name)
    if kind == "json_schema":
        value, violation = parse_json(text)
        if violation is not None:
            return violation.message
        return ConstraintSpec(kind, orjson.dumps(value).decode(), name)
    return ConstraintSpec(kind, text, name)
