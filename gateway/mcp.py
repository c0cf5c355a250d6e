"""MCP Streamable HTTP proxy at `/mcp/{server}`: POST JSON-RPC (JSON or SSE answers), GET server
stream, DELETE session.

Identity and run id resolve exactly as for model calls, so MCP steps belong to the agent's run.
Every POST must be one well-formed JSON-RPC message; the server receives tollgate's own serialisation
of it, so what the server parses is exactly what tollgate judged (duplicate keys, escapes and the
like cannot make the two disagree). `tools/list` answers are filtered to the agent's allowed tools
(each page; the client follows `nextCursor` itself); `tools/call` goes through `gateway.mcp_calls`.
Everything else is relayed as is, streaming, each message under an MCP CLIENT span of its method
(`gateway.observe_mcp`). `Mcp-Session-Id`, `MCP-Protocol-Version` and the other
end-to-end headers travel both ways; the agent's tollgate key does not reach the server, the server's
configured `headers` are added.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from gateway.approvals import queue_of
from gateway.errors import GatewayError, ShuttingDown, UpstreamUnavailable
from gateway.identity import RUN_ID_HEADER
from gateway.jsonrpc import (
    BadMessage,
    Message,
    check_routing_headers,
    error_body,
    filter_tools,
    parse_message,
    untasked,
)
from gateway.mcp_calls import call_tool
from gateway.mcp_transport import McpRequest, Transform, refusal, relay, state_of
from gateway.observe_mcp import end_relay_span, start_relay_span
from gateway.proxy import GATEWAY
from gateway.request_body import read_body
from gateway.respond import echo_headers


async def mcp_handler(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    name = request.match_info["server"]
    headers = echo_headers(request.headers)  # answers before the agent is known echo a named run id
    try:
        if gw.shutting_down:
            raise ShuttingDown("tollgate is shutting down")
        identity = gw.identifier.identify(request.headers)
        headers[RUN_ID_HEADER] = identity.run_id
        server = gw.config.mcp_servers.get(name)
        if server is None:
            body = error_body(None, -32600, f"mcp_server_not_found: no MCP server named {name!r} is configured",
                              {"code": "mcp_server_not_found"})
            return web.Response(status=404, body=body, content_type="application/json", headers=headers)
        mcp = McpRequest(gw, request, identity, name, server, gw.tool_policy(identity.agent, identity.policy), headers)
        if request.method == "POST":
            return await _post(mcp)
        if request.method in ("GET", "DELETE"):
            upstream = await mcp.open(request.method, None)
            return await relay(mcp, upstream, None, _no_responses if request.method == "GET" else None)
        headers["Allow"] = "GET, POST, DELETE"
        body = error_body(None, -32600, f"method_not_allowed: the MCP endpoint takes GET, POST and DELETE, "
                          f"not {request.method[:20]}", {"code": "method_not_allowed"})
        return web.Response(status=405, body=body, content_type="application/json", headers=headers)
    except GatewayError as exc:
        return refusal(exc, None, headers)


async def _post(mcp: McpRequest) -> web.StreamResponse:
    limits = mcp.gw.config.limits
    raw = await read_body(mcp.request, limits)
    message = parse_message(raw, limits.max_json_depth)
    try:
        headers = mcp.request.headers
        check_routing_headers(message, headers.getall("Mcp-Method", ()), headers.getall("Mcp-Name", ()))
        if message.method == "notifications/cancelled" and not message.is_request:
            # what the client gave up on must not run later: a call parked for approval is denied
            queue_of(mcp.gw).cancel(mcp.request_key(message.params.get("requestId")))
        if message.method == "tools/call":
            if not message.is_request:
                raise BadMessage("tools/call must be a request (with an id), not a notification")
            return await call_tool(mcp, untasked(message), len(raw))
        if (message.method or "").startswith("tasks/"):  # no task is created through tollgate (`untasked`)
            raise BadMessage(f"{message.method} is not relayed: tollgate runs no MCP tasks (their results "
                             "would reach the agent unjudged)")
        return await _relayed(mcp, message)
    except GatewayError as exc:
        return refusal(exc, message.id, mcp.headers)


async def _relayed(mcp: McpRequest, message: Message) -> web.StreamResponse:
    """Forward a message that is no `tools/call` and relay the server's answer, under its MCP span
    (`tools/list` filtered by the allow-list). Raises GatewayError before the answer has started."""
    span, body = await start_relay_span(mcp, message)
    seen: list[Mapping[str, Any]] = []
    status: int | None = None
    try:
        upstream = await mcp.open("POST", body)
        status = upstream.status
        listing = message.method == "tools/list" and message.is_request
        answer = await relay(mcp, upstream, message.id if message.is_request else None,
                             _list_filter(mcp) if listing else None, seen.append)
    except GatewayError as exc:
        end_relay_span(span, status=status, response=None, failure=exc)
        raise
    except asyncio.CancelledError:  # the client went away before the answer was relayed
        end_relay_span(span, status=status, response=None, gone=True)
        raise
    end_relay_span(span, status=status, response=seen[0] if seen else None, failure=mcp.lost)
    return answer


async def _no_responses(message: dict[str, Any]) -> dict[str, Any]:
    """A GET stream carries responses only when a client resumes a request's stream there, which
    tollgate's clients cannot do (it gives them no event ids): one would reach the agent unjudged."""
    raise UpstreamUnavailable("the MCP server sent a JSON-RPC response on its GET stream (a request's "
                              "stream resumed around tollgate); the stream is ended")


def _list_filter(mcp: McpRequest) -> Transform:
    """Filters a `tools/list` result and remembers the kept tools' input schemas."""
    state = state_of(mcp.gw)

    def seen(tool: str, schema: Any) -> None:
        state.remember(mcp.server_name, tool, schema)

    async def transform(message: dict[str, Any]) -> dict[str, Any]:
        return filter_tools(message, mcp.allowed, seen, private=mcp.policy.restricted) or message

    return transform
