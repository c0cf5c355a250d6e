"""A hand-scripted HTTP server on loopback for MCP tests: a subclass writes `handle`, served at `/mcp`."""

from __future__ import annotations

from typing import Self

from aiohttp import web
from aiohttp.test_utils import TestServer


class ScriptedServer:
    """`await server.start()` serves `handle` (every method) at `url`; `close()` stops it."""

    url: str = ""
    _server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def start(self) -> Self:
        app = web.Application()
        app.router.add_route("*", "/mcp", self.handle)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self.url = str(self._server.make_url("/mcp"))
        return self

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
