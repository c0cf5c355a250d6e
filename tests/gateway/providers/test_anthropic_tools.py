"""gateway/providers/anthropic_tools.py: Anthropic's own tools by what they make it bill, and the names
the allow-list judges them by (pure)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.call import ToolCall, ToolSpec
from gateway.config import Limits
from gateway.errors import InvalidRequest
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.anthropic_tools import (
    MCP_CONNECTOR,
    TOOL_USE_SYSTEM_PROMPT,
    call_name,
    input_overhead,
    offers_server_tools,
    tool_call,
    tool_name,
    tool_specs,
    toolset_family,
    unpriced_tools,
    unreserved_tools,
)
from gateway.providers.sse import SseParser, format_event

FUNCTION = {"name": "lookup", "input_schema": {"type": "object"}}
BASH = {"type": "bash_20250124", "name": "bash"}
EDITOR = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}
COMPUTER = {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768}
CODE = {"type": "code_execution_20250825", "name": "code_execution"}
ADVISOR = {"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-4-8", "max_uses": 3}
SEARCH = {"type": "web_search_20250305", "name": "web_search"}


@pytest.mark.parametrize(("body", "tokens"), [
    ({}, 0),
    ({"tools": []}, 0),
    ({"tools": "x"}, 0),  # not a list: the adapter refuses it before this is asked
    ({"tools": [FUNCTION]}, TOOL_USE_SYSTEM_PROMPT),  # the tool-use system prompt, whatever the tool
    ({"tools": [SEARCH]}, TOOL_USE_SYSTEM_PROMPT),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "gh"}]}, TOOL_USE_SYSTEM_PROMPT),
    ({"tools": [BASH]}, TOOL_USE_SYSTEM_PROMPT + 245),  # Anthropic's bash tool docs
    ({"tools": [EDITOR]}, TOOL_USE_SYSTEM_PROMPT + 700),  # its text editor tool docs
    ({"tools": [{"type": "text_editor_20250124", "name": "str_replace_editor"}]}, TOOL_USE_SYSTEM_PROMPT + 700),
    ({"tools": [COMPUTER]}, TOOL_USE_SYSTEM_PROMPT + 735 + 499),  # a definition and its system prompt
    ({"tools": [FUNCTION, BASH, EDITOR, COMPUTER]}, TOOL_USE_SYSTEM_PROMPT + 245 + 700 + 735 + 499),
    ({"tools": [{"type": 7, "name": "bash"}, "bash"]}, TOOL_USE_SYSTEM_PROMPT),  # no type it knows
])
def test_input_overhead(body: dict[str, Any], tokens: int) -> None:
    assert input_overhead(body) == tokens


def test_the_largest_documented_tool_use_prompt_is_held() -> None:
    """346 on the Claude 4 models; the largest any model's row gives is held for every model."""
    assert TOOL_USE_SYSTEM_PROMPT >= 804


@pytest.mark.parametrize(("tools", "unpriced", "unreserved"), [
    ([], (), ()),
    ([FUNCTION, SEARCH, BASH], (), ()),
    ([CODE], ("code_execution_20250825",), ()),
    ([{"type": "code_execution_20250522", "name": "code_execution"}, CODE],
     ("code_execution_20250522", "code_execution_20250825"), ()),
    ([ADVISOR], (), ("advisor_20260301",)),
    ([ADVISOR, CODE, FUNCTION], ("code_execution_20250825",), ("advisor_20260301",)),
])
def test_tools_a_budget_cannot_hold(tools: list[Any], unpriced: tuple[str, ...],
                                    unreserved: tuple[str, ...]) -> None:
    assert unpriced_tools({"tools": tools}) == unpriced
    assert unreserved_tools({"tools": tools}) == unreserved


@pytest.mark.parametrize(("body", "unreserved"), [
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "gh"}]}, (MCP_CONNECTOR,)),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "gh"}], "tools": [ADVISOR]},
     ("advisor_20260301", MCP_CONNECTOR)),
    ({"mcp_servers": []}, ()), ({"mcp_servers": None}, ()),
])
def test_the_mcp_connector_bills_input_no_reservation_holds(body: dict[str, Any],
                                                            unreserved: tuple[str, ...]) -> None:
    assert unreserved_tools(body) == unreserved


@pytest.mark.parametrize(("body", "offered"), [
    ({}, False), ({"tools": [FUNCTION, BASH]}, False), ({"tools": [SEARCH]}, True), ({"tools": [CODE]}, True),
    ({"tools": [ADVISOR]}, True), ({"mcp_servers": [{"name": "gh"}]}, True),
])
def test_offers_server_tools(body: dict[str, Any], offered: bool) -> None:
    assert offers_server_tools(body) is offered


# -- names for the allow-list: toolsets (one `tools` entry for a family, without a `name`) -----------------

MCP_TOOLSET = {"type": "mcp_toolset", "mcp_server_name": "gh"}  # the SDK's BetaMCPToolsetParam
COMPUTER_TOOLSET = {"type": "computer_toolset_20260801", "configs": {"zoom": {"enabled": False}}}
BROWSER_TOOLSET = {"type": "browser_toolset_20260801"}


@pytest.mark.parametrize(("tool", "family", "name"), [
    (MCP_TOOLSET, "mcp", "mcp"),
    (COMPUTER_TOOLSET, "computer", "computer"),
    (BROWSER_TOOLSET, "browser", "browser"),
    ({"type": "browser_toolset"}, "browser", "browser"),  # undated, as the SDK computes a family
    ({"type": "browser_toolset_20991231", "cache_control": {"type": "ephemeral"}}, "browser", "browser"),
    # a toolset is named by its family whatever `name` it carries: no entry passes as another tool
    ({**MCP_TOOLSET, "name": "search_kb"}, "mcp", "mcp"),
    ({**COMPUTER_TOOLSET, "name": "search_kb"}, "computer", "computer"),
    (FUNCTION, None, "lookup"),
    (COMPUTER, None, "computer"),  # the single computer tool: `computer` too
    (BASH, None, "bash"),
    ({"type": "custom", "name": "x"}, None, "x"),
    ({"type": "_toolset"}, None, ""), ({"type": "toolset"}, None, ""), ({"type": 7}, None, ""),
    ({"name": 7}, None, ""), ("bash", None, ""), (None, None, ""),
])
def test_tool_names_and_toolset_families(tool: Any, family: str | None, name: str) -> None:
    assert toolset_family(tool) == family
    assert tool_name(tool) == name


@pytest.mark.parametrize(("tools", "specs"), [
    ([MCP_TOOLSET], (ToolSpec("mcp"),)),
    ([COMPUTER_TOOLSET, BROWSER_TOOLSET], (ToolSpec("computer"), ToolSpec("browser"))),
    ([{"name": "get", "description": "d", "input_schema": {"type": "object"}}, SEARCH],
     (ToolSpec("get", "d", {"type": "object"}), ToolSpec("web_search"))),
    ([{"name": "get", "input_schema": "not a schema"}], (ToolSpec("get"),)),
])
def test_tool_specs(tools: list[Any], specs: tuple[ToolSpec, ...]) -> None:
    assert tool_specs(tools) == specs


@pytest.mark.parametrize("tool", [
    "get", None, {"description": "x"}, {"type": "custom"}, {"type": "web_search_20250305"}, {"name": 7},
    {"type": "_toolset"}, {"type": 7, "mcp_server_name": "gh"},
])
def test_tool_specs_refuse_a_tool_without_a_name_unless_a_toolset(tool: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"tools\.1 must be an object with a name"):
        tool_specs([FUNCTION, tool])


def test_a_request_offering_toolsets_parses() -> None:
    """The MCP connector's current shape (beta mcp-client-2025-11-20): `mcp_servers` plus an `mcp_toolset`."""
    body = {"model": "claude-sonnet-4-5", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}],
            "mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "gh"}],
            "tools": [MCP_TOOLSET, COMPUTER_TOOLSET]}
    call = AnthropicMessages().parse_request(body, orjson.dumps(body), Limits())
    assert [t.name for t in call.tools] == ["mcp", "computer"]
    assert call.provider_tools and call.unreserved_tools == (MCP_CONNECTOR,)


def member_use(name: str, toolset: Any, payload: Any = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_use", "id": "toolu_1", "name": name, "input": payload or {}}
    return block if toolset is None else {**block, "toolset_name": toolset}


@pytest.mark.parametrize(("block", "name", "arguments"), [
    (member_use("lookup", None, {"q": 1}), "lookup", '{"q":1}'),
    # a toolset member's call is judged by its toolset's family, and names its member in its arguments
    (member_use("left_click", "computer", {"coordinate": [1, 2]}), "computer",
     '{"member":"left_click","input":{"coordinate":[1,2]}}'),
    (member_use("navigate", "browser", {"url": "u"}), "browser", '{"member":"navigate","input":{"url":"u"}}'),
    (member_use("x", ""), "x", "{}"), (member_use("x", 7), "x", "{}"),  # no toolset's name: by its own
    ({"type": "tool_use", "toolset_name": "computer"}, "computer", '{"member":"","input":{}}'),
])
def test_calls_are_named_as_their_tools_were_offered(block: dict[str, Any], name: str, arguments: str) -> None:
    assert call_name(block) == name
    made = tool_call(block, orjson.dumps(block.get("input") or {}).decode())
    assert (made.name, orjson.loads(made.arguments)) == (name, orjson.loads(arguments))


def test_members_of_one_toolset_are_told_apart_by_loop_detection() -> None:
    left = tool_call(member_use("left_click", "computer"), '{"coordinate":[5,5]}')
    right = tool_call(member_use("right_click", "computer"), '{"coordinate":[5,5]}')
    assert left.name == right.name == "computer" and left.fingerprint != right.fingerprint


def test_the_adapter_reads_toolset_calls_whole_and_streamed() -> None:
    adapter = AnthropicMessages()
    use = member_use("left_click", "computer", {"coordinate": [1, 2]})
    answer = adapter.parse_answer({"id": "m", "content": [use], "stop_reason": "tool_use"})
    expected = (ToolCall("toolu_1", "computer", '{"member":"left_click","input":{"coordinate":[1,2]}}'),)
    assert answer.tool_calls == expected
    reader = adapter.stream_reader(hide_usage=False)
    events = [{"type": "content_block_start", "index": 0, "content_block": {**use, "input": {}}},
              {"type": "content_block_delta", "index": 0,
               "delta": {"type": "input_json_delta", "partial_json": '{"coordinate":[1,2]}'}},
              {"type": "content_block_stop", "index": 0}]
    for data in events:
        [event] = SseParser().feed(format_event(orjson.dumps(data), str(data["type"])))
        reader.feed(event)
    assert reader.answer().tool_calls == expected
