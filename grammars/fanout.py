"""How many subschemas jsonschema may apply to one value of a document (pure).

Why: in-place applicators (`allOf`, `anyOf`, `oneOf`, `not`, `if` / `then` / `else`, `dependentSchemas`,
`$ref`) apply their subschemas to the same value, and chained through `$ref`s their fan-outs multiply:
16 levels of `anyOf: [{"$ref": next}, {"$ref": next}]`, a 1 KB tool schema, took 6 s to validate
`{"p": 5}` on the event loop, and each two more levels four times that. `in_place_fanout` finds the
largest such count of any subschema, so a schema over a bound is refused when it compiles (its size
alone says nothing: `limits.max_schema_bytes` lets that one through); `in_place_cycle`, whether a subschema
applies itself that way, which no validation of a value reaching it ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import unquote

_IN_PLACE_LISTS: Final = ("allOf", "anyOf", "oneOf")
_IN_PLACE_ONE: Final = ("not", "if", "then", "else")


def in_place_fanout(schema: Any, limit: int) -> int:
    """The most subschemas that may be applied to one value of a document valid or not, counting through
    local `$ref`s (`#` JSON pointers; any other ref counts as one); counting stops past `limit` (the
    result is then some value over it). A ref cycle counts once (`grammars.schema` refuses the ones that
    never descend)."""
    memo: dict[int, int] = {}
    names = _names(schema)

    def cost(node: Any, open_: set[int]) -> int:
        if not isinstance(node, dict):
            return 1
        key = id(node)
        if key in memo:
            return memo[key]
        if key in open_:
            return 1
        open_.add(key)
        total = 1
        for child in _in_place(schema, names, node):
            total += cost(child, open_)
            if total > limit:
                break
        open_.discard(key)
        memo[key] = total
        return total

    best = 0
    for node in _subschemas(schema):
        best = max(best, cost(node, set()))
        if best > limit:
            break
    return best


def in_place_cycle(schema: Any) -> bool:
    """Whether some subschema applies itself to the value it is applied to, through in-place keywords
    alone (`{"$ref": "#"}`, `anyOf: [..., {"$ref": "#"}]`, `if`/`then` to a ref): validating a value that
    reaches it never ends. A ref under a keyword that descends (`properties`, `items`) is a recursive
    schema, which ends with the document. Iterative: no schema is too deep for it."""
    done: set[int] = set()
    names = _names(schema)
    for start in _subschemas(schema):
        if id(start) in done:
            continue
        on_path: set[int] = {id(start)}
        stack: list[tuple[Any, Iterator[Any]]] = [(start, _in_place(schema, names, start))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(id(node))
                done.add(id(node))
                continue
            if not isinstance(child, dict) or id(child) in done:
                continue
            if id(child) in on_path:
                return True
            on_path.add(id(child))
            stack.append((child, _in_place(schema, names, child)))
    return False


def _names(schema: Any) -> dict[str, Any]:
    """The subschemas a ref may name other than by JSON pointer: by `$anchor` (`#name`), by an `$id`
    (as written, and as `#name` for an old-style `"$id": "#name"`), by `$dynamicAnchor`."""
    names: dict[str, Any] = {}
    for node in _subschemas(schema):
        for keyword in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(keyword), str):
                names.setdefault("#" + node[keyword], node)
        if isinstance(node.get("$id"), str):
            names.setdefault(node["$id"].rstrip("#"), node)
    return names


def _in_place(root: Any, names: dict[str, Any], node: dict[str, Any]) -> Iterator[Any]:
    """The subschemas `node` applies to the value it is applied to."""
    for keyword in _IN_PLACE_LISTS:
        items = node.get(keyword)
        if isinstance(items, list):
            yield from items
    for keyword in _IN_PLACE_ONE:
        if keyword in node:
            yield node[keyword]
    dependent = node.get("dependentSchemas")
    if isinstance(dependent, dict):
        yield from dependent.values()
    for keyword in ("$ref", "$dynamicRef"):
        ref = node.get(keyword)
        if isinstance(ref, str):
            target = resolve(root, names, ref)
            if target is not None:
                yield target


def resolve(root: Any, names: dict[str, Any], ref: str) -> Any | None:
    """What `ref` names in the schema: a JSON pointer (`resolve_local`), a name (`_names`), or a pointer
    into a subschema named by its `$id` (`item.json#/$defs/a`); None when it is none of those. A ref
    relative to a nested `$id`'s base URI is not resolved (it counts as one)."""
    if ref.startswith("#/") or ref == "#":
        return resolve_local(root, ref)
    if ref in names or ref.rstrip("#") in names:
        return names.get(ref, names.get(ref.rstrip("#")))
    base, _, fragment = ref.partition("#")
    if base in names and fragment.startswith("/"):
        return resolve_local(names[base], "#" + fragment)
    return None


def object_count(schema: Any) -> int:
    """How many objects the schema holds: a fan-out no larger than a few times this is a flat union,
    not refs multiplying."""
    return sum(1 for _ in _subschemas(schema))


def _subschemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every object in the schema (some are not subschemas, such as a `properties` map: they cost 1)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            yield current
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)


def resolve_local(root: Any, ref: str) -> Any | None:
    """The part of `root` a local `$ref` (`#`, `#/$defs/a`, with `~0`, `~1` and %-escapes) names, else
    None (a ref to another document, an anchor, a pointer to nothing)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        name = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and name in node:
            node = node[name]
        elif isinstance(node, list) and name.isdigit() and int(name) < len(node):
            node = node[int(name)]
        else:
            return None
    return node
