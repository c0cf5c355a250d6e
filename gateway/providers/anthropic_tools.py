"""Anthropic's own tools in a Messages request, by what they make Anthropic bill (pure).

Server tools (types Anthropic runs itself, dated: `web_search_20250305`, ...) bill beyond the tokens of the
request's body: web search per search, web fetch by the content it adds, code execution per container-hour,
the advisor by sub-inferences on a model of its own. Anthropic-defined client tools (bash, text editor,
computer use) and tool use itself bill input tokens the body does not carry. This module says, for a
request body, how much of that the budget can hold and what it cannot: `search_limits` entries,
`input_overhead` tokens, `unpriced_tools` and `unreserved_tools` (refused under a budget, `guards.budget`).
It also names tools for the allow-list: by `name`, but a toolset (one `tools` entry for a family of tools,
which carries no `name`) by its family, and its members' calls too (`tool_name`, `call_name`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.call import ToolCall, ToolSpec
from gateway.errors import InvalidRequest
from gateway.providers.common import MAX_TOKEN_COUNT
from guards.bounds import SEARCH_INPUT_TOKENS

MAX_USES_TOOLS = ("web_search_", "web_fetch_", "advisor_")
"""Server tool types (dated) that take a `max_uses`: held to the tool-call cap and the budget's searches."""
SERVER_TOOLS = (*MAX_USES_TOOLS, "code_execution_", "mcp_toolset")
"""Tool types Anthropic runs itself (with its MCP connector: not offered once no tool call is left)."""
UNPRICED_TOOLS = ("code_execution_",)
"""Tool types Anthropic bills apart at a cost tollgate cannot bound, absent from `usage`: a code execution
container per hour it runs (like the Responses API's `code_interpreter`). A USD budget refuses them."""
UNRESERVED_TOOLS = ("advisor_",)
"""Tool types whose use makes Anthropic run and bill model calls no reservation holds: each advisor use is
a sub-inference on the tool's own `model` over the whole transcript, up to `max_uses` times (reported in
`usage.iterations`, charged when settled). Any budget, USD or tokens, refuses them, and the MCP connector
(`mcp_servers`): Anthropic reads each server's tool list and every result into the context, input of any
size."""
MCP_CONNECTOR = "mcp_servers (the MCP connector)"

FETCH_CONTENT_TOKENS = SEARCH_INPUT_TOKENS
"""The `max_content_tokens` a web fetch tool sent without one is given when tollgate limits the tools
Anthropic runs (a budget, or the tool-call cap): a fetch then adds at most what a search's results are held
at, room for a typical page (~2,500 tokens by Anthropic's docs); an agent wanting more sends its own."""
_CONTEXT_TOKENS = 1_000_000  # the largest Claude context: no fetch adds more input than it holds

TOOL_USE_SYSTEM_PROMPT = 804
"""Input tokens of the system prompt Anthropic adds to any request that offers tools. Anthropic's tool-use
pricing table (docs: agents-and-tools/tool-use/overview, "Pricing") gives it per model and `tool_choice`:
346 / 313 on the Claude 4 and 4.5 models, 530 on Claude 3 Opus, and more on later models (Claude Opus 4.7:
675 with `auto`, 804 with `any` or a named tool). The largest is held, whatever the model."""
TOOL_OVERHEAD: dict[str, int] = {
    "bash_": 245,  # Bash tool docs: "The bash tool adds 245 input tokens to your API calls"
    "text_editor_": 700,  # Text editor tool docs: 700 input tokens per tool definition
    # Computer use tool docs: 735 tokens per tool definition (683 on Claude Sonnet 3.5), plus a system
    # prompt of 466-499 tokens it adds: the largest of each
    "computer_": 735 + 499,
}
"""Input tokens an Anthropic-defined tool bills beyond its definition in the body, by type prefix."""


_DATE = re.compile(r"_\d{8}$")


def toolset_family(tool: Any) -> str | None:
    """A toolset's family, as the API and the SDK compute it: its `type` without a trailing date, then
    without `_toolset` (`mcp_toolset`: `mcp`; `computer_toolset_20260801`: `computer`; `browser_toolset_...`:
    `browser`). None for a tool that is no toolset."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    base = _DATE.sub("", kind) if isinstance(kind, str) else ""
    family = base.removesuffix("_toolset")
    return family if family and family != base else None


def tool_name(tool: Any) -> str:
    """The allow-list name of an offered tool: its `name`; a toolset's is its family whatever else it
    carries (the MCP connector's `mcp_toolset` is `mcp`, as its `mcp_servers`), the name its members' calls
    are judged by (`call_name`)."""
    if not isinstance(tool, Mapping):
        return ""
    family = toolset_family(tool)
    name = tool.get("name")
    return family if family is not None else name if isinstance(name, str) else ""


def tool_specs(raw_tools: list[Any]) -> tuple[ToolSpec, ...]:
    """The offered tools, by allow-list name. Raises InvalidRequest (400) for one that is no object, or
    neither a toolset nor named."""
    specs: list[ToolSpec] = []
    for index, tool in enumerate(raw_tools):
        if not isinstance(tool, Mapping) or not (toolset_family(tool) or isinstance(tool.get("name"), str)):
            raise InvalidRequest(f"tools.{index} must be an object with a name (or a toolset's type)", param="tools")
        schema = tool.get("input_schema")
        specs.append(ToolSpec(tool_name(tool), tool.get("description"), schema if isinstance(schema, Mapping) else None))
    return tuple(specs)


def call_name(block: Mapping[str, Any]) -> str:
    """The allow-list name of a `tool_use` block: a toolset member's is its toolset's family
    (`toolset_name`), as the toolset was offered; any other's, its `name`."""
    toolset = block.get("toolset_name")
    return toolset if isinstance(toolset, str) and toolset else str(block.get("name", ""))


def tool_call(block: Mapping[str, Any], arguments: str) -> ToolCall:
    """A `tool_use` block as the guards judge it (`arguments`: its input's JSON text): named by `call_name`;
    a toolset member's arguments name the member (`{"member": ..., "input": ...}`), so that loop detection
    tells `left_click` from `right_click` at one point."""
    toolset = block.get("toolset_name")
    if isinstance(toolset, str) and toolset:
        arguments = f'{{"member":{orjson.dumps(str(block.get("name", ""))).decode()},"input":{arguments}}}'
    return ToolCall(str(block.get("id", "")), call_name(block), arguments)


def count(value: Any) -> int | None:
    """`value` when it is a count (a non-negative int, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


_LIMIT_KEYS = ("max_uses", "max_content_tokens")


def check_limits(body: Mapping[str, Any]) -> None:
    """Raises InvalidRequest (400) for a server tool's `max_uses` or `max_content_tokens` that is not an
    integer from 0 to `MAX_TOKEN_COUNT` (null is absent). The budget and the tool-call cap lower these
    limits and reserve for what they allow: one they could not read (`1000.0`, `1e3`, a number beyond 64
    bits, which JSON parsers read as a float) would reach the API unlowered, and an API that reads it as
    an integer would run more searches than were reserved."""
    for index, tool in enumerate(_tool_list(body)):
        if not type_starts(tool, MAX_USES_TOOLS):
            continue
        for key in _LIMIT_KEYS:
            value = tool.get(key)
            if value is not None and (count(value) is None or value > MAX_TOKEN_COUNT):
                raise InvalidRequest(f"'tools[{index}].{key}' must be an integer from 0 to {MAX_TOKEN_COUNT}",
                                     param=f"tools.{index}.{key}")


def type_starts(tool: Any, prefixes: tuple[str, ...]) -> bool:
    """The tool's `type` is a string starting with one of `prefixes`."""
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    return isinstance(kind, str) and kind.startswith(prefixes)


def _tool_list(body: Mapping[str, Any]) -> list[Any]:
    tools = body.get("tools")
    return tools if isinstance(tools, list) else []


def with_max_uses(tool: Any, limit: int) -> Any:
    """`max_uses` held to `limit` (`check_limits` refused one that is no count). A web
    fetch tool without `max_content_tokens` is given `FETCH_CONTENT_TOKENS` (what `search_limits` held)."""
    if not type_starts(tool, MAX_USES_TOOLS):
        return tool
    if type_starts(tool, ("web_fetch_",)) and tool.get("max_content_tokens") is None:
        tool = {**tool, "max_content_tokens": FETCH_CONTENT_TOKENS}
    uses = tool.get("max_uses")
    if uses is not None and not (isinstance(uses, int) and not isinstance(uses, bool) and uses > limit):
        return tool
    return {**tool, "max_uses": limit}


def _fetch_uses(tool: Mapping[str, Any]) -> tuple[int | None, int]:
    """A web fetch tool's `max_uses` and the content one fetch may add: its `max_content_tokens` (at most a
    context); None uses when it sends no content limit, so that under a budget it is always limited, and so
    given `FETCH_CONTENT_TOKENS`."""
    content = count(tool.get("max_content_tokens"))
    if not content:
        return None, FETCH_CONTENT_TOKENS
    return count(tool.get("max_uses")), min(content, _CONTEXT_TOKENS)


# server tools whose results Anthropic bills as input, by type prefix: (uses allowed, input one use adds)
_HELD_USES: dict[str, Callable[[Mapping[str, Any]], tuple[int | None, int]]] = {
    "web_search_": lambda tool: (count(tool.get("max_uses")), SEARCH_INPUT_TOKENS),
    "web_fetch_": _fetch_uses,
}


def _held(body: Mapping[str, Any]) -> list[tuple[int | None, int]]:
    return [uses(tool) for tool in _tool_list(body) for prefix, uses in _HELD_USES.items()
            if type_starts(tool, (prefix,))]


def search_limits(body: Mapping[str, Any]) -> tuple[int | None, ...]:
    """The uses allowed of each server tool whose results are billed as input (`Call.search_limits`): a web
    search or fetch tool's `max_uses`, None where it sends no count (a fetch without a content limit too)."""
    return tuple(limit for limit, _ in _held(body))


def search_sizes(body: Mapping[str, Any]) -> tuple[int, ...]:
    """The input one use of each `search_limits` entry may add (`Call.search_sizes`): a search's results
    (`SEARCH_INPUT_TOKENS`), a fetch's content (its `max_content_tokens`)."""
    return tuple(size for _, size in _held(body))


def input_overhead(body: Mapping[str, Any]) -> int:
    """Input tokens Anthropic bills for the request's tools that its body does not carry: the tool-use
    system prompt when it offers any tool (its MCP connector's included), and each Anthropic-defined
    tool's `TOOL_OVERHEAD`. Tools the allow-list removes later keep theirs: the bound only grows."""
    tools = _tool_list(body)
    if not tools and not body.get("mcp_servers"):
        return 0
    return TOOL_USE_SYSTEM_PROMPT + sum(tokens for tool in tools for prefix, tokens in TOOL_OVERHEAD.items()
                                        if type_starts(tool, (prefix,)))


def _types(body: Mapping[str, Any], prefixes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted({t["type"] for t in _tool_list(body) if type_starts(t, prefixes)}))


def unpriced_tools(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The types of the offered tools Anthropic bills apart at a cost tollgate cannot bound
    (`UNPRICED_TOOLS`), sorted, for `Call.unpriced_tools`."""
    return _types(body, UNPRICED_TOOLS)


def unreserved_tools(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The types of the offered tools whose billed use no reservation holds (`UNRESERVED_TOOLS`), sorted,
    then `MCP_CONNECTOR` when the request has MCP servers, for `Call.unreserved_tools`."""
    connector = (MCP_CONNECTOR,) if body.get("mcp_servers") else ()
    return _types(body, UNRESERVED_TOOLS) + connector


def offers_server_tools(body: Mapping[str, Any]) -> bool:
    """The request offers a tool Anthropic runs itself, or its MCP connector (`Call.provider_tools`)."""
    return bool(body.get("mcp_servers")) or any(type_starts(t, SERVER_TOOLS) for t in _tool_list(body))
