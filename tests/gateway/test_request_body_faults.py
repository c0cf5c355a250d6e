"""Request bodies that stall or break, through a running gateway: a clear error in the caller's wire
format, the connection closed after it, nothing sent upstream, and nothing logged as unhandled.

aiohttp's C parser never ends a body whose chunked framing breaks after the handler started reading
it; the body idle deadline (`limits.body_idle_s`) is what answers that request."""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
import pytest

from tests.conftest import GatewayFactory, Harness

IDLE_S = 0.3
CHAT = b"/v1/chat/completions"
MESSAGES = b"/v1/messages"
OPENAI_BODY = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
ANTHROPIC_BODY = orjson.dumps({"model": "claude-3-5-haiku-latest", "max_tokens": 8,
                               "messages": [{"role": "user", "content": "hi"}]})


async def exchange(h: Harness, path: bytes, headers: list[bytes], parts: list[bytes]) -> tuple[bytes, bytes]:
    """Write the request head and `parts` (the first with the head, the rest after the gateway has had
    the first), then read to EOF, which only comes when the gateway closes the connection (the request
    asks for keep-alive). Returns the response's (head, body)."""
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = [b"POST " + path + b" HTTP/1.1", b"Host: gw", b"Content-Type: application/json", *headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + parts[0])
        await writer.drain()
        for part in parts[1:]:
            await asyncio.sleep(0.05)  # a later TCP segment: the handler is already reading the body
            writer.write(part)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)  # EOF: the gateway closed the connection
    finally:
        writer.close()
    response_head, _, body = data.partition(b"\r\n\r\n")
    return response_head, body


@pytest.fixture
async def gw(gateway_factory: GatewayFactory) -> Harness:
    return await gateway_factory(limits={"body_idle_s": IDLE_S})


@pytest.mark.parametrize(
    ("headers", "parts"),
    [
        # declared 500 bytes, sent 20, then silence
        ([b"Content-Length: 500"], [OPENAI_BODY[:20]]),
        # chunked, one chunk, then silence
        ([b"Transfer-Encoding: chunked"], [b"14\r\n" + OPENAI_BODY[:20] + b"\r\n"]),
        # chunked framing that breaks after the first chunk (the C parser's hang)
        ([b"Transfer-Encoding: chunked"], [b"5\r\n" + OPENAI_BODY[:5] + b"\r\n", b"ZZ\r\nbad\r\n0\r\n\r\n"]),
    ],
)
async def test_a_stalled_body_is_a_408_and_the_connection_closes(gw: Harness, headers: list[bytes],
                                                                 parts: list[bytes]) -> None:
    started = time.monotonic()
    head, body = await exchange(gw, CHAT, headers, parts)
    elapsed = time.monotonic() - started
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert b"Connection: close" in head
    assert orjson.loads(body)["error"] == {
        "message": f"no byte of the request body for {IDLE_S:g} s", "type": "invalid_request_error",
        "param": None, "code": "request_timeout"}
    assert IDLE_S <= elapsed < IDLE_S + 5  # answered at the deadline, not after aiohttp's lingering
    assert gw.fake.seen == []


async def test_a_stalled_anthropic_body_is_an_anthropic_timeout_error(gw: Harness) -> None:
    head, body = await exchange(gw, MESSAGES, [b"Content-Length: 500"], [ANTHROPIC_BODY[:20]])
    assert head.startswith(b"HTTP/1.1 408 ")
    error = orjson.loads(body)
    assert error["type"] == "error"
    assert (error["error"]["type"], error["error"]["code"]) == ("timeout_error", "request_timeout")


async def test_a_slow_body_that_keeps_arriving_is_not_cut(gw: Harness) -> None:
    """The deadline is between bytes, not for the whole body: a slow upload is not refused."""
    pieces = [OPENAI_BODY[i:i + 10] for i in range(0, len(OPENAI_BODY), 10)]
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(OPENAI_BODY))
        for piece in pieces:  # all of it takes longer than the idle deadline, no gap reaches it
            await asyncio.sleep(IDLE_S / 3)
            writer.write(piece)
            await writer.drain()
        assert len(pieces) * IDLE_S / 3 > IDLE_S
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert len(gw.fake.seen) == 1


@pytest.mark.parametrize("data", [b"not gzip at all!", b"\x1f\x8b\x08\x00" + b"\x00" * 5 + b"\x03" + b"\xff" * 20])
async def test_an_undecodable_body_is_a_400_without_an_unhandled_error(gw: Harness, data: bytes,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        head, body = await exchange(
            gw, CHAT, [b"Content-Encoding: gzip", b"Content-Length: %d" % len(data)], [data])
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"Connection: close" in head
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("request body cannot be decoded: ")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert gw.fake.seen == []


async def test_the_connection_serves_the_next_request_after_a_normal_error(gw: Harness) -> None:
    """Only broken or stalled bodies close the connection: a bad JSON body keeps it alive."""
    async with gw.session.post(f"{gw.url}/v1/chat/completions", data=b"{",
                               headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        assert "close" not in resp.headers.get("Connection", "").lower()
    async with gw.session.post(f"{gw.url}/v1/chat/completions", data=OPENAI_BODY,
                               headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
