"""Wire-level probes of the HTTP/1.1 framing tollgate relays, against a raw loopback upstream and a raw
client socket: what an SDK never sends but a proxy in the path, a file upload or an odd upstream does.

Kept as tests once probed: HEAD answers keep the upstream's length, 204/304 carry no body, gzip event
streams are decoded and metered, trailers and HTTP/1.0 streams are relayed, pipelined calls each get
their answer, and malformed upstream framing is a 502 in the caller's format, never a 500 or a relayed
smuggle. Request codings the server leaves encoded are in test_body_codings.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.raw_http import read_request
from tests.fakes.upstream import openai_completion, openai_stream


class Raw:
    """Loopback upstream: reads each request (Content-Length framed) and answers with `answer(head, body)`
    raw bytes; `close` after writing when the script says so."""

    def __init__(self) -> None:
        self.script: list[tuple[bytes, bool]] = []
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.conns = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        """Close the listener and every connection still open: since Python 3.12 `wait_closed` waits for
        them, and the gateway keeps its pooled connections to this upstream until it stops itself."""
        assert self.server is not None
        self.server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.conns += 1
        self._writers.add(writer)
        try:
            while True:
                try:
                    self.requests.append(await read_request(reader))
                except asyncio.IncompleteReadError:
                    return
                data, close = self.script.pop(0)
                writer.write(data)
                await writer.drain()
                if close:
                    return
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()  # closed before the test's loop ends, never left to the collector


@pytest.fixture
async def raw() -> AsyncIterator[tuple[Raw, str]]:
    r = Raw()
    url = await r.start()
    try:
        yield r, url
    finally:
        await r.close()


def providers(url: str) -> dict[str, Any]:
    return {"providers": {
        "openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai",
                   "timeouts": {"connect": 2, "first_byte": 2, "idle": 2}},
        "anthropic": {"type": "anthropic", "base_url": url, "api_key": "sk-ant-provider",
                      "timeouts": {"connect": 2, "first_byte": 2, "idle": 2}}}}


def answer(status: bytes, headers: list[bytes], body: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + \
        b"Content-Length: %d\r\n\r\n" % len(body) + body


async def exchange(h: Harness, request: bytes) -> bytes:
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def post(path: bytes, body: bytes, extra: tuple[bytes, ...] = (), version: bytes = b"HTTP/1.1") -> bytes:
    return (b"POST " + path + b" " + version + b"\r\nHost: gw\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + b"".join(e + b"\r\n" for e in extra) + b"Content-Length: %d\r\n\r\n" % len(body) + body)


CHAT = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
STREAM = orjson.dumps({"model": "gpt-4o-mini", "stream": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": "hi"}]})
Upstream = tuple[Raw, str]


def chunked(*parts: bytes, trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts if p) + b"0\r\n" + trailers + b"\r\n"


def split(answer: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """(status line, headers by lower-case name, body as sent) of one raw answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    return status, fields, body


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


async def test_head_keeps_the_upstream_length_and_204_304_carry_no_body(gateway_factory: GatewayFactory,
                                                                         raw: Upstream) -> None:
    r, url = raw
    h = await gateway_factory(**providers(url))
    r.script.append((b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1234\r\n\r\n", False))
    status, fields, body = split(await exchange(h, b"HEAD /v1/files/f1/content HTTP/1.1\r\nHost: gw\r\n"
                                                    b"Connection: close\r\n\r\n"))
    assert status.endswith(b"200 OK") and fields[b"content-length"] == b"1234" and body == b""
    r.script.append((b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n", False))
    status, fields, body = split(await exchange(h, b"DELETE /v1/files/f1 HTTP/1.1\r\nHost: gw\r\n"
                                                    b"Connection: close\r\n\r\n"))
    assert status.endswith(b"204 No Content") and fields[b"x-a"] == b"1" and body == b""
    assert b"transfer-encoding" not in fields
    r.script.append((b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n", False))
    status, fields, body = split(await exchange(h, b"GET /v1/files/f1 HTTP/1.1\r\nHost: gw\r\n"
                                                    b"If-None-Match: x\r\nConnection: close\r\n\r\n"))
    assert status.endswith(b"304 Not Modified") and fields[b"etag"] == b"x" and body == b""


async def test_a_gzip_event_stream_is_decoded_and_metered(gateway_factory: GatewayFactory, raw: Upstream) -> None:
    r, url = raw
    h = await gateway_factory(**providers(url), agents={"default": {"budget": {"usd": 5.0}}})
    comp = zlib.compressobj(wbits=31)
    parts = [comp.compress(e) + comp.flush(zlib.Z_SYNC_FLUSH) for e in openai_stream(["Hel", "lo"], usage=(10, 5))]
    parts.append(comp.flush())
    r.script.append((b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*parts), False))
    status, fields, body = split(await exchange(h, post(b"/v1/chat/completions", STREAM,
                                                        (b"x-tollgate-run-id: g1",))))
    assert status.endswith(b"200 OK") and b"content-encoding" not in fields
    text = dechunk(body)
    assert b'"content":"Hel"' in text and text.endswith(b"data: [DONE]\n\n")
    run = await h.settled("g1")
    assert (run["input_tokens"], run["output_tokens"]) == (10, 5)


async def test_a_stream_with_trailers_is_relayed_and_metered(gateway_factory: GatewayFactory, raw: Upstream) -> None:
    r, url = raw
    h = await gateway_factory(**providers(url), agents={"default": {"budget": {"usd": 5.0}}})
    events = b"".join(openai_stream(["Hel", "lo"], usage=(10, 5)))
    r.script.append((b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Trailer: X-T\r\n\r\n" + chunked(events, trailers=b"X-T: 1\r\n"), False))
    status, _, body = split(await exchange(h, post(b"/v1/chat/completions", STREAM, (b"x-tollgate-run-id: g2",))))
    assert status.endswith(b"200 OK") and dechunk(body) == events
    run = await h.settled("g2")
    assert (run["input_tokens"], run["output_tokens"]) == (10, 5)


async def test_http10_streams_and_pipelined_calls_are_each_answered(gateway_factory: GatewayFactory,
                                                                   raw: Upstream) -> None:
    r, url = raw
    h = await gateway_factory(**providers(url))
    events = b"".join(openai_stream(["Hel", "lo"], usage=(10, 5)))
    r.script.append((b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + chunked(events), False))
    status, fields, body = split(await exchange(h, post(b"/v1/chat/completions", STREAM, version=b"HTTP/1.0")))
    # HTTP/1.0 has no chunked coding: the stream is the body up to the connection's close
    assert status.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in fields and body == events
    for text in ("one", "two"):
        r.script.append((answer(b"200 OK", [b"Content-Type: application/json"],
                                orjson.dumps(openai_completion(text))), False))
    first = post(b"/v1/chat/completions", CHAT).replace(b"Connection: close\r\n", b"")
    out = await exchange(h, first + post(b"/v1/chat/completions", CHAT))
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(b'"content":"one"') < out.index(b'"content":"two"')


MALFORMED: list[tuple[str, bytes, str]] = [
    ("both framings", b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n" + chunked(orjson.dumps(openai_completion())),
     "Transfer-Encoding can't be present with Content-Length"),
    ("two lengths", b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 271\r\n"
                    b"Content-Length: 271\r\n\r\n" + orjson.dumps(openai_completion()), "Duplicate Content-Length"),
    ("folded header", b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Fold: a\r\n b\r\n"
                      b"Content-Length: 271\r\n\r\n" + orjson.dumps(openai_completion()), "whitespace"),
]


@pytest.mark.parametrize(("reply", "why"), [(a, w) for _, a, w in MALFORMED], ids=[n for n, _, _ in MALFORMED])
async def test_malformed_upstream_framing_is_a_502_in_the_callers_format(
        gateway_factory: GatewayFactory, raw: Upstream, reply: bytes, why: str) -> None:
    r, url = raw
    h = await gateway_factory(**providers(url), agents={"default": {"budget": {"usd": 5.0}}})
    r.script.append((reply, True))
    status, _, body = split(await exchange(h, post(b"/v1/chat/completions", CHAT, (b"x-tollgate-run-id: m1",))))
    error = orjson.loads(body)["error"]
    assert status.endswith(b"502 Bad Gateway") and error["code"] == "upstream_unavailable", body
    assert why in error["message"]
    run = await h.settled("m1")
    # the request was sent and may have been served: charged its reservation, nothing left reserved
    assert run["spent_usd"] > 0 and run["reserved_usd"] == 0
