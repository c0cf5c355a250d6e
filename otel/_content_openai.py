"""OpenAI Chat Completions request body -> semconv v1.41 content shapes.

System and developer messages are part of the chat history, so they go into `gen_ai.input.messages`
(roles kept as sent) and there are no separate system instructions (gen-ai-spans.md, "system
instructions ... passed separately from the chat history").
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


def _image_url(part: Mapping[str, Any]) -> Part:
    return data_url_part(str(mapping(part.get("image_url")).get("url", "")), "image")


def _input_audio(part: Mapping[str, Any]) -> Part:
    audio = mapping(part.get("input_audio"))
    fmt = audio.get("format")
    return without_none(
        type="blob", modality="audio", mime_type=f"audio/{fmt}" if fmt else None, content=audio.get("data")
    )


def _file(part: Mapping[str, Any]) -> Part:
    file = mapping(part.get("file"))
    if file.get("file_id"):
        return {"type": "file", "modality": "document", "file_id": file["file_id"]}
    data = file.get("file_data")
    if isinstance(data, str):
        return data_url_part(data, "document")
    return generic_part(part)


_PARTS: Final[Mapping[str, Callable[[Mapping[str, Any]], Part]]] = {
    "text": lambda part: text_part(part.get("text", "")),
    "refusal": lambda part: {"type": "refusal", "content": part.get("refusal", "")},
    "image_url": _image_url,
    "input_audio": _input_audio,
    "file": _file,
}


def _content_parts(content: Any) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(content)]
    parts: list[Part] = []
    for block in content if isinstance(content, list) else ():
        block = mapping(block)
        mapper = _PARTS.get(str(block.get("type")))
        parts.append(mapper(block) if mapper is not None else generic_part(block))
    return parts


def _text_of(content: Any) -> Any:
    """A tool message's content as the `response` value: its text when it is text parts only."""
    if isinstance(content, list) and all(mapping(p).get("type") == "text" for p in content):
        return "".join(str(mapping(p).get("text", "")) for p in content)
    return content


def _tool_call(call: Mapping[str, Any]) -> Part:
    function = mapping(call.get("function"))
    return without_none(
        type="tool_call",
        id=call.get("id"),
        name=function.get("name", ""),
        arguments=json_or_text(function.get("arguments")),
    )


def _message(msg: Mapping[str, Any]) -> Message:
    role = str(msg.get("role", "user"))
    content = msg.get("content")
    if role in ("tool", "function"):
        parts: list[Part] = [
            without_none(
                type="tool_call_response",
                id=msg.get("tool_call_id"),
                response=_text_of(content),
            )
        ]
    else:
        parts = _content_parts(content)
    if msg.get("refusal"):
        parts.append({"type": "refusal", "content": msg["refusal"]})
    parts.extend(_tool_call(mapping(call)) for call in msg.get("tool_calls") or ())
    legacy = msg.get("function_call")
    if isinstance(legacy, Mapping):
        parts.append(_tool_call({"function": legacy}))
    message: Message = {"role": role, "parts": parts}
    if msg.get("name") and role not in ("function",):
        message["name"] = msg["name"]
    return message


def input_messages(raw: Mapping[str, Any]) -> list[Message] | None:
    messages = raw.get("messages")
    if not isinstance(messages, list):
        return None
    return [_message(mapping(msg)) for msg in messages]


def system_instructions(raw: Mapping[str, Any]) -> list[Part] | None:
    del raw  # system messages are chat history in this API
    return None


def _tool_definition(tool: Mapping[str, Any], detailed: bool) -> Part:
    kind = str(tool.get("type", "function"))
    spec = mapping(tool.get(kind))
    definition: Part = {"type": kind, "name": spec.get("name", "")}
    if detailed:
        definition.update(
            without_none(description=spec.get("description"), parameters=spec.get("parameters"))
        )
    return definition


def tool_definitions(raw: Mapping[str, Any], detailed: bool) -> list[Part] | None:
    tools = raw.get("tools")
    if isinstance(tools, list) and tools:
        return [_tool_definition(mapping(tool), detailed) for tool in tools]
    functions = raw.get("functions")  # legacy function calling
    if isinstance(functions, list) and functions:
        return [_tool_definition({"type": "function", "function": fn}, detailed) for fn in functions]
    return None
