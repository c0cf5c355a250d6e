"""One upstream HTTP/1.1 connection (`gateway.http1`'s pool holds them): the asyncio protocol, the
httptools callbacks that record its current exchange (status, headers, body chunks, end, error), and
`wait`, the one place an exchange is waited for with a timeout. Reading pauses above `HIGH_WATER`
buffered body bytes; a response head over `MAX_HEADER_BYTES` is refused.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import UpstreamUnavailable

if TYPE_CHECKING:
    from gateway.http1 import Http1Pool
    from gateway.http1_wire import Origin

__all__ = ["HIGH_WATER", "MAX_HEADER_BYTES", "Connection", "Expired"]

HIGH_WATER = 1 << 20  # buffered response bytes at which reading from the socket pauses
MAX_HEADER_BYTES = 64 * 1024  # a response head larger than this is refused (aiohttp's limits are near)


class Expired(Exception):
    """A wait ran out of time (turned into the phase's `UpstreamTimeout` by its caller)."""


class Connection(asyncio.Protocol):
    """One upstream connection and the state of its current exchange (httptools callbacks)."""

    def __init__(self, pool: Http1Pool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.active = False
        self.closed = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.changes = 0  # exchange events so far (see `wait`)
        self.aborted = False  # we closed it: a close-delimited body that ends here is cut, not complete
        self.begin(head_only=False)

    def begin(self, *, head_only: bool) -> None:
        self.head_only = head_only
        self.interim = False  # inside a 1xx response, which precedes the real one
        self.status = 0
        self.raw_headers: list[tuple[str, str]] = []
        self.header_bytes = 0
        self.head_read = 0  # bytes read while the head was still incomplete
        self.framed = False
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: str | None = None
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            self._fail("upstream sent data outside a response")
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response ({exc.__cause__ or exc})")
            return
        if not self.headers_done and self.error is None:
            # the parser keeps an unfinished header line to itself, growing it a read at a time (copying
            # it each time): an endless one is refused here, not when (never) it completes
            self.head_read += len(data)
            if self.head_read > MAX_HEADER_BYTES:
                self._fail("response headers too large")

    def eof_received(self) -> bool:
        return False  # a half-closed upstream connection is a closed one

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        clean = exc is None and not self.aborted and self.error is None
        if self.active and self.headers_done and not self.complete and not self.framed and clean:
            self.complete = True  # a body delimited by the connection's end (no length, not chunked)
        elif self.active and not self.complete and self.error is None:
            self.error = f"connection {'reset' if exc else 'closed'} by upstream"
        self.pool.lost(self)
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.headers_done or self.complete:  # a second response to one request: never ours to pass on
            self._fail("upstream sent more than one response")
            raise UpstreamUnavailable("upstream sent more than one response")  # stops the parser

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            self._fail("response headers too large")
            raise UpstreamUnavailable("response headers too large")  # stops the parser
        text = name.decode("utf-8", "surrogateescape")
        if not self.framed and text.lower() in ("content-length", "transfer-encoding"):
            self.framed = True
        self.raw_headers.append((text, value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        self.status = status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                self._fail("upstream switched protocols")
                return
            # 100 Continue, 103 Early Hints: the real response follows on the same connection
            self.interim = True
            self.raw_headers = []
            self.header_bytes = 0
            self.head_read = 0
            self.framed = False
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        if self.head_only or status in (204, 304):
            self.framed = True
            self.complete = True
            self.keep_alive = False  # httptools cannot skip a HEAD body; never reuse the connection
        self._wake()

    def on_body(self, data: bytes) -> None:
        self.body.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    # -- the exchange ------------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self.abort()
        self._wake()

    def abort(self) -> None:
        self.aborted = True
        if self.transport is not None:
            self.transport.abort()

    def reusable(self) -> bool:
        """Idle-able: the exchange ended cleanly and the socket is open and ours to reuse."""
        transport = self.transport
        return (
            self.complete and self.keep_alive and self.error is None and not self.closed and not self.body
            and transport is not None and not transport.is_closing()
        )

    def _wake(self) -> None:
        self.changes += 1
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until the exchange changes (headers, a body chunk, the end, an error). `Expired` after
        `timeout` seconds without a change.

        What arrived by the time the timer fired counts as in time: after the loop was busy for
        longer than `timeout` (a burst of requests), the timer and the bytes that came meanwhile are
        due together, and uvloop runs timers (and the task they wake) before it reads sockets. So an
        expiry first lets the loop turn once, to read them; without that, an upstream that answered
        in time would be reported as a timeout."""
        waiter = self.loop.create_future()
        self.waiter = waiter
        before = self.changes
        timer = self.loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        except Expired:
            await asyncio.sleep(0)
            if self.changes == before:
                raise
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        """Every body byte buffered so far (resumes reading if it was paused)."""
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def headers(self) -> CIMultiDictProxy[str]:
        return CIMultiDictProxy(CIMultiDict(self.raw_headers))


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(Expired())
