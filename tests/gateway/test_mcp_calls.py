"""`tools/call` whose client goes away: it is still a step (run view, ledger row), a parked one is denied
and carries its count, a sent write runs on and is recorded for the retry, and a cancel notification
cancels only its own agent's call. Servers: `RawServer` of test_mcp_probe (`hang` holds a call until
released)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.mcp_flights import flights_of
from tests.conftest import GatewayFactory, Harness
from tests.gateway.test_mcp_probe import RAW_TOOLS, admin, call, gateway, pending, post, raw, raw_server

PARKED = {"allow": ["files/read_file", "files/write_note", "files/delete_*"], "approval": ["files/delete_*"],
          "tiers": {"files/write_*": "write", "files/delete_*": "dangerous"}, "approval_timeout_s": 30}


async def until(condition: Callable[[], Awaitable[Any]], what: str) -> Any:
    """Poll a condition the gateway reaches on its own (nothing to await for it)."""
    for _ in range(1000):
        found = await condition()
        if found:
            return found
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def leave(task: asyncio.Task[Any]) -> None:
    """The agent's HTTP client gives up."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def tool_rows(h: Harness, run: str = "r1") -> list[dict[str, Any]]:
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    return [r for r in ledger.rows(run) if r["operation"].startswith("tools/call")]


async def client_left(h: Harness) -> bool:
    return any(f.client_left for f in flights_of(h.gateway).running())


@pytest.mark.parametrize("use_sse", [False, True], ids=["json", "sse"])
async def test_a_write_whose_client_left_while_it_ran_runs_on_and_its_retry_gets_the_recorded_result(
    gateway_factory: GatewayFactory, use_sse: bool
) -> None:
    async with raw_server(hang=True, use_sse=use_sse) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        first = asyncio.create_task(post(h, call("write_note", {"text": "once"})))
        await until(lambda: asyncio.sleep(0, srv.calls or srv.received), "the call to reach the server")
        await leave(first)
        await until(lambda: client_left(h), "the gateway to see its client leave")
        srv.release.set()  # the server answers now: nobody reads it but the gateway
        status, headers, data = await raw(h, "POST", call("write_note", {"text": "once"}, rpc_id=8))
        assert status == 200 and b"note 1" in data and headers.get("x-tollgate-idempotent-replay") == "true", data
        assert srv.calls == [("write_note", {"text": "once"})]
        rows = {r["decision"]: r for r in await tool_rows(h)}
        assert sorted(rows) == ["executed", "replayed"], rows
        assert "client_disconnected" in rows["executed"]["detail"], rows
        assert rows["replayed"]["reason"] is None  # a replayed result: no refusal to name


async def test_a_read_whose_client_left_while_it_ran_is_cut_and_still_a_step(gateway_factory: GatewayFactory) -> None:
    async with raw_server(hang=True) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        task = asyncio.create_task(post(h, call("read_file", {"path": "a"})))
        await until(lambda: asyncio.sleep(0, srv.received), "the call to reach the server")
        await leave(task)
        [row] = await until(lambda: tool_rows(h), "the ledger row")
        assert (row["decision"], row["reason"]) == ("error", "client_disconnected"), row
        [step] = (await h.run("r1"))["steps"]
        assert (step["decision"], step["error"], step["status"]) == ("error", "client_disconnected", 499), step
        assert len(flights_of(h.gateway)) == 0


async def test_a_parked_call_whose_client_left_is_denied_recorded_and_carries_its_count(
    gateway_factory: GatewayFactory,
) -> None:
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=PARKED, caps={"tool_calls": 1})
        task = asyncio.create_task(post(h, call("delete_file", {"path": "a"})))
        [item] = await pending(h)
        await leave(task)
        [row] = await until(lambda: tool_rows(h), "the ledger row")
        assert (row["decision"], row["reason"]) == ("denied", "approval_denied"), row
        run = await h.run("r1")
        assert [(s["decision"], s["refusal"]) for s in run["steps"]] == [("refuse", "approval_denied")], run
        retry = asyncio.create_task(post(h, call("delete_file", {"path": "a"}, rpc_id=8)))
        [again] = await pending(h)  # parked again: the identical retry did not count a second time
        await admin(h, "POST", f"/admin/approvals/{again['id']}", {"decision": "approve", "by": "alice"})
        status, answer = await retry
        assert status == 200 and "result" in answer, answer
        assert srv.calls == [("delete_file", {"path": "a"})]
        run = await h.run("r1")
        assert (run["status"], run["tool_calls"]) == ("active", 1), run
        assert item["id"] != again["id"]


async def test_a_cancel_notification_cancels_only_its_own_agents_call(gateway_factory: GatewayFactory) -> None:
    """Agents sharing a run number their requests independently: the same id is another call."""
    async with raw_server() as srv:
        h = await gateway_factory(mcp_servers={"files": {"url": srv.url}},
                                  agents={"bot": {"tools": PARKED}, "helper": {"tools": PARKED}})
        mine = asyncio.create_task(post(h, call("delete_file", {"path": "mine"}, rpc_id=1)))
        [item] = await pending(h)
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
        status, _, _ = await raw(h, "POST", cancel, headers={"x-tollgate-agent": "helper"})
        assert status == 202
        [still] = await pending(h)
        assert still["id"] == item["id"]
        status, _, _ = await raw(h, "POST", cancel)  # its own agent's cancel does deny it
        assert status == 202
        status, answer = await mine
        assert status == 200 and answer["error"]["data"] == {"code": "approval_denied"}, answer
        assert srv.calls == []


class HeldRead:
    """Holds the next `store.get` of the gateway until `go` (a store round trip not back yet)."""

    def __init__(self, h: Harness) -> None:
        self.store, self.original = h.gateway.store, h.gateway.store.get
        self.armed = False
        self.entered, self.go = asyncio.Event(), asyncio.Event()
        self.store.get = self._get  # type: ignore[method-assign]

    async def _get(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            self.entered.set()
            await self.go.wait()
        return await self.original(*args, **kwargs)


async def test_a_denied_call_whose_client_leaves_while_its_carry_reads_the_run_still_carries_its_count(
    gateway_factory: GatewayFactory,
) -> None:
    """The carry reads the run (was it reset since?) before it writes: a client leaving during that read
    must not cut the carry, or the identical retry counts a second time (here: over `caps.tool_calls: 1`)."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=PARKED, caps={"tool_calls": 1})
        task = asyncio.create_task(post(h, call("delete_file", {"path": "a"})))
        [item] = await pending(h)
        read = HeldRead(h)
        read.armed = True
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "deny", "by": "ops"})
        await read.entered.wait()  # the denied call's carry is reading the run
        await leave(task)
        await until(lambda: client_left(h), "the gateway to see its client leave")
        read.go.set()
        await until(lambda: asyncio.sleep(0, not flights_of(h.gateway).running()), "the call to end")
        retry = asyncio.create_task(post(h, call("delete_file", {"path": "a"}, rpc_id=8)))
        [again] = await pending(h)  # parked: the retry is the carried call, not one over the cap
        await admin(h, "POST", f"/admin/approvals/{again['id']}", {"decision": "approve", "by": "ops"})
        status, answer = await retry
        assert status == 200 and "result" in answer, answer


async def test_a_disallowed_call_on_a_run_stopped_before_answers_the_runs_reason(
    gateway_factory: GatewayFactory,
) -> None:
    """README: a stopped run answers with the reason that stopped it (`on_violation: reject` would stop it
    with `tool_not_allowed`, but the first stop wins)."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=PARKED, caps={"tool_calls": 1})
        assert "result" in (await post(h, call("read_file", {"path": "a"}, rpc_id=1)))[1]
        _, over = await post(h, call("read_file", {"path": "b"}, rpc_id=2))
        assert over["error"]["data"]["code"] == "tool_call_cap"
        _, disallowed = await post(h, call("format_disk", {}, rpc_id=3))
        assert disallowed["error"]["data"]["code"] == "tool_call_cap"
        assert (await h.run("r1"))["stop_reason"] == "tool_call_cap"
        assert srv.calls == [("read_file", {"path": "a"})]


