"""Review of 72990ac (write tools claimed in the run store): each test proves one defect and fails today.

Harnesses: the gated MCP server of `test_mcp_replicas` (it counts the write tool's executions and holds
each until the test opens its gate), served here statelessly with JSON answers so that a raw JSON-RPC
`tools/call` reaches the tool without an MCP session; sidecars sharing a real redis-server
(`tests.redis_fixture`); the store backends of `test_store_writes`.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from mcp.server.mcpserver import MCPServer

from gateway.call import digest
from gateway.errors import StateUnavailable
from gateway.idempotency import MAX_RECORDED_BYTES, WRITES_KEEP, ResultCache
from gateway.store.memory import MemoryRunStore
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.gateway.test_mcp import TOOLS, call
from tests.gateway.test_mcp_replicas import Gate, post, unique
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

KEY_META = {"tollgate/idempotency_key": "k-1"}
KEY = f"files/write_note:{digest(b'key', b'k-1')}"  # the claim key of that idempotency key


def start_gated_json(gate: Gate) -> mcp_server.RunningServer:
    """`test_mcp_replicas.start_gated`, stateless with JSON answers: the answer's headers come only when
    the tool has finished, and a plain POST of a `tools/call` runs the tool."""
    server = MCPServer("files")

    @server.tool()
    async def write_note(text: str) -> str:
        """Append a note; answers with the note's number."""
        return f"note {await gate.hold()} saved: {text}"

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = server.streamable_http_app(stateless_http=True, json_response=True)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("gated MCP server did not start")
        time.sleep(0.01)
    return mcp_server.RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}/mcp", mcp_server.Seen(), [],
                                    uv, thread, sock)


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Gate, str]]:
    gate = Gate(asyncio.get_running_loop())
    server = start_gated_json(gate)
    try:
        yield gate, server.url
    finally:
        gate.opened.set()
        server.stop()


async def gateways(factory: GatewayFactory, url: str, state: dict[str, Any], count: int,
                   timeouts: dict[str, float] | None = None) -> list[Harness]:
    server: dict[str, Any] = {"url": url}
    if timeouts is not None:
        server["timeouts"] = timeouts
    return [await factory(mcp_servers={"files": server}, agents={"bot": {"tools": TOOLS}}, state=state)
            for _ in range(count)]


def write(rpc_id: int = 7) -> dict[str, Any]:
    return call("write_note", {"text": "x"}, rpc_id=rpc_id, _meta=KEY_META)


def error_code(answer: dict[str, Any]) -> str | None:
    error = answer.get("error")
    return (error.get("data") or {}).get("code") if isinstance(error, dict) else None


# -- 1. a result the store failed to record: the claim lapses and another sidecar runs the call again ----


async def test_a_write_whose_result_the_store_failed_to_record_is_not_run_again_after_the_lease(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """README: "When the store cannot take ... the result ...: fail closed (`state_unavailable`; a result not
    recorded is withheld)"; DuplicateToolCall: a call whose result was not recorded because "the store failed
    while it was recorded ... is refused rather than run twice". But `WriteLease.finish` stops the renewals
    before it writes, `close` retries the write once, and then nothing renews the claim: one lease later
    (3 s here: connect + first_byte + idle) any sidecar takes the claim over and runs the call again, though
    the sidecar that ran it is alive and knows it ran."""
    gate, url = gated
    gate.opened.set()
    a, b = await gateways(gateway_factory, url, {"backend": "redis", "url": redis_server.url}, 2,
                          timeouts={"connect": 1, "first_byte": 1, "idle": 1})
    run = unique("finish-failed")

    async def blip(*args: Any, **kwargs: Any) -> None:  # sidecar a's Redis connection fails for a moment
        raise StateUnavailable("state store error: connection reset")

    a.gateway.store.finish_write = blip  # type: ignore[method-assign]
    status, _, answer = await post(a, run, write())
    assert gate.executions == 1  # the tool ran
    assert error_code(answer) == "state_unavailable", (status, answer)  # its result withheld (fail closed)
    del a.gateway.store.finish_write  # Redis answers again
    _, _, answer = await post(b, run, write(8))
    assert error_code(answer) == "tool_call_in_progress", answer  # while the lease lasts: refused, good
    await asyncio.sleep(3.5)  # one lease
    _, _, answer = await post(b, run, write(9))
    assert gate.executions == 1, f"the write ran twice; the repeat through b got {answer}"


# -- 2. a claim is released although the request may have reached the server -------------------------


async def test_a_write_that_timed_out_after_it_was_sent_is_not_run_again(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str]
) -> None:
    """The server got the call and runs it, but answers after the MCP server's `first_byte` timeout. The
    claim is released (`close(ran=False)`: `ran` is set only by a judged answer), so the agent's retry runs
    the tool a second time. `_execute` itself knows better: it does not carry the count of an
    UpstreamError with `request_sent` because the tool may have run."""
    gate, url = gated
    [h] = await gateways(gateway_factory, url, {"backend": "memory"}, 1,
                         timeouts={"connect": 1, "first_byte": 1, "idle": 1})
    run = unique("timed-out")
    _, _, answer = await post(h, run, write())
    assert error_code(answer) == "upstream_timeout", answer
    assert gate.executions == 1  # the server has the call: its tool is running
    gate.opened.set()  # ... and finishes: the side effect happened
    await asyncio.sleep(0.2)
    _, _, answer = await post(h, run, write(8))  # the agent retries the call it got no result for
    assert gate.executions == 1, f"the write ran twice; the retry got {answer}"


async def test_a_write_whose_client_left_while_it_ran_is_not_run_again_through_another_sidecar(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """The client goes away (its own timeout) while the tool runs at the server: aiohttp cancels the
    handler (`handler_cancellation`, as `tollgate serve` runs it), the `finally` of `_idempotent` releases
    the claim (`ran` is False), and the retry through another sidecar runs the tool a second time while
    the first execution is still running: "concurrent duplicates reach the server once" does not hold.
    (Overlaps the concurrent work on client disconnects: `Flight.keep` for a sent write would fix it.)"""
    gate, url = gated
    a, b = await gateways(gateway_factory, url, {"backend": "redis", "url": redis_server.url}, 2)
    run = unique("client-left")
    first = asyncio.create_task(post(a, run, write()))
    await asyncio.wait_for(gate.entered.wait(), 10)
    first.cancel()  # the client disconnects
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0.5)  # sidecar a sees the connection close and cancels the handler
    second = asyncio.create_task(post(b, run, write(8)))
    try:
        await asyncio.wait({second}, timeout=3)
        executions = gate.executions
    finally:
        gate.opened.set()
        await asyncio.gather(second, return_exceptions=True)
    assert executions == 1, "the retry through b ran the write while the first execution still ran"


# -- 3. writes recorded by the former version are forgotten -------------------------------------------


async def test_a_write_recorded_by_the_former_version_is_still_refused_after_the_upgrade(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str]
) -> None:
    """Before 72990ac a write that ran was recorded in the run's `tool_writes` list (the run's state: in
    the SQLite file across a restart, in Redis for every sidecar) and a repeat whose result the process did
    not hold was refused `duplicate_tool_call`. The new code no longer reads that list, so after an upgrade
    (or through a new-version sidecar during a rolling one) the repeat of a write that already ran runs
    again."""
    gate, url = gated
    gate.opened.set()
    [h] = await gateways(gateway_factory, url, {"backend": "memory"}, 1)
    run = unique("upgraded")
    # the run as the former version left it after running the call
    await h.gateway.store.push(run, "bot", "tool_writes", (KEY,), WRITES_KEEP)
    _, _, answer = await post(h, run, write())
    assert gate.executions == 0, f"a write that already ran ran again; the repeat got {answer}"
    assert error_code(answer) == "duplicate_tool_call", answer


# -- 4. the memory store keeps recorded results of every run, for ever --------------------------------


async def test_the_memory_store_bounds_the_result_bodies_it_keeps_across_runs() -> None:
    """Runs never leave the memory store, and each keeps up to WRITES_KEEP results of up to 64 KB: 64 MB per
    run, without bound across runs (before 72990ac result bodies lived only in the process's ResultCache,
    bounded at 64 MiB). Two runs of 600 writes each already hold more than that."""
    store = MemoryRunStore()
    body = b'{"r": "' + b"x" * (MAX_RECORDED_BYTES - 100) + b'"}'
    for run in ("run-1", "run-2"):
        for n in range(600):
            key = f"files/write_note:{n}"
            found = await store.claim_write(run, "bot", 1, key, "t", lease_s=60, keep=WRITES_KEEP, now=1.0)
            assert found.state == "claimed"
            await store.finish_write(run, "bot", 1, key, "t", body, keep=WRITES_KEEP, now=1.0)
    held = sum(len(entry.result or b"") for book in store._writes.values() for entry in book.entries.values())
    limit = ResultCache()._max_bytes
    assert held <= limit, f"the memory store holds {held / 2**20:.0f} MiB of results, over the bound"



# -- 5. a claim whose caller was cancelled during the claim round trip is not released ------------------


async def test_a_write_whose_client_left_during_the_claim_round_trip_runs_on_the_retry(
    gateway_factory: GatewayFactory, gated: tuple[Gate, str], redis_server: RedisServer  # noqa: F811
) -> None:
    """The client leaves while the claim's script runs in Redis (here: its reply is slow): the claim is
    taken, but `WriteLease.claim` never marks it held, so `close` releases nothing, though the call never
    ran and the lease's token is known. The agent's immediate retry is refused `tool_call_in_progress`,
    and so is every retry for a whole lease (190 s by default)."""
    gate, url = gated
    gate.opened.set()
    [h] = await gateways(gateway_factory, url, {"backend": "redis", "url": redis_server.url}, 1)
    store = h.gateway.store
    real = store.claim_write
    claimed = asyncio.Event()

    async def slow_reply(*args: Any, **kwargs: Any) -> Any:
        found = await real(*args, **kwargs)  # Redis has taken the claim ...
        claimed.set()
        await asyncio.sleep(10)  # ... and its reply is on its way
        return found

    store.claim_write = slow_reply  # type: ignore[method-assign]
    run = unique("claim-cancelled")
    first = asyncio.create_task(post(h, run, write()))
    await asyncio.wait_for(claimed.wait(), 10)
    first.cancel()  # the client disconnects
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0.5)  # the handler is cancelled
    del store.claim_write
    _, _, answer = await post(h, run, write(8))
    assert gate.executions == 1 and error_code(answer) is None, f"the retry was refused: {answer}"
