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
