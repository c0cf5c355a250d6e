"""The demo's scripted MCP tool server: a tiny Streamable HTTP JSON-RPC endpoint on loopback.

`POST /mcp` takes one JSON-RPC message and answers with `application/json`: `initialize`, `ping`,
`tools/list` and `tools/call` are answered, notifications get 202, other methods -32601. There is no
session and no server stream (`GET` is 405, as the transport allows). Tools are `DemoTool`s whose
handler turns the arguments into a text result. Every `tools/call` that reaches the server is logged
in `calls`, so the tour can show that a refused call never got here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from gateway.frozen_init import fast_init

__all__ = ["PROTOCOL_VERSION", "DemoTool", "ScriptedToolServer"]

PROTOCOL_VERSION = "2025-11-25"


@fast_init
@dataclass(frozen=True, slots=True)
class DemoTool:
    """One tool: `handler(arguments)` returns the text result."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    handler: Callable[[Mapping[str, Any]], str]

    def listing(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "inputSchema": dict(self.input_schema)}


def _reply(rpc_id: Any, *, result: Any = None, error: tuple[int, str] | None = None,
           status: int = 200) -> web.Response:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": rpc_id}
    if error is not None:
        message["error"] = {"code": error[0], "message": error[1]}
    else:
        message["result"] = result
    return web.Response(status=status, body=orjson.dumps(message), content_type="application/json")


class ScriptedToolServer:
    """The MCP server named `name`, serving `tools`. `calls` logs (tool, arguments) as received."""

    def __init__(self, name: str, tools: Sequence[DemoTool]) -> None:
        self.name = name
        self._tools = {t.name: t for t in tools}
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        """The aiohttp app serving `/mcp`."""
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        app.router.add_route("*", "/mcp", self._not_allowed)
        return app

    async def _not_allowed(self, request: web.Request) -> web.Response:
        return web.Response(status=405, headers={"Allow": "POST"})

    async def _post(self, request: web.Request) -> web.Response:
        try:
            message = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _reply(None, error=(-32700, "parse error"), status=400)
        if not isinstance(message, dict) or not isinstance(message.get("method"), str):
            return _reply(None, error=(-32600, "expected one JSON-RPC request"), status=400)
        if "id" not in message:
            return web.Response(status=202)  # a notification (e.g. notifications/initialized)
        rpc_id, method = message["id"], message["method"]
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        if method == "initialize":
            return _reply(rpc_id, result={
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": f"tollgate-demo-{self.name}", "version": "1.0"},
            })
        if method == "ping":
            return _reply(rpc_id, result={})
        if method == "tools/list":
            return _reply(rpc_id, result={"tools": [t.listing() for t in self._tools.values()]})
        if method == "tools/call":
            return self._call(rpc_id, params)
        return _reply(rpc_id, error=(-32601, f"method not found: {method}"))

    def _call(self, rpc_id: Any, params: Mapping[str, Any]) -> web.Response:
        name = params.get("name")
        arguments = params.get("arguments")
        arguments = arguments if isinstance(arguments, dict) else {}
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return _reply(rpc_id, error=(-32602, f"unknown tool: {name!r}"))
        self.calls.append((tool.name, dict(arguments)))
        text = tool.handler(arguments)
        return _reply(rpc_id, result={"content": [{"type": "text", "text": text}], "isError": False})
