"""`gateway.mcp_idempotent`: what a replayed refusal's ledger row gives as its reason. The at-most-once
behaviour through running gateways is tested in tests/gateway/test_mcp_calls.py, test_mcp_replicas.py
and test_mcp_flights*.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.mcp_idempotent import refusal_code


@pytest.mark.parametrize(("outcome", "code"), [
    ({"jsonrpc": "2.0", "id": 1, "error": {"code": -32003, "message": "m", "data": {"code": "approval_denied"}}},
     "approval_denied"),
    ({"jsonrpc": "2.0", "id": 1, "error": {"code": -32000, "message": "m", "data": {"code": "approval_denied"}}},
     None),  # the MCP server's own error: what its data says is not a decision of tollgate
    ({"jsonrpc": "2.0", "id": 1, "error": {"code": -32003, "message": "m", "data": {"code": 7}}}, None),
    ({"jsonrpc": "2.0", "id": 1, "error": {"code": -32003, "message": "m"}}, None),
    ({"jsonrpc": "2.0", "id": 1, "result": {"content": []}}, None),
])
def test_the_refusal_a_replay_gives_again(outcome: dict[str, Any], code: str | None) -> None:
    assert refusal_code(outcome) == code
