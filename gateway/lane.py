"""The proxy port's lane for model calls: aiohttp's parser and request, without its per-request loop.

Why: aiohttp's server spends most of its CPU per request outside the parser: its connection loop (a
future to wait on, a stream writer, a task per request, keep-alive and lingering bookkeeping), the
application's dispatch (routing, match info, the expect check) and the response's `prepare` path
(headers prepared one by one, then serialized, then written). For a model call that is a tenth of
tollgate's work. Measured with `valgrind --tool=callgrind` on a bare pass-through handler (600 requests
at concurrency 16): aiohttp's server with a plain handler 329 k instructions per request, the same
server with this lane 204 k, a bare `asyncio.Protocol` on httptools 144 k.

What takes the lane: a `POST` whose target is exactly one of the app's lane paths (no query string, no
`Expect`, no upgrade), parsed while the connection is idle: nothing queued, no request of aiohttp's in
progress, aiohttp's loop parked waiting for the next message. It is parsed by aiohttp's parser as every
request is (same limits, same refusals), becomes the same `web.Request` (with its route's match info,
resolved once: the app has no middleware to run, or there is no lane), and its handler runs in a task
of its own. Everything else goes through aiohttp's loop unchanged and in the order it arrived: messages
that arrive while a lane request runs wait for it.

What stays aiohttp's: the parser and its limits, `web.Request`, the JSON refusals of `gateway.runner`,
keep-alive and its idle timeout, the lingering read of a body the handler left unread, handler
cancellation when the client leaves (`handler_cancellation`), and graceful shutdown (a lane request is
a request in progress: the drain waits for it, then cancels it).

`deliver` sends a handler's answer: a plain `web.Response` (bytes body, not chunked, not compressed,
no cookies, a status that has a body, no `Content-Length` of the handler's) is serialized at once with
aiohttp's own header serializer (which refuses control characters, as `prepare` does), with the
`Content-Length`, `Content-Type`, `Date`, `Server` and `Connection` headers `prepare` would add;
anything else goes through `prepare` and `write_eof`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import hdrs, web
from aiohttp.helpers import ceil_timeout, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE, HttpVersion10, HttpVersion11, StreamWriter
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import _serialize_headers
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import _PAYLOAD_ACCESS_ERROR, RequestHandler, _ErrInfo
from aiohttp.web_urldispatcher import PlainResource, UrlMappingMatchInfo

from gateway.frozen_init import fast_init

__all__ = ["LaneHandler", "LaneRoute", "deliver", "lane_routes"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_NO_BODY = frozenset({204, 304})


@fast_init
@dataclass(frozen=True, slots=True)
class LaneRoute:
    """A lane path's handler and its match info, frozen once (it holds no variable of the request)."""

    handler: Handler
    match_info: UrlMappingMatchInfo


def lane_routes(app: web.Application, paths: tuple[str, ...]) -> dict[str, LaneRoute]:
    """The `POST` routes of `paths` in `app`'s router, keyed by path. Empty when the app has
    middlewares or signals on response prepare (the lane would skip them), or nothing matches."""
    if not paths or app.middlewares or app.on_response_prepare:
        return {}
    routes: dict[str, LaneRoute] = {}
    for resource in app.router.resources():
        if not isinstance(resource, PlainResource) or resource.canonical not in paths:
            continue
        for route in resource:
            if route.method == hdrs.METH_POST:
                match_info = UrlMappingMatchInfo({}, route)
                match_info.add_app(app)
                match_info.freeze()
                routes[resource.canonical] = LaneRoute(route.handler, match_info)
    return routes


class LaneHandler(RequestHandler):
    """aiohttp's connection handler with the lane (see the module docstring). `lanes`: `lane_routes`;
    empty, it is aiohttp's handler."""

    __slots__ = ("_lane", "_lanes")

    def __init__(self, manager: web.Server, *, lanes: Mapping[str, LaneRoute], **kwargs: object) -> None:
        super().__init__(manager, **kwargs)  # type: ignore[arg-type]
        self._lanes = lanes
        self._lane: asyncio.Task[None] | None = None

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if (not self._lanes or parser is None or self._force_close or self._close or self._upgraded
                or self._payload_parser is not None):
            super().data_received(data)
            return
        # as aiohttp's `data_received`, except that a lane request is started instead of queued
        try:
            messages, upgraded, tail = parser.feed_data(data)
        except HttpProcessingError as exc:
            messages = [(_ErrInfo(status=400, exc=exc, message=exc.message), EMPTY_PAYLOAD)]
            upgraded, tail = False, b""
        for message, payload in messages:
            self._request_count += 1
            route = self._route(message)
            if route is None:
                self._messages.append((message, payload))
                continue
            parser.message_consumed()
            assert isinstance(message, RawRequestMessage)
            self._lane = self._loop.create_task(self._serve(route, message, payload))
        if self._messages and self._lane is None:
            self._wake()
        if not self._buffer_paused and len(self._messages) >= self._max_msg_queue_size:
            self._pause_reading_for_buffer()
        self._upgraded = upgraded
        if upgraded and tail:
            self._message_tail = tail

    def _route(self, message: RawRequestMessage | _ErrInfo) -> LaneRoute | None:
        """The lane of `message`, when it takes one (see the module docstring)."""
        waiter = self._waiter  # aiohttp's loop waits on it between requests
        if self._lane is not None or self._messages or waiter is None or waiter.done():
            return None
        if not isinstance(message, RawRequestMessage) or message.method != hdrs.METH_POST:
            return None
        if message.upgrade or hdrs.EXPECT in message.headers:
            return None
        return self._lanes.get(message.path)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _serve(self, route: LaneRoute, message: RawRequestMessage, payload: StreamReader) -> None:
        """One lane request, as aiohttp's loop serves one (`RequestHandler.start`, `_handle_request`)."""
        keep_alive = False
        try:
            manager, factory = self._manager, self._request_factory
            if manager is None or factory is None or self.transport is None:
                return  # the connection was lost before the task ran
            manager.requests_count += 1
            if self._keepalive_handle is not None:  # the idle timeout is for the next request, not this one
                self._keepalive_handle.cancel()
                self._keepalive_handle = None
            task = asyncio.current_task()
            request = factory(message, payload, self, StreamWriter(self, self._loop), task)  # type: ignore[arg-type]
            assert isinstance(request, web.Request)  # the app's factory: `Application._make_request`
            request._match_info = route.match_info
            self._current_request = request
            self._request_in_progress = True
            try:
                keep_alive = await self._answer(route, request)
                await self._linger(payload)
            except ConnectionError:
                keep_alive = False  # the client left, or a second answer was due after the first
            finally:
                request._finish()
                self._current_request = None
                self._request_in_progress = False
                if self._handler_waiter is not None and not self._handler_waiter.done():
                    self._handler_waiter.set_result(None)
        finally:
            payload.set_exception(_PAYLOAD_ACCESS_ERROR)
            self._lane = None
        self._next(keep_alive)

    async def _answer(self, route: LaneRoute, request: web.Request) -> bool:
        """Run the handler and send its answer (a failure is aiohttp's 500 or 504, in JSON); its keep-alive."""
        try:
            response = await route.handler(request)
        except web.HTTPException as exc:
            response = exc
        except TimeoutError:
            response = self.handle_error(request, 504)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the handler failed: aiohttp's 500 (`gateway.runner`: JSON)
            response = self.handle_error(request, 500, exc)
        await deliver(request, response)
        return bool(response.keep_alive)

    async def _linger(self, payload: StreamReader) -> None:
        """Read what the handler left of the body, within aiohttp's lingering time (the client may still be
        sending it and would see a reset instead of its answer); still unread after it: close."""
        if payload.is_eof():
            return
        if not self._force_close and self._lingering_time:
            end = self._loop.time() + self._lingering_time
            try:
                while not payload.is_eof() and (now := self._loop.time()) < end:
                    async with ceil_timeout(end - now):
                        await payload.readany()
            except (asyncio.CancelledError, TimeoutError):
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
        if not payload.is_eof() and not self._force_close:
            self.close()

    def _next(self, keep_alive: bool) -> None:
        """After a lane request: close, or keep the connection for the next one (what arrived meanwhile
        goes to aiohttp's loop)."""
        if not keep_alive or self._close or self._force_close:
            self.force_close()
            return
        self._keepalive = True
        close_time = self._loop.time() + self._keepalive_timeout
        self._next_keepalive_close_time = close_time
        if self._keepalive_handle is None:
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)
        if self._messages:
            self._wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        lane = self._lane
        cancel = lane is not None and self._manager is not None and self._manager.handler_cancellation
        super().connection_lost(exc)
        if cancel:
            assert lane is not None
            lane.cancel()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """aiohttp's: waits up to `timeout` for the request in progress; then a lane request is cancelled
        as aiohttp's own handler is."""
        await super().shutdown(timeout)
        if self._lane is not None:
            self._lane.cancel()


def _plain(request: web.BaseRequest, response: web.StreamResponse) -> tuple[bytes, bool] | None:
    """The whole answer of a plain `web.Response` (see the module docstring) and its keep-alive, with the
    headers `prepare` adds; None when it is not plain."""
    if type(response) is not web.Response or response._compression or response._chunked or response._cookies:
        return None
    body = response._body
    status = response.status
    headers = response.headers
    if type(body) is not bytes or status < 200 or status in _NO_BODY or hdrs.CONTENT_LENGTH in headers:
        return None
    keep_alive = response.keep_alive
    if keep_alive is None:
        keep_alive = request.keep_alive
    version = request.version
    headers[hdrs.CONTENT_LENGTH] = str(len(body))
    if body:
        headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
    if hdrs.DATE not in headers:
        headers[hdrs.DATE] = rfc822_formatted_time()
    headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
    if hdrs.CONNECTION not in headers:
        if keep_alive:
            if version == HttpVersion10:
                headers[hdrs.CONNECTION] = "keep-alive"
        elif version == HttpVersion11:
            headers[hdrs.CONNECTION] = "close"
    head = _serialize_headers(f"HTTP/{version[0]}.{version[1]} {status} {response.reason}", headers)
    return head + body, keep_alive


async def deliver(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Send `response` now, whole (see the module docstring); nothing when it was sent already. Raises
    ConnectionResetError when the client is gone."""
    if response.prepared:
        await response.write_eof()
        return
    plain = _plain(request, response)
    if plain is None:
        await response.prepare(request)
        await response.write_eof()
        return
    data, keep_alive = plain
    writer = request.writer
    assert isinstance(writer, StreamWriter)
    writer._write(data)  # counted as sent (`output_size`): a later failure closes instead of answering twice
    response._keep_alive = keep_alive
    response._body_length = len(data)
    response._eof_sent = True  # `prepare` and `write_eof` are no-ops from here, as after aiohttp's own send
    protocol = request.protocol
    if protocol.writing_paused:
        await protocol._drain_helper()
