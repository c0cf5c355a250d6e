"""OpenAI Responses request body -> semconv v1.41 content shapes.

`input` is the chat history: a string is one user message; message items keep their role, and the
call and call-output items the model and the agent exchanged become `tool_call` / `tool_call_response`
parts of an assistant / tool message. `instructions` is passed apart from the history, so it is
`gen_ai.system_instructions`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from otel._content_common import (
    Message,
    Part,
    data_url_part,
    generic_part,
    json_or_text,
    mapping,
    text_part,
    without_none,
)


def _image(part: Mapping[str, Any]) -> Part:
    if part.get("file_id"):
        return {"type": "file", "modality": "image", "file_id": part["file_id"]}
    return data_url_part(str(part.get("image_url") or ""), "image")


def _file(part: Mapping[str, Any]) -> Part:
    if part.get("file_id"):
        return {"type": "file", "modality": "document", "file_id": part["file_id"]}
    data = part.get("file_data")
    return data_url_part(data, "document") if isinstance(data, str) else generic_part(part)


_PARTS: Final[Mapping[str, Callable[[Mapping[str, Any]], Part]]] = {
    "input_text": lambda part: text_part(part.get("text", "")),
    "output_text": lambda part: text_part(part.get("text", "")),
    "refusal": lambda part: {"type": "refusal", "content": part.get("refusal", "")},
    "input_image": _image,
    "input_file": _file,
}


def _parts(content: Any) -> list[Part]:
    if isinstance(content, str):
        return [text_part(content)]
    parts: list[Part] = []
    for block in content if isinstance(content, list) else ():
        block = mapping(block)
        mapper = _PARTS.get(str(block.get("type")))
        parts.append(mapper(block) if mapper is not None else generic_part(block))
    return parts


def _item(item: Mapping[str, Any]) -> Message:
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments") if kind == "function_call" else item.get("input")
        part = without_none(type="tool_call", id=item.get("call_id"), name=item.get("name", ""),
                            arguments=json_or_text(arguments))
        return {"role": "assistant", "parts": [part]}
    if kind in ("function_call_output", "custom_tool_call_output"):
        part = without_none(type="tool_call_response", id=item.get("call_id"), response=item.get("output"))
        return {"role": "tool", "parts": [part]}
    if kind in (None, "message"):
        return {"role": str(item.get("role", "user")), "parts": _parts(item.get("content"))}
    return {"role": "assistant", "parts": [generic_part(item)]}  # reasoning, hosted tool calls


def input_messages(raw: Mapping[str, Any]) -> list[Message] | None:
    value = raw.get("input")
    if isinstance(value, str):
        return [{"role": "user", "parts": [text_part(value)]}]
    if not isinstance(value, list):
        return None
    return [_item(mapping(item)) for item in value]


def system_instructions(raw: Mapping[str, Any]) -> list[Part] | None:
    instructions = raw.get("instructions")
    return _parts(instructions) or None if instructions else None


def tool_definitions(raw: Mapping[str, Any], detailed: bool) -> list[Part] | None:
    tools = raw.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    definitions: list[Part] = []
    for tool in tools:
        tool = mapping(tool)
        kind = str(tool.get("type", "function"))
        definition: Part = {"type": kind, "name": tool.get("name", kind)}
        if detailed:
            definition.update(
                without_none(description=tool.get("description"), parameters=tool.get("parameters")))
        definitions.append(definition)
    return definitions
