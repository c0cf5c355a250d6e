"""Idempotent write tools across sidecars: two gateways on one real Redis in front of one MCP server.

The server's write tool counts its executions and holds each one until the test opens its gate, so
"the same call through both sidecars at the same instant" is a fact the test controls, not a race it
hopes to win. The clients are the official `mcp` SDK's; replays are also read raw, for their header.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import uvicorn
from mcp import MCPError
from mcp.server.mcpserver import MCPServer

from gateway.call import digest
from gateway.config import Timeouts
from gateway.errors import StateUnavailable
from gateway.idempotency import lease_for
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.gateway.test_mcp import POLICY_REFUSED, TOOLS, call, mcp_client, text
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

REPLAY = "x-tollgate-idempotent-replay"


class Gate:
    """Counts the write tool's executions; each waits (in the server's thread) until `opened`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.opened = threading.Event()
        self.entered = asyncio.Event()  # of the test's loop: an execution began
        self.executions = 0

    async def hold(self) -> int:
        self.executions += 1
        number = self.executions
        self.loop.call_soon_threadsafe(self.entered.set)
        await asyncio.to_thread(self.opened.wait, 30)  # bounded: a test that never opens it fails, not hangs
        return number


def start_gated(gate: Gate) -> mcp_server.RunningServer:
    server = MCPServer("files")

    @server.tool()
    async def write_note(text: str) -> str:
        """Append a note; answers with the note's number."""
        return f"note {await gate.hold()} saved: {text}"

    @server.tool()
    def read_file(path: str) -> str:
        """Read a file."""
        return f"contents of {path}"

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = server.streamable_http_app()
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:  # a server in another thread: nothing here to await
        if time.monotonic() > deadline:
            raise RuntimeError("gated MCP server did not start")
        time.sleep(0.01)
    return mcp_server.RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", mcp_server.Seen(), [],
                                    uv, thread, sock)


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Gate, str]]:
    gate = Gate(asyncio.get_running_loop())
    server = start_gated(gate)
    try:
        yield gate, server.url
    finally:
        gate.opened.set()
        server.stop()


async def sidecars(factory: GatewayFactory, url: str, redis_url: str, count: int = 2) -> list[Harness]:
    return [await factory(mcp_servers={"files": {"url": url}}, agents={"bot": {"tools": TOOLS}},
                          state={"backend": "redis", "url": redis_url}) for _ in range(count)]


def unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"


async def post(h: Harness, run: str, message: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run, "content-type": "application/json",
            "accept": "application/json, text/event-stream"}
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(message), headers=hdrs) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, orjson.loads(await resp.read())


def result_text(answer: dict[str, Any]) -> str:
    return str(answer["result"]["content"][0]["text"])


async def test_a_write_sent_through_two_sidecars_at_once_runs_once_and_a_repeat_through_either_replays_it(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str], redis_server: RedisServer  # noqa: F811
) -> None:
    gate, url = gated
    a, b = await sidecars(gateway_factory, url, redis_server.url)
    run = unique("same-instant")
    async with mcp_client(a, run=run) as one, mcp_client(b, run=run) as two:
        tasks = [asyncio.create_task(client.call_tool("write_note", {"text": "hi"})) for client in (one, two)]
        try:  # while one runs (held at the gate), the other must be answered without running it
            done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert done, "both sidecars sent the write to the server"
        finally:
            gate.opened.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        first = 0 if tasks[0] in done else 1
        refusing, running = (a, b)[first], (a, b)[1 - first]
        refusal = results[first]
        assert isinstance(refusal, MCPError), results
        error = refusal.error.model_dump()
        assert error["code"] == POLICY_REFUSED and error["data"] == {"code": "tool_call_in_progress"}, error
        assert "running" in error["message"]
        assert text(results[1 - first]) == "note 1 saved: hi"
        assert gate.executions == 1
        # a repeat through the sidecar that refused it (its result is in Redis only) and through the one
        # that ran it: the recorded result, marked as a replay
        for h in (refusing, running):
            status, headers, answer = await post(h, run, call("write_note", {"text": "hi"}, rpc_id=40))
            assert status == 200 and headers.get(REPLAY) == "true", (status, headers, answer)
            assert answer["id"] == 40 and result_text(answer) == "note 1 saved: hi"
        assert text(await (one, two)[first].call_tool("write_note", {"text": "hi"})) == "note 1 saved: hi"
    assert gate.executions == 1
    # a reset run starts with nothing recorded: the call runs again, through either sidecar
    async with refusing.session.post(f"{refusing.admin_url}/admin/runs/{run}/reset") as resp:
        assert resp.status == 200
    async with mcp_client(refusing, run=run) as client:
        assert text(await client.call_tool("write_note", {"text": "hi"})) == "note 2 saved: hi"
    assert gate.executions == 2


async def test_a_claim_left_by_a_crashed_sidecar_holds_for_its_lease_then_the_call_runs(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """A sidecar died while running the call: its claim answers `tool_call_in_progress` until the lease
    (the MCP server's connect + first byte + idle timeouts) runs out; then the call may run."""
    gate, url = gated
    gate.opened.set()
    [a] = await sidecars(gateway_factory, url, redis_server.url, count=1)
    run = unique("crashed")
    key = f"files/write_note:{digest(b'key', b'k-1')}"  # the key of `_meta["tollgate/idempotency_key"]`
    lease = lease_for(Timeouts())
    message = call("write_note", {"text": "x"}, _meta={"tollgate/idempotency_key": "k-1"})
    claimed = await a.gateway.store.claim_write(run, "bot", 1, key, "dead-sidecar", lease_s=lease, keep=10,
                                                now=time.time() - lease + 60)  # a minute of it left
    assert claimed.state == "claimed"
    status, _, answer = await post(a, run, message)
    assert status == 200 and answer["error"]["data"] == {"code": "tool_call_in_progress"}, answer
    assert gate.executions == 0
    # the same claim, its lease run out a second ago
    await a.gateway.store.claim_write(run, "bot", 1, key, "dead-sidecar", lease_s=lease, keep=10,
                                      now=time.time() - lease - 1)
    async with mcp_client(a, run=run) as client:
        key_meta: Any = {"tollgate/idempotency_key": "k-1"}
        result = await client.call_tool("write_note", {"text": "x"}, meta=key_meta)
    assert text(result) == "note 1 saved: x"
    assert gate.executions == 1


async def test_a_store_that_cannot_take_the_claim_follows_the_agents_state_failure_policy(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str]
) -> None:
    """README: when the run store is unreachable, steps fail closed with `state_unavailable`; an agent
    with `state_failure: fail_open` goes on unguarded (the write then runs, deduplicated in-process)."""
    gate, url = gated
    gate.opened.set()
    h = await gateway_factory(mcp_servers={"files": {"url": url}},
                              agents={"bot": {"tools": TOOLS}, "open": {"tools": TOOLS, "state_failure": "fail_open"}})

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StateUnavailable("state store error: connection refused")

    h.gateway.store.claim_write = down  # type: ignore[method-assign]  # the run was read; the claim fails
    async with mcp_client(h, run="closed") as client:
        with pytest.raises(MCPError) as info:
            await client.call_tool("write_note", {"text": "c"})
    assert info.value.error.model_dump()["data"] == {"code": "state_unavailable"}
    assert gate.executions == 0
    async with mcp_client(h, run="open", headers={"x-tollgate-agent": "open"}) as client:
        assert text(await client.call_tool("write_note", {"text": "o"})) == "note 1 saved: o"
        assert text(await client.call_tool("write_note", {"text": "o"})) == "note 1 saved: o"
    assert gate.executions == 1
