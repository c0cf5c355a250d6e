"""Review of `tools/call` executions in their own tasks (gateway/mcp_flights.py, gateway/mcp_calls.py):
what a client leaving, or the shutdown, still gets wrong. Servers: `RawServer` of test_mcp_probe, and
`HeldServer` below, whose SSE answers the server keeps open (keep-alive comments) after, or instead of,
the response."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.mcp_flights import end_flights, flights_of
from tests.conftest import GatewayFactory, Harness
from tests.gateway.test_mcp_calls import PARKED, client_left, leave, tool_rows, until
from tests.gateway.test_mcp_probe import (
    MODEL_TOOLS,
    RAW_TOOLS,
    RawServer,
    admin,
    call,
    gateway,
    pending,
    post,
    propose,
    raw,
    raw_server,
    sse,
)
from tests.gateway.test_operator_probe import Served, ledger_rows, serve  # noqa: F401  (serve: a fixture)


class HeldServer(RawServer):
    """`tools/call` is answered with an SSE stream the server holds open with keep-alive comments
    until `release`: after the response (`answer=True`), or without ever sending it."""

    def __init__(self, *, answer: bool) -> None:
        super().__init__(use_sse=True)
        self.answer = answer

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return await super().handle(request)
        body = orjson.loads(await request.read())
        if body.get("method") != "tools/call":
            return await super().handle(request)
        self.received.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        with suppress(ConnectionError):
            if self.answer:
                result = self.result("tools/call", body.get("params") or {})
                await resp.write(sse({"jsonrpc": "2.0", "id": body["id"], "result": result}))
            while not self.release.is_set():
                await resp.write(b": keep-alive\n\n")
                with suppress(TimeoutError):
                    await asyncio.wait_for(self.release.wait(), 0.05)
            await resp.write_eof()
        return resp


@asynccontextmanager
async def held_server(*, answer: bool) -> AsyncIterator[HeldServer]:
    server = HeldServer(answer=answer)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


class Gate:
    """Wraps one run-store method of a harness: the first call matching `when` lands (or not, `before`),
    then waits for `go`, as a store round trip whose reply has not come back yet."""

    def __init__(self, h: Harness, method: str, *, before: bool = False, when: Any = None) -> None:
        self.store = h.gateway.store
        self.method = method
        self.original = getattr(self.store, method)
        self.before = before
        self.when = when or (lambda *a: True)
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.used = False
        setattr(self.store, method, self._wrapped)

    async def _wrapped(self, *args: Any, **kwargs: Any) -> Any:
        if self.used or not self.when(*args):
            return await self.original(*args, **kwargs)
        self.used = True
        result = None if self.before else await self.original(*args, **kwargs)
        self.entered.set()
        await self.go.wait()
        return await self.original(*args, **kwargs) if self.before else result

    def restore(self) -> None:
        setattr(self.store, self.method, self.original)
        self.go.set()


async def no_flights(h: Harness) -> bool:
    return len(flights_of(h.gateway)) == 0


async def saw_leave(h: Harness) -> bool:
    """The gateway has seen the client leave: its call is still running with `client_left`, or over."""
    return await no_flights(h) or await client_left(h)


# -- 1. a cut that lands while the call is being counted ---------------------------------------------------


@pytest.mark.parametrize("where", ["counted", "proposal_taken"])
async def test_a_call_cut_while_its_count_is_written_carries_the_count_to_its_retry(
    gateway_factory: GatewayFactory, where: str
) -> None:
    """README: a counted call whose tool did not run carries its count to an identical retry, which does
    not count again. The client leaves while the count (or the taking of the model's proposal) is a store
    round trip in flight: the count landed, the tool never ran, and the retry must not count again."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=MODEL_TOOLS if where == "proposal_taken" else RAW_TOOLS,
                          caps={"tool_calls": 1})
        if where == "proposal_taken":
            await propose(h, ("read_file", '{"path": "a"}'))  # counted once, with the model's answer
            gate = Gate(h, "take")
        else:
            gate = Gate(h, "apply", when=lambda run_id, agent, adds, pushes, now: bool(adds))
        first = asyncio.create_task(post(h, call("read_file", {"path": "a"})))
        await asyncio.wait_for(gate.entered.wait(), 5)
        await leave(first)
        await until(lambda: saw_leave(h), "the gateway to see its client leave")
        gate.restore()  # the store answers now
        await until(lambda: no_flights(h), "the cut call to be recorded")
        assert srv.calls == []  # the tool did not run
        status, answer = await post(h, call("read_file", {"path": "a"}, rpc_id=8))
        assert status == 200 and "result" in answer, answer
        run = await h.run("r1")
        assert (run["status"], run["tool_calls"]) == ("active", 1), run


# -- 2. a write's decided outcome is finished before it is marked `recording` ------------------------------


async def test_a_write_stopped_by_a_guard_is_recorded_as_the_stop_when_its_client_leaves_meanwhile(
    gateway_factory: GatewayFactory,
) -> None:
    """DESIGN 4: a stop is never silent, it is on the span and in the ledger. The write's outcome is decided
    (tool_call_cap) and `_idempotent` is releasing its claim when the client leaves: that must not turn
    the stop into a `client_disconnected` error."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS, caps={"tool_calls": 1})
        status, answer = await post(h, call("write_note", {"text": "a"}))
        assert status == 200 and "result" in answer, answer
        gate = Gate(h, "release_write", before=True)
        second = asyncio.create_task(post(h, call("write_note", {"text": "b"}, rpc_id=8)))
        await asyncio.wait_for(gate.entered.wait(), 5)  # the stop is decided: the claim is being released
        await leave(second)
        await until(lambda: saw_leave(h), "the gateway to see its client leave")
        gate.restore()  # the store answers now
        await until(lambda: no_flights(h), "the call to be recorded")
        rows = await tool_rows(h)
        assert [(r["decision"], r["reason"]) for r in rows] == [("executed", None), ("stopped", "tool_call_cap")], rows
        run = await h.run("r1")
        assert run["stop_reason"] == "tool_call_cap", run
        assert [s["stop_reason"] for s in run["steps"]] == [None, "tool_call_cap"], run["steps"]


async def test_a_rejected_call_is_recorded_as_the_stop_when_its_client_leaves_while_the_stop_is_written(
    gateway_factory: GatewayFactory,
) -> None:
    """The same for any tier: `tool_not_allowed` with `on_violation: reject` stops the run (a store round
    trip) before the refusal is raised; a client leaving during it turns the recorded stop into a
    `client_disconnected` error, though the run is stopped."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools={"allow": ["files/read_file"], "on_violation": "reject"})
        gate = Gate(h, "stop")
        task = asyncio.create_task(post(h, call("admin_reset", {"confirm": True})))
        await asyncio.wait_for(gate.entered.wait(), 5)  # the stop has landed; its reply is on the way
        await leave(task)
        await until(lambda: saw_leave(h), "the gateway to see its client leave")
        gate.restore()  # the store answers now
        await until(lambda: no_flights(h), "the call to be recorded")
        run = await h.run("r1")
        assert run["stop_reason"] == "tool_not_allowed", run
        rows = await tool_rows(h)
        assert [(r["decision"], r["reason"]) for r in rows] == [("rejected", "tool_not_allowed")], rows


async def test_a_denied_write_whose_client_leaves_while_its_claim_is_released_can_be_retried(
    gateway_factory: GatewayFactory,
) -> None:
    """README: a call that did not run (not approved) is released, and a retry runs it. The human's denial
    is decided and the claim is being given back when the client leaves: the release must complete, or
    the identical retry is refused `tool_call_in_progress` for a whole lease (190 s by default)."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=PARKED)
        first = asyncio.create_task(post(h, call("delete_file", {"path": "a"})))
        [item] = await pending(h)
        gate = Gate(h, "release_write", before=True)
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "deny", "by": "alice"})
        await asyncio.wait_for(gate.entered.wait(), 5)
        await leave(first)
        await until(lambda: saw_leave(h), "the gateway to see its client leave")
        gate.restore()  # the store answers now
        await until(lambda: no_flights(h), "the call to be recorded")
        retry = asyncio.create_task(post(h, call("delete_file", {"path": "a"}, rpc_id=8)))
        done, _ = await asyncio.wait({retry}, timeout=1.0)
        if done:
            status, answer = retry.result()
            pytest.fail(f"the identical retry of a call that never ran was refused: {status} {answer}")
        [again] = await pending(h)
        await admin(h, "POST", f"/admin/approvals/{again['id']}", {"decision": "approve", "by": "alice"})
        status, answer = await retry
        assert status == 200 and "result" in answer, answer
        assert srv.calls == [("delete_file", {"path": "a"})]


# -- 3. the shutdown cutting a handler is not the client leaving ------------------------------------------


async def test_a_read_still_running_when_the_shutdown_cuts_it_is_recorded_as_shutting_down(
    serve: Any, tmp_path: Path  # noqa: F811
) -> None:
    """README (SIGTERM, Tools and MCP) and gateway/mcp_flights.py: a call the shutdown cuts is recorded
    `shutting_down`; `client_disconnected` says the agent went away, which it did not. aiohttp's shutdown
    cancels the handler of a request still running after the grace, and `Flights.run` takes every
    cancellation of its caller for the client leaving."""
    async with raw_server(hang=True) as srv:
        served: Served = await serve(mcp_servers={"files": {"url": srv.url}}, agents={"bot": {"tools": RAW_TOOLS}},
                                     shutdown_grace_s=1)
        headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "cut-read", "content-type": "application/json",
                   "accept": "application/json, text/event-stream"}
        async with aiohttp.ClientSession() as session:

            async def ask() -> None:
                async with session.post(f"{served.url}/mcp/files", data=orjson.dumps(call("read_file", {"path": "a"})),
                                        headers=headers) as resp:
                    await resp.read()

            task = asyncio.create_task(ask())
            await until(lambda: asyncio.sleep(0, srv.received), "the call to reach the server")
            served.signal(signal.SIGTERM)
            with suppress(aiohttp.ClientError):
                await asyncio.wait_for(task, 15)
        assert await served.wait(15) == 0
    rows = [r for r in ledger_rows(tmp_path / "state.db", "cut-read") if r["operation"].startswith("tools/call")]
    assert [(r["decision"], r["reason"]) for r in rows] == [("error", "shutting_down")], rows


# -- 4. `recording` also covers draining the server's stream after the answer -----------------------------


async def test_a_call_whose_server_holds_its_stream_open_after_the_answer_is_ended_and_recorded_at_shutdown(
    gateway_factory: GatewayFactory,
) -> None:
    """The agent has its answer; the server keeps the SSE stream open (keep-alive comments). The flight
    is marked `recording` from the judgement on, through the drain of that stream, so neither the client
    leaving nor `end_flights` ends it, and its ledger row waits for the server: at shutdown the store
    and the ledger close first and the row is lost."""
    async with held_server(answer=True) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        status, _, data = await asyncio.wait_for(raw(h, "POST", call("read_file", {"path": "a"})), 5)
        assert status == 200 and b"ran read_file" in data, data  # the agent has its answer
        await end_flights(h.gateway, timeout_s=1.0)  # what `tollgate serve` does before the ledger closes
        assert len(flights_of(h.gateway)) == 0, "a tools/call still runs after end_flights"
        rows = await tool_rows(h)
        assert [r["decision"] for r in rows] == ["executed"], rows


# -- 5. a kept write whose client left is bounded by nothing ----------------------------------------------


async def test_a_kept_write_whose_client_left_is_not_held_forever_by_a_server_that_never_answers(
    gateway_factory: GatewayFactory,
) -> None:
    """A sent write runs on when its client leaves. With nobody left to give up, a server that keeps the
    stream alive (keep-alive comments reset the idle timeout) without ever answering holds the task, the
    upstream connection and the run store claim (renewed forever) for good, and the identical retry in
    this process waits on it forever. Bounded here by one lease (connect + first_byte + idle = 1.5 s)."""
    async with held_server(answer=False) as srv:
        timeouts = {"connect": 0.5, "first_byte": 0.5, "idle": 0.5}
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS,
                          servers={"files": {"url": srv.url, "timeouts": timeouts}})
        first = asyncio.create_task(post(h, call("write_note", {"text": "once"})))
        await until(lambda: asyncio.sleep(0, srv.received), "the call to reach the server")
        await leave(first)
        await until(lambda: client_left(h), "the gateway to see its client leave")
        await asyncio.sleep(4.0)  # more than two leases
        assert len(flights_of(h.gateway)) == 0, "the write whose client left still runs"
        status, answer = await asyncio.wait_for(post(h, call("write_note", {"text": "once"}, rpc_id=8)), 2)
        assert answer["error"]["data"] == {"code": "duplicate_tool_call"}, answer
