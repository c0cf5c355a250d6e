"""`gateway.lane`: model calls served without aiohttp's per-request loop, everything else unchanged.

Through a running gateway (`GatewayTestServer`, the runner `tollgate serve` uses): the official SDKs,
raw sockets for what SDKs never send (pipelining, HTTP/1.0, `Connection: close`), and the lane's
bookkeeping (cancellation, shutdown) observed from outside."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from gateway.app import create_apps
from gateway.config import parse_config
from gateway.lane import LaneHandler, deliver, lane_routes
from gateway.runner import LANES, GatewayRunner
from gateway.server import handler_args
from tests.conftest import GatewayFactory, Harness, base_config
from tests.fakes.upstream import FakeProvider, Reply, anthropic_message, openai_completion, openai_stream

BOTH_LOOPS = True
USER = [{"role": "user", "content": "hi"}]
CHAT = orjson.dumps({"model": "gpt-4o-mini", "messages": USER})


@pytest.fixture
def lanes_taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the requests the lane served, in order."""
    taken: list[str] = []
    serve = LaneHandler._serve

    async def spy(self: LaneHandler, route, message, payload):  # type: ignore[no-untyped-def]
        taken.append(message.path)
        await serve(self, route, message, payload)

    monkeypatch.setattr(LaneHandler, "_serve", spy)
    return taken


def request(path: str, body: bytes = CHAT, *, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: gw\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP answer with a Content-Length body: (head, body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"content-length:" in head.lower(), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return head, await asyncio.wait_for(reader.readexactly(length), 10)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass  # the gateway may have closed it first


async def connect(h: Harness) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = h.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def test_sdk_calls_take_the_lane(gw: Harness, lanes_taken: list[str]) -> None:
    gw.fake.queue(Reply(body=openai_completion("one")), Reply(chunks=openai_stream(["tw", "o"])),
                  Reply(body=anthropic_message("three")))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        answer = await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == "one"
        stream = await client.chat.completions.create(model="gpt-4o-mini", messages=USER, stream=True)  # type: ignore[arg-type]
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "two"
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as claude:
        message = await claude.messages.create(model="claude-3-5-haiku-latest", max_tokens=50, messages=USER)  # type: ignore[arg-type]
        assert message.content[0].text == "three"  # type: ignore[union-attr]
    assert lanes_taken == ["/v1/chat/completions", "/v1/chat/completions", "/v1/messages"]


async def test_other_requests_keep_aiohttps_loop(gw: Harness, lanes_taken: list[str]) -> None:
    """A query string, an `Expect: 100-continue` and a GET are served as before, by aiohttp's loop."""
    gw.fake.queue(Reply(body=openai_completion("q")), Reply(body=openai_completion("e")))
    async with gw.session.post(f"{gw.url}/v1/chat/completions?x=1", data=CHAT) as resp:
        assert resp.status == 200, await resp.text()
    async with gw.session.post(f"{gw.url}/v1/chat/completions", data=CHAT, expect100=True) as resp:
        assert resp.status == 200, await resp.text()
    async with gw.session.get(f"{gw.url}/v1/models") as resp:
        assert resp.status == 200
    assert lanes_taken == []


async def test_pipelined_requests_are_answered_in_order(gw: Harness, lanes_taken: list[str]) -> None:
    """A lane request and the requests sent behind it on the same connection: the ones behind wait for
    it (aiohttp's loop serves them after), every answer in the order asked."""
    gw.fake.queue(Reply(body=openai_completion("first"), delay=0.05), Reply(body=openai_completion("second")))
    reader, writer = await connect(gw)
    writer.write(request("/v1/chat/completions") + b"GET /nowhere HTTP/1.1\r\nHost: gw\r\n\r\n"
                 + request("/v1/chat/completions"))
    texts = []
    for _ in range(3):
        _, body = await read_answer(reader)
        texts.append(orjson.loads(body))
    await close(writer)
    assert texts[0]["choices"][0]["message"]["content"] == "first"
    assert texts[1]["error"]["code"] == "not_found"
    assert texts[2]["choices"][0]["message"]["content"] == "second"
    assert lanes_taken == ["/v1/chat/completions"]


async def test_keep_alive_across_lane_and_loop(gw: Harness, lanes_taken: list[str]) -> None:
    """One connection: a lane request, a request of aiohttp's loop, a lane request again."""
    gw.fake.queue(Reply(body=openai_completion("a")), Reply(body=openai_completion("b")))
    reader, writer = await connect(gw)
    for raw in (request("/v1/chat/completions"), b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n",
                request("/v1/chat/completions")):
        writer.write(raw)
        head, _ = await read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert b"connection: close" not in head.lower()
    await close(writer)
    assert lanes_taken == ["/v1/chat/completions", "/v1/chat/completions"]


@pytest.mark.parametrize(("version", "extra", "closes", "connection"), [
    ("1.1", "Connection: close\r\n", True, b"close"),
    ("1.0", "", True, None),
    ("1.0", "Connection: keep-alive\r\n", False, b"keep-alive"),
])
async def test_connection_semantics(gw: Harness, lanes_taken: list[str], version: str, extra: str, closes: bool,
                                    connection: bytes | None) -> None:
    gw.fake.queue(Reply(body=openai_completion("x")))
    reader, writer = await connect(gw)
    writer.write(request("/v1/chat/completions", extra=extra, version=version))
    head, body = await read_answer(reader)
    assert head.startswith(f"HTTP/{version} 200 ".encode()), head
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
    assert {k.lower(): v for k, v in headers.items()}.get(b"connection") == connection
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "x"
    if closes:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the gateway closed it
    await close(writer)
    assert lanes_taken == ["/v1/chat/completions"]


async def test_a_refused_body_is_answered_and_the_rest_lingers(gateway_factory: GatewayFactory,
                                                               lanes_taken: list[str]) -> None:
    """A 413 before the body was read: the answer is whole, and the connection stays usable once the
    rest of the body arrived (read and dropped, as aiohttp's loop lingers)."""
    h = await gateway_factory(limits={"max_body_bytes": 1000})
    h.fake.queue(Reply(body=openai_completion("after")))
    reader, writer = await connect(h)
    big = b"x" * 5000
    writer.write(request("/v1/chat/completions", big)[:-4000])
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert orjson.loads(body)["error"]["code"] == "request_too_large"
    writer.write(big[-4000:] + request("/v1/chat/completions"))
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 200 "), head
    await close(writer)
    assert lanes_taken[0] == "/v1/chat/completions"


async def test_a_client_that_leaves_cancels_its_lane_request(gw: Harness, lanes_taken: list[str]) -> None:
    """handler_cancellation: the step ends as `client_disconnected`, its reservation settled, and the
    upstream connection it held is closed."""
    gw.fake.queue(Reply(body=openai_completion("late"), delay=30))
    _, writer = await connect(gw)
    writer.write(request("/v1/chat/completions", extra="x-tollgate-run-id: left\r\n"))
    for _ in range(500):
        if gw.fake.seen:
            break
        await asyncio.sleep(0.01)
    await close(writer)
    view = await gw.settled("left")
    assert view["steps"][0]["error"] == "client_disconnected"
    for _ in range(500):
        if gw.gateway.upstream.busy_connections() == 0:
            break
        await asyncio.sleep(0.01)
    assert gw.gateway.upstream.busy_connections() == 0
    assert lanes_taken == ["/v1/chat/completions"]


async def test_a_handler_failure_is_a_json_500(gw: Harness, monkeypatch: pytest.MonkeyPatch,
                                               lanes_taken: list[str]) -> None:
    """A handler that raises: aiohttp's 500, in the JSON both SDKs read (`gateway.runner`), connection closed."""

    async def broken(request: web.Request, protocol: str) -> web.StreamResponse:
        raise RuntimeError("boom")

    monkeypatch.setattr("gateway.proxy.handle_chat", broken)
    reader, writer = await connect(gw)
    writer.write(request("/v1/chat/completions"))
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 500 "), head
    assert orjson.loads(body)["error"]["code"] == "internal_error"
    assert b"boom" not in body
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await close(writer)
    assert lanes_taken == ["/v1/chat/completions"]


async def test_shutdown_drains_a_lane_request(fake: tuple[FakeProvider, str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Graceful shutdown waits for a lane request in progress (it counts as a request in progress)."""
    provider, url = fake
    config = parse_config(base_config(url), env={}, base_dir=str(tmp_path))
    proxy, _ = create_apps(config)
    runner = GatewayRunner(proxy, shutdown_timeout=5.0, handler_cancellation=True, **handler_args(config.limits))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    provider.queue(Reply(body=openai_completion("drained"), delay=0.3))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request("/v1/chat/completions"))
    for _ in range(500):
        if provider.seen:
            break
        await asyncio.sleep(0.01)
    cleanup = asyncio.create_task(runner.cleanup())
    head, body = await read_answer(reader)
    await cleanup
    await close(writer)
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "drained"


def test_lane_routes_are_the_apps_model_calls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = parse_config(base_config("http://127.0.0.1:9"), env={}, base_dir=str(tmp_path))
    proxy, admin = create_apps(config)
    assert sorted(lane_routes(proxy, proxy[LANES])) == ["/v1/chat/completions", "/v1/messages", "/v1/responses"]
    assert lane_routes(admin, admin.get(LANES, ())) == {}

    async def middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
        return await handler(request)

    with_middleware = web.Application(middlewares=[middleware])
    with_middleware.router.add_post("/v1/chat/completions", middleware)
    assert lane_routes(with_middleware, ("/v1/chat/completions",)) == {}  # it would skip the middleware


@pytest.fixture
async def raw_server() -> AsyncIterator[tuple[str, list[web.StreamResponse]]]:
    """A server whose handler answers with `deliver` whatever the test put in the list."""
    answers: list[web.StreamResponse] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        response = answers.pop(0)
        try:
            await deliver(request, response)
        except ValueError as exc:  # what `prepare` raises for a header it refuses
            return web.Response(status=500, text=f"refused: {exc}")
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = GatewayRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", answers
    finally:
        await runner.cleanup()


async def test_deliver_writes_what_prepare_would(raw_server: tuple[str, list[web.StreamResponse]]) -> None:
    url, answers = raw_server
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answers.append(web.Response(body=b'{"a":1}', content_type="application/json", headers={"x-one": "1"}))
    answers.append(web.Response(status=204))  # no body: through `prepare`
    answers.append(web.Response(body=b"x", headers={"x-bad": "a\nb"}))  # refused like `prepare` refuses it
    fast = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
    writer.write(fast)
    head, body = await read_answer(reader)
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK" and body == b'{"a":1}'
    names = {line.split(b": ")[0].lower() for line in lines[1:] if line}
    assert {b"content-type", b"content-length", b"date", b"server", b"x-one"} <= names
    writer.write(fast)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 204 ") and b"content-length" not in head.lower()
    writer.write(fast)
    head, body = await read_answer(reader)
    assert head.startswith(b"HTTP/1.1 500 ") and b"Forbidden control character" in body
    await close(writer)
