"""An MCP `tools/call` in flight while its run is reset counts in no run (README: "a step in flight while
its run is reset does not stop the fresh run, and counts in no run"): its result is delivered, but its
progress marks and result fingerprints (`loop.stall_steps`) do not land in the fresh run.

The server holds the first `tools/call` until the test releases it, so the reset lands while it is in
flight (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from aiohttp import web

from tests.conftest import GatewayFactory
from tests.gateway.test_mcp_probe import TOOLS, RawServer, admin, call, gateway, post


class HoldFirstCall(RawServer):
    """`tools/call`: the first one waits for `release`; the others answer at once."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = asyncio.Event()
        self._held_one = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST" and not self._held_one:
            body = orjson.loads(await request.read())  # aiohttp keeps the body: `super().handle` reads it again
            if body.get("method") == "tools/call":
                self._held_one = True
                self.arrived.set()
                await self.release.wait()
        return await super().handle(request)


@asynccontextmanager
async def hold_first_call() -> AsyncIterator[HoldFirstCall]:
    server = await HoldFirstCall().start()
    try:
        yield server
    finally:
        await server.close()


async def test_a_tools_call_in_flight_across_a_reset_does_not_stop_the_fresh_run(
    gateway_factory: GatewayFactory,
) -> None:
    """`loop.stall_steps: 1`: a result the run has seen already stops it with `no_progress`. The call
    from before the reset returns the result the fresh run's own call returned: counted there, it
    stopped the fresh run."""
    async with hold_first_call() as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, loop={"stall_steps": 1})
        old = asyncio.ensure_future(post(h, call("read_file", {"path": "a"}, rpc_id=1), run="mr"))
        await server.arrived.wait()
        status, _ = await admin(h, "POST", "/admin/runs/mr/reset")
        assert status == 200
        status, fresh = await post(h, call("read_file", {"path": "a"}, rpc_id=2), run="mr")
        assert (status, fresh["result"]["content"][0]["text"]) == (200, "ran read_file")
        server.release.set()
        status, answer = await old
        assert (status, answer["result"]["content"][0]["text"]) == (200, "ran read_file")  # delivered
        _, run = await admin(h, "GET", "/admin/runs/mr")
        assert (run["status"], run["stop_reason"], run["tool_calls"]) == ("active", None, 1)
        status, again = await post(h, call("write_note", {"text": "b"}, rpc_id=3), run="mr")
        assert (status, again["result"]["content"][0]["text"]) == (200, "note 1")  # the fresh run goes on
