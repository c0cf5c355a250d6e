"""Review of 0b36206 (MCP stream resumption, exact integers): each test fails on a real defect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import sse_response
from tests.gateway.test_mcp_calls import tool_rows
from tests.gateway.test_mcp_probe import call, raw
from tests.gateway.test_mcp_transport import POLICY, PollingServer, events

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/mcp", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/mcp"))
    finally:
        await server.close()


async def gateway(factory: GatewayFactory, url: str, **server: Any) -> Harness:
    return await factory(mcp_servers={"files": {"url": url, **server}}, agents={"bot": POLICY})


async def safe_raw(h: Harness, body: bytes | dict[str, Any]) -> tuple[int, bytes]:
    """The agent's view; a stream cut mid-way (no JSON-RPC answer) reads as what arrived before it."""
    try:
        status, _, data = await raw(h, "POST", body)
        return status, data
    except Exception as exc:  # noqa: BLE001 - a broken stream is itself the observation
        return -1, repr(exc).encode()


def nested(depth: int, leaf: bytes) -> bytes:
    return b"[" * depth + leaf + b"]" * depth


# -- a `retry` field too large for a float --------------------------------------------------------------


class HugeRetry(PollingServer):
    """The priming event's `retry` is an integer of 400 digits (valid SSE: "ASCII digits"); the GET then
    brings the response. The README bounds the wait by `timeouts.idle`."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return await super().handle(request)
        body = orjson.loads(await request.read())
        self.pending["e1"] = self.answer(body)
        return await self.stream(request, b"id: e1\nretry: 1" + b"0" * 400 + b"\ndata: \n\n")


async def test_a_huge_retry_delay_is_capped_by_the_idle_timeout_not_a_crash(gateway_factory: GatewayFactory) -> None:
    """README: resumed "after the server's `retry` delay, at most `timeouts.idle`". `_resume` computes
    `delay_ms / 1000` before capping it: an int over ~1e308 raises OverflowError, which neither
    `_relay_events` nor `_call_tool` catch (only GatewayError/ValueError): the agent's stream is cut
    without a JSON-RPC answer and the call has no ledger row at all."""
    server = await HugeRetry().start()
    try:
        h = await gateway(gateway_factory, server.url, timeouts={"idle": 0.2})
        async with asyncio.timeout(20):
            status, data = await safe_raw(h, call("read_file", {"path": "a"}))
            rows = await tool_rows(h)
        assert status == 200, data
        assert events(data) == [{"jsonrpc": "2.0", "id": 7,
                                 "result": {"content": [{"type": "text", "text": "ran read_file 1"}]}}], data
        assert [r["decision"] for r in rows] == ["executed"]
    finally:
        await server.close()


# -- exact_json: the stdlib parser gives up where orjson did not ------------------------------------------


async def test_a_deep_request_holding_a_long_number_is_a_400_not_a_500(gateway_factory: GatewayFactory) -> None:
    """orjson reads up to 1024 levels; `exact_json.loads` re-parses with `json.loads` whenever 19 digits
    occur, which raises RecursionError near 1000 levels. `parse_message` catches only JSONDecodeError, so
    a message the depth check (limits.max_json_depth, 64) refused with a 400 before is now a 500 (with a
    leaf of `1` instead of 19 digits it is still the 400)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse_response(request, ())

    async with scripted(handler) as url:
        h = await gateway(gateway_factory, url)
        body = (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_file","arguments":{"p":'
                + nested(1000, b"1234567890123456789") + b"}}}")
        async with asyncio.timeout(10):
            status, data = await safe_raw(h, body)
    assert status == 400, (status, data[:300])
    assert b"nests deeper" in data, data[:300]


async def test_a_deep_result_holding_a_long_number_is_still_answered_and_recorded(
    gateway_factory: GatewayFactory,
) -> None:
    """The same RecursionError on the server's side (`_event` -> exact_json.loads): orjson accepted the
    event, the stdlib re-parse raises, nothing catches it. README: a `tools/call` "is a step all the same
    (run view, span, ledger row)" however it ends, and judged answers fail closed with a JSON-RPC error;
    instead the stream is cut and no ledger row is written. (The deep value sits in `result._meta`, which
    the no-progress guard leaves out, so only the new re-parse is in the way: with a leaf of `1` the same
    answer is relayed and recorded.)"""
    result = b'{"content":[{"type":"text","text":"x"}],"_meta":{"v":' + nested(
        1000, b"1234567890123456789") + b"}}"

    async def handler(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        return await sse_response(request, (b'event: message\ndata: {"jsonrpc":"2.0","id":' + str(body["id"]).encode()
                                            + b',"result":' + result + b"}\n\n",))

    async with scripted(handler) as url:
        h = await gateway(gateway_factory, url)
        async with asyncio.timeout(10):
            status, data = await safe_raw(h, call("read_file", {"path": "a"}))
            rows = await tool_rows(h)
    assert status == 200, data[:300]
    messages = events(data)
    assert len(messages) == 1 and messages[0]["id"] == 7, data[:300]
    assert len(rows) == 1, rows


# -- exact_json: a schema integer beyond 64 bits switches argument validation off ---------------------------


async def test_a_schema_with_an_integer_beyond_64_bits_still_validates_arguments(
    gateway_factory: GatewayFactory,
) -> None:
    """README: arguments "must ... satisfy the tool's `inputSchema` (when a `tools/list` answer through
    tollgate showed it)". The tools/list answer is now parsed with exact_json, so `"maximum":
    100000000000000000000` stays an int; grammars.tool_args._key serialises the schema with orjson,
    which refuses it (JSONEncodeError -> InvalidGrammar), and mcp_calls._check_arguments then skips
    validation altogether: a call missing a required argument reaches the server."""
    calls: list[Any] = []
    schema = (b'{"type":"object","properties":{"path":{"type":"string"},"n":{"type":"integer",'
              b'"maximum":100000000000000000000}},"required":["path"]}')

    async def handler(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid = str(body["id"]).encode()
        if body["method"] == "tools/list":
            data = (b'{"jsonrpc":"2.0","id":' + rid + b',"result":{"tools":[{"name":"read_file","inputSchema":'
                    + schema + b"}]}}")
        else:
            calls.append(body["params"])
            data = b'{"jsonrpc":"2.0","id":' + rid + b',"result":{"content":[{"type":"text","text":"ran"}]}}'
        return web.Response(body=data, content_type="application/json")

    async with scripted(handler) as url:
        h = await gateway(gateway_factory, url)
        async with asyncio.timeout(10):
            status, _, listed = await raw(h, "POST", {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
            assert status == 200, listed
            status, _, data = await raw(h, "POST", call("read_file", {"n": 1}))
    assert calls == [], f"a call that breaks the declared inputSchema reached the server: {calls} -> {data!r}"
    assert orjson.loads(data)["error"]["data"]["code"] == "invalid_arguments", data


# -- a response to another request on the resumed stream ---------------------------------------------------


class OtherId(PollingServer):
    """The resumed stream brings a tool result under another request's id, and ends."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            self.gets.append(dict(request.headers))
            foreign = {"jsonrpc": "2.0", "id": 99, "result": {"content": [{"type": "text", "text": "unjudged"}]}}
            return await self.stream(request, b"event: message\ndata: " + orjson.dumps(foreign) + b"\n\n")
        return await super().handle(request)


async def test_a_response_to_another_id_on_a_resumed_stream_is_not_relayed_unjudged(
    gateway_factory: GatewayFactory,
) -> None:
    """On a request's stream the official SDK client takes *any* response as the answer to that request
    (mcp/client/streamable_http.py `_handle_sse_event`: `message.id = original_request_id`). tollgate
    relays a response whose id is not the call's raw (`_event`: not `_is_response` -> relayed as is), so
    the agent gets a tool result that was never judged (no no-progress guard, not recorded), while the
    ledger says the call was refused."""
    srv = await OtherId().start()
    try:
        h = await gateway(gateway_factory, srv.url)
        async with asyncio.timeout(15):
            status, data = await safe_raw(h, call("read_file", {"path": "a"}))
    finally:
        await srv.close()
    assert status == 200, data
    unjudged = [m for m in events(data) if ("result" in m or "error" in m) and m.get("id") != 7]
    assert unjudged == [], f"responses relayed unjudged on call 7's stream: {unjudged}"
