"""A pooled HTTP/1.1 client on asyncio protocols and httptools: the network half of `Upstream`.

Why not aiohttp's client, which tollgate used before: per call it built a request and a response
object, yarl URLs, a cookie lookup, a task-scoped timer per phase and a stream reader; on the
benchmark machine that was 270-300 us of CPU per call against 55-70 us for a bare protocol and
httptools parser. A sidecar makes one upstream call per step, so that was a fifth of tollgate's CPU.

What it does: one request at a time per connection (no pipelining), keep-alive pooling per origin
(idle connections older than `keepalive_s` are closed, not reused), TLS through `ssl`, request bodies
in memory, response bodies streamed with back-pressure (reading pauses above `HIGH_WATER` buffered
bytes), `gzip` / `deflate` content decoded (we ask for `identity`), bounded response headers, and a
body read whole (`read()`) bounded by `max_answer_bytes`, before and after decoding.
Timeouts are per phase, as `Timeouts` says: connect, first byte (headers), idle gap between body
chunks. Every failure is an `UpstreamUnavailable` or `UpstreamTimeout`; a response that did not end
cleanly never returns its connection to the pool.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping

from gateway.config import Limits, Timeouts
from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.http1_connection import HIGH_WATER, Connection, Expired
from gateway.http1_wire import Origin, Sending, decoder_for, request_head, split_url

MAX_ANSWER_BYTES: int = Limits.model_fields["max_answer_bytes"].default  # `tollgate serve` passes the config's


class Http1Response:
    """`UpstreamResponse` of one exchange. `read()` / `chunks()` release the connection back to the
    pool once the body ended; `release()` (idempotent) closes it when the body did not end. `cap`: the
    most body bytes `read()` returns (see there); `chunks()` is not bounded as a whole (streams are
    bounded event by event, by their SSE parser)."""

    __slots__ = ("_cap", "_conn", "_decoder", "_idle", "_released", "headers", "status")

    def __init__(self, conn: Connection, idle: float, cap: int = MAX_ANSWER_BYTES) -> None:
        self._conn = conn
        self._idle = idle
        self._cap = cap
        self._released = False
        self.status = conn.status
        self.headers = conn.headers()
        self._decoder = decoder_for(self.headers.get("Content-Encoding", "").strip().lower())

    def _decode(self, data: bytes, final: bool, limit: int = 0) -> bytes:
        """`data` decoded (the rest of the body with `final`). `limit` > 0: a body that decodes to more
        than `limit` bytes is refused before all of it is decoded (a compression bomb stays small)."""
        decoder = self._decoder
        if decoder is None:
            return data
        try:
            if not final:
                return decoder.decode(data)
            self._decoder = None
            out = decoder.decode(data, limit + 1 if limit else 0)
            if limit and len(out) > limit:
                raise self._too_large()
            out += decoder.finish()
        except zlib.error as exc:
            raise UpstreamUnavailable(f"upstream body does not decode: {exc}") from None
        if limit and len(out) > limit:
            raise self._too_large()
        return out

    def _pieces(self, data: bytes, final: bool) -> Iterator[bytes]:
        """`data` decoded (the rest of the body with `final`), `HIGH_WATER` bytes at most per piece."""
        decoder = self._decoder
        if decoder is None:
            if data:
                yield data
            return
        try:
            out = decoder.decode(data, HIGH_WATER)
            while True:
                if out:
                    yield out
                if not decoder.pending:
                    break
                out = decoder.decode(b"", HIGH_WATER)
            if final:
                self._decoder = None
                tail = decoder.finish()
                if tail:
                    yield tail
        except zlib.error as exc:
            raise UpstreamUnavailable(f"upstream body does not decode: {exc}") from None

    def _too_large(self) -> UpstreamUnavailable:
        """Refuse the answer: its connection closes (the rest of the body is never read) and leaves the
        pool. The request was sent: the upstream may bill it (`request_sent`)."""
        self._conn._fail("answer over the size limit")
        self.release()
        return UpstreamUnavailable(f"upstream answer is larger than limits.max_answer_bytes ({self._cap} bytes)")

    async def read(self) -> bytes:
        """The whole body, decoded. More than `cap` bytes, as sent or decoded, is an `UpstreamUnavailable`
        and the connection closes: what is held stays within `cap` plus what the socket buffered before
        reading paused (about `HIGH_WATER`)."""
        conn = self._conn
        room = self._cap  # body bytes still allowed: one comparison per chunk
        parts: list[bytes] = []
        try:
            while True:
                if conn.body:
                    data = conn.take()
                    room -= len(data)
                    if room < 0:
                        raise self._too_large()
                    parts.append(data)
                if conn.complete:
                    break
                if conn.error is not None:
                    raise UpstreamUnavailable(f"upstream connection failed while reading: {conn.error}")
                await conn.wait(self._idle)
        except Expired:
            raise UpstreamTimeout(f"upstream sent no data for {self._idle:g}s") from None
        body = self._decode(parts[0] if len(parts) == 1 else b"".join(parts), True, self._cap)
        self.release()  # after decoding: an answer refused there closes its connection instead
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, decoded a piece of at most `HIGH_WATER` bytes at a time (what a
        compressed chunk inflates to is never held whole)."""
        conn = self._conn
        while True:
            if conn.body:
                if self._decoder is None:  # the usual case (we ask for identity): no generator per chunk
                    yield conn.take()
                    continue
                for data in self._pieces(conn.take(), conn.complete):
                    yield data
                continue
            if conn.complete:
                tail = list(self._pieces(b"", True))
                self.release()
                for data in tail:
                    yield data
                return
            if conn.error is not None:
                raise UpstreamUnavailable(f"upstream stream broke: {conn.error}")
            try:
                await conn.wait(self._idle)
            except Expired:
                raise UpstreamTimeout(f"upstream stream idle for more than {self._idle:g}s") from None

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._conn.pool.release(self._conn)


class Http1Pool:
    """Connections per origin, at most `limit` busy at once (more callers wait for one). Each response's
    `read()` returns at most `max_answer_bytes` (`limits.max_answer_bytes`)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, limit: int = 256, keepalive_s: float = 15.0,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.loop = loop
        self.keepalive_s = keepalive_s
        self.max_answer_bytes = max_answer_bytes
        self._idle: dict[Origin, list[Connection]] = {}
        self._busy: set[Connection] = set()
        self._slots = asyncio.Semaphore(limit)
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def busy(self) -> int:
        return len(self._busy)

    def open_count(self) -> int:
        return len(self._busy) + sum(1 for pool in self._idle.values() for c in pool if not c.closed)

    async def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        sending: Sending | None = None,
    ) -> Http1Response:
        """Send the request, wait for the response headers (within `timeouts.first_byte`, connect
        included), return the response with its body still to read. `sending.started` turns True right
        before the first byte is written: a caller cancelled while queued or connecting sent nothing."""
        if sending is not None:
            sending.started = False
        origin, target, host = split_url(url)
        head = request_head(method, target, host, headers, None if body is None else len(body))
        if self._closed:
            raise UpstreamUnavailable("the gateway is shutting down", sent=False)
        loop = self.loop
        await self._acquire(timeouts.first_byte)
        deadline = loop.time() + timeouts.first_byte  # from here: a queued call is not timed out unsent
        try:
            if self._closed:
                raise UpstreamUnavailable("the gateway is shutting down", sent=False)
            conn = self._pooled(origin) or await self._connect(origin, timeouts)
        except BaseException:
            self._slots.release()
            raise
        self._busy.add(conn)
        conn.begin(head_only=method == "HEAD")
        conn.active = True
        try:
            assert conn.transport is not None
            if sending is not None:
                sending.started = True
            if body:
                conn.transport.writelines((head, body))
            else:
                conn.transport.write(head)
            while not conn.headers_done:
                if conn.error is not None:
                    raise UpstreamUnavailable(f"upstream request failed: {conn.error}")
                await conn.wait(deadline - loop.time())
            return Http1Response(conn, timeouts.idle, self.max_answer_bytes)
        except Expired:
            self.release(conn)
            raise UpstreamTimeout(f"upstream did not answer within {timeouts.first_byte:g}s") from None
        except BaseException:
            self.release(conn)
            raise

    async def _acquire(self, timeout: float) -> None:
        """A busy slot; waiting for one (all `limit` connections busy) is bounded by `timeout`."""
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise UpstreamTimeout(f"no upstream connection was free within {timeout:g}s", sent=False) from None

    def _pooled(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest = self.loop.time() - self.keepalive_s
        while idle and (idle[0].closed or idle[0].idle_since <= oldest):
            idle.pop(0).abort()
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, origin: Origin, timeouts: Timeouts) -> Connection:
        host, port, scheme = origin
        context = self._context() if scheme == "https" else None
        limit = min(timeouts.connect, timeouts.first_byte)
        try:
            async with asyncio.timeout(limit):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self, origin), host, port,
                    ssl=context, server_hostname=host if context else None,
                )
        except TimeoutError:  # nothing of the request was written yet: `sent=False` (see UpstreamError)
            if timeouts.first_byte < timeouts.connect:
                raise UpstreamTimeout(f"upstream did not answer within {timeouts.first_byte:g}s", sent=False) from None
            raise UpstreamTimeout(f"upstream connect timed out after {timeouts.connect:g}s", sent=False) from None
        except ssl.SSLError as exc:
            raise UpstreamUnavailable(f"TLS with upstream failed: {exc.reason or exc}", sent=False) from None
        except OSError as exc:
            raise UpstreamUnavailable(f"cannot connect to upstream: {exc.strerror or exc}", sent=False) from None
        return conn

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def use_tls_context(self, context: ssl.SSLContext) -> None:
        """Trust what `context` trusts for https upstreams (tests with their own CA)."""
        self._ssl = context

    def release(self, conn: Connection) -> None:
        """End the exchange: a connection whose response ended cleanly and may be kept alive goes back
        to the pool; any other is closed."""
        if conn not in self._busy:
            return
        self._busy.discard(conn)
        self._slots.release()
        conn.active = False
        if conn.reusable() and not self._closed:
            conn.idle_since = self.loop.time()
            self._idle.setdefault(conn.origin, []).append(conn)
        elif not conn.closed:
            conn.abort()

    def lost(self, conn: Connection) -> None:
        """The connection closed: forget it if it sat idle in the pool."""
        if not conn.active:
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        for conns in (*self._idle.values(), list(self._busy)):
            for conn in conns:
                conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the aborted transports run connection_lost
