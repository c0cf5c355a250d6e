"""Neutral calls and answers for the otel tests, as the provider adapters would produce them."""

from __future__ import annotations

from typing import Any

from gateway.call import Answer, Call, RequestParams, ToolCall, ToolResult, ToolSpec, Usage

PROVIDER_KEY = "sk-proj-Zx81KqPq3nT0aB4cD5eF6gH7iJ8kL9mN0"
AGENT_BEARER = "tg-agent-7f3a9c0d1e2b4a5f"

OPENAI_BODY: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in Paris?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy, 57°F"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
            },
        }
    ],
    "temperature": 0.2,
    "top_p": 1,
    "max_tokens": 256,
    "seed": 7,
    "n": 2,
    "stop": ["END"],
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    "service_tier": "default",
}

ANTHROPIC_BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5",
    "system": [{"type": "text", "text": "You are terse."}],
    "max_tokens": 512,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"location": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "rainy"}],
                },
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"},
                },
            ],
        },
    ],
    "tools": [
        {
            "name": "get_weather",
            "description": "Current weather",
            "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ],
    "temperature": 1,
    "top_k": 40,
    "stop_sequences": ["\n\nHuman:"],
}


def openai_call(body: dict[str, Any] | None = None, *, stream: bool = False) -> Call:
    body = dict(OPENAI_BODY if body is None else body)
    return Call(
        protocol="openai",
        operation="chat",
        model=body["model"],
        stream=stream,
        max_tokens=body.get("max_tokens"),
        tools=(ToolSpec("get_weather", "Current weather", {"type": "object"}),),
        params=RequestParams(
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            frequency_penalty=body.get("frequency_penalty"),
            presence_penalty=body.get("presence_penalty"),
            stop_sequences=tuple(body["stop"]) if "stop" in body else None,
            seed=body.get("seed"),
            choice_count=body.get("n"),
        ),
        raw=body,
    )


def anthropic_call(body: dict[str, Any] | None = None, *, stream: bool = False) -> Call:
    body = dict(ANTHROPIC_BODY if body is None else body)
    return Call(
        protocol="anthropic",
        operation="chat",
        model=body["model"],
        stream=stream,
        max_tokens=body["max_tokens"],
        params=RequestParams(
            temperature=body.get("temperature"),
            top_k=body.get("top_k"),
            stop_sequences=tuple(body.get("stop_sequences", ())) or None,
        ),
        raw=body,
    )


def mcp_call(tool: str = "read_file", arguments: str = '{"path": "/etc/motd"}') -> Call:
    return Call(protocol="mcp", operation="execute_tool", model="", tool_call=ToolCall("7", tool, arguments))


OPENAI_ANSWER = Answer(
    response_id="chatcmpl-123",
    model="gpt-4o-mini-2024-07-18",
    text="It is rainy.",
    finish_reasons=("stop", "length"),
    usage=Usage(input_tokens=120, output_tokens=30, cache_read_tokens=64, reasoning_tokens=12),
)

# The Anthropic adapter already summed input_tokens (100) + cache_read (20) + cache_creation (30).
ANTHROPIC_ANSWER = Answer(
    response_id="msg_01",
    model="claude-sonnet-4-5-20250929",
    text="",
    tool_calls=(ToolCall("toolu_2", "get_weather", '{"location": "Lyon"}'),),
    finish_reasons=("tool_use",),
    usage=Usage(input_tokens=150, output_tokens=40, cache_read_tokens=20, cache_creation_tokens=30),
)

MCP_OK = Answer(tool_result=ToolResult("7", "Welcome!"))
MCP_TOOL_ERROR = Answer(is_error=True, tool_result=ToolResult("7", "no such file", is_error=True))
