"""Anthropic Messages request body -> semconv v1.41 content shapes.

The `system` parameter becomes `gen_ai.system_instructions` (anthropic.md, v1.41); messages keep the
role they were sent with (`tool_result` blocks stay in their `user` message as `tool_call_response`
parts). Thinking blocks become `reasoning` parts; server tools become `server_tool_call` and
`server_tool_call_response` parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from otel._content_common import (
    Message,
    Part,
    data_url_part,
    generic_part,
    mapping,
    text_part,
    without_none,
)


def _source(block: Mapping[str, Any], modality: str) -> Part:
    source = mapping(block.get("source"))
    kind = source.get("type")
    if kind == "base64":
        return without_none(
            type="blob", modality=modality, mime_type=source.get("media_type"), content=source.get("data")
        )
    if kind == "url":
        return data_url_part(str(source.get("url", "")), modality)
    if kind == "file":
        return {"type": "file", "modality": modality, "file_id": source.get("file_id", "")}
    if kind == "text":
        return text_part(source.get("data", ""))
    return generic_part(block)


def _tool_result(block: Mapping[str, Any]) -> Part:
    content = block.get("content")
    if isinstance(content, list) and all(mapping(b).get("type") == "text" for b in content):
        content = "".join(str(mapping(b).get("text", "")) for b in content)
    return without_none(type="tool_call_response", id=block.get("tool_use_id"), response=content)


def _server_tool_result(block: Mapping[str, Any]) -> Part:
    body = {key: value for key, value in block.items() if key != "tool_use_id"}
    return without_none(
        type="server_tool_call_response", id=block.get("tool_use_id"), server_tool_call_response=body
    )


_BLOCKS: Final[Mapping[str, Callable[[Mapping[str, Any]], Part]]] = {
    "text": lambda block: text_part(block.get("text", "")),
    "image": lambda block: _source(block, "image"),
    "document": lambda block: _source(block, "document"),
    "tool_use": lambda block: without_none(
        type="tool_call", id=block.get("id"), name=block.get("name", ""), arguments=block.get("input")
    ),
    "tool_result": _tool_result,
    "thinking": lambda block: {"type": "reasoning", "content": block.get("thinking", "")},
    "redacted_thinking": lambda block: {"type": "reasoning", "content": ""},
    "server_tool_use": lambda block: without_none(
        type="server_tool_call",
        id=block.get("id"),
        name=block.get("name", ""),
        server_tool_call={"type": block.get("name", ""), **mapping(block.get("input"))},
    ),
}


def _block(block: Mapping[str, Any]) -> Part:
    kind = str(block.get("type"))
    mapper = _BLOCKS.get(kind)
    if mapper is not None:
        return mapper(block)
    if kind.endswith("_tool_result"):  # web_search_tool_result, code_execution_tool_result, ...
        return _server_tool_result(block)
    return generic_part(block)


def _parts(content: Any) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(content)]
    return [_block(mapping(block)) for block in content] if isinstance(content, list) else []


def input_messages(raw: Mapping[str, Any]) -> list[Message] | None:
    messages = raw.get("messages")
    if not isinstance(messages, list):
        return None
    return [
        {"role": str(mapping(msg).get("role", "user")), "parts": _parts(mapping(msg).get("content"))}
        for msg in messages
    ]


def system_instructions(raw: Mapping[str, Any]) -> list[Part] | None:
    system = raw.get("system")
    if not system:
        return None
    return _parts(system)


def _tool_definition(tool: Mapping[str, Any], detailed: bool) -> Part:
    kind = tool.get("type")
    server_tool = isinstance(kind, str) and kind != "custom"
    definition: Part = {"type": kind if server_tool else "function", "name": tool.get("name", "")}
    if detailed and not server_tool:
        definition.update(
            without_none(description=tool.get("description"), parameters=tool.get("input_schema"))
        )
    return definition


def tool_definitions(raw: Mapping[str, Any], detailed: bool) -> list[Part] | None:
    tools = raw.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    return [_tool_definition(mapping(tool), detailed) for tool in tools]
