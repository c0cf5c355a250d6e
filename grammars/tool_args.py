"""The parameter schemas tools declare, compiled once (cached by content), and tool-call arguments
checked against them.

A request offers its tools' schemas; every call an answer proposes is validated against its tool's.
`check_tool_schemas` compiles what a request offers when it arrives, off the event loop, so a schema
tollgate cannot check is a 400 before anything is reserved or sent, and the validation of an answer
finds its validators compiled. The cache holds `TOOL_CACHE_SIZE` schemas, twice the default
`limits.max_tools`, so one request's tools never evict each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

import orjson

from gateway import exact_json
from gateway.errors import InvalidGrammar
from grammars.compile import LRU, object_check
from grammars.spec import Violation, parse_json

if TYPE_CHECKING:
    from grammars.schema import SchemaCheck

TOOL_CACHE_SIZE: Final[int] = 1024
_CHECKS: LRU[SchemaCheck] = LRU(TOOL_CACHE_SIZE)


def _key(parameters: Mapping[str, Any]) -> str:
    """The cache key of a schema: its JSON as the agent sent it (agents resend the same tools each
    step; the same schema with its keys in another order only compiles twice)."""
    try:
        # exactly: an MCP server's schema may hold an integer beyond 64 bits (`maximum`)
        return exact_json.dumps(parameters if isinstance(parameters, dict) else dict(parameters)).decode()
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise InvalidGrammar(f"tool parameters: not a JSON schema: {exc}") from exc


def _compile(key: str) -> SchemaCheck | str:
    """The validator of the schema `key` names, or why there is none; cached either way."""
    from grammars.schema import build_check  # loaded on first use (see compile._compile_schema)

    hit = _CHECKS.get(key)
    if hit is not None:
        return hit
    try:
        check: SchemaCheck | str = build_check(exact_json.loads(key.encode()))
    except InvalidGrammar as exc:
        check = exc.message
    _CHECKS.put(key, check)
    return check


async def check_tool_schemas(tools: Iterable[tuple[str, Mapping[str, Any] | None]], *,
                             max_bytes: int | None = None) -> None:
    """Raise InvalidGrammar naming the first tool whose parameter schema tollgate cannot check, or when
    their JSON together is longer than `max_bytes` (`limits.max_schema_bytes`: compiling would cost
    seconds of the worker threads every request shares).

    `tools` are (name, parameters) pairs; None parameters declare no schema. Cached schemas cost a
    lookup; the others compile together in one worker thread, never on the event loop."""
    keyed = [(name, _key(parameters)) for name, parameters in tools if parameters is not None]
    if max_bytes is not None and sum(len(key) for _, key in keyed) > max_bytes // 4:
        total = sum(len(key.encode()) for _, key in keyed)
        if total > max_bytes:
            raise InvalidGrammar(f"the tools' parameter schemas are {total} bytes of JSON together, more than "
                                 f"limits.max_schema_bytes ({max_bytes})", param="tools")
    results = {key: _CHECKS.get(key) for _, key in keyed}
    misses = [key for key, check in results.items() if check is None]
    if misses:
        results.update(zip(misses, await asyncio.to_thread(lambda: [_compile(key) for key in misses]),
                           strict=True))
    for name, key in keyed:
        check = results[key]
        if isinstance(check, str):
            raise InvalidGrammar(f"parameters of tool {name!r}: {check}", param="tools")


def validate_tool_arguments(
    parameters: Mapping[str, Any] | None, arguments: str | Mapping[str, Any]
) -> Violation | None:
    """Check a tool call's arguments against the tool's declared parameter schema.

    `arguments` is the JSON text the model produced (OpenAI `function.arguments`; an empty string
    means `{}`) or an already parsed object (Anthropic `input`, MCP `arguments`). They must form a
    JSON object; with `parameters` None that is all that is checked. Validators are cached by schema
    content. A schema that does not compile raises InvalidGrammar (the tool declaration is broken).
    """
    if isinstance(arguments, str):
        if not arguments.strip():
            value: Any = {}
        else:
            value, violation = parse_json(arguments)
            if violation is not None:
                return violation
    else:
        value = arguments
    if parameters is None:
        return object_check().check_value(value)
    check = _compile(_key(parameters))
    if isinstance(check, str):
        raise InvalidGrammar(f"tool parameters: {check}")
    if not isinstance(value, dict):
        return object_check().check_value(value)
    return check.check_value(value)
