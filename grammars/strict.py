"""OpenAI strict-mode schemas, made from ordinary JSON Schemas without touching the input.

Strict mode wants every property listed in `required` and `additionalProperties: false` on every
object, and rejects keywords it does not support. The conversion: optional properties become required
but nullable (OpenAI's documented way to express "optional"), `oneOf` becomes `anyOf`, unsupported
keywords and formats are dropped (jsonschema still enforces them on the answer). Schemas strict mode
cannot express at all give None: a root that is not an object, a map (`additionalProperties` true or a
schema, `patternProperties`), tuple `items`, boolean or empty subschemas.

Because the model may then answer `null` for an optional property, answers are checked against
`nullable_optionals(schema)`, a superset of the original schema that also accepts those nulls.
"""

from __future__ import annotations

from typing import Any, Final

from grammars.walk import map_schema

OPENAI_KEYWORDS: Final[frozenset[str]] = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "description",
        "title",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
    }
)
OPENAI_FORMATS: Final[frozenset[str]] = frozenset(
    {
        "date-time",
        "time",
        "date",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uuid",
    }
)
# Keywords whose presence means the schema is a map or otherwise not expressible in strict mode.
_INEXPRESSIBLE: Final[frozenset[str]] = frozenset({"patternProperties", "unevaluatedProperties"})
_TYPED: Final[tuple[str, ...]] = ("type", "anyOf", "$ref", "enum", "const")
_NULL: Final[dict[str, str]] = {"type": "null"}


class _InexpressibleError(Exception):
    """Raised inside the conversion; turned into None at the top."""


def openai_strict_schema(schema: Any) -> dict[str, Any] | None:
    """A new strict-mode-compatible schema, or None when strict mode cannot express `schema`."""
    if not isinstance(schema, dict) or not is_object_schema(schema) or "anyOf" in schema or "oneOf" in schema:
        return None
    try:
        return _strict(schema)
    except (_InexpressibleError, AttributeError, TypeError, ValueError):
        return None  # not a valid schema either: compiling it gives the caller its 400


def nullable_optionals(schema: Any) -> Any:
    """A copy of `schema` in which every optional property also accepts null (a superset)."""
    return map_schema(schema, _relax_object)


def is_object_schema(node: dict[str, Any]) -> bool:
    declared = node.get("type")
    return (
        declared == "object" or (isinstance(declared, list) and "object" in declared) or "properties" in node
    )


def nullable(node: Any) -> Any:
    """A copy of subschema `node` that also accepts null."""
    if not isinstance(node, dict):
        return node
    declared = node.get("type")
    branches = node.get("anyOf")
    if isinstance(branches, list) and set(node) <= {"anyOf", "description", "title"}:
        # Widen the existing alternatives instead of nesting them one level deeper.
        return node if _NULL in branches else {**node, "anyOf": [*branches, dict(_NULL)]}
    if declared is None or any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")):
        return {"anyOf": [node, dict(_NULL)]}
    if isinstance(declared, str):
        return node if declared == "null" else {**node, "type": [declared, "null"]}
    if isinstance(declared, list):
        return node if "null" in declared else {**node, "type": [*declared, "null"]}
    return node


def _relax_object(node: dict[str, Any]) -> dict[str, Any]:
    props = node.get("properties")
    if not isinstance(props, dict):
        return node
    required = set(node.get("required", ()))
    return {**node, "properties": {n: s if n in required else nullable(s) for n, s in props.items()}}


def _strict(node: Any) -> dict[str, Any]:
    if not isinstance(node, dict) or any(k in node for k in _INEXPRESSIBLE):
        raise _InexpressibleError
    if "oneOf" in node and "anyOf" in node:
        raise _InexpressibleError
    out: dict[str, Any] = {}
    for key, value in node.items():
        key = "anyOf" if key == "oneOf" else key  # exclusivity is checked on the answer
        if key not in OPENAI_KEYWORDS or key == "required":
            continue
        if key == "format" and value not in OPENAI_FORMATS:
            continue
        if key in ("properties", "$defs", "definitions"):
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = _strict(value)
        elif key == "anyOf":
            out[key] = [_strict(sub) for sub in value]
        elif key == "additionalProperties":
            if value is not False:
                raise _InexpressibleError  # a map: strict mode would force it to be empty
        else:
            out[key] = _copy(value)
    if is_object_schema(node):
        props = out.setdefault("properties", {})
        required = set(node.get("required", ()))
        for name, sub in props.items():
            if name not in required:
                props[name] = nullable(sub)
        out["required"] = list(props)
        out["additionalProperties"] = False
    if not any(k in out for k in _TYPED):
        raise _InexpressibleError  # strict mode rejects untyped ("any value") subschemas
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
