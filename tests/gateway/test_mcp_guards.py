"""`gateway.mcp_guards`: a stopped run refuses a tool call with its own reason; a guard's claims on a
tool call are reserved atomically (a claim over its limit stops the run, one only held refuses the
call) and settled: counts per step always, usage only when the tool may have run; a result that would
change a run reset since its call was admitted counts in no run. End to end (a custom guard's claim
limit on MCP calls): tests/gateway/test_readme_operate_probe.py; a call in flight across a reset:
tests/gateway/test_mcp_reset_in_flight.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.call import Call
from gateway.config import Agent
from gateway.errors import BudgetHeld, Stopped
from gateway.mcp_guards import (
    changes_run,
    refuse_if_stopped,
    release_claims,
    reserve_claims,
    reset_since,
    settle_claims,
)
from gateway.store.base import Claim, Push, RunState
from gateway.store.memory import MemoryRunStore
from guards.base import Decision, StepContext
from guards.chain import Verdict

CALL = Call(protocol="mcp", operation="execute_tool", model="files")


def ctx(run_id: str = "r1") -> StepContext:
    return StepContext(CALL, "bot", run_id, Agent(), None, 0.0)


def gateway(store: MemoryRunStore) -> Any:
    return SimpleNamespace(store=store)  # the only part of the gateway these functions use


def test_a_stopped_run_refuses_with_its_own_reason() -> None:
    refuse_if_stopped(None)
    refuse_if_stopped(RunState("r1", "bot"))
    with pytest.raises(Stopped) as info:
        refuse_if_stopped(RunState("r1", "bot", status="stopped", stop_reason="tool_call_cap", stop_detail="3 of 3"))
    assert info.value.reason == "tool_call_cap" and "3 of 3" in str(info.value)


async def test_no_claims_reserve_nothing() -> None:
    store = MemoryRunStore()
    assert await reserve_claims(gateway(store), ctx(), ()) is None
    assert await store.get("r1") is None


async def test_a_claim_over_its_limit_stops_the_run() -> None:
    store = MemoryRunStore()
    gw = gateway(store)
    claim = Claim("probe_calls", 1.0, 0.0, 1.0, "probe_cap")
    first = await reserve_claims(gw, ctx(), (claim,))
    assert first is not None
    await settle_claims(gw, first, may_have_run=False)  # a count per step counts whether or not it ran
    with pytest.raises(Stopped) as info:
        await reserve_claims(gw, ctx(), (claim,))
    state = await store.get("r1")
    assert info.value.reason == "probe_cap" and state is not None and state.stopped
    assert state.used["probe_calls"] == 1.0 and not state.open


async def test_a_claim_held_by_a_step_in_flight_refuses_only_this_call() -> None:
    store = MemoryRunStore()
    gw = gateway(store)
    # a claim that may settle lower (per unit) is held; a fixed count per step is not (it never does)
    claim = Claim("usd", 0.5, 1.0, 0.75, "budget_exhausted")
    held = await reserve_claims(gw, ctx(), (claim,))
    with pytest.raises(BudgetHeld):
        await reserve_claims(gw, ctx(), (claim,))
    assert held is not None
    state = await store.get("r1")
    assert state is not None and not state.stopped


@pytest.mark.parametrize(("may_have_run", "usd"), [(True, 0.5), (False, 0.0)])
async def test_usage_is_charged_only_when_the_tool_may_have_run(may_have_run: bool, usd: float) -> None:
    store = MemoryRunStore()
    gw = gateway(store)
    grant = await reserve_claims(gw, ctx(), (Claim("usd", 0.5, 0.0, 10.0, "budget_exhausted"),
                                             Claim("probe_calls", 1.0, 0.0, None, "probe_cap")))
    assert grant is not None
    await settle_claims(gw, grant, may_have_run=may_have_run)
    state = await store.get("r1")
    assert state is not None and not state.open
    assert state.used.get("usd", 0.0) == usd and state.used["probe_calls"] == 1.0


async def test_released_claims_count_nothing() -> None:
    store = MemoryRunStore()
    gw = gateway(store)
    grant = await reserve_claims(gw, ctx(), (Claim("probe_calls", 1.0, 0.0, 1.0, "probe_cap"),))
    assert grant is not None
    await release_claims(gw, grant)
    state = await store.get("r1")
    assert state is not None and not state.open and state.used.get("probe_calls", 0.0) == 0.0
    assert await reserve_claims(gw, ctx(), (Claim("probe_calls", 1.0, 0.0, 1.0, "probe_cap"),)) is not None


@pytest.mark.parametrize(("stop", "effects", "changes"), [
    (None, (), False),
    (None, (Push("progress", ("1",), 3),), True),
    (Decision.stop("loop", "no_progress", "3 steps"), (), True),
    (Decision.reject("guard", "bad_result", "refused"), (), False),  # withholds the result, changes no run
])
def test_what_changes_a_run(stop: Decision | None, effects: tuple[Push, ...], changes: bool) -> None:
    assert changes_run(Verdict(stop, (), effects, ())) is changes


@pytest.mark.parametrize(("admitted", "now", "reset"), [
    (RunState("r1", "bot", epoch=2), RunState("r1", "bot", epoch=2), False),
    (RunState("r1", "bot", epoch=2), RunState("r1", "bot", epoch=3), True),
    (None, RunState("r1", "bot", epoch=1), False),  # admitted before its run existed: created at epoch 1
    (None, RunState("r1", "bot", epoch=2), True),
    (RunState("r1", "bot"), None, False),  # the run is gone (expired): nothing to change
])
def test_reset_since_admission(admitted: RunState | None, now: RunState | None, reset: bool) -> None:
    assert reset_since(admitted, now) is reset
