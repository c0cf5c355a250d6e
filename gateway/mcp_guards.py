"""Checks of an MCP `tools/call` step before it runs: a stopped run refuses it, its arguments must match
the tool's listed `inputSchema`, and the guards' claims are reserved. After it ran: a result that comes
back after its run was reset counts in no run (README), as a model call's answer (`pipeline.guard_after`).

What a guard claims on a tool call is reserved atomically before the call, as for a model call
(`pipeline.guard_before`), and settled when the call ends.
The built-in guards claim nothing on a tool call (its counts are the caps' effects); a custom guard's
claim, such as one `probe_calls` per step with a limit, holds for tool calls as for model calls, also
under concurrency. A claimed counter other than the usage counters (`usd`, tokens) counts per step,
whether or not the tool ran; usage counters are charged only when the server may have run the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from gateway.errors import HELD, BudgetHeld, InvalidGrammar, StateUnavailable, Stopped
from gateway.jsonrpc import BadArguments
from gateway.mcp_transport import McpRequest, state_of
from gateway.outputs import CHECK_ON_LOOP_CHARS
from gateway.runtime import Gateway
from gateway.store.base import Claim, Denial, Reservation, ReserveRequest, RunState
from grammars.tool_args import validate_tool_arguments
from guards.base import StepContext
from guards.budget import USAGE_COUNTERS
from guards.chain import Verdict


def refuse_if_stopped(run: RunState | None) -> None:
    """Raise Stopped with the run's own reason when it is stopped (sticky until a reset)."""
    if run is not None and run.stopped:
        reason = run.stop_reason or "stopped"
        raise Stopped(reason, f"the run is stopped ({reason}): {run.stop_detail or ''}".rstrip(": "))


async def check_arguments(mcp: McpRequest, tool: str, arguments: dict[str, Any], size: int) -> None:
    """Raise BadArguments when `arguments` break the `inputSchema` the server listed for `tool`. Those of
    a message over `CHECK_ON_LOOP_CHARS` (`size` bytes) are checked in a worker thread, as answers are."""
    schema = state_of(mcp.gw).schemas.get(mcp.server_name, {}).get(tool)
    try:
        violation = (validate_tool_arguments(schema, arguments) if size <= CHECK_ON_LOOP_CHARS
                     else await asyncio.to_thread(validate_tool_arguments, schema, arguments))
    except InvalidGrammar:
        return  # the server declared a schema that does not compile: the server validates for itself
    if violation is not None:
        raise BadArguments(f"arguments of {tool!r} do not match its inputSchema: {violation.message}",
                           summary=f"arguments of {tool!r} do not match its inputSchema: {violation.redacted}")


async def reserve_claims(gw: Gateway, ctx: StepContext, claims: Sequence[Claim]) -> Reservation | None:
    """Reserve `claims` for the step (None when there are none). Raises Stopped when one does not fit
    (the store has stopped the run), BudgetHeld when only steps in flight stand in the way (this call
    alone is refused), StateUnavailable when the store is down."""
    if not claims:
        return None
    grant = await gw.store.reserve(ctx.run_id, ctx.agent, ReserveRequest(tuple(claims)), time.time())
    if isinstance(grant, Denial):
        if grant.held:
            raise HELD.get(grant.reason, BudgetHeld)(grant.detail)
        raise Stopped(grant.reason, grant.detail)
    return grant


async def settle_claims(gw: Gateway, reservation: Reservation, *, may_have_run: bool) -> None:
    """Settle a step's claims: every claimed amount when the server may have run the call, else only
    the counts per step. Never raises: a store that is down keeps the settlement for replay (Redis) or
    charges the reservation in full when the gateway restarts (SQLite), as for a model call's."""
    amounts = reservation.amounts if may_have_run else {
        counter: amount for counter, amount in reservation.amounts.items() if counter not in USAGE_COUNTERS}
    with contextlib.suppress(StateUnavailable):
        await gw.store.settle(reservation, dict(amounts), time.time())


async def release_claims(gw: Gateway, reservation: Reservation) -> None:
    """Release a step's claims unspent: the call was refused before it could run (nothing counts).
    Never raises, like `settle_claims`."""
    with contextlib.suppress(StateUnavailable):
        await gw.store.settle(reservation, {}, time.time())


def changes_run(verdict: Verdict) -> bool:
    """The verdict on a result would change its run: effects to write, or a stop (a guard's reject only
    withholds the result)."""
    return bool(verdict.effects) or (verdict.stop is not None and verdict.stop.action != "reject")


def reset_since(admitted: RunState | None, now: RunState | None) -> bool:
    """The run was reset after the call was admitted (on `admitted`; None: a run not created yet)."""
    return now is not None and now.epoch != (admitted.epoch if admitted is not None else 1)
