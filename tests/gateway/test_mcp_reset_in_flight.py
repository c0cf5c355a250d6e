"""An MCP `tools/call` in flight while its run is reset counts in no run (README: "a step in flight while
its run is reset does not stop the fresh run, and counts in no run"): its result is delivered, but its
progress marks and result fingerprints (`loop.stall_steps`) do not land in the fresh run; a call parked
before the reset and denied after it carries no count to a retry in the fresh run. A result whose
judgement would stop a run another call stopped meanwhile answers the run's own reason.

The server holds the first `tools/call` until the test releases it, so the reset lands while it is in
flight (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web

from tests.conftest import GatewayFactory, Harness
from tests.gateway.test_mcp_probe import TOOLS, RawServer, admin, call, gateway, pending, post, raw_server
from tests.gateway.test_reset_while_judged import ResetFirst


class HoldFirstCall(RawServer):
    """`tools/call`: the `hold`-th one waits for `release`; the others answer at once."""

    def __init__(self, hold: int = 1) -> None:
        super().__init__()
        self.arrived = asyncio.Event()
        self._left = hold

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "POST" and self._left:
            body = orjson.loads(await request.read())  # aiohttp keeps the body: `super().handle` reads it again
            if body.get("method") == "tools/call":
                self._left -= 1
                if not self._left:
                    self.arrived.set()
                    await self.release.wait()
        return await super().handle(request)


@asynccontextmanager
async def hold_first_call(hold: int = 1) -> AsyncIterator[HoldFirstCall]:
    server = await HoldFirstCall(hold).start()
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
        assert len(run["steps"]) == 1  # the fresh run's own call: the old one is a step of the old epoch
        async with h.session.get(f"{h.admin_url}/metrics") as resp:  # a stop that never happened is not counted
            assert 'decision="stop"' not in await resp.text()
        status, again = await post(h, call("write_note", {"text": "b"}, rpc_id=3), run="mr")
        assert (status, again["result"]["content"][0]["text"]) == (200, "note 1")  # the fresh run goes on


async def test_a_parked_call_denied_after_a_reset_carries_no_count_into_the_fresh_run(
    gateway_factory: GatewayFactory,
) -> None:
    """A counted call whose tool did not run carries its count to an identical retry, which does not
    count again. Parked before a reset and denied after it, the call counted in the old run: carried into
    the fresh one, its retry ran uncounted there, past `caps.tool_calls: 1`."""
    async with raw_server() as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, caps={"tool_calls": 1})
        parked = asyncio.ensure_future(post(h, call("delete_file", {"path": "x"}, rpc_id=1), run="cr"))
        [old] = await pending(h)
        assert (await admin(h, "POST", "/admin/runs/cr/reset"))[0] == 200
        assert (await admin(h, "POST", f"/admin/approvals/{old['id']}", {"decision": "deny", "by": "ops"}))[0] == 200
        status, denied = await parked
        assert denied["error"]["data"]["code"] == "approval_denied"
        retry = asyncio.ensure_future(post(h, call("delete_file", {"path": "x"}, rpc_id=2), run="cr"))
        [again] = await pending(h)
        await admin(h, "POST", f"/admin/approvals/{again['id']}", {"decision": "approve", "by": "ops"})
        status, ran = await retry
        assert (status, ran["result"]["content"][0]["text"]) == (200, "ran delete_file")  # counted: 1 of 1
        status, over = await post(h, call("read_file", {"path": "a"}, rpc_id=3), run="cr")
        assert over["error"]["data"]["code"] == "tool_call_cap"
        assert server.calls == [("delete_file", {"path": "x"})]
        _, run = await admin(h, "GET", "/admin/runs/cr")
        assert (run["tool_calls"], run["stop_reason"]) == (1, "tool_call_cap")


async def test_a_result_in_flight_when_another_call_stops_the_run_answers_the_runs_reason(
    gateway_factory: GatewayFactory,
) -> None:
    """`stall_steps: 1` and `caps.tool_calls: 2`. The second call is in flight when a third, over the cap,
    stops the run; the second's result repeats the first's, which would be `no_progress`: the run is
    stopped for `tool_call_cap`, and that is what a stopped run answers (it answered `no_progress`)."""
    async with hold_first_call(hold=2) as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, loop={"stall_steps": 1}, caps={"tool_calls": 2})
        assert "result" in (await post(h, call("read_file", {"path": "a"}, rpc_id=1), run="ms"))[1]
        second = asyncio.ensure_future(post(h, call("read_file", {"path": "b"}, rpc_id=2), run="ms"))
        await server.arrived.wait()
        _, over = await post(h, call("read_file", {"path": "c"}, rpc_id=3), run="ms")
        assert over["error"]["data"]["code"] == "tool_call_cap"
        server.release.set()
        _, withheld = await second
        assert withheld["error"]["data"]["code"] == "tool_call_cap"
        _, run = await admin(h, "GET", "/admin/runs/ms")
        assert run["stop_reason"] == "tool_call_cap"


async def second_call_across_a_reset(h: Harness, run_id: str, operation: str, *, second_path: str) -> Any:
    """`read_file(a)`, then `read_file(second_path)` with the run reset right before that call's
    `operation` (`stop` or `apply`) reaches the store; the second result is delivered. The run's view."""
    assert (await post(h, call("read_file", {"path": "a"}, rpc_id=1), run=run_id))[0] == 200
    store = h.gateway.store = ResetFirst(h.gateway.store, operation)  # type: ignore[assignment]
    status, answer = await post(h, call("read_file", {"path": second_path}, rpc_id=2), run=run_id)
    assert store.resets == 1
    assert (status, answer["result"]["content"][0]["text"]) == (200, "ran read_file"), answer
    return (await admin(h, "GET", f"/admin/runs/{run_id}"))[1]


async def test_a_result_judged_before_a_reset_is_delivered_and_stops_nothing(gateway_factory: GatewayFactory) -> None:
    """`loop.stall_steps: 1`: the same result twice is a call without progress. The run is reset between
    the judgement of the second result and the stop (`ResetFirst`: the store's own epoch check decides,
    not the read before it): the result is delivered and the fresh run is not stopped."""
    async with hold_first_call(hold=0) as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, loop={"stall_steps": 1})
        run = await second_call_across_a_reset(h, "rs", "stop", second_path="a")
        assert (run["status"], run["stop_reason"]) == ("active", None)


async def test_a_call_whose_count_a_reset_refused_is_judged_again_and_counted_in_the_fresh_run(
    gateway_factory: GatewayFactory,
) -> None:
    """A `tools/call` counts toward `caps.tool_calls` when it is admitted. The run is reset between its
    judgement and the count: the call has not run yet, so it is judged again on the fresh run and counted
    there, as a model call is; the cap then holds exactly in the fresh run (2: one more call, then the
    stop)."""
    async with hold_first_call(hold=0) as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, caps={"tool_calls": 2})
        run = await second_call_across_a_reset(h, "rc", "apply", second_path="b")
        assert (run["status"], run["tool_calls"]) == ("active", 1)
        assert (await post(h, call("read_file", {"path": "c"}, rpc_id=3), run="rc"))[1]["result"]
        _, refused = await post(h, call("read_file", {"path": "d"}, rpc_id=4), run="rc")
        assert refused["error"]["data"]["code"] == "tool_call_cap", refused


async def test_a_count_carried_while_a_reset_lands_does_not_reach_the_fresh_run(
    gateway_factory: GatewayFactory,
) -> None:
    """A parked call denied carries its count to an identical retry. The run is reset right before the
    carry lands: the count was the old run's, so the store refuses it atomically (the check used to be a
    read before the write), and the fresh run's identical retry counts: `caps.tool_calls: 1` then holds."""
    async with hold_first_call(hold=0) as server:
        h = await gateway(gateway_factory, server.url, tools=TOOLS, caps={"tool_calls": 1})
        parked = asyncio.ensure_future(post(h, call("delete_file", {"path": "x"}, rpc_id=1), run="cr"))
        [old] = await pending(h)
        store = h.gateway.store = ResetFirst(h.gateway.store, "apply")  # type: ignore[assignment]
        assert (await admin(h, "POST", f"/admin/approvals/{old['id']}", {"decision": "deny", "by": "ops"}))[0] == 200
        await parked
        assert store.resets == 1
        retry = asyncio.ensure_future(post(h, call("delete_file", {"path": "x"}, rpc_id=2), run="cr"))
        [again] = await pending(h)
        assert (await admin(h, "POST", f"/admin/approvals/{again['id']}", {"decision": "approve", "by": "ops"}))[0] == 200
        assert (await retry)[1]["result"]["content"][0]["text"] == "ran delete_file"
        _, over = await post(h, call("read_file", {"path": "a"}, rpc_id=3), run="cr")
        assert over["error"]["data"]["code"] == "tool_call_cap", over
