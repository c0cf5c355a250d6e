"""`limits.max_answer_bytes` in the HTTP/1.1 upstream client: `read()` refuses a body over the cap,
however it is framed (Content-Length, chunked, delimited by the close, endless) or encoded (a
compression bomb), closes its connection instead of pooling it, and returns one of exactly the cap.
`chunks()` is not capped. Scripted loopback servers of test_http1.py."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.errors import UpstreamUnavailable
from gateway.http1 import HIGH_WATER, Http1Pool
from tests.gateway.test_http1 import FAST, Handler, Server, answer

BOTH_LOOPS = True  # every async test on asyncio's loop and on uvloop (tests/conftest.py)
Served = Callable[[Handler, int], Awaitable[tuple[Http1Pool, Server, str]]]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """A scripted server and a pool whose answers are capped at the given number of bytes."""
    made: list[tuple[Http1Pool, Server]] = []

    async def make(handler: Handler, cap: int) -> tuple[Http1Pool, Server, str]:
        pool = Http1Pool(asyncio.get_running_loop(), max_answer_bytes=cap)
        server = Server(handler)
        url = await server.start()
        made.append((pool, server))
        return pool, server, url

    yield make
    for pool, server in made:
        await pool.close()
        await server.close()



CAP = 1000


def chunked_answer(body: bytes, piece: int = 300) -> Handler:
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for at in range(0, len(body), piece):
            part = body[at:at + piece]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return handle


def close_delimited(body: bytes) -> Handler:
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    return handle


def endless(chunked: bool) -> Handler:
    """A body that never ends: 4 MiB of chunks (or of raw bytes, delimited by a close that never
    comes), then nothing until the client goes away (bounded, so that a client without a cap times
    out instead of filling the test machine's memory)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + (b"Transfer-Encoding: chunked\r\n" if chunked else b"") + b"\r\n")
        piece = b"x" * 4096
        for _ in range(1024):
            writer.write(b"1000\r\n%s\r\n" % piece if chunked else piece)
            await writer.drain()
        await reader.read()  # until the client closes

    return handle


FRAMINGS: dict[str, Callable[[bytes], Handler]] = {"content-length": answer, "chunked": chunked_answer, "close-delimited": close_delimited}


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
async def test_a_body_over_the_cap_is_refused_and_its_connection_closed(served: Served, framing: str) -> None:
    pool, server, url = await served(FRAMINGS[framing](b"y" * (CAP + 1)), CAP)
    resp = await pool.open("POST", url, {}, b"{}", FAST)
    with pytest.raises(UpstreamUnavailable, match=r"larger than limits.max_answer_bytes \(1000 bytes\)") as caught:
        await resp.read()
    assert caught.value.request_sent  # the upstream had the request: it may bill it
    resp.release()
    assert pool.busy() == 0 and pool.open_count() == 0  # closed, never back in the pool
    server.handler = answer(b"ok")
    assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"ok"
    assert server.connections == 2  # the refused connection was not reused


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
async def test_a_body_of_exactly_the_cap_is_read(served: Served, framing: str) -> None:
    body = bytes(range(256)) * 4  # 1024 bytes
    pool, server, url = await served(FRAMINGS[framing](body), len(body))
    for _ in range(2):
        assert await (await pool.open("GET", url, {}, None, FAST)).read() == body
    assert server.connections == (2 if framing == "close-delimited" else 1)  # kept alive when it can be


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
async def test_an_endless_body_is_cut_at_the_cap(served: Served, chunked: bool) -> None:
    pool, _, url = await served(endless(chunked), 64 * 1024)
    resp = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamUnavailable, match="max_answer_bytes"):
        await resp.read()
    resp.release()
    assert pool.busy() == 0 and pool.open_count() == 0


async def test_the_cap_bounds_the_decoded_body(served: Served) -> None:
    """A compression bomb: a few kilobytes that decode to megabytes are refused, not decoded whole."""
    bomb = gzip.compress(b"\0" * (4 << 20))
    assert len(bomb) < CAP * 10
    pool, server, url = await served(answer(bomb, b"Content-Encoding: gzip\r\n"), CAP * 10)
    resp = await pool.open("GET", url, {}, None, FAST)
    with pytest.raises(UpstreamUnavailable, match="max_answer_bytes"):
        await resp.read()
    assert pool.busy() == 0 and pool.open_count() == 0
    two_members = gzip.compress(b"a" * 600) + gzip.compress(b"b" * 600)  # each under the cap, both over
    server.handler = answer(two_members, b"Content-Encoding: gzip\r\n")
    pool.max_answer_bytes = 1199
    with pytest.raises(UpstreamUnavailable, match="max_answer_bytes"):
        await (await pool.open("GET", url, {}, None, FAST)).read()
    pool.max_answer_bytes = 1200
    assert await (await pool.open("GET", url, {}, None, FAST)).read() == b"a" * 600 + b"b" * 600


async def test_streamed_chunks_are_not_capped(served: Served) -> None:
    """`chunks()` holds a chunk at a time: a stream longer than the cap passes whole."""
    pool, _, url = await served(chunked_answer(b"z" * (CAP * 5)), CAP)
    resp = await pool.open("GET", url, {}, None, FAST)
    assert sum([len(chunk) async for chunk in resp.chunks()]) == CAP * 5
    assert pool.busy() == 0 and pool.open_count() == 1


async def test_a_compressed_stream_is_decoded_a_piece_at_a_time(served: Served) -> None:
    """A chunk that inflates to many megabytes (a compression bomb in a stream) is never held whole:
    `chunks()` yields it `HIGH_WATER` bytes at most at a time, and all of it."""
    inflated = 8 * HIGH_WATER + 123
    body = gzip.compress(b"\0" * (inflated // 2)) + gzip.compress(b"\1" * (inflated - inflated // 2))
    pool, _, url = await served(encoded_chunked(body), CAP)
    resp = await pool.open("GET", url, {}, None, FAST)
    sizes = [len(piece) async for piece in resp.chunks()]
    assert sum(sizes) == inflated and max(sizes) <= HIGH_WATER
    assert pool.busy() == 0 and pool.open_count() == 1


def encoded_chunked(body: bytes) -> Handler:
    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        await writer.drain()

    return handle
