"""Probes of the MCP proxy with the official `mcp` SDK on both sides, as real agents use it.

A real `MCPServer` (Streamable HTTP, its own thread, an in-memory event store so streams can be
resumed) sits behind `/mcp/files`. Some of its tools close their SSE stream mid-call, as the SDK lets a
server do (`ctx.close_sse_stream()`), so the SDK client resumes with `Last-Event-ID`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventCallback, EventMessage, EventStore

from tests.conftest import GatewayFactory, Harness
from tests.fakes.mcp_server import RunningServer, serve

# progress is deprecated as of 2026-07-28, still the handshake era's own
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")


class MemoryEvents(EventStore):
    """The simplest event store: every event of every stream, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []  # (event id, stream id, message)

    async def store_event(self, stream_id: str, message: Any) -> str:
        event_id = str(len(self.events) + 1)
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id: str, send_callback: EventCallback) -> str | None:
        found = [e for e in self.events if e[0] == last_event_id]
        if not found:
            return None
        stream = found[0][1]
        for event_id, stream_id, message in self.events[int(last_event_id):]:
            if stream_id == stream and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream


PROGRESSED = threading.Event()  # a polled tool's progress reached its client (set by `progressed`)


async def progressed(progress: float, total: float | None, message: str | None) -> None:
    """The client's progress callback for the polled tools."""
    PROGRESSED.set()


async def on_the_wire() -> None:
    """Wait until the client got the tool's progress, so the stream's priming event (its event id) is on
    the wire before the tool closes the stream: the SDK server's writer sends it in a task of its own,
    and a stream closed before it has no id to resume from (on a loaded machine, seen in full runs)."""
    await anyio.to_thread.run_sync(PROGRESSED.wait, 2.0)
    PROGRESSED.clear()


async def polled(value: str, ctx: Context) -> str:
    """A long tool: it reports progress, closes its stream mid-call (the client resumes it with
    Last-Event-ID) and answers 0.3 s later."""
    await ctx.report_progress(1, 2, "started")
    await on_the_wire()
    await ctx.close_sse_stream()
    await asyncio.sleep(0.3)  # the tool's own work, not a wait for something the test could await
    return f"polled {value}"


def build() -> MCPServer:
    server = MCPServer("files")

    @server.tool()
    def read_file(path: str) -> str:
        """Read a file."""
        return f"contents of {path}"

    @server.tool()
    async def write_polled(text: str, ctx: Context) -> str:
        """A long write that closes its stream (the client resumes it with Last-Event-ID)."""
        return await polled(text, ctx)

    @server.tool()
    async def read_polled(path: str, ctx: Context) -> str:
        return await polled(path, ctx)

    @server.tool()
    def echo_int(n: int) -> str:
        return str(n)

    return server


def start(json_response: bool = False) -> RunningServer:
    app = build().streamable_http_app(json_response=json_response, event_store=MemoryEvents(), retry_interval=50)
    return serve(app, [])


@pytest.fixture
def files() -> Iterator[RunningServer]:
    server = start()
    yield server
    server.stop()


TOOLS = {"allow": ["files/*"], "on_violation": "drop"}


async def gateway(factory: GatewayFactory, files: RunningServer, **policy: Any) -> Harness:
    policy.setdefault("tools", TOOLS)
    return await factory(mcp_servers={"files": {"url": files.url}}, agents={"bot": policy})


@asynccontextmanager
async def client(h: Harness, *, mode: str = "legacy", run: str = "r1", **kw: Any) -> AsyncIterator[Client]:
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run}
    async with (
        httpx2.AsyncClient(headers=hdrs, timeout=httpx2.Timeout(5, read=5)) as http,
        Client(streamable_http_client(f"{h.url}/mcp/files", http_client=http), mode=mode, **kw) as c,
    ):
        yield c


def text(result: Any) -> str:
    assert not result.is_error, result
    return str(result.content[0].text)


# -- a tool call resumed with Last-Event-ID ---------------------------------------------------------------
#
# The server closes the call's SSE stream before its result (`ctx.close_sse_stream()`, SEP-1699 polling);
# the SDK client resumes with a GET carrying `Last-Event-ID` and gets the result there. The MCP spec
# (2025-11-25, transports: "Resumability and Redelivery") lets a server do this for any request.


async def test_a_resumed_read_still_feeds_the_no_progress_guard(
    gateway_factory: GatewayFactory, files: RunningServer
) -> None:
    """README: "Results feed the no-progress guard before the agent sees them." The same call with the
    same result a third time (stall_steps 2) must be withheld and stop the run, as it is when the result
    comes on the POST stream (tests/gateway/test_mcp.py::test_results_feed_the_no_progress_guard)."""
    h = await gateway(gateway_factory, files, loop={"window": 10, "max_distinct": 1, "stall_steps": 2})
    async with client(h) as c:
        async with asyncio.timeout(10):
            assert text(await c.call_tool("read_polled", {"path": "a"}, progress_callback=progressed)) == "polled a"  # a new result
            assert text(await c.call_tool("read_polled", {"path": "a"}, progress_callback=progressed)) == "polled a"  # stalled once
            with pytest.raises(MCPError) as info:  # stalled twice: the result is withheld
                await c.call_tool("read_polled", {"path": "a"}, progress_callback=progressed)
    assert info.value.error.data == {"code": "no_progress"}
    assert (await h.run("r1"))["stop_reason"] == "no_progress"


async def test_a_resumed_write_is_replayed_to_its_identical_retry(
    gateway_factory: GatewayFactory, files: RunningServer
) -> None:
    """README: a write's identical retry "gets the recorded result"; "the result the agent gets is
    recorded there before the agent sees it: a repeat through any sidecar of the run gets it replayed"."""
    h = await gateway(gateway_factory, files, tools={**TOOLS, "tiers": {"files/write_*": "write"}})
    async with client(h) as c:
        async with asyncio.timeout(10):
            assert text(await c.call_tool("write_polled", {"text": "a"}, progress_callback=progressed)) == "polled a"  # the agent has it
            retry = await c.call_tool("write_polled", {"text": "a"}, progress_callback=progressed)  # refused duplicate_tool_call instead
            assert text(retry) == "polled a"
    assert files.seen.calls() == [("write_polled", {"text": "a"})]


async def test_a_resumed_call_is_recorded_as_executed(gateway_factory: GatewayFactory, files: RunningServer) -> None:
    """The call ran and its result reached the agent: its ledger row must say `executed` (the row of a
    `tools/call` answered by the server, tests/gateway/test_mcp.py::test_mcp_calls_are_ledger_rows), not
    `replayed` (a recorded result handed out again without running the tool)."""
    h = await gateway(gateway_factory, files)
    async with client(h) as c:
        async with asyncio.timeout(10):
            assert text(await c.call_tool("read_polled", {"path": "a"}, progress_callback=progressed)) == "polled a"
    assert await tool_rows_soon(h) == [("tools/call read_polled", "executed")]


async def tool_rows_soon(h: Harness, timeout: float = 5.0) -> list[tuple[str, str]]:
    """The run's `tools/call` ledger rows once there is one: a call's row is written once its handler ends,
    just after the agent has the answer."""
    ledger = h.gateway.services["ledger"]
    deadline = time.monotonic() + timeout
    while True:
        await ledger.flush()
        rows = [(r["operation"], r["decision"]) for r in ledger.rows("r1") if r["operation"].startswith("tools/call")]
        if rows or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.02)


# -- what the server receives ------------------------------------------------------------------------------


async def test_an_integer_argument_beyond_64_bits_reaches_the_tool_unchanged(
    gateway_factory: GatewayFactory, files: RunningServer
) -> None:
    """JSON numbers have no size limit and the SDKs (Python's json) read 2**70 + 1 as that integer. The
    README: "The server receives tollgate's own serialisation of the message it judged" - a
    serialisation, not a different value: the tool must get the integer the agent sent, not a float."""
    h = await gateway(gateway_factory, files)
    async with client(h) as c:
        async with asyncio.timeout(10):
            result = await c.call_tool("echo_int", {"n": 2**70 + 1})
    # without tollgate in between, the tool gets it exactly
    async with Client(files.url, mode="legacy") as direct:
        async with asyncio.timeout(10):
            assert text(await direct.call_tool("echo_int", {"n": 2**70 + 1})) == str(2**70 + 1)
    # through tollgate it got 1.1805916207174113e+21 and refused it ("Unable to parse input string as an
    # integer ... input_type=float")
    assert text(result) == str(2**70 + 1)
