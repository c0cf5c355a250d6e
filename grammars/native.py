"""Native structured-output parameters per upstream dialect.

`native_params(dialect, spec)` gives the top-level fields to merge into an OpenAI-wire request body so
that the upstream constrains decoding itself, or None when the dialect cannot express the constraint
(then tollgate only validates). Table (schema = json_schema, obj = json_object):

| dialect     | json_schema / json_object                  | regex          | lark / gbnf    | choice      |
|-------------|--------------------------------------------|----------------|----------------|-------------|
| openai      | response_format json_schema strict / j.o.  | -              | -              | -           |
| vllm        | structured_outputs.json                    | .regex         | .grammar       | .choice     |
| vllm-legacy | guided_json                                | guided_regex   | guided_grammar | guided_choice|
| llamacpp    | json_schema                                | grammar (GBNF) | - / grammar    | grammar     |
| ollama      | response_format json_schema / json_object  | -              | -              | -           |
| sglang      | response_format json_schema                | regex          | - / ebnf       | regex       |
| none        | -                                          | -              | -              | -           |

Ollama: its OpenAI-compatible endpoint turns `response_format` into its native `format`; a top-level
`format` field would be silently ignored there.

OpenAI (`openai` dialect): the schema is rewritten for strict mode by `grammars.strict.openai_strict_schema`,
which only narrows it (every property required with its own schema, `additionalProperties: false`) and
drops only keywords that narrow values alone; a schema it cannot rewrite so (None) is not sent at all,
and answers are validated only. Answers are always validated against the spec itself, the agent's own
schema (no rewrite here widens it). `native_is_exact` says whether the native form emits JSON keys in
schema order (so `checker(native=True)` is safe).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Final

import orjson

from gateway.errors import InvalidGrammar
from grammars.gbnf import choice_to_gbnf, regex_alternatives, regex_to_gbnf
from grammars.spec import ConstraintSpec
from grammars.strict import openai_strict_schema

DIALECTS: Final[tuple[str, ...]] = ("openai", "vllm", "vllm-legacy", "llamacpp", "ollama", "sglang", "none")
# Dialects whose decoders emit object keys in schema order, optional ones included in place.
# llama.cpp (and Ollama, built on it) moves required properties before optional ones.
_ORDERED: Final[frozenset[str]] = frozenset({"openai", "vllm", "vllm-legacy", "sglang"})
_ANY_OBJECT: Final[dict[str, Any]] = {"type": "object"}
_VLLM_FIELDS: Final[dict[str, str]] = {
    "json_schema": "json",
    "regex": "regex",
    "lark": "grammar",
    "gbnf": "grammar",
    "choice": "choice",
}


def native_params(dialect: str, spec: ConstraintSpec) -> dict[str, Any] | None:
    """Fields to merge into the request body, or None when `dialect` cannot express `spec`.
    The returned dict is new on every call (callers may mutate it). `spec` must compile."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown structured-output dialect {dialect!r}")
    if dialect == "none":
        return None
    kind = spec.kind
    if kind == "json_object":
        return _json_object(dialect)
    value: Any = _loads(spec.source) if kind in ("json_schema", "choice") else spec.source
    if dialect == "openai":
        return _openai(spec, value) if kind == "json_schema" else None
    if dialect == "vllm":
        return {"structured_outputs": {_VLLM_FIELDS[kind]: value}}
    if dialect == "vllm-legacy":
        return {"guided_" + _VLLM_FIELDS[kind]: value}
    if dialect == "llamacpp":
        return _llamacpp(kind, value)
    if dialect == "ollama":
        return _response_format(spec, value) if kind == "json_schema" else None
    return _sglang(spec, value)


def native_is_exact(dialect: str, spec: ConstraintSpec) -> bool:
    """True when the native form makes the upstream emit exactly what the spec's grammar expects, keys in schema order included, so `checker(native=True)` cannot cut a good answer."""
    if native_params(dialect, spec) is None:
        return False
    return dialect in _ORDERED or not spec.is_json


def schema_name(name: str | None) -> str:
    """A response_format name OpenAI accepts: ^[a-zA-Z0-9_-]{1,64}$."""
    cleaned = re.sub(r"[^a-zA-Z0-9_-]", "_", name or "")[:64]
    return cleaned or "output"


def _json_object(dialect: str) -> dict[str, Any]:
    if dialect in ("openai", "ollama"):
        return {"response_format": {"type": "json_object"}}
    if dialect == "vllm":
        return {"structured_outputs": {"json": dict(_ANY_OBJECT)}}
    if dialect == "vllm-legacy":
        return {"guided_json": dict(_ANY_OBJECT)}
    if dialect == "llamacpp":
        return {"json_schema": dict(_ANY_OBJECT)}
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "json_object", "schema": dict(_ANY_OBJECT)},
        }
    }


def _openai(spec: ConstraintSpec, schema: Any) -> dict[str, Any] | None:
    strict = _strict_json(spec.source)
    if strict is None:
        return None
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": schema_name(spec.name), "strict": True, "schema": orjson.loads(strict)},
        }
    }


@functools.lru_cache(maxsize=256)
def _strict_json(source: str) -> str | None:
    # Cached as text: converting walks the whole schema, and callers get a fresh dict each time.
    strict = openai_strict_schema(orjson.loads(source))
    return None if strict is None else orjson.dumps(strict).decode()


def _response_format(spec: ConstraintSpec, schema: Any) -> dict[str, Any]:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": schema_name(spec.name), "schema": schema},
        }
    }


def _llamacpp(kind: str, value: Any) -> dict[str, Any] | None:
    if kind == "json_schema":
        return {"json_schema": value}
    if kind == "gbnf":
        return {"grammar": value}
    if kind == "choice":
        return {"grammar": choice_to_gbnf(value)}
    if kind == "regex":
        try:
            return {"grammar": regex_to_gbnf(value)}
        except InvalidGrammar:
            return None  # valid for llguidance but not expressible in GBNF: validate only
    return None  # Lark: llama.cpp reads GBNF only


def _sglang(spec: ConstraintSpec, value: Any) -> dict[str, Any] | None:
    kind = spec.kind
    if kind == "json_schema":
        return _response_format(spec, value)
    if kind == "regex":
        return {"regex": value}
    if kind == "gbnf":
        return {"ebnf": value}
    if kind == "choice":
        return {"regex": regex_alternatives(value)}
    return None  # Lark: SGLang's `ebnf` is a GBNF-like dialect


def _loads(source: str) -> Any:
    try:
        return orjson.loads(source)
    except orjson.JSONDecodeError as exc:
        raise InvalidGrammar(f"not valid JSON: {exc}") from exc
