"""Schema-aware rebuilding of JSON Schemas: knows which keywords hold subschemas, so that a property
*named* "format" is never mistaken for the `format` keyword. Never mutates its input.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final

# Keywords whose value is one subschema (or, for the two item keywords of old drafts, a list of them).
SINGLE: Final[frozenset[str]] = frozenset(
    {
        "additionalProperties",
        "items",
        "additionalItems",
        "contains",
        "not",
        "if",
        "then",
        "else",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
LISTS: Final[frozenset[str]] = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
MAPS: Final[frozenset[str]] = frozenset(
    {
        "properties",
        "patternProperties",
        "$defs",
        "definitions",
        "dependentSchemas",
        "dependencies",
    }
)

SchemaFn = Callable[[dict[str, Any]], Any]


def map_schema(node: Any, fn: SchemaFn) -> Any:
    """Rebuild `node` bottom-up: every object subschema is rebuilt with its subschemas already mapped,
    then passed to `fn`, whose result replaces it. Booleans and non-schema values are copied as is."""
    if not isinstance(node, dict):
        return copy.deepcopy(node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in SINGLE and isinstance(value, dict | bool):
            out[key] = map_schema(value, fn)
        elif (key in LISTS or key in SINGLE) and isinstance(value, list):
            out[key] = [map_schema(item, fn) for item in value]
        elif key in MAPS and isinstance(value, dict):
            # `dependencies` (draft 7) mixes schemas and lists of names; map_schema copies lists as is.
            out[key] = {name: map_schema(sub, fn) for name, sub in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    return fn(out)


def without_keywords(schema: Any, keywords: frozenset[str]) -> Any:
    """A copy of `schema` with `keywords` removed from every subschema."""
    return map_schema(schema, lambda node: {k: v for k, v in node.items() if k not in keywords})
