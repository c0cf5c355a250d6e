"""`gateway.runner`: what aiohttp's server answers on its own is JSON that both official SDKs read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from gateway.config import Limits
from gateway.runner import MAX_DETAIL, refusal_body
from tests.conftest import Harness
from tests.fakes.gateway_server import GatewayTestServer

USER = [{"role": "user", "content": "hi"}]
BIG = "v" * (Limits().max_header_bytes + 100)  # one header field over the parser's limit


@pytest.mark.parametrize(
    ("status", "detail", "code", "kind", "message"),
    [
        (400, "Got more than 16384 bytes when reading Header value is too long.", "invalid_request",
         "invalid_request_error", "malformed HTTP request: Got more than 16384 bytes when reading Header value is too long."),
        (400, None, "invalid_request", "invalid_request_error", "malformed HTTP request: refused"),
        (431, "too many headers", "invalid_request", "invalid_request_error", "malformed HTTP request: too many headers"),
        (500, "Traceback: secret detail", "internal_error", "api_error", "the gateway failed to answer this request"),
        (504, None, "internal_error", "api_error", "the gateway failed to answer this request"),
    ],
)
def test_refusal_body(status: int, detail: str | None, code: str, kind: str, message: str) -> None:
    data = orjson.loads(refusal_body(status, detail))
    assert data == {"type": "error", "error": {"message": message, "type": kind, "param": None, "code": code}}


def test_refusal_body_keeps_a_bounded_detail() -> None:
    message = orjson.loads(refusal_body(400, "x" * 5000))["error"]["message"]
    assert message == "malformed HTTP request: " + "x" * MAX_DETAIL


async def raw(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, bytes]:
    """Send one raw request; the answer's head and body, read to the connection's end."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10.0)  # to EOF: the server closes after a refusal
    writer.close()
    await writer.wait_closed()
    answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
    return answer_head, answer_body


async def test_openai_sdk_reads_a_parser_refusal(gw: Harness) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-big": BIG}) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    assert caught.value.code == "invalid_request"
    assert "malformed HTTP request" in caught.value.message
    assert gw.fake.seen == []


async def test_anthropic_sdk_reads_a_parser_refusal(gw: Harness) -> None:
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0,
                                        default_headers={"x-big": BIG}) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model="claude-3-5-haiku-latest", max_tokens=8, messages=USER)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_request"
    assert gw.fake.seen == []


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        b"GARBAGE\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\n" + b"".join(b"x-%d: v\r\n" % i for i in range(200)) + b"\r\n",
    ],
    ids=["undecodable-encoding", "two-lengths", "not-http", "too-many-fields"],
)
async def test_parser_refusals_are_json_and_close(gw: Harness, head: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    answer_head, answer_body = await raw(gw.url, head, b"{}")
    assert answer_head.split(b"\r\n")[0].endswith(b"400 Bad Request"), answer_head
    assert b"Content-Type: application/json" in answer_head
    data = orjson.loads(answer_body)
    assert data["type"] == "error" and data["error"]["code"] == "invalid_request", data
    # a client's malformed request is no error of the gateway's: no traceback, nothing above DEBUG
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG or r.exc_info], caplog.records
    assert gw.fake.seen == []


@pytest.fixture
async def raising() -> AsyncIterator[str]:
    """A runner-served app whose handler raises: what aiohttp answers a handler's own failure."""

    async def handler(request: web.Request) -> web.Response:
        raise RuntimeError("secret detail of the failure")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    server = GatewayTestServer(app, Limits())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_a_handler_that_raises_is_a_json_500_without_its_detail(
    raising: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    async with openai.AsyncOpenAI(base_url=f"{raising}/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
    assert caught.value.code == "internal_error"
    assert "secret detail" not in str(caught.value.body)
    assert any(r.exc_info for r in caplog.records)  # the traceback is logged for the operator


@pytest.mark.parametrize("target", [b"/v1/chat/completions", b"/mcp/files", b"example.com:443", b"/"])
async def test_connect_is_a_json_404_not_a_forward_proxy(gw: Harness, target: bytes) -> None:
    head = b"CONNECT " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    answer_head, answer_body = await raw(gw.url, head)
    assert answer_head.split(b"\r\n")[0].endswith(b"404 Not Found"), answer_head
    assert b"Content-Type: application/json" in answer_head
    data = orjson.loads(answer_body)
    assert data["type"] == "error" and data["error"]["code"] == "not_found" and "CONNECT" in data["error"]["message"]
    assert gw.fake.seen == []
