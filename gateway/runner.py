"""The aiohttp runner of both ports: aiohttp's server, except that what it answers on its own is JSON.

Why: aiohttp's HTTP parser refuses some requests before any handler runs (a request line or header
field over `limits.max_header_bytes`, more than `limits.max_headers` fields, framing broken in the
request head, a `Content-Encoding` it cannot decode), and answers a handler that raised with a 500;
both are plain text, which an SDK reports as an unreadable error. At that point the request line is
lost, so the caller's API is unknown: the answer is one JSON body that both wire formats read,
Anthropic's `{"type": "error", "error": {...}}` whose inner object also has OpenAI's four fields.
The status stays aiohttp's (400 for what the parser refused) and the connection still closes.

A `CONNECT` request never reaches a handler either: its target is an authority (`host:port`), so the
router has no path to match, not even the proxy's catch-all, and answers a plain-text 404. It gets the
JSON 404 `not_found` of any path tollgate does not serve (tollgate is not a forward proxy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.errors import GatewayError, InvalidRequest, PathNotFound, both_formats

__all__ = ["GatewayRunner", "refusal_body"]

Handler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]
MAX_DETAIL = 200  # characters of the parser's message kept: it may quote the refused bytes


def refusal_body(status: int, detail: str | None) -> bytes:
    """The JSON body of an answer aiohttp's server gives on its own: `invalid_request` for a 4xx, else
    `internal_error` (a handler raised; the detail is not shown)."""
    if 400 <= status < 500:
        error: GatewayError = InvalidRequest(f"malformed HTTP request: {(detail or 'refused')[:MAX_DETAIL]}")
        kind = error.openai_type
    else:
        error = GatewayError("the gateway failed to answer this request")
        kind = error.anthropic_type
    return both_formats(error, kind)


class _JsonRefusals(RequestHandler):
    """aiohttp's connection handler, answering its own refusals with `refusal_body`."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # a handler raised: aiohttp's version logs the traceback, and raises ConnectionError when
            # bytes were already sent; both are wanted
            status = super().handle_error(request, status, exc, message).status
        else:
            # what a client sent wrong is not the gateway's error: no traceback per malformed request
            if request.writer.output_size > 0:
                raise ConnectionError("malformed request after a response started")
            self.log_debug("refused a malformed request: %s", message)
        body = refusal_body(status, message)
        answer = web.Response(status=status, body=body, content_type="application/json")
        answer.force_close()
        return answer


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonRefusals(self, loop=self._loop, **self._kwargs)


def _refusing_connect(handler: Handler) -> Handler:
    async def handle(request: BaseRequest) -> web.StreamResponse:
        if request.method == "CONNECT":
            error = PathNotFound("tollgate is not a forward proxy: CONNECT is not served (model calls are "
                                 "under /v1/, MCP servers under /mcp/<server>)")
            return web.Response(status=error.status, body=both_formats(error), content_type="application/json")
        return await handler(request)

    return handle


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose server answers its own refusals in JSON (see the module docstring).

    aiohttp has no public hook for this: the server is rebuilt from the one `AppRunner` makes (its
    private `_make_server` and `Server._kwargs`); tests/gateway/test_runner.py fails if that changes."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the app's startup; its handler arguments are kept
        kwargs: dict[str, Any] = dict(plain._kwargs)
        return _Server(_refusing_connect(plain.request_handler), request_factory=plain.request_factory,
                       handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
                       **kwargs)
