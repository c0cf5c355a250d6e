"""MCP results of one run that come back at once are judged one after another (README: "answers and MCP
results are judged on the run's history as it is when they come back"): with `loop.stall_steps: 2`, six
identical results deliver two and stop the run with `no_progress`, as six in a row do. On Redis the
judgement reads and writes the run in two round trips; six results judged at once each passed (found by
a review probe, stall_mcp_par.py). One gateway; memory and Redis state.

The server holds every `tools/call` until all six arrived, then answers them together (no sleeps)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web

from tests.conftest import GatewayFactory
from tests.gateway.test_mcp_probe import TOOLS, RawServer, admin, call, gateway, post
from tests.redis_fixture import memory_or_redis, redis_server  # noqa: F401  (fixtures, by name)


class HoldCalls(RawServer):
    """Every `tools/call` waits until `count` of them arrived; then all are answered."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.arrivals = 0
        self.all_in = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            body = orjson.loads(await request.read())  # aiohttp keeps the body: `super().handle` reads it again
            if body.get("method") == "tools/call":
                self.arrivals += 1
                if self.arrivals >= self.count:
                    self.all_in.set()
                await self.all_in.wait()
        return await super().handle(request)


@asynccontextmanager
async def hold_calls(count: int) -> AsyncIterator[HoldCalls]:
    server = await HoldCalls(count).start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
def state(memory_or_redis: dict[str, Any]) -> dict[str, Any]:  # noqa: F811  (the fixture, by name)
    return memory_or_redis


def outcome(answer: dict[str, Any]) -> str:
    return "ok" if "result" in answer else str(answer["error"]["data"]["code"])


async def test_identical_results_back_at_once_are_judged_one_after_another(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    async with hold_calls(6) as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, loop={"stall_steps": 2},
                          config={"state": state})
        run = f"par-results-{state['backend']}"
        answers = await asyncio.gather(*(post(h, call("read_file", {"path": str(i)}, rpc_id=i), run=run)
                                         for i in range(6)))
        assert Counter(outcome(a) for _, a in answers) == {"ok": 2, "no_progress": 4}
        _, view = await admin(h, "GET", f"/admin/runs/{run}")
        assert (view["status"], view["stop_reason"], view["tool_calls"]) == ("stopped", "no_progress", 6)
