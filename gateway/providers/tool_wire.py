"""Tool allow-list edits on wire bodies, per protocol (pure).

Requests: drop offered tools the agent may not use; find a `tool_choice` that forces one. Answers:
drop proposed calls of disallowed tools, from a JSON body or from the held events of a stream, keeping
indices contiguous because the SDKs assemble calls by index. Registries are dicts keyed by protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.providers import anthropic_tools, responses_wire
from gateway.providers.common import allowed_subset
from gateway.providers.openai_functions import LEGACY, proposed, tool_spec
from gateway.providers.responses_tools import allowed_tools, offered_tools
from gateway.providers.responses_tools import tool_name as _responses_tool_name
from gateway.providers.sse import SseParser, format_event

Allowed = Callable[[str], bool]


def _openai_tool_name(tool: Any) -> str:
    spec = tool_spec(tool)
    return str(spec.get("name", "")) if spec is not None else ""


def _filter_allowed_tools(body: dict[str, Any], allowed: Allowed) -> bool:
    """Chat Completions' `tool_choice: {type: allowed_tools, allowed_tools: {mode, tools}}`."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return False
    subset = choice.get("allowed_tools")
    listed = subset.get("tools") if isinstance(subset, Mapping) else None
    if not isinstance(subset, Mapping) or not isinstance(listed, list):
        return False
    kept = allowed_subset(listed, subset.get("mode"), allowed, _openai_tool_name)
    if kept is listed:
        return False
    body["tool_choice"] = {**choice, "allowed_tools": {**subset, "tools": kept}} if kept is not None else "none"
    return True


def _filter_functions(body: dict[str, Any], allowed: Allowed) -> bool:
    """OpenAI's legacy `functions`, as `tools`: a function not allowed is not offered; and an
    `allowed_tools` choice loses the tools the agent may not use (one requiring only those is refused)."""
    changed = _filter_allowed_tools(body, allowed)
    offered = body.get("functions")
    if not isinstance(offered, list) or not offered:
        return changed
    kept = [f for f in offered if isinstance(f, Mapping) and allowed(str(f.get("name", "")))]
    if len(kept) == len(offered):
        return changed
    if kept:
        body["functions"] = kept
    else:
        body.pop("functions", None)
        body.pop("function_call", None)
    return True


TOOL_NAME: dict[str, Callable[[Any], str]] = {
    "openai": _openai_tool_name,
    # a toolset by its family: the MCP connector's `mcp_toolset` is `mcp`, as its `mcp_servers`
    "anthropic": anthropic_tools.tool_name,
    "openai_responses": _responses_tool_name,
}


def _kept_by_name(protocol: str) -> Callable[[list[Any], Allowed], list[Any]]:
    name_of = TOOL_NAME[protocol]

    def kept(tools: list[Any], allowed: Allowed) -> list[Any]:
        left = [t for t in tools if allowed(name_of(t))]
        return tools if len(left) == len(tools) else left

    return kept


KEPT_TOOLS: dict[str, Callable[[list[Any], Allowed], list[Any]]] = {
    "openai": _kept_by_name("openai"),
    "anthropic": _kept_by_name("anthropic"),
    "openai_responses": allowed_tools,  # a namespace keeps its allowed functions
}
"""The tools of a list the allow-list keeps, per protocol: the list itself when it keeps all."""


def _filter_mcp_servers(body: dict[str, Any], allowed: Allowed) -> bool:
    """Anthropic's MCP connector (`mcp_servers`): servers Anthropic calls itself, whose tools run
    upstream before any answer. Offered only when the allow-list names `mcp` (as the Responses API's
    hosted `mcp` tool)."""
    if body.get("mcp_servers") is None or allowed("mcp"):
        return False
    del body["mcp_servers"]
    return True


# what else a protocol's request offers besides `tools`
OTHER_OFFERS: dict[str, Callable[[dict[str, Any], Allowed], bool]] = {
    "openai": _filter_functions,
    "anthropic": _filter_mcp_servers,
    "openai_responses": responses_wire.filter_offers,
}


OTHER_OFFERED: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    "openai": lambda body: bool(body.get("functions")),
    "anthropic": lambda body: bool(body.get("mcp_servers")),
    "openai_responses": lambda body: bool(offered_tools(body)),
}
"""Whether a request offers tools outside `tools`, per protocol (what `OTHER_OFFERS` filters)."""


def offers_tools(protocol: str, body: Mapping[str, Any]) -> bool:
    """The request offers the model any tool: `tools`, OpenAI's legacy `functions`, Anthropic's MCP
    connector, the tool lists of the Responses API's input items."""
    other = OTHER_OFFERED.get(protocol)
    return bool(body.get("tools")) or (other is not None and other(body))


def filter_request_tools(protocol: str, body: dict[str, Any], allowed: Allowed) -> bool:
    """Remove offered tools that are not allowed: `tools`, and what `OTHER_OFFERS` adds per protocol
    (OpenAI's legacy functions, Anthropic's MCP connector, the Responses API's tool lists in input
    items and `allowed_tools`). True when the body changed."""
    other = OTHER_OFFERS.get(protocol)
    changed = other is not None and other(body, allowed)
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return changed
    kept = KEPT_TOOLS[protocol](tools, allowed)
    if kept is tools:
        return changed
    if kept:
        body["tools"] = kept
    else:
        # an empty tool list (and a tool_choice without tools) is an error for both APIs
        for key in ("tools", "tool_choice", "parallel_tool_calls"):
            body.pop(key, None)
    return True


# -- answers -----------------------------------------------------------------------------------------


def _drop_openai(body: dict[str, Any], names: frozenset[str]) -> bool:
    left = False
    for choice in body.get("choices") or ():
        message = choice.get("message") or {}
        legacy = proposed(message)
        if legacy is not None and legacy[0] in names:
            message.pop("function_call")
            if choice.get("finish_reason") == "function_call":
                choice["finish_reason"] = "stop"
        calls = message.get("tool_calls") or []
        kept = [c for c in calls if _openai_tool_name(c) not in names]
        if calls and len(kept) != len(calls):
            if kept:
                message["tool_calls"] = kept
            else:
                message.pop("tool_calls", None)
                if choice.get("finish_reason") == "tool_calls":
                    choice["finish_reason"] = "stop"
        left = left or bool(kept) or bool(message.get("content")) or "function_call" in message
    return left


def _drop_anthropic(body: dict[str, Any], names: frozenset[str]) -> bool:
    blocks = body.get("content") or []
    kept = [b for b in blocks if not (b.get("type") == "tool_use" and anthropic_tools.call_name(b) in names)]
    body["content"] = kept
    if not any(b.get("type") == "tool_use" for b in kept) and body.get("stop_reason") == "tool_use":
        body["stop_reason"] = "end_turn"
    # what the agent can act on: text or a call of its own; thinking and the records of the tools the
    # provider ran are no answer on their own (as for the Responses API's reasoning items)
    return any(b.get("type") == "tool_use" or (b.get("type") == "text" and b.get("text")) for b in kept)


DROP_IN_BODY: dict[str, Callable[[dict[str, Any], frozenset[str]], bool]] = {
    "openai": _drop_openai,
    "anthropic": _drop_anthropic,
    "openai_responses": responses_wire.drop_in_body,
}


def drop_calls(protocol: str, body: dict[str, Any], names: frozenset[str]) -> bool:
    """Remove proposed calls of `names` from an answer body in place. True when something is left
    (text or other calls)."""
    return DROP_IN_BODY[protocol](body, names)


def _events(raw: bytes) -> list[tuple[str | None, str, bytes]]:
    parser = SseParser()
    return [(e.event, e.data, e.raw) for e in parser.feed(raw)]


def _openai_chunks(raw: bytes) -> list[tuple[bytes, dict[str, Any] | None]]:
    """Each held event's bytes, and its JSON chunk (None for `[DONE]` and what is not a JSON object)."""
    out: list[tuple[bytes, dict[str, Any] | None]] = []
    for _, data, original in _events(raw):
        try:
            chunk = orjson.loads(data) if data and data != "[DONE]" else None
        except orjson.JSONDecodeError:
            chunk = None
        out.append((original, chunk if isinstance(chunk, dict) else None))
    return out


def _openai_call_names(chunks: list[tuple[bytes, dict[str, Any] | None]]) -> dict[tuple[int, int], str]:
    """Each streamed call's whole name, by (choice index, call index): a name may come in pieces, and
    a call is judged by its whole name, never by a prefix."""
    names: dict[tuple[int, int], str] = {}
    for _, chunk in chunks:
        for choice in (chunk or {}).get("choices") or ():
            legacy = proposed(choice.get("delta") or {})
            if legacy is not None:
                key = (int(choice.get("index") or 0), LEGACY)
                names[key] = names.get(key, "") + legacy[0]
            for tc in (choice.get("delta") or {}).get("tool_calls") or ():
                name = (tool_spec(tc) or {}).get("name")
                if name:
                    key = (int(choice.get("index") or 0), int(tc.get("index") or 0))
                    names[key] = names.get(key, "") + name
    return names


def _drop_openai_stream(raw: bytes, names: frozenset[str]) -> bytes:
    out: list[bytes] = []
    chunks = _openai_chunks(raw)
    call_names = _openai_call_names(chunks)
    renumber: dict[tuple[int, int], int] = {}
    for original, chunk in chunks:
        if chunk is None:
            out.append(original)
            continue
        changed = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            index = int(choice.get("index") or 0)
            legacy_dropped = call_names.get((index, LEGACY)) in names
            if legacy_dropped and "function_call" in delta:
                delta.pop("function_call")
                changed = True
            if legacy_dropped and choice.get("finish_reason") == "function_call":
                choice["finish_reason"] = "stop"
                changed = True
            calls = delta.get("tool_calls")
            if calls:
                kept = []
                for tc in calls:
                    key = (int(choice.get("index") or 0), int(tc.get("index") or 0))
                    if call_names.get(key) in names:
                        continue
                    if key not in renumber:
                        renumber[key] = sum(1 for k in renumber if k[0] == key[0])
                    kept.append({**tc, "index": renumber[key]})
                changed = True
                if kept:
                    delta["tool_calls"] = kept
                else:
                    delta.pop("tool_calls")
            if choice.get("finish_reason") == "tool_calls" and not any(k[0] == index for k in renumber):
                choice["finish_reason"] = "stop"
                changed = True
        if not changed:
            out.append(original)
            continue
        empty = all(not c.get("delta") and not c.get("finish_reason") for c in chunk.get("choices") or ())
        if empty and chunk.get("usage") is None:
            continue
        out.append(format_event(orjson.dumps(chunk)))
    return b"".join(out)


def _drop_anthropic_stream(raw: bytes, names: frozenset[str]) -> bytes:
    out: list[bytes] = []
    dropped: set[int] = set()
    has_tool = False
    for event, data, original in _events(raw):
        try:
            body = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or "index" not in body:
            if isinstance(body, dict) and body.get("type") == "message_delta" and not has_tool:
                delta = body.get("delta") or {}
                if delta.get("stop_reason") == "tool_use":
                    delta["stop_reason"] = "end_turn"
                    out.append(format_event(orjson.dumps(body), event))
                    continue
            out.append(original)
            continue
        index = int(body["index"])
        block = body.get("content_block") or {}
        if body.get("type") == "content_block_start":
            if block.get("type") == "tool_use" and anthropic_tools.call_name(block) in names:
                dropped.add(index)
                continue
            has_tool = has_tool or block.get("type") == "tool_use"
        if index in dropped:
            continue
        new_index = index - sum(1 for d in dropped if d < index)
        if new_index == index:
            out.append(original)
        else:
            out.append(format_event(orjson.dumps({**body, "index": new_index}), event))
    return b"".join(out)


DROP_IN_STREAM: dict[str, Callable[[bytes, frozenset[str]], bytes]] = {
    "openai": _drop_openai_stream,
    "anthropic": _drop_anthropic_stream,
    "openai_responses": responses_wire.drop_in_stream,
}


def drop_stream_calls(protocol: str, raw: bytes, names: frozenset[str]) -> bytes:
    """Held stream events without the calls of `names` (their bytes never reach the agent)."""
    return DROP_IN_STREAM[protocol](raw, names)
