"""`gateway.providers.responses_tools`: the tools a Responses request offers, wherever it offers them, and
which of them OpenAI runs and bills (pure)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.providers.responses_tools import (
    allowed_tools,
    hosted,
    limit_hosted_calls,
    offered_tools,
    offers_preview_search,
    search_limits,
    unpriced_tools,
    unreserved_tools,
)

FUNCTION = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
SEARCH = {"type": "web_search"}
LOCAL_SHELL = {"type": "shell", "environment": {"type": "local"}}
HOSTED_SHELL = {"type": "shell", "environment": {"type": "container_auto", "memory_limit": "64g"}}


def body(tools: list[Any] | None = None, extra: list[Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"model": "gpt-5", "input": [{"role": "user", "content": "hi"}]}
    if tools is not None:
        data["tools"] = tools
    if extra is not None:
        data["input"].append({"type": "additional_tools", "role": "developer", "tools": extra})
    return data


def test_tools_are_offered_in_tools_and_in_input_items() -> None:
    offered = list(offered_tools(body([FUNCTION], [SEARCH])))
    assert offered == [FUNCTION, SEARCH]
    assert list(offered_tools({"input": "text"})) == []


@pytest.mark.parametrize(("tool", "runs"), [
    (FUNCTION, False), ({"type": "custom", "name": "grammar"}, False), ({"type": "computer"}, False),
    ({"type": "apply_patch"}, False), (LOCAL_SHELL, False), ({"type": "shell"}, False),
    (HOSTED_SHELL, True), ({"type": "shell", "environment": {"type": "container_reference", "container_id": "c"}},
                           True),
    (SEARCH, True), ({"type": "mcp", "server_url": "https://x"}, True), ({"type": "code_interpreter"}, True),
    ({"name": "no type"}, False),
    ({"type": "namespace", "name": "crm", "tools": [FUNCTION]}, False),  # the agent's functions, grouped
])
def test_which_tools_openai_runs(tool: dict[str, Any], runs: bool) -> None:
    assert hosted(tool) is runs


@pytest.mark.parametrize(("request_body", "unpriced"), [
    (body([FUNCTION, SEARCH]), ()),
    (body([{"type": "code_interpreter", "container": {"type": "auto"}}]), ("code_interpreter",)),
    (body([FUNCTION], [{"type": "image_generation"}]), ("image_generation",)),  # offered in an input item
    (body([HOSTED_SHELL]), ("shell (hosted container)",)),
    (body([LOCAL_SHELL]), ()),
])
def test_tools_billed_apart_at_a_cost_tollgate_cannot_bound(request_body: dict[str, Any],
                                                            unpriced: tuple[str, ...]) -> None:
    assert unpriced_tools(offered_tools(request_body)) == unpriced


MCP = {"type": "mcp", "server_label": "wiki", "server_url": "https://mcp.example/mcp"}
CONNECTOR = {"type": "mcp", "server_label": "mail", "connector_id": "connector_gmail"}


@pytest.mark.parametrize(("request_body", "unreserved"), [
    (body([FUNCTION, SEARCH]), ()),
    (body([MCP]), ("mcp",)),
    (body([FUNCTION], [CONNECTOR]), ("mcp",)),  # offered in an input item
    (body([MCP, CONNECTOR, FUNCTION]), ("mcp",)),
])
def test_hosted_mcp_bills_input_no_reservation_holds(request_body: dict[str, Any],
                                                     unreserved: tuple[str, ...]) -> None:
    assert unreserved_tools(offered_tools(request_body)) == unreserved


def test_searches_offered_in_input_items_are_limited_and_priced() -> None:
    extra = body([FUNCTION], [SEARCH])
    assert search_limits(extra, offered_tools(extra)) == (None,)
    limited = {**extra, "max_tool_calls": 3}
    assert search_limits(limited, offered_tools(limited)) == (3,)
    assert search_limits(body([FUNCTION]), [FUNCTION]) == ()
    assert offers_preview_search(offered_tools(body(None, [{"type": "web_search_preview_2025_03_11"}])))


def test_the_input_is_walked_only_when_its_bytes_may_hold_an_item_with_tools() -> None:
    """Given the raw bytes, a request whose input holds no item type that carries tools is not walked (one
    byte test); an escaped spelling of the type still is."""
    plain = body([FUNCTION])
    plain["input"] = [*plain["input"], {"type": "message", "role": "user", "content": "x", "tools": [SEARCH]}]
    raw = orjson.dumps(plain)
    assert offered_tools(plain, raw) == [FUNCTION]  # no item type that carries tools: the walk is skipped
    assert offered_tools(plain) == [FUNCTION, SEARCH]  # without the bytes, every item is read
    extra = body([FUNCTION], [SEARCH])
    escaped = orjson.dumps(extra).replace(b'"additional_tools"', b'"\\u0061dditional_tools"')
    assert offered_tools(orjson.loads(escaped), escaped) == [FUNCTION, SEARCH]


def test_a_limit_is_sent_when_a_hosted_tool_is_offered_anywhere() -> None:
    data = body([FUNCTION], [SEARCH])
    assert limit_hosted_calls(data, 2) and data["max_tool_calls"] == 2
    shell = body([HOSTED_SHELL])
    assert limit_hosted_calls(shell, 1) and shell["max_tool_calls"] == 1
    local = body([LOCAL_SHELL, FUNCTION])
    assert not limit_hosted_calls(local, 1) and "max_tool_calls" not in local


def test_with_no_call_left_hosted_tools_are_offered_nowhere() -> None:
    data = {**body([FUNCTION, SEARCH], [SEARCH, FUNCTION]), "tool_choice": {"type": "web_search"},
            "max_tool_calls": 5}
    assert limit_hosted_calls(data, 0)
    assert data["tools"] == [FUNCTION] and data["input"][-1]["tools"] == [FUNCTION]
    assert "tool_choice" not in data and "max_tool_calls" not in data
    only = body([SEARCH])
    assert limit_hosted_calls(only, 0) and "tools" not in only
    choice = {**body([FUNCTION, SEARCH]), "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                           "tools": [SEARCH, FUNCTION]}}
    assert limit_hosted_calls(choice, 0) and choice["tool_choice"]["tools"] == [FUNCTION]


def ns(*tools: Any, name: str = "crm") -> dict[str, Any]:
    return {"type": "namespace", "name": name, "description": "d", "tools": list(tools)}


def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name}


@pytest.mark.parametrize(("tools", "allow", "kept"), [
    ([fn("a"), fn("b")], {"a", "b"}, None),  # None: the list itself
    ([fn("a"), fn("b")], {"a"}, [fn("a")]),
    ([ns(fn("a"), fn("b"))], {"a"}, [ns(fn("a"))]),
    ([ns(fn("a"), fn("b"))], {"a", "b"}, None),
    ([ns(fn("a"), fn("b"))], {"namespace", "crm"}, []),  # neither its type nor its name allows what it holds
    ([ns(fn("a")), SEARCH], {"web_search"}, [SEARCH]),
    ([ns(ns(fn("a"), fn("b"), name="inner"))], {"b"}, [ns(ns(fn("b"), name="inner"))]),  # nested: the same
    ([ns({"type": "custom", "name": "a"}, fn("b"))], {"a"}, [ns({"type": "custom", "name": "a"})]),
    ([{"type": "namespace", "name": "crm"}], {"namespace"}, None),  # no tool list: judged by its type
    ([{"type": "namespace", "name": "crm", "tools": "a"}], {"a"}, []),
    ([ns()], set(), None),
    ([], set(), None),
])
def test_allowed_tools_judges_the_functions_inside_a_namespace(tools: list[Any], allow: set[str],
                                                               kept: list[Any] | None) -> None:
    before = orjson.dumps(tools)
    result = allowed_tools(tools, allow.__contains__)
    assert result is tools if kept is None else result == kept
    assert orjson.dumps(tools) == before  # never edited in place
