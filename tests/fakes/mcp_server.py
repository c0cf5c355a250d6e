"""A real MCP server (the official SDK's `MCPServer`, Streamable HTTP) on loopback, for tests.

It runs under uvicorn in a thread of its own and logs every JSON-RPC message it receives, so a test
can tell exactly which calls reached it. `tools/list` is paginated (`page_size` tools per page) when
`page_size` is set.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.types import ListToolsResult

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Seen:
    """What the server received: (HTTP method, JSON-RPC message or None) in arrival order."""

    requests: list[tuple[str, dict[str, Any] | None]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def calls(self) -> list[tuple[str, dict[str, Any]]]:
        """(tool name, arguments) of every `tools/call` that reached the server."""
        out: list[tuple[str, dict[str, Any]]] = []
        for _, msg in self.requests:
            if msg is not None and msg.get("method") == "tools/call":
                params = msg.get("params") or {}
                out.append((str(params.get("name")), params.get("arguments") or {}))
        return out

    def methods(self) -> list[str]:
        return [m.get("method", "<response>") for _, m in self.requests if m is not None]


class _Paged(MCPServer):
    page_size: int | None = None

    async def _handle_list_tools(self, ctx: Any, params: Any) -> ListToolsResult:
        tools = await self.list_tools()
        if not self.page_size:
            return ListToolsResult(tools=tools)
        start = int(getattr(params, "cursor", None) or 0)
        end = start + self.page_size
        return ListToolsResult(tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None)


def build_server(notes: list[str], *, page_size: int | None = None, slow_s: float = 0.0) -> MCPServer:
    server = _Paged("files")
    server.page_size = page_size

    @server.tool()
    def read_file(path: str) -> str:
        """Read a file."""
        return f"contents of {path}"

    @server.tool()
    def delete_file(path: str) -> str:
        """Delete a file."""
        return f"deleted {path}"

    @server.tool()
    async def write_note(text: str) -> str:
        """Append a note; answers with the note's number."""
        await asyncio.sleep(slow_s)
        notes.append(text)
        return f"note {len(notes)} saved: {text}"

    @server.tool()
    def admin_reset(confirm: bool) -> str:
        """Never allowed in the tests."""
        return "reset"

    return server


class _Recorder:
    def __init__(self, app: Asgi, seen: Seen) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        parsed = orjson.loads(body) if body else None
        self.seen.requests.append((scope["method"], parsed))
        self.seen.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@dataclass
class RunningServer:
    url: str  # the MCP endpoint, http://127.0.0.1:PORT/mcp
    seen: Seen
    notes: list[str]
    _server: uvicorn.Server
    _thread: threading.Thread
    _sock: socket.socket

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def start(*, page_size: int | None = None, slow_s: float = 0.0, json_response: bool = False) -> RunningServer:
    """Start the server in a thread; `stop()` it when done."""
    notes: list[str] = []
    app = build_server(notes, page_size=page_size, slow_s=slow_s).streamable_http_app(json_response=json_response)
    return serve(app, notes)


def serve(app: Asgi, notes: list[str]) -> RunningServer:
    """Serve an MCP server's ASGI app under uvicorn in a thread of its own, recording what it receives."""
    seen = Seen()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_Recorder(app, seen), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("MCP test server did not start")
        time.sleep(0.01)
    return RunningServer(f"http://127.0.0.1:{port}/mcp", seen, notes, server, thread, sock)
