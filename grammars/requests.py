"""Constraints a request brings itself (Chat Completions here; the Responses API's `text.format` and
Anthropic's structured outputs below).

Recognised fields (OpenAI and vLLM wire):
- `response_format`: `{"type": "json_schema", "json_schema": {"name", "schema", ...}}` (no `schema`
  means any JSON object), `{"type": "json_object"}`, `{"type": "text"}` (no constraint).
- vLLM before 0.12: `guided_json` (object or JSON text), `guided_regex`, `guided_grammar` (GBNF when
  it contains `::=`, else Lark), `guided_choice` (list of strings).
- vLLM 0.12+: `structured_outputs: {json | regex | grammar | choice | json_object: true}`; other keys
  of it (whitespace_pattern, disable_fallback, ...) are options, not constraints, and are ignored.
`null` values count as absent. Malformed values raise InvalidGrammar whose `param` names the field;
whether a schema or grammar compiles is checked later, by `compile_async`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.errors import InvalidGrammar
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec, json_schema_spec, parse_json

VLLM_ONLY_FIELDS: Final[tuple[str, ...]] = (
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
)


def request_constraints(body: Mapping[str, Any]) -> tuple[ConstraintSpec, ...]:
    """Every constraint `body` asks for, in field order, without duplicates (same kind and source)."""
    specs: list[ConstraintSpec] = []
    rf = body.get("response_format")
    if rf is not None:
        specs.extend(_response_format(rf))
    for field in ("guided_json", "guided_regex", "guided_grammar", "guided_choice"):
        value = body.get(field)
        if value is not None:
            specs.append(_guided(field, field.removeprefix("guided_"), value))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise _bad("structured_outputs", "must be an object")
        for key in ("json", "regex", "grammar", "choice"):
            if so.get(key) is not None:
                specs.append(_guided(f"structured_outputs.{key}", key, so[key]))
        if so.get("json_object") is True:
            specs.append(JSON_OBJECT)
    unique: dict[str, ConstraintSpec] = {}
    for spec in specs:
        unique.setdefault(spec.key, spec)
    return tuple(unique.values())


def responses_constraints(body: Mapping[str, Any]) -> tuple[ConstraintSpec, ...]:
    """The constraint an OpenAI Responses request asks for in `text.format` (flat: `name`, `schema`)."""
    text = body.get("text")
    if text is None:
        return ()
    if not isinstance(text, Mapping):
        raise _bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return ()
    if not isinstance(fmt, Mapping):
        raise _bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return ()
    if kind == "json_object":
        return (JSON_OBJECT,)
    if kind != "json_schema":
        raise _bad("text.format.type", f"{kind!r} is not supported (text, json_object, json_schema)")
    name = fmt.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad("text.format.name", "must be a string")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping | bool):
        raise _bad("text.format.schema", "must be an object")
    return (json_schema_spec(_plain(schema), name),)


def anthropic_constraints(body: Mapping[str, Any]) -> tuple[ConstraintSpec, ...]:
    """The constraint an Anthropic Messages request asks for: structured outputs' `output_config.format`
    (or the beta's top-level `output_format`), `{"type": "json_schema", "schema": {...}}`."""
    specs: list[ConstraintSpec] = []
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, Mapping):
            raise _bad("output_config", "must be an object")
        if config.get("format") is not None:
            specs.append(_anthropic_format("output_config.format", config["format"]))
    if body.get("output_format") is not None:
        specs.append(_anthropic_format("output_format", body["output_format"]))
    return tuple({spec.key: spec for spec in specs}.values())


def _anthropic_format(field: str, fmt: Any) -> ConstraintSpec:
    if not isinstance(fmt, Mapping):
        raise _bad(field, "must be an object")
    if fmt.get("type") != "json_schema":
        raise _bad(f"{field}.type", f"{fmt.get('type')!r} is not supported (json_schema)")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise _bad(f"{field}.schema", "must be an object")
    return json_schema_spec(_plain(schema), None)


def strip_guided_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of `body` without the vLLM-only fields, for upstreams that reject them."""
    return {k: v for k, v in body.items() if k not in VLLM_ONLY_FIELDS}


def grammar_kind(text: str) -> str:
    """ "gbnf" when the grammar uses GBNF's `::=`, else "lark"."""
    return "gbnf" if "::=" in text else "lark"


def _response_format(rf: Any) -> list[ConstraintSpec]:
    if not isinstance(rf, Mapping):
        raise _bad("response_format", "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [JSON_OBJECT]
    if kind != "json_schema":
        raise _bad("response_format.type", f"{kind!r} is not supported (text, json_object, json_schema)")
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise _bad("response_format.json_schema", "must be an object")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad("response_format.json_schema.name", "must be a string")
    schema = js.get("schema")
    if schema is None:
        return [JSON_OBJECT]
    if not isinstance(schema, Mapping | bool):
        raise _bad("response_format.json_schema.schema", "must be an object")
    return [json_schema_spec(_plain(schema), name)]


def _guided(field: str, what: str, value: Any) -> ConstraintSpec:
    if what == "json":
        if isinstance(value, str):
            value, violation = parse_json(value)
            if violation is not None:
                raise _bad(field, f"is a string but {violation.message}")
        if not isinstance(value, Mapping | bool):
            raise _bad(field, "must be a JSON schema (an object, or its JSON text)")
        return json_schema_spec(_plain(value))
    if what == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise _bad(field, "must be a non-empty list of strings")
        return choice_spec(value)
    if not isinstance(value, str):
        raise _bad(field, "must be a string")
    if what == "regex":
        return ConstraintSpec("regex", value)
    if not value.strip():
        raise _bad(field, "must not be empty")
    return ConstraintSpec("gbnf" if grammar_kind(value) == "gbnf" else "lark", value)


def _plain(value: Any) -> Any:
    """Any Mapping as a dict and any tuple as a list, recursively (orjson serializes only those)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _bad(field: str, problem: str) -> InvalidGrammar:
    return InvalidGrammar(f"{field} {problem}", param=field)
