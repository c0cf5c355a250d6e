"""Pure mapping from one MCP request tollgate forwards to its client span's name and attributes
(`span.mcp.client`, semconv v1.41 `docs/gen-ai/mcp.md`)."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv._incubating.attributes import jsonrpc_attributes as JsonRpc
from opentelemetry.semconv._incubating.attributes import mcp_attributes as Mcp
from opentelemetry.semconv._incubating.attributes import rpc_attributes as Rpc
from opentelemetry.semconv.attributes import error_attributes as Error
from opentelemetry.semconv.attributes import network_attributes as Network
from opentelemetry.semconv.attributes import server_attributes as Server

from gateway.frozen_init import fast_init
from otel.attributes import EXECUTE_TOOL, TOOL_ERROR, TOOLS_CALL, Attributes, present

__all__ = ["McpOperation", "mcp_attributes", "mcp_span_name"]


@fast_init
@dataclass(frozen=True, slots=True)
class McpOperation:
    """One MCP request as its span describes it, known before it is forwarded: the method, what it names
    (`tool_name` for `tools/call`, `prompt_name` for `prompts/get`, `resource_uri` for `resources/*`),
    the JSON-RPC id (None for a notification), the session and protocol, the server."""

    method: str
    tool_name: str | None = None
    prompt_name: str | None = None
    resource_uri: str | None = None
    request_id: str | int | None = None
    session_id: str | None = None
    protocol_version: str | None = None
    server_address: str | None = None
    server_port: int | None = None


def mcp_span_name(op: McpOperation) -> str:
    """`{mcp.method.name} {target}`, the target the tool or prompt when there is one; never the resource
    URI, which the convention leaves to an opt-in (its cardinality)."""
    target = op.tool_name or op.prompt_name
    return f"{op.method} {target}" if target else op.method


def mcp_attributes(op: McpOperation, *, is_error: bool | None = None, rpc_error_code: int | None = None) -> Attributes:
    """Attributes of an MCP client span. `gen_ai.operation.name = execute_tool` only for `tools/call`;
    `jsonrpc.request.id` as a string and only for requests with an id; `error.type` is the JSON-RPC error
    code as a string (with `rpc.response.status_code`) on a protocol error, else `tool_error` when
    `CallToolResult.isError`. The streamable-HTTP transport is TCP + HTTP."""
    error_code = str(rpc_error_code) if rpc_error_code is not None else None
    error_type = error_code if error_code is not None else (TOOL_ERROR if is_error else None)
    return present(
        (
            (Mcp.MCP_METHOD_NAME, op.method),
            (GenAI.GEN_AI_OPERATION_NAME, EXECUTE_TOOL if op.method == TOOLS_CALL else None),
            (GenAI.GEN_AI_TOOL_NAME, op.tool_name or None),
            (GenAI.GEN_AI_PROMPT_NAME, op.prompt_name or None),
            (Mcp.MCP_RESOURCE_URI, op.resource_uri or None),
            (JsonRpc.JSONRPC_REQUEST_ID, str(op.request_id) if op.request_id is not None else None),
            (Mcp.MCP_SESSION_ID, op.session_id or None),
            (Mcp.MCP_PROTOCOL_VERSION, op.protocol_version or None),
            (Server.SERVER_ADDRESS, op.server_address or None),
            (Server.SERVER_PORT, op.server_port if op.server_address else None),
            (Network.NETWORK_TRANSPORT, Network.NetworkTransportValues.TCP.value),
            (Network.NETWORK_PROTOCOL_NAME, "http"),
            (Rpc.RPC_RESPONSE_STATUS_CODE, error_code),
            (Error.ERROR_TYPE, error_type),
        )
    )
