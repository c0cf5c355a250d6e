"""Tool parameter schemas: compiled once off the event loop (`check_tool_schemas`), arguments checked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.errors import InvalidGrammar
from grammars import tool_args
from grammars.spec import Violation
from grammars.tool_args import check_tool_schemas, validate_tool_arguments

SMALL = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}
LOOKAROUND = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^(?=a)"}}}


def v(message: str, offset: int | None = None) -> Violation:
    return Violation(message, offset)


@pytest.mark.parametrize(
    ("parameters", "arguments", "expected"),
    [
        (SMALL, '{"a": 1}', None),
        (SMALL, {"a": 1, "b": "x"}, None),  # Anthropic `input` / MCP `arguments` come parsed
        (SMALL, '{"b": 2}', v("at <root>: 'a' is a required property; at b: 2 is not of type 'string'")),
        (SMALL, '{"a": 1', v("not valid JSON: unexpected end of data at char 7", 7)),
        (SMALL, "[1]", v("at <root>: [1] is not of type 'object'")),
        (SMALL, "", v("at <root>: 'a' is a required property")),  # empty = {}
        (None, "", None),
        (None, '{"anything": [1]}', None),
        (None, "42", v("at <root>: 42 is not of type 'object'")),
        (None, "nope", v("not valid JSON: invalid literal, expected 'null' at char 0", 0)),
        (
            {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}},
            '{"when": "2024-13-01"}',
            v("at when: '2024-13-01' is not a 'date'"),
        ),
    ],
)
def test_validate_tool_arguments(
    parameters: dict[str, object] | None, arguments: str | dict[str, object], expected: Violation | None
) -> None:
    assert validate_tool_arguments(parameters, arguments) == expected


def test_validate_tool_arguments_broken_schema() -> None:
    with pytest.raises(InvalidGrammar, match=r"^tool parameters: json_schema: invalid schema at type"):
        validate_tool_arguments({"type": "nope"}, "{}")


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the worker-thread hops (each with how many schemas it compiled); a fresh cache."""
    monkeypatch.setattr(tool_args, "_CHECKS", tool_args.LRU(tool_args.TOOL_CACHE_SIZE))
    hops: list[int] = []
    real = asyncio.to_thread

    async def to_thread(fn: Callable[[], Any]) -> Any:
        result = await real(fn)
        hops.append(len(result))
        return result

    monkeypatch.setattr(tool_args.asyncio, "to_thread", to_thread)
    return hops


@pytest.mark.parametrize(
    ("tools", "refused"),
    [
        ([], None),
        ([("f", SMALL)], None),
        ([("f", None)], None),  # no schema declared: arguments must only form an object
        ([("f", LOOKAROUND)], "parameters of tool 'f': json_schema: "),
        ([("ok", SMALL), ("bad", {"type": 7})], "parameters of tool 'bad': json_schema: invalid schema"),
        ([("r", {"$ref": "https://example.com/s.json"})], "parameters of tool 'r': json_schema: cannot resolve"),
    ],
)
async def test_check_tool_schemas(tools: list[tuple[str, dict[str, Any] | None]], refused: str | None,
                                  threads: list[int]) -> None:
    if refused is None:
        await check_tool_schemas(tools)
        return
    with pytest.raises(InvalidGrammar) as caught:
        await check_tool_schemas(tools)
    assert caught.value.message.startswith(refused) and caught.value.param == "tools"


async def test_schemas_compile_once_in_one_thread_hop_and_answers_find_them(threads: list[int]) -> None:
    other = {**SMALL, "required": ["b"]}
    await check_tool_schemas([("f", SMALL), ("g", other), ("h", None), ("f2", SMALL)])
    assert threads == [2]  # two distinct schemas, compiled together off the loop
    await check_tool_schemas([("f", SMALL), ("g", other)])
    assert threads == [2]  # cached: no hop
    with pytest.raises(InvalidGrammar):
        await check_tool_schemas([("bad", LOOKAROUND)])
    with pytest.raises(InvalidGrammar):
        await check_tool_schemas([("bad", LOOKAROUND)])
    assert threads == [2, 1]  # the refusal is cached too
    assert validate_tool_arguments(other, '{"b": "x"}') is None  # the validator compiled above
    assert threads == [2, 1]


async def test_more_tools_than_the_cache_still_all_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_args, "_CHECKS", tool_args.LRU(4))
    tools: list[tuple[str, dict[str, Any] | None]] = [
        (f"t{i}", {"type": "object", "properties": {f"p{i}": {"type": "string"}}}) for i in range(10)
    ]
    await check_tool_schemas(tools)
    with pytest.raises(InvalidGrammar, match="'last'"):
        await check_tool_schemas([*tools, ("last", LOOKAROUND)])


def test_parameters_that_are_not_json_are_refused() -> None:
    with pytest.raises(InvalidGrammar, match="not a JSON schema"):
        validate_tool_arguments({"a": {1, 2}}, "{}")
