"""gateway/providers/anthropic_tools.py: Anthropic's own tools by what they make it bill (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.providers.anthropic_tools import (
    MCP_CONNECTOR,
    TOOL_USE_SYSTEM_PROMPT,
    input_overhead,
    offers_server_tools,
    unpriced_tools,
    unreserved_tools,
)

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
