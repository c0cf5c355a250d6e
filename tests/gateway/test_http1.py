"""The HTTP/1.1 upstream client against scripted loopback servers: framing, pooling, timeouts,
back-pressure, decoding, TLS, header splitting and what each failure leaves open."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trustme

from gateway.config import Timeouts
from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.http1 import HIGH_WATER, Http1Pool
from gateway.http1_wire import Sending

FAST = Timeouts(connect=1, first_byte=0.5, idle=0.5)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
BOTH_LOOPS = True  # every async test on asyncio's loop and on uvloop (tests/conftest.py)


class Server:
    """A loopback server that answers each request with the scripted `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self, context: ssl.SSLContext | None = None) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context)
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if context else 'http'}://{'localhost' if context else '127.0.0.1'}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                    0,
                )
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def answer(body: bytes, head: bytes = b"") -> Handler:
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), head, body))
        await writer.drain()

    return handle


@pytest.fixture
async def served() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[Http1Pool, Server, str]]]]:
    made: list[tuple[Http1Pool, Server]] = []

    async def make(handler: Handler) -> tuple[Http1Pool, Server, str]:
        server = Server(handler)
        url = await server.start()
        pool = Http1Pool(asyncio.get_running_loop())
        made.append((pool, server))
        return pool, server, url

    yield make
    for pool, server in made:
        await pool.close()
        await server.close()


async def test_keep_alive_reuses_one_connection(served) -> None:  # type: ignore[no-untyped-def]
    pool, server, url = await served(answer(b'{"ok":1}', b"Content-Type: application/json\r\n"))
    for _ in range(3):
        resp = await pool.open("POST", url + "/v1/x?a=1", {"Authorization": "Bearer k"}, b"{}", FAST)
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert await resp.read() == b'{"ok":1}'
    assert server.connections == 1
    assert pool.open_count() == 1 and pool.busy() == 0
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Authorization: Bearer k\r\n" in first and b"Content-Length: 2\r\n" in first and first.endswith(b"{}")


async def test_chunked_stream_arrives_chunk_by_chunk(served) -> None:  # type: ignore[no-untyped-def]
    gate = asyncio.Event()

    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await gate.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

    pool, server, url = await served(handle)
    resp = await pool.open("GET", url + "/s", {}, None, FAST)
    got = []
    async for chunk in resp.chunks():
        got.append(chunk)
        gate.set()
    assert got == [b"first", b"second"]
    assert pool.busy() == 0 and pool.open_count() == 1  # ended cleanly: back in the pool
    assert b"Content-Length" not in server.requests[0]


async def test_body_delimited_by_close_is_complete_and_not_reused(served) -> None:  # type: ignore[no-untyped-def]
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    pool, _, url = await served(handle)
    resp = await pool.open("GET", url, {}, None, FAST)
    assert await resp.read() == b"until the end"
    assert pool.open_count() == 0


async def test_connection_close_answer_is_not_pooled(served) -> None:  # type: ignore[no-untyped-def]
    pool, server, url = await served(answer(b"x", b"Connection: close\r\n"))
    for _ in range(2):
        assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"x"
    assert server.connections == 2


async def test_gzip_answer_is_decoded(served) -> None:  # type: ignore[no-untyped-def]
    pool, server, url = await served(answer(gzip.compress(b"plain text" * 100), b"Content-Encoding: gzip\r\n"))
    assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"plain text" * 100
    assert b"Accept-Encoding: identity\r\n" in server.requests[0]
    resp = await pool.open("GET", url, {}, None, FAST)
    assert b"".join([c async for c in resp.chunks()]) == b"plain text" * 100


async def test_unsupported_encoding_is_refused_and_closed(served) -> None:  # type: ignore[no-untyped-def]
    pool, _, url = await served(answer(b"??", b"Content-Encoding: br\r\n"))
    with pytest.raises(UpstreamUnavailable, match="unsupported content-encoding 'br'"):
        await pool.open("GET", url, {}, None, FAST)
    assert pool.busy() == 0


async def test_no_answer_times_out_and_closes(served) -> None:  # type: ignore[no-untyped-def]
    async def silent(_: asyncio.StreamReader, __: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3)

    pool, _, url = await served(silent)
    with pytest.raises(UpstreamTimeout, match="did not answer within 0.5s") as caught:
        await pool.open("POST", url, {}, b"{}", FAST)
    assert caught.value.request_sent  # the upstream has the request: it may bill it
    assert pool.busy() == 0 and pool.open_count() == 0


async def test_stalled_stream_times_out_and_closes(served) -> None:  # type: ignore[no-untyped-def]
    async def stall(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(3)

    pool, _, url = await served(stall)
    resp = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamTimeout, match="idle for more than 0.5s"):
        async for _ in resp.chunks():
            pass
    resp.release()
    resp = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamTimeout, match="no data for 0.5s"):
        await resp.read()
    resp.release()
    await asyncio.sleep(0)
    assert pool.busy() == 0 and pool.open_count() == 0


async def test_truncated_body_is_an_error(served) -> None:  # type: ignore[no-untyped-def]
    async def truncate(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    pool, _, url = await served(truncate)
    resp = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamUnavailable, match="closed by upstream"):
        await resp.read()
    resp.release()
    assert pool.open_count() == 0


async def test_malformed_answer_is_an_error(served) -> None:  # type: ignore[no-untyped-def]
    async def garbage(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    pool, _, url = await served(garbage)
    with pytest.raises(UpstreamUnavailable, match="malformed response"):
        await pool.open("GET", url, {}, None, FAST)
    assert pool.busy() == 0


async def test_oversized_headers_are_refused(served) -> None:  # type: ignore[no-untyped-def]
    pool, _, url = await served(answer(b"", b"X-Big: " + b"a" * 70_000 + b"\r\n"))
    with pytest.raises(UpstreamUnavailable, match="headers too large"):
        await pool.open("GET", url, {}, None, FAST)


async def test_refused_connection(unused_tcp_port: int) -> None:
    pool = Http1Pool(asyncio.get_running_loop())
    with pytest.raises(UpstreamUnavailable, match="cannot connect to upstream") as caught:
        await pool.open("GET", f"http://127.0.0.1:{unused_tcp_port}/", {}, None, FAST)
    assert not caught.value.request_sent
    assert pool.busy() == 0
    await pool.close()


async def test_slow_reader_pauses_the_socket(served) -> None:  # type: ignore[no-untyped-def]
    size = 8 * HIGH_WATER

    async def flood(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    pool, _, url = await served(flood)
    resp = await pool.open("GET", url, {}, None, Timeouts(connect=1, first_byte=2, idle=2))
    conn = resp._conn
    for _ in range(200):  # let the server fill the socket while nobody reads
        await asyncio.sleep(0.005)
        if conn.paused:
            break
    assert conn.paused and conn.buffered < 2 * HIGH_WATER  # bounded, not the whole body
    total = sum([len(chunk) async for chunk in resp.chunks()])
    assert total == size


async def test_busy_limit_makes_callers_wait(served) -> None:  # type: ignore[no-untyped-def]
    _, server, url = await served(answer(b"ok"))
    pool = Http1Pool(asyncio.get_running_loop(), limit=1)
    first = await pool.open("GET", url, {}, None, FAST)
    second = asyncio.ensure_future(pool.open("GET", url, {}, None, FAST))
    await asyncio.sleep(0.05)
    assert not second.done()
    await first.read()  # ends the exchange: the slot and the connection pass to the waiter
    assert await (await second).read() == b"ok"
    assert server.connections == 1
    await pool.close()


async def test_stale_idle_connections_are_not_reused(served) -> None:  # type: ignore[no-untyped-def]
    pool, server, url = await served(answer(b"ok"))
    pool.keepalive_s = 0.0
    await (await pool.open("GET", url, {}, None, FAST)).read()
    await (await pool.open("GET", url, {}, None, FAST)).read()
    assert server.connections == 2


async def test_server_closing_an_idle_connection_drops_it_from_the_pool(served) -> None:  # type: ignore[no-untyped-def]
    pool, server, url = await served(answer(b"ok"))
    await (await pool.open("GET", url, {}, None, FAST)).read()
    assert pool.open_count() == 1
    for writer in server.writers:
        writer.close()
    for _ in range(100):
        await asyncio.sleep(0.005)
        if pool.open_count() == 0:
            break
    assert pool.open_count() == 0
    assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"ok"


async def test_head_request_has_no_body(served) -> None:  # type: ignore[no-untyped-def]
    async def head(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        await writer.drain()

    pool, _, url = await served(head)
    assert await (await pool.open("HEAD", url, {}, None, FAST)).read() == b""


async def test_cancelled_exchange_closes_its_connection(served) -> None:  # type: ignore[no-untyped-def]
    async def slow(_: asyncio.StreamReader, __: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3)

    pool, _, url = await served(slow)
    task = asyncio.ensure_future(pool.open("GET", url, {}, None, Timeouts(connect=1, first_byte=5, idle=5)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert pool.busy() == 0 and pool.open_count() == 0


async def test_tls_upstream(served) -> None:  # type: ignore[no-untyped-def]
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    server = Server(answer(b"secure"))
    url = await server.start(server_context)
    pool = Http1Pool(asyncio.get_running_loop())
    with pytest.raises(UpstreamUnavailable, match="TLS with upstream failed"):
        await pool.open("GET", url, {}, None, FAST)  # the test CA is not trusted by default
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    pool.use_tls_context(client_context)
    for _ in range(2):
        assert await (await pool.open("GET", url + "/x", {}, None, FAST)).read() == b"secure"
    assert server.connections == 1  # one kept-alive connection (the refused handshake never got one)
    await pool.close()
    await server.close()


@pytest.mark.parametrize("split", [True, False], ids=["own-packet", "same-packet"])
async def test_interim_responses_precede_the_answer(served, split: bool) -> None:  # type: ignore[no-untyped-def]
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        final = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Real: 1\r\n\r\nok"
        if split:
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(final)
        else:
            writer.write(interim + final)
        await writer.drain()

    pool, server, url = await served(handle)
    for _ in range(2):
        resp = await pool.open("POST", url, {}, b"{}", FAST)
        assert resp.status == 200 and resp.headers["X-Real"] == "1" and "Link" not in resp.headers
        assert await resp.read() == b"ok"
    assert server.connections == 1


async def test_a_second_response_to_one_request_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    async def two(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                     b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\nSet-Cookie: evil\r\n\r\nevil")
        await writer.drain()

    pool, _, url = await served(two)
    resp = await pool.open("GET", url, {}, None, FAST)
    assert resp.status == 200 and "Set-Cookie" not in resp.headers
    assert await resp.read() == b"ok"
    await asyncio.sleep(0.01)
    assert pool.open_count() == 0  # never pooled: the next caller would have read the stray answer


async def test_bytes_after_the_body_keep_the_connection_out_of_the_pool(served) -> None:  # type: ignore[no-untyped-def]
    pool, server, url = await served(answer(b"unused"))

    async def trailing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE")
        await writer.drain()

    server.handler = trailing
    assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"ok"
    await asyncio.sleep(0.01)
    assert pool.open_count() == 0
    server.handler = answer(b"fine")
    assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"fine"
    assert server.connections == 2


async def test_a_reset_cuts_a_close_delimited_body(served) -> None:  # type: ignore[no-untyped-def]
    import socket
    import struct

    async def reset(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\ndata: partial")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    pool, _, url = await served(reset)
    resp = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamUnavailable, match="reset by upstream"):
        await resp.read()
    resp.release()


async def test_waiting_for_a_free_connection_is_bounded_and_sends_nothing(served) -> None:  # type: ignore[no-untyped-def]
    _, server, url = await served(answer(b"ok"))
    pool = Http1Pool(asyncio.get_running_loop(), limit=1)
    held = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamTimeout, match="no upstream connection was free within 0.5s") as caught:
        await pool.open("POST", url + "/charge", {}, b"{}", FAST)
    assert not caught.value.request_sent
    assert not any(b"/charge" in r for r in server.requests)  # timed out before it was sent
    held.release()
    await pool.close()


async def test_close_stops_callers_waiting_for_a_connection(served) -> None:  # type: ignore[no-untyped-def]
    _, server, url = await served(answer(b"ok"))
    pool = Http1Pool(asyncio.get_running_loop(), limit=1)
    held = await pool.open("GET", url, {}, None, FAST)
    waiting = asyncio.ensure_future(pool.open("POST", url + "/late", {}, b"{}", FAST))
    await asyncio.sleep(0.01)
    await pool.close()
    held.release()
    with pytest.raises(UpstreamUnavailable, match="shutting down"):
        await waiting
    assert not any(b"/late" in r for r in server.requests)


async def test_sending_tells_a_cancelled_caller_whether_a_byte_was_written(served) -> None:  # type: ignore[no-untyped-def]
    _, server, url = await served(answer(b"ok"))
    pool = Http1Pool(asyncio.get_running_loop(), limit=1)
    sent = Sending()
    held = await pool.open("GET", url, {}, None, FAST, sent)
    assert sent.started is True
    queued = Sending()
    waiting = asyncio.ensure_future(pool.open("POST", url + "/queued", {}, b"{}", FAST, queued))
    await asyncio.sleep(0)  # queued for the only connection
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert queued.started is False  # the caller left before its request was written: nothing to bill
    held.release()
    await pool.close()
    assert not any(b"/queued" in r for r in server.requests)


async def test_a_response_head_that_never_ends_is_refused_once_it_passes_the_limit(served) -> None:  # type: ignore[no-untyped-def]
    """One header line that keeps growing never completes, and the parser keeps it (copying it a read at
    a time): the limit was checked on complete header lines only, so memory grew by hundreds of MB and
    the event loop stalled for seconds until the first-byte timeout. It is refused once the head read
    passes the limit, in a bounded time."""
    async def endless(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Endless: ")
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"a" * 65536)
                await writer.drain()

    pool, _, url = await served(endless)
    started = time.monotonic()
    with pytest.raises(UpstreamUnavailable, match="headers too large"):
        await pool.open("GET", url, {}, None, Timeouts(connect=2, first_byte=30, idle=30))
    assert time.monotonic() - started < 5
    assert pool.busy() == 0
