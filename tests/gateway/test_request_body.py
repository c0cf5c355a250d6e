"""gateway/request_body.py, `read_body`: the body limit (declared and streamed, after decoding) and bodies that
cannot be decoded. Mocked requests for the arithmetic, an aiohttp server on loopback for real decoding."""

from __future__ import annotations

import asyncio
import gzip
import io
import time
import zlib
from collections.abc import AsyncIterator, Callable
from unittest import mock

import pytest
from aiohttp import ClientSession, TCPConnector, streams, web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.test_utils import make_mocked_request

from gateway.config import Limits
from gateway.errors import GatewayError, InvalidRequest, RequestTimeout, RequestTooLarge, UndecodableBody
from gateway.request_body import read_body
from tests.fakes.gateway_server import GatewayTestServer


def payload(*chunks: bytes, error: BaseException | None = None) -> streams.StreamReader:
    reader = streams.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        reader.feed_data(chunk)
    if error is not None:
        reader.set_exception(error)
    else:
        reader.feed_eof()
    return reader


def request(reader: streams.StreamReader, content_length: int | None = None) -> web.Request:
    headers = {} if content_length is None else {"Content-Length": str(content_length)}
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers, payload=reader)


@pytest.mark.parametrize(
    ("chunks", "limit", "declared"),
    [
        ((), 10, None),
        ((b"abc", b"def"), 6, None),  # exactly the limit
        ((b"abc", b"def"), 6, 6),
        ((b"x" * 100,), 1000, 100),
        ((b"a", b"b", b"c", b"d"), 4, None),
    ],
)
async def test_read_body_returns_the_whole_body(chunks: tuple[bytes, ...], limit: int,
                                                declared: int | None) -> None:
    body = await read_body(request(payload(*chunks), declared), Limits(max_body_bytes=limit))
    assert body == b"".join(chunks)


@pytest.mark.parametrize(
    ("chunks", "limit"),
    [((b"abc", b"defg"), 6), ((b"x" * 7,), 6), ((b"a",) * 11, 10)],
)
async def test_streamed_body_over_the_limit(chunks: tuple[bytes, ...], limit: int) -> None:
    """No Content-Length (chunked): refused as soon as the count passes the limit."""
    with pytest.raises(RequestTooLarge) as info:
        await read_body(request(payload(*chunks)), Limits(max_body_bytes=limit))
    assert info.value.status == 413
    assert info.value.message == f"request body exceeds the limit of {limit} bytes"


async def test_declared_length_over_the_limit_is_refused_before_reading() -> None:
    # a payload that would fail if it were read: the refusal comes from Content-Length alone
    unread = payload(error=web.RequestPayloadError("must not be read"))
    with pytest.raises(RequestTooLarge) as info:
        await read_body(request(unread, 7), Limits(max_body_bytes=6))
    assert info.value.message == "request body of 7 bytes exceeds the limit of 6"


@pytest.mark.parametrize(
    ("cause", "detail"),
    [
        (ContentEncodingError("Can not decode content-encoding: gzip"),
         "Can not decode content-encoding: gzip"),
        (ValueError("no message attribute"), "ValueError"),
        (None, "RequestPayloadError"),
    ],
)
async def test_undecodable_body_is_invalid_request(cause: BaseException | None, detail: str) -> None:
    error = web.RequestPayloadError("payload")
    error.__cause__ = cause
    with pytest.raises(InvalidRequest) as info:
        await read_body(request(payload(b"partial", error=error)), Limits())
    assert info.value.status == 400
    assert info.value.message == f"request body cannot be decoded: {detail}"
    assert info.value.__cause__ is None  # the aiohttp exception is not chained into the answer


@pytest.mark.parametrize("chunks", [(), (b"partial",)])
async def test_a_body_that_stops_arriving_is_a_request_timeout(chunks: tuple[bytes, ...]) -> None:
    reader = streams.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    for chunk in chunks:
        reader.feed_data(chunk)  # and no EOF: the client went quiet
    with pytest.raises(RequestTimeout) as info:
        await read_body(request(reader), Limits(body_idle_s=0.01))
    assert (info.value.status, info.value.code) == (408, "request_timeout")
    assert info.value.closes_connection
    assert reader.is_eof()  # ended here, so aiohttp does not linger reading it after the answer


async def test_an_undecodable_body_ends_the_payload_and_closes_the_connection() -> None:
    reader = payload(b"x", error=web.RequestPayloadError("payload"))
    with pytest.raises(UndecodableBody) as info:
        await read_body(request(reader), Limits())
    assert info.value.closes_connection and reader.is_eof()


# -- on loopback, served as `tollgate serve` does: the limit applies to the decoded bytes ---------------

LIMIT = 1000


async def _handler(req: web.Request) -> web.Response:
    try:
        body = await read_body(req, Limits(max_body_bytes=LIMIT))
    except GatewayError as exc:
        return web.json_response({"code": exc.code, "message": exc.message}, status=exc.status)
    return web.Response(body=body)


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/", _handler)
    srv = GatewayTestServer(app, Limits(max_body_bytes=LIMIT))
    await srv.start_server()
    try:
        yield str(srv.make_url("/"))
    finally:
        await srv.close()


async def post(url: str, data: bytes, encoding: str) -> tuple[int, bytes]:
    async with (
        ClientSession(auto_decompress=False) as session,
        session.post(url, data=data, headers={"Content-Encoding": encoding}) as resp,
    ):
        return resp.status, await resp.read()


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("identity", bytes)],
)
@pytest.mark.parametrize("size", [1, LIMIT])
async def test_encoded_body_is_decoded(server: str, encoding: str, compress: Callable[[bytes], bytes],
                                       size: int) -> None:
    plain = b'{"model": "m"}'.ljust(size, b" ")[:size]
    assert await post(server, compress(plain), encoding) == (200, plain)


@pytest.mark.parametrize("size", [LIMIT + 1, 500_000])
async def test_compression_bomb_stops_at_the_limit(server: str, size: int) -> None:
    packed = gzip.compress(b"a" * size)
    assert len(packed) < LIMIT  # small on the wire: only the decoded size is over
    status, body = await post(server, packed, "gzip")
    assert status == 413
    assert body == b'{"code": "request_too_large", "message": "request body exceeds the limit of 1000 bytes"}'


@pytest.mark.parametrize(
    ("encoding", "data"), [("gzip", b"not gzip at all"), ("deflate", b"\x00\x01garbage")]
)
async def test_body_that_fails_to_decode_is_a_400(server: str, encoding: str, data: bytes) -> None:
    status, body = await post(server, data, encoding)
    assert status == 400
    assert body.startswith(b'{"code": "invalid_request", "message": "request body cannot be decoded: it is not valid '
                           + encoding.encode())


async def test_a_truncated_gzip_body_is_a_400_not_the_part_that_came(server: str) -> None:
    """aiohttp's decoder took a gzip body cut mid-stream as whole: an upload reached the upstream as
    151 of its 36,183 bytes."""
    status, body = await post(server, gzip.compress(b"x" * 900)[:-12], "gzip")
    assert status == 400 and b"ends before its end" in body


async def _refuse_unread(_: web.Request) -> web.Response:
    return web.Response(status=401)


async def test_a_refused_bomb_is_not_decoded_after_the_answer() -> None:
    """aiohttp decoded the rest of a refused body while it drained it (its lingering read), on the event
    loop: 1 GiB of zeros in 1 MB cost ~2.5 s of CPU after the 413, or after a 401 that never read it.
    Now what is left is drained as the bytes it is. The second request on the same connection is
    answered only once the first one's body is drained."""
    app = web.Application()
    app.router.add_post("/", _handler)
    app.router.add_post("/unread", _refuse_unread)
    srv = GatewayTestServer(app, Limits(max_body_bytes=LIMIT))
    await srv.start_server()
    bomb = gzip.compress(b"\0" * 2**20, 9) * 1024  # gzip members: 1 GiB decoded, ~1 MB sent
    try:
        async with ClientSession(connector=TCPConnector(limit=1)) as session:
            for path, status in (("/", 413), ("/unread", 401)):
                started = time.process_time()
                async with session.post(srv.make_url(path), data=io.BytesIO(bomb),
                                        headers={"Content-Encoding": "gzip"}) as resp:
                    assert resp.status == status
                async with session.post(srv.make_url("/"), data=b"{}") as resp:
                    assert resp.status == 200
                assert time.process_time() - started < 1.0  # decoding it all took ~2.5 s
    finally:
        await srv.close()
