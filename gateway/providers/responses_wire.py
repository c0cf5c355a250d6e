"""Tool allow-list edits on OpenAI Responses bodies and held stream events (pure); registered in
`gateway.providers.tool_wire`.

A dropped call item leaves the output list, and later items move up: the SDK's stream state indexes
its output list by `output_index`, so every later event (and the final response's `output`) is
renumbered to stay contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.errors import ToolNotAllowed
from gateway.providers.responses_tools import CALL_ITEMS, allowed_tools, call_name, item_type, tool_name
from gateway.providers.sse import SseParser, format_event

Allowed = Callable[[str], bool]


def filter_offers(body: dict[str, Any], allowed: Allowed) -> bool:
    """Beyond `tools`: the tool lists input items carry (`additional_tools`, `tool_search_output`) and an
    `allowed_tools` choice lose the tools the agent may not use, a namespace the functions (`allowed_tools`).
    True when the body changed. Raises ToolNotAllowed when an `allowed_tools` choice that requires a tool
    keeps none."""
    changed = False
    items = body.get("input")
    if isinstance(items, list):
        shaped = [_with_allowed_tools(item, allowed) for item in items]
        if any(new is not old for new, old in zip(shaped, items, strict=True)):
            body["input"], changed = shaped, True
    choice = body.get("tool_choice")
    listed = choice.get("tools") if isinstance(choice, dict) and item_type(choice) == "allowed_tools" else None
    if not isinstance(choice, dict) or not isinstance(listed, list):
        return changed
    kept = allowed_tools(listed, allowed)
    if kept is listed:
        return changed
    if not kept and choice.get("mode") == "required":
        raise ToolNotAllowed("tool_choice requires tools outside the allow-list: "
                             + ", ".join(sorted(tool_name(tool) for tool in listed)))
    body["tool_choice"] = {**choice, "tools": kept} if kept else "none"
    return True


def _with_allowed_tools(item: Any, allowed: Allowed) -> Any:
    tools = item.get("tools") if isinstance(item, Mapping) else None
    if not isinstance(tools, list):
        return item
    kept = allowed_tools(tools, allowed)
    return item if kept is tools else {**item, "tools": kept}


def _dropped(item: Any, names: frozenset[str]) -> bool:
    return item_type(item) in CALL_ITEMS and call_name(item) in names


def drop_in_body(body: dict[str, Any], names: frozenset[str]) -> bool:
    """Remove call items of `names` from a response's `output`. True when something the agent can use
    is left: text, or a call (reasoning items and hosted tools' records alone are not an answer)."""
    output = body.get("output")
    if not isinstance(output, list):
        return False
    kept = [item for item in output if not _dropped(item, names)]
    body["output"] = kept
    return any(item_type(i) in CALL_ITEMS or (item_type(i) == "message" and _has_text(i)) for i in kept)


def _has_text(item: Mapping[str, Any]) -> bool:
    parts = item.get("content")
    return isinstance(parts, list) and any(isinstance(p, Mapping) and p.get("text") for p in parts)


def drop_in_stream(raw: bytes, names: frozenset[str]) -> bytes:
    """Held events without those about call items of `names`; later output indices renumbered."""
    out: list[bytes] = []
    dropped: set[int] = set()
    for event in SseParser().feed(raw):
        try:
            data = orjson.loads(event.data) if event.data else None
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            out.append(event.raw)
            continue
        response = data.get("response")
        if isinstance(response, dict) and isinstance(response.get("output"), list):
            before = len(response["output"])
            drop_in_body(response, names)
            if len(response["output"]) != before:
                out.append(format_event(orjson.dumps(data), event.event))
                continue
        index = data.get("output_index")
        if not isinstance(index, int):
            out.append(event.raw)
            continue
        if item_type(data) == "response.output_item.added" and _dropped(data.get("item"), names):
            dropped.add(index)
        if index in dropped:
            continue
        shift = sum(1 for d in dropped if d < index)
        out.append(format_event(orjson.dumps({**data, "output_index": index - shift}), event.event)
                   if shift else event.raw)
    return b"".join(out)
