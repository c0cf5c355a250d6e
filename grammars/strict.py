"""OpenAI strict-mode schemas, made from ordinary JSON Schemas without touching the input.

Strict mode wants every property of every object listed in `required`, `additionalProperties: false`
on every object, and only the keywords it supports. `openai_strict_schema(O)` gives a strict schema S
for the JSON Schema O, or None when it cannot give one that keeps the contract below: O is then not sent
natively, and answers are validated only.

S differs from O in three ways, and no other:

1. Objects are narrowed, as the OpenAI SDK's `to_strict_json_schema` does: every object schema lists
   each of its properties in `required`, with that property's own schema (no null is added: a
   property whose own schema admits null admits it, the others do not), and gets
   `additionalProperties: false`.
2. Keywords strict mode lacks are dropped only where dropping them widens a value the narrowing never
   touches (annotations, string lengths, formats it does not know, ...: `_ANNOTATIONS`,
   `_STRING_BOUNDS` and the keyword cases of `_Converter.convert`, each with its reason).
3. Exact rewrites: an `allOf` is merged into its schema where no keyword is split from one it reads
   (`_merge_all_of`); a `oneOf` becomes `anyOf` (exclusivity is a dropped constraint of 2.).

So (a) every answer S admits satisfies O, except for the constraints dropped by 2. and 3.; answers
are validated against O itself (never a relaxed copy), so an answer O rejects never reaches the
agent. And (b) S admits every answer of O whose objects carry exactly their declared properties, and
whenever O admits an answer it also admits one of that shape (the answer with each missing optional
property added and each undeclared one removed), provided each optional property admits some value:
S never rules out every answer O admits. Keywords that could make (b) fail give None: any keyword not handled here (`not`, `if`, `prefixItems`,
`dependentRequired`, `propertyNames`, ...), a `required` name outside `properties`, a map
(`additionalProperties` true or a schema, `patternProperties`), a `minProperties`/`maxProperties` the
narrowed object count breaks, a `oneOf` over objects with no discriminating property, `enum`/`const`
objects beside schemas the narrowing changes, ... Also None: a root that is not an object, tuple
`items`, boolean or untyped subschemas, and `$ref`s S could not resolve.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from grammars.fanout import resolve_local

# Keywords strict mode supports, kept as they are (or checked, then kept).
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
# Safe to drop anywhere: annotations, which assert nothing (jsonschema ignores them; `discriminator` is
# OpenAPI's annotation beside a `oneOf`, and `contentSchema` is an annotation from 2019-09 on).
_ANNOTATIONS: Final[frozenset[str]] = frozenset(
    {
        "$comment",
        "examples",
        "default",
        "readOnly",
        "writeOnly",
        "deprecated",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
        "discriminator",
    }
)
# Safe to drop anywhere: they bound a string's length, and the narrowing never changes a string.
_STRING_BOUNDS: Final[frozenset[str]] = frozenset({"minLength", "maxLength"})
# Safe to drop at the root only. `$schema` names O's dialect; the keywords S keeps mean the same in
# every draft except as `_legacy_ref_ok` and the number checks handle. A root `$id` only sets the base
# URI: S's refs are all "#..." ones, which then resolve in the document either way. A nested `$id` starts
# a new resource that "#/..." refs below it are relative to: None.
_ROOT_ONLY: Final[frozenset[str]] = frozenset({"$schema", "$id"})
_NUMBERS: Final[frozenset[str]] = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
# Kept as written, once the value's kind is checked by strict mode itself.
_KEPT: Final[frozenset[str]] = frozenset({"type", "description", "title", "pattern", "minItems", "maxItems"})
_TYPED: Final[tuple[str, ...]] = ("type", "anyOf", "$ref", "enum", "const")
# Keywords whose verdict can depend on which properties an object has (or, for uniqueItems, on whether
# two objects are equal, which the narrowing can change): a subschema free of them judges an object
# and its narrowed form alike. $refs are counted in: their target is not looked at.
_SHAPE_KEYWORDS: Final[frozenset[str]] = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "uniqueItems",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
    }
)
_DATA_KEYWORDS: Final[frozenset[str]] = frozenset({"enum", "const", "default", "examples"})
# allOf merging: a keyword that reads others of its own schema object (additionalProperties reads
# properties and patternProperties, ...) must come from the same part as them.
_READS: Final[dict[str, tuple[str, ...]]] = {
    "additionalProperties": ("properties", "patternProperties"),
    "minContains": ("contains",),
    "maxContains": ("contains",),
    "then": ("if",),
    "else": ("if",),
    "items": ("prefixItems",),
    "additionalItems": ("items",),
}
# Annotations a merge keeps from the first part that has them.
_MERGE_FIRST: Final[frozenset[str]] = _ANNOTATIONS | {"title", "description"}
# Keywords a draft-04/06/07 `$ref` may stand beside: those drafts ignore a $ref's siblings, S would not.
_LEGACY_REF_SIBLINGS: Final[frozenset[str]] = _ANNOTATIONS | {"$ref", "title", "description", "$defs", "definitions"}
_LEGACY_DRAFTS: Final[tuple[str, ...]] = ("draft-03", "draft-04", "draft-06", "draft-07")
_MAX_REF_HOPS: Final[int] = 32


class _InexpressibleError(Exception):
    """Raised inside the conversion; turned into None at the top."""


def openai_strict_schema(schema: Any) -> dict[str, Any] | None:
    """A new strict-mode schema that narrows `schema` (module docstring), or None when strict mode
    cannot express it so."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("$schema")
    legacy = isinstance(declared, str) and any(draft in declared for draft in _LEGACY_DRAFTS)
    converter = _Converter(schema, legacy=legacy)
    try:
        out = converter.convert(schema, at_root=True)
        for ref in converter.refs:  # moved or dropped by the rewrite: S would point nowhere (or elsewhere)
            if not isinstance(resolve_local(out, ref), dict):
                raise _InexpressibleError
    except (_InexpressibleError, AttributeError, TypeError, ValueError, RecursionError):
        return None  # not a valid schema either: compiling it gives the caller its 400
    return out


def is_object_schema(node: dict[str, Any]) -> bool:
    declared = node.get("type")
    return (
        declared == "object" or (isinstance(declared, list) and "object" in declared) or "properties" in node
    )


class _Converter:
    __slots__ = ("legacy", "refs", "root")

    def __init__(self, root: dict[str, Any], *, legacy: bool) -> None:
        self.root = root
        self.legacy = legacy
        self.refs: list[str] = []

    def convert(self, node: Any, *, at_root: bool = False) -> dict[str, Any]:
        if not isinstance(node, dict):
            raise _InexpressibleError  # a boolean subschema: strict mode has none
        if self.legacy and "$ref" in node and not set(node) <= _LEGACY_REF_SIBLINGS:
            raise _InexpressibleError
        if "allOf" in node:
            node = _merge_all_of(node)
        obj = is_object_schema(node)
        if obj and any(k in node for k in ("anyOf", "oneOf", "$ref")):
            # the object's properties are split between this schema and others: this one's
            # `additionalProperties: false` would refuse theirs
            raise _InexpressibleError
        if at_root and not obj:
            raise _InexpressibleError  # strict mode wants an object at the root
        if "oneOf" in node and "anyOf" in node:
            raise _InexpressibleError
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions"):
                if not isinstance(value, dict):
                    raise _InexpressibleError
                out[key] = {name: self.convert(sub) for name, sub in value.items()}
            elif key == "items":
                out[key] = self.convert(value)  # tuple (list) items raise there
            elif key in ("anyOf", "oneOf"):
                if not isinstance(value, list) or not value:
                    raise _InexpressibleError
                if key == "oneOf" and not self._exclusive(value):
                    raise _InexpressibleError
                # oneOf -> anyOf widens by exclusivity only, which the answer's check enforces
                out["anyOf"] = [self.convert(sub) for sub in value]
            elif key == "additionalProperties":
                if value is not False:
                    raise _InexpressibleError  # a map: strict mode would force it to be empty
            elif key == "required":
                # kept as every property (below); a name outside `properties` could never be given
                if not isinstance(value, list):
                    raise _InexpressibleError
                if obj:
                    if not set(value) <= set(node.get("properties", ())):
                        raise _InexpressibleError
                else:
                    _vacuous(node, "object")  # objects are not this schema's values, or raise
            elif key == "$ref":
                if not isinstance(value, str) or not (value == "#" or value.startswith("#/")):
                    raise _InexpressibleError  # S keeps no $id, $anchor or other document
                self.refs.append(value)
                out[key] = value
            elif key in ("enum", "const"):
                if _holds_object(value) and _may_narrow({k: v for k, v in node.items() if k != key}):
                    raise _InexpressibleError  # a listed object may lack what the narrowing requires
                out[key] = _copy(value)
            elif key == "format":
                # a format strict mode does not know only narrows strings, which are never narrowed
                if value in OPENAI_FORMATS:
                    out[key] = value
            elif key in _NUMBERS:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise _InexpressibleError  # draft-04's boolean exclusiveMinimum and the like
                out[key] = value
            elif key in _KEPT:
                out[key] = _copy(value)
            elif key in _ANNOTATIONS or key in _STRING_BOUNDS:
                pass
            elif key in _ROOT_ONLY:
                if not at_root:
                    raise _InexpressibleError
            elif key in ("minProperties", "maxProperties"):
                self._property_count(node, key, value, obj)
            elif key == "uniqueItems":
                if value is True and not _vacuous(node, "array", strict=False) and not _unique_ok(node):
                    raise _InexpressibleError
            elif key == "contains":
                # dropped when its subschema cannot tell an object from its narrowed form: an item it
                # matches then still matches narrowed, so match counts hold
                if not _vacuous(node, "array", strict=False) and not _shape_blind(value):
                    raise _InexpressibleError
            elif key in ("minContains", "maxContains"):
                pass  # bounds on `contains` matches, which the check above keeps as they are
            else:
                raise _InexpressibleError  # allOf left over, not, if/then/else, prefixItems, ...
        if obj:
            props = out.setdefault("properties", {})
            out["required"] = list(props)
            out["additionalProperties"] = False
        if "$ref" in out and len(out) > 1:
            # strict mode refuses a $ref beside other keywords (the OpenAI SDK inlines the target for a
            # pydantic field's description): annotations are dropped, anything else is not expressed
            out = {k: v for k, v in out.items() if k not in ("description", "title")}
            if len(out) > 1:
                raise _InexpressibleError
        if not any(k in out for k in _TYPED):
            raise _InexpressibleError  # strict mode rejects untyped ("any value") subschemas
        return out

    def _property_count(self, node: dict[str, Any], key: str, value: Any, obj: bool) -> None:
        """A narrowed object has exactly as many properties as its schema declares: the bound is then
        always met (dropped) or never (None)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise _InexpressibleError
        if not obj:
            _vacuous(node, "object")
            return
        count = len(node.get("properties", ()))
        if (count < value) if key == "minProperties" else (count > value):
            raise _InexpressibleError

    def _exclusive(self, branches: list[Any]) -> bool:
        """Whether narrowing keeps the branches as exclusive as O made them: nothing in them is narrowed,
        or they are objects told apart by one property's `const`/`enum` values, disjoint per branch (an
        answer's narrowed form carries the property, with a value of its own branch only)."""
        if not any(_may_narrow(branch) for branch in branches):
            return True
        shapes: list[dict[str, Any]] = []
        for branch in branches:
            resolved = self._resolve(branch)
            shape = resolved.get("properties")
            if resolved.get("type") != "object" or not isinstance(shape, dict):
                return False  # a null or a string could match several branches
            shapes.append(shape)
        for name in shapes[0]:
            listed = [_listed(shape.get(name)) for shape in shapes]
            values = [v for v in listed if v is not None]
            if len(values) == len(shapes) and all(
                not _overlap(values[i], values[j]) for i in range(len(values)) for j in range(i + 1, len(values))
            ):
                return True
        return False

    def _resolve(self, node: Any) -> dict[str, Any]:
        """`node` with its $refs followed (in O) and its allOf merged; {} when that is no schema object."""
        for _ in range(_MAX_REF_HOPS):
            if not isinstance(node, dict):
                return {}
            found: dict[str, Any] = _merge_all_of(node) if "allOf" in node else node
            ref = found.get("$ref")
            if ref is None:
                return found
            node = resolve_local(self.root, ref) if isinstance(ref, str) else None
            if node is None:
                raise _InexpressibleError  # another document, an anchor, a pointer to nothing
        return {}


def _merge_all_of(node: dict[str, Any]) -> dict[str, Any]:
    """`node` with its `allOf` merged in, exactly: raise when a merge would change what it admits.
    Parts may share `required` (united), `properties` of distinct names, equal values and annotations
    (the first is kept); a keyword that reads others of its schema object must come with them."""
    branches = node["allOf"]
    if not isinstance(branches, list):
        raise _InexpressibleError
    keys = list(node)
    at = keys.index("allOf")
    # Parts in document order, the branches where the allOf stands (the node itself is part 0): the
    # merged properties then come in the order llguidance's grammar of O expects them (it merges so),
    # which native_is_exact relies on.
    parts: list[tuple[int, dict[str, Any]]] = [(0, {k: node[k] for k in keys[:at]})]
    for branch in branches:
        if branch is True:
            continue
        if not isinstance(branch, dict) or any(k in branch for k in ("$defs", "definitions", "$id", "$schema")):
            raise _InexpressibleError  # refs into a branch's $defs would point nowhere once merged
        parts.append((len(parts), _merge_all_of(branch) if "allOf" in branch else branch))
    parts.append((0, {k: node[k] for k in keys[at + 1 :]}))
    merged: dict[str, Any] = {}
    origins: dict[str, set[int]] = {}
    for index, part in parts:
        for key, value in part.items():
            origins.setdefault(key, set()).add(index)
            if key not in merged:
                merged[key] = value
            elif key == "required":
                if not isinstance(value, list) or not isinstance(merged[key], list):
                    raise _InexpressibleError
                merged[key] = list(dict.fromkeys([*merged[key], *value]))
            elif key == "properties":
                if not isinstance(value, dict) or not isinstance(merged[key], dict) or set(value) & set(merged[key]):
                    raise _InexpressibleError
                merged[key] = {**merged[key], **value}
            elif key not in _MERGE_FIRST and not _same(merged[key], value):
                raise _InexpressibleError
    for reader, read in _READS.items():
        if reader in origins and (
            len(origins[reader]) > 1 or any(not origins.get(k, set()) <= origins[reader] for k in read)
        ):
            raise _InexpressibleError
    return merged


def _vacuous(node: dict[str, Any], kind: str, *, strict: bool = True) -> bool:
    """True when `node` declares a type that excludes `kind`, so keywords about `kind` never apply.
    Otherwise raise (or, with strict=False, answer False)."""
    declared = node.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if types is not None and kind not in types:
        return True
    if strict:
        raise _InexpressibleError
    return False


def _unique_ok(node: dict[str, Any]) -> bool:
    """Whether dropping `uniqueItems` is safe. Narrowing may make two distinct objects equal: harmless
    when no item is narrowed, or when an array of at most one item meets the node's own bounds (a
    `$ref` or `anyOf` beside it may hold other bounds)."""
    if not _may_narrow({k: v for k, v in node.items() if k != "uniqueItems"}):
        return True
    if any(k in node for k in ("$ref", "anyOf", "oneOf")):
        return False
    least = node.get("minItems", 0)
    if "contains" in node:
        least = max(least, node.get("minContains", 1))
    return isinstance(least, int | float) and least < 2


def _subschemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every dict in `node` outside data keywords (conservative: maps of subschemas are yielded too)."""
    if isinstance(node, dict):
        yield node
        for key, value in node.items():
            if key not in _DATA_KEYWORDS:
                yield from _subschemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from _subschemas(item)


def _may_narrow(node: Any) -> bool:
    """Whether converting `node` may narrow some object in its values ($refs are assumed to)."""
    return any("$ref" in sub or is_object_schema(sub) for sub in _subschemas(node))


def _shape_blind(node: Any) -> bool:
    """Whether `node` judges every object as it judges its narrowed form."""
    for sub in _subschemas(node):
        if any(k in sub for k in _SHAPE_KEYWORDS):
            return False
        if any(_holds_object(sub[k]) for k in ("enum", "const") if k in sub):
            return False
    return True


def _holds_object(value: Any) -> bool:
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and any(_holds_object(item) for item in value)


def _listed(node: Any) -> list[Any] | None:
    """The values a discriminating property's schema allows, when it lists them."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    listed = node.get("enum")
    return listed if isinstance(listed, list) else None


def _overlap(first: list[Any], second: list[Any]) -> bool:
    return any(_same(a, b) for a in first for b in second)


def _same(a: Any, b: Any) -> bool:
    """JSON Schema equality: 1 equals 1.0, true does not equal 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
