"""`gateway.observe_mcp`: what an MCP server's answer to `tools/call` tells the span."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.call import ToolResult
from gateway.jsonrpc import Message
from gateway.observe_mcp import _answer

CALL = Message({"jsonrpc": "2.0", "id": 7, "method": "tools/call"}, "tools/call", 7, {})


@pytest.mark.parametrize(("outcome", "code", "description"), [
    # semconv (mcp.md): the status description is JSONRPCError.message; it was the code
    ({"error": {"code": -32602, "message": "Invalid params: path is required"}}, "-32602",
     "Invalid params: path is required"),
    ({"error": {"code": -32000, "message": "x" * 1000}}, "-32000", "x" * 256),  # bounded
    ({"error": {"code": "bad", "message": ""}}, "_OTHER", None),
    ({"error": {"code": -32601}}, "-32601", None),
    (None, None, None),
    ({"result": "odd"}, None, None),
])
def test_a_json_rpc_error_gives_its_code_and_message(outcome: dict[str, Any] | None, code: str | None,
                                                     description: str | None) -> None:
    assert _answer(outcome, CALL) == (None, code, description)


def test_a_result_is_the_tool_s_answer() -> None:
    answer, code, description = _answer({"result": {"content": [{"type": "text", "text": "hi"}], "isError": True}},
                                        CALL)
    assert (code, description) == (None, None)
    assert answer is not None and answer.is_error
    assert answer.tool_result == ToolResult("7", '[{"type":"text","text":"hi"}]', True)
