"""The tools a Responses API request offers, and which of them OpenAI runs and bills (pure, no I/O).

A request offers tools in `tools` and in input items that carry a tool list of their own
(`additional_tools`, `tool_search_output`): every reading of what is offered (the fees a reservation
holds, the tools a budget refuses, the limit on the calls OpenAI runs) reads all of them, as the
allow-list does (`gateway.providers.tool_wire.filter_request_tools`).

Tools are named for the allow-list by `name` (function and custom tools) or by `type` for the others; a
`namespace` (tool search: function and custom tools grouped under a name) is no tool of its own: the tools
inside it are judged one by one (`allowed_tools`), as their calls are (by their own `name`).
OpenAI runs a tool itself unless it is a function, a custom tool or one whose calls the agent runs
(computer, local shell, shell, apply_patch); a `shell` with a hosted environment (`container_auto`, a
`container_reference`) is OpenAI's to run, in a container billed per session. A hosted `mcp` tool (a
server or a connector OpenAI calls itself) reads the server's tool list and each result into the context:
input of any size, which no reservation can hold (`unreserved_tools`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.providers.common import may_contain

__all__ = [
    "AGENT_CALLS", "CALL_ITEMS", "UNPRICED_TOOLS", "allowed_tools", "call_name", "hosted", "item_type",
    "limit_hosted_calls", "offered_tools", "offers_preview_search", "search_limits", "tool_name", "unpriced_tools",
    "unreserved_tools",
]

# the call items the agent runs (judged by the guards), by item type: the allow-list name of their tool,
# or None for the item's own `name` (function and custom tools)
AGENT_CALLS: dict[str, str | None] = {
    "function_call": None, "custom_tool_call": None, "computer_call": "computer",
    "local_shell_call": "local_shell", "shell_call": "shell", "apply_patch_call": "apply_patch",
}
CALL_ITEMS = frozenset(AGENT_CALLS)
_AGENT_RUN_TOOLS = frozenset(name for name in AGENT_CALLS.values() if name)
_SEARCH_TOOLS = ("web_search", "file_search")  # tool types (some dated) whose calls are billed apart
# tools OpenAI bills apart at a cost tollgate does not price: a container per Code Interpreter or hosted
# shell session, an image model's output per generated image (none of them is in `usage`)
UNPRICED_TOOLS = ("code_interpreter", "image_generation")
_TOOL_ALIASES = {"computer_use_preview": "computer"}  # both tool types make `computer_call` items


def item_type(value: Any) -> str | None:
    """The `type` of an item, tool or event when it is a string; anything else is no type tollgate knows
    (and never reaches a set lookup, where a list would raise)."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    return kind if isinstance(kind, str) else None


def tool_name(tool: Any) -> str:
    """The allow-list name of an offered tool: `name` for function and custom tools, else `type`."""
    kind = item_type(tool)
    if kind in ("function", "custom"):
        return str(tool.get("name", ""))
    return _TOOL_ALIASES.get(kind, kind) if kind else ""


def _namespace_tools(tool: Any) -> list[Any] | None:
    """The tools a `namespace` groups; None for any other tool (and a namespace without a tool list)."""
    listed = tool.get("tools") if item_type(tool) == "namespace" else None
    return listed if isinstance(listed, list) else None


def allowed_tools(tools: list[Any], allowed: Callable[[str], bool]) -> list[Any]:
    """The tools the allow-list keeps, each judged by its `tool_name`; a namespace keeps only its allowed
    tools, and goes when none is left. `tools` itself when it keeps every one (lists are replaced, not edited:
    the agent's original body shares them)."""
    kept: list[Any] = []
    for tool in tools:
        inner = _namespace_tools(tool)
        if inner is None:
            if allowed(tool_name(tool)):
                kept.append(tool)
            continue
        narrowed = allowed_tools(inner, allowed)
        if narrowed is inner:
            kept.append(tool)
        elif narrowed:
            kept.append({**tool, "tools": narrowed})
    if len(kept) == len(tools) and all(new is old for new, old in zip(kept, tools, strict=True)):
        return tools
    return kept


def call_name(item: Mapping[str, Any]) -> str:
    """The allow-list name of a call item's tool."""
    return AGENT_CALLS.get(item_type(item) or "") or str(item.get("name", ""))


_ITEMS_WITH_TOOLS = (b"additional_tools", b"tool_search_output")  # input item types that carry a tool list


def offered_tools(body: Mapping[str, Any], raw: bytes | None = None) -> list[Any]:
    """Every tool the request offers: `tools`, then the tool lists of its input items. With the request's
    `raw` bytes, the input is walked only when they may hold an item type that carries tools (one byte
    test: most requests, long conversations included, skip the walk)."""
    tools = body.get("tools")
    offered = list(tools) if isinstance(tools, list) else []
    items = body.get("input")
    if not isinstance(items, list) or (raw is not None and not may_contain(raw, *_ITEMS_WITH_TOOLS)):
        return offered
    for item in items:
        listed = item.get("tools") if type(item) is dict else None
        if isinstance(listed, list):
            offered += listed
    return offered


def _hosted_shell(tool: Any) -> bool:
    environment = tool.get("environment") if item_type(tool) == "shell" else None
    return isinstance(environment, Mapping) and item_type(environment) not in (None, "local")


def hosted(tool: Any) -> bool:
    """An offered tool OpenAI runs itself (not a function, a custom tool, a namespace of them or one the agent
    runs)."""
    kind = item_type(tool)
    if kind is None or kind in ("function", "custom", "namespace"):  # a namespace holds the agent's functions
        return False
    return tool_name(tool) not in _AGENT_RUN_TOOLS or _hosted_shell(tool)


def unpriced_tools(offered: Iterable[Any]) -> tuple[str, ...]:
    """Of the `offered_tools`, those OpenAI bills apart whose cost tollgate cannot bound (`UNPRICED_TOOLS`,
    a hosted shell's container)."""
    names = set()
    for tool in offered:
        kind = item_type(tool) or ""
        if kind.startswith(UNPRICED_TOOLS):
            names.add(kind)
        elif _hosted_shell(tool):
            names.add("shell (hosted container)")
    return tuple(sorted(names))


def unreserved_tools(offered: Iterable[Any]) -> tuple[str, ...]:
    """Of the `offered_tools`, those whose use bills input no reservation can hold: a hosted `mcp` tool,
    whose server's tool list and results OpenAI reads into the context, of any size."""
    return ("mcp",) if any(item_type(t) == "mcp" for t in offered) else ()


def offers_preview_search(offered: Iterable[Any]) -> bool:
    """The `offered_tools` hold `web_search_preview` (or a dated version of it), which OpenAI bills apart."""
    return any((item_type(t) or "").startswith("web_search_preview") for t in offered)


def search_limits(body: Mapping[str, Any], offered: Iterable[Any]) -> tuple[int | None, ...]:
    """`max_tool_calls` (None when it sends no count) when a tool whose runs are billed apart is offered
    (`offered`: the request's `offered_tools`): web search and file search, billed per call. It bounds every
    call of the tools OpenAI runs."""
    if not any((item_type(t) or "").startswith(_SEARCH_TOOLS) for t in offered):
        return ()
    sent = body.get("max_tool_calls")
    return (sent if isinstance(sent, int) and not isinstance(sent, bool) and sent >= 0 else None,)


def limit_hosted_calls(body: dict[str, Any], limit: int) -> bool:
    """`max_tool_calls` (calls of the tools OpenAI runs, over the whole response) held to `limit` when the
    request offers such a tool anywhere; with none left (`limit` <= 0) those tools are not offered (a
    `max_tool_calls` that is no count was refused when the request was read). True when the body changed."""
    hosted_kinds = {item_type(t) for t in offered_tools(body) if hosted(t)}
    if not hosted_kinds:
        return False
    if limit <= 0:
        _drop_hosted(body, hosted_kinds)
        return True
    sent = body.get("max_tool_calls")
    if sent is not None and not (isinstance(sent, int) and not isinstance(sent, bool) and sent > limit):
        return False
    body["max_tool_calls"] = limit
    return True


def _drop_hosted(body: dict[str, Any], kinds: set[str | None]) -> None:
    tools = body.get("tools")
    if isinstance(tools, list):
        kept = [t for t in tools if not hosted(t)]
        if kept:
            body["tools"] = kept
        else:
            for key in ("tools", "tool_choice", "parallel_tool_calls"):
                body.pop(key, None)
    items = body.get("input")
    if isinstance(items, list):
        body["input"] = [_without_hosted(item) for item in items]
    choice = body.get("tool_choice")
    if item_type(choice) in kinds:
        del body["tool_choice"]  # it forced a tool no longer offered
    elif isinstance(choice, Mapping) and item_type(choice) == "allowed_tools" and isinstance(choice.get("tools"), list):
        allowed = [t for t in choice["tools"] if not hosted(t)]
        if allowed:
            body["tool_choice"] = {**choice, "tools": allowed}
        else:
            del body["tool_choice"]
    body.pop("max_tool_calls", None)


def _without_hosted(item: Any) -> Any:
    listed = item.get("tools") if isinstance(item, Mapping) else None
    if not isinstance(listed, list) or not any(hosted(t) for t in listed):
        return item
    return {**item, "tools": [t for t in listed if not hosted(t)]}
