"""Helpers shared by the per-dialect content mappers (`_content_openai`, `_content_anthropic`).

Part shapes follow the v1.41 JSON schemas `docs/gen-ai/gen-ai-input-messages.json` and
`gen-ai-output-messages.json`: `text`, `tool_call`, `tool_call_response`, `blob`, `uri`, `file`,
`reasoning`, and generic parts (any other `type` plus its own fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

Part = dict[str, Any]
Message = dict[str, Any]


def compact(value: Any) -> str:
    """Compact JSON text, as util-genai's `gen_ai_json_dumps` writes content on spans."""
    return orjson.dumps(value).decode("utf-8")


def json_or_text(text: Any) -> Any:
    """Tool-call arguments as an object when they are JSON text, else the text itself (semconv
    prefers structured arguments)."""
    if not isinstance(text, str):
        return text
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def without_none(**fields: Any) -> Part:
    return {key: value for key, value in fields.items() if value is not None}


def text_part(content: Any) -> Part:
    return {"type": "text", "content": content if isinstance(content, str) else str(content)}


def data_url_part(url: str, modality: str) -> Part:
    """`data:<mime>;base64,<data>` becomes a `blob` part; any other URL a `uri` part."""
    if url.startswith("data:") and "," in url:
        header, _, data = url[5:].partition(",")
        mime = header.split(";", 1)[0] or None
        return without_none(type="blob", modality=modality, mime_type=mime, content=data)
    return {"type": "uri", "modality": modality, "uri": url}


def generic_part(block: Mapping[str, Any]) -> Part:
    """A block no mapping knows: kept as a generic part (its own `type` and fields)."""
    part = dict(block)
    part.setdefault("type", "unknown")
    return part


def mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
