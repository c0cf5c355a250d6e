"""`TestServer` that serves an app the way `tollgate serve` does: through `GatewayRunner`, with the HTTP
parser limits of the config."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.config import Limits
from gateway.runner import GatewayRunner
from gateway.server import handler_args


class GatewayTestServer(TestServer):
    def __init__(self, app: web.Application, limits: Limits, **kwargs: Any) -> None:
        super().__init__(app, host="127.0.0.1", **kwargs)
        self._limits = limits

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return GatewayRunner(self.app, **{**kwargs, **handler_args(self._limits)})
