"""`otel.mcp_attributes`: an MCP request's client span name and attributes, exactly (semconv v1.41 mcp.md)."""

from __future__ import annotations

from typing import Any

import pytest

from otel.mcp_attributes import McpOperation, mcp_attributes, mcp_span_name

NETWORK = {"network.transport": (str, "tcp"), "network.protocol.name": (str, "http")}


def typed(attrs: dict[str, Any]) -> dict[str, tuple[type, Any]]:
    return {k: (type(v), v) for k, v in attrs.items()}


def test_tools_call_attributes_exact() -> None:
    op = McpOperation("tools/call", tool_name="read_file", request_id=7, session_id="sess-1",
                      protocol_version="2025-06-18", server_address="127.0.0.1", server_port=3001)
    assert typed(mcp_attributes(op)) == {
        "mcp.method.name": (str, "tools/call"),
        "gen_ai.operation.name": (str, "execute_tool"),
        "gen_ai.tool.name": (str, "read_file"),
        "jsonrpc.request.id": (str, "7"),
        "mcp.session.id": (str, "sess-1"),
        "mcp.protocol.version": (str, "2025-06-18"),
        "server.address": (str, "127.0.0.1"),
        "server.port": (int, 3001),
        **NETWORK,
    }
    assert mcp_span_name(op) == "tools/call read_file"


@pytest.mark.parametrize(("op", "name", "expected"), [
    (McpOperation("tools/list", request_id="a", server_address="h", server_port=1), "tools/list",
     {"mcp.method.name": (str, "tools/list"), "jsonrpc.request.id": (str, "a"), "server.address": (str, "h"),
      "server.port": (int, 1), **NETWORK}),
    (McpOperation("prompts/get", prompt_name="review", request_id=2), "prompts/get review",
     {"mcp.method.name": (str, "prompts/get"), "gen_ai.prompt.name": (str, "review"),
      "jsonrpc.request.id": (str, "2"), **NETWORK}),
    # the URI is an attribute, never part of the name (its cardinality)
    (McpOperation("resources/read", resource_uri="file:///a.txt", request_id=3), "resources/read",
     {"mcp.method.name": (str, "resources/read"), "mcp.resource.uri": (str, "file:///a.txt"),
      "jsonrpc.request.id": (str, "3"), **NETWORK}),
    # a notification has no id; a port without an address is not reported
    (McpOperation("notifications/initialized", server_port=9), "notifications/initialized",
     {"mcp.method.name": (str, "notifications/initialized"), **NETWORK}),
])
def test_other_methods(op: McpOperation, name: str, expected: dict[str, tuple[type, Any]]) -> None:
    assert typed(mcp_attributes(op)) == expected
    assert mcp_span_name(op) == name


@pytest.mark.parametrize(
    ("is_error", "code", "expected"),
    [
        (True, None, {"error.type": "tool_error"}),
        (False, None, {}),
        (None, -32602, {"error.type": "-32602", "rpc.response.status_code": "-32602"}),
        (True, -32603, {"error.type": "-32603", "rpc.response.status_code": "-32603"}),
    ],
)
def test_errors(is_error: bool | None, code: int | None, expected: dict[str, str]) -> None:
    attrs = mcp_attributes(McpOperation("tools/call", tool_name="t"), is_error=is_error, rpc_error_code=code)
    assert {k: v for k, v in attrs.items() if k in ("error.type", "rpc.response.status_code")} == expected
