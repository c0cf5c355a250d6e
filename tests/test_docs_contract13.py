"""README claims of session 13's changes, each checked against a running gateway (each test failed on
the first wording or code it was written against)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import GatewayFactory, Harness
from tests.gateway.test_mcp_probe import call, raw
from tests.gateway.test_mcp_transport import POLICY, events, polling

MSG = [{"role": "user", "content": "q"}]


async def chat(h: Harness, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    hdrs = {"x-tollgate-run-id": "d13", **(headers or {})}
    async with h.session.post(f"{h.url}/v1/chat/completions", json=body, headers=hdrs) as resp:
        return resp.status, await resp.read()


async def test_a_non_tools_request_stream_ended_early_is_resumed(gateway_factory: GatewayFactory) -> None:
    """README: "A server that ends a request's event stream before its response (MCP "Resumability and
    Redelivery") has it resumed by tollgate (`GET` with `Last-Event-ID`, ...), so the response still
    comes on the judged stream; the agent is given no event ids, so it never resumes a stream around
    tollgate." Only `tools/list` / `tools/call` streams are resumed: any other request's stream (here
    `resources/read`) is relayed raw, its priming event's `id:` and `retry:` included, and ends without
    the response; the agent's own resumption (a GET) then has that response cut by tollgate."""
    async with polling() as srv:
        h = await gateway_factory(mcp_servers={"files": {"url": srv.url}}, agents={"bot": POLICY})
        async with asyncio.timeout(15):
            status, _, data = await raw(h, "POST", {"jsonrpc": "2.0", "id": 9, "method": "resources/read",
                                                    "params": {"uri": "file:///a"}})
        gets = list(srv.gets)
    assert status == 200, data
    assert b"id:" not in data and b"retry:" not in data, f"the agent was given an event id: {data!r}"
    assert [m.get("id") for m in events(data)] == [9], f"no response on the stream: {data!r}; GETs: {gets}"


async def test_integers_reach_the_server_exactly_up_to_a_doubles_range(gateway_factory: GatewayFactory) -> None:
    """README: "Integers beyond 64 bits in a message reach the server exactly as sent (up to a double's
    range, ~1e308; a larger number is a 400 parse error)." (The first README said "beyond 64 bits" with
    no bound, and a 400-digit integer was refused.)"""
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(body)
        return web.json_response({"jsonrpc": "2.0", "id": 7, "result": {"content": []}})

    app = web.Application()
    app.router.add_route("*", "/mcp", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        h = await gateway_factory(mcp_servers={"files": {"url": str(server.make_url("/mcp"))}}, agents={"bot": POLICY})
        bodies = {digits: ('{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_file","arguments":'
                           '{"n":' + "9" * digits + "}}}").encode() for digits in (300, 400)}
        async with asyncio.timeout(15):
            fits = await raw(h, "POST", bodies[300])
            too_big = await raw(h, "POST", bodies[400])
    finally:
        await server.close()
    assert fits[0] == 200 and len(seen) == 1 and b"9" * 300 in seen[0], fits
    assert too_big[0] == 400 and orjson.loads(too_big[2])["error"]["code"] == -32700, too_big
    assert len(seen) == 1


async def test_the_resumption_pause_keeps_its_floor_under_a_tiny_idle_timeout(gateway_factory: GatewayFactory) -> None:
    """README: resumed "after the server's `retry` delay capped at `timeouts.idle`, and at least 100 ms".
    (The first README said "at most `timeouts.idle`", which a `timeouts.idle` under 100 ms contradicted.)"""
    async with polling() as srv:
        h = await gateway_factory(mcp_servers={"files": {"url": srv.url, "timeouts": {"idle": 0.02}}},
                                  agents={"bot": POLICY})
        start = time.monotonic()
        async with asyncio.timeout(15):
            status, _, data = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 200 and events(data)[0]["id"] == 7, data
        assert srv.times[0] - start >= 0.09, f"the resumption waited only {srv.times[0] - start:.3f} s"
