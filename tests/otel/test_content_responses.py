"""Content capture shapes (semconv v1.41) from OpenAI Responses bodies (`otel._content_responses`)."""

from __future__ import annotations

from typing import Any

import pytest

from otel._content_responses import input_messages, system_instructions, tool_definitions

BODY: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,iVBO"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rainy"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}},
              {"type": "web_search_preview"}],
}


def test_input_items_become_messages() -> None:
    assert input_messages(BODY) == [
        {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"},
                                   {"type": "blob", "modality": "image", "mime_type": "image/png", "content": "iVBO"}]},
        {"role": "assistant", "parts": [{"type": "text", "content": "Let me check."}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1", "name": "get_weather",
                                         "arguments": {"city": "Paris"}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "rainy"}]},
        {"role": "assistant", "parts": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
    ]


@pytest.mark.parametrize(("value", "expected"), [
    ("hi", [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
    (None, None),
    (7, None),
])
def test_input_string_or_absent(value: Any, expected: Any) -> None:
    assert input_messages({"input": value}) == expected


def test_instructions_are_system_instructions() -> None:
    assert system_instructions(BODY) == [{"type": "text", "content": "Be brief."}]
    assert system_instructions({"input": "hi"}) is None


def test_tool_definitions_name_hosted_tools_by_type() -> None:
    assert tool_definitions(BODY, False) == [{"type": "function", "name": "get_weather"},
                                             {"type": "web_search_preview", "name": "web_search_preview"}]
    detailed = tool_definitions(BODY, True)
    assert detailed is not None and detailed[0]["description"] == "Weather."
    assert detailed[0]["parameters"] == {"type": "object"}
    assert tool_definitions({"tools": []}, False) is None
