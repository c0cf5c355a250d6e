"""MCP `tools/call`: the decisions tollgate makes before and after a tool runs.

In order, none of which contacts the server until the last:
1. allow-list on `server/tool` (a refusal with `on_violation: reject` stops the run); a stopped run
   refuses every call with its stop reason; arguments must be an object that satisfies the tool's
   `inputSchema` (when a `tools/list` answer through tollgate showed it).
2. `write` and `dangerous` tools are idempotent within a run: the same tool with the same canonical
   arguments, or the same `params._meta["tollgate/idempotency_key"]`, gets the recorded result
   (`gateway.mcp_idempotent`, `gateway.idempotency`); with an explicit key the key alone identifies the call (arguments are not
   compared), so a new key runs the tool again. Concurrent duplicates in one process wait for the first
   and share its approval; the first claims the call in the run store, so a duplicate sent through
   another sidecar meanwhile is refused `tool_call_in_progress`, and a repeat through any sidecar once
   it ran gets the result recorded in the run store (`duplicate_tool_call` when it was too large to keep).
3. the guard chain: `before`, then, unless the call executes a proposal the model already made
   (`pending_calls` of the run), the proposal judgement (`after` with `counts_tool_call` and no
   result): the call counts toward `caps.tool_calls` and feeds loop detection *before* it runs,
   so a call over the cap or repeating a loop never reaches the server.
4. approval, when `tools.approval` matches: the call waits for a human or the timeout.
5. forward; the result goes through `after` again (no-progress guard) before the agent sees it.
MCP calls cost no tokens: nothing is reserved.

A call is recorded (run view, span, ledger row) however it ends, also when its client goes away or the
shutdown cuts it (it runs in a task of its own, `gateway.mcp_flights`): see the README's MCP section.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

from aiohttp import web

from gateway.approvals import queue_of
from gateway.call import Answer, Call, ToolCall, ToolResult, canonical_json, digest
from gateway.errors import (
    ApprovalDenied,
    ApprovalTimeout,
    GatewayError,
    InvalidRequest,
    RunReset,
    StateUnavailable,
    Stopped,
    ToolNotAllowed,
    UpstreamError,
    UpstreamUnavailable,
)
from gateway.http1_wire import Sending
from gateway.idempotency import lease_for
from gateway.jsonrpc import (
    TASK_ANSWER,
    BadArguments,
    BadMessage,
    Message,
    gateway_error,
    is_final_result,
    is_task_handle,
    result_content,
)
from gateway.mcp_flights import CLIENT_LEFT, Flight, cause_of, flights_of, uncut
from gateway.mcp_guards import (
    changes_run,
    check_arguments,
    refuse_if_stopped,
    release_claims,
    reserve_claims,
    reset_since,
    settle_claims,
)
from gateway.mcp_idempotent import idempotent, record_write
from gateway.mcp_step import ToolStep
from gateway.mcp_transport import McpRequest, refusal, relay
from gateway.observe import telemetry_of
from gateway.observe_mcp import end_tool_span, record_tool_step, start_tool_span
from gateway.pipeline import RESET_RETRIES
from gateway.respond import STOP_HEADER
from gateway.store.base import RunState
from gateway.tools import SIDE_EFFECT_TIERS, mcp_tool_name, proposed_names, refusal_detail
from guards.base import Push, StepContext
from guards.caps import PENDING_KEEP
from guards.chain import GuardChain, Verdict

PENDING = "pending_calls"
CUT_STATUS = 499  # the step's status in the run view when nobody got an answer (nginx's "client closed")


async def call_tool(mcp: McpRequest, message: Message, size: int) -> web.StreamResponse:
    """Answer one `tools/call` request. Every refusal is a JSON-RPC error naming its code; every call
    that names a tool is recorded as a step of the run, also when its client goes away meanwhile (the
    cancellation of this handler reaches the execution once, through `gateway.mcp_flights`)."""
    return await flights_of(mcp.gw).run(lambda flight: _call_tool(mcp, message, size, flight))


async def _call_tool(mcp: McpRequest, message: Message, size: int, flight: Flight) -> web.StreamResponse:
    ident = mcp.identity
    params = message.params
    tool = params.get("name")
    if not isinstance(tool, str) or not tool:
        raise BadMessage('tools/call needs "params.name", a non-empty string')
    arguments = params.get("arguments")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadArguments('"arguments" must be an object')
    qualified = mcp_tool_name(mcp.server_name, tool)
    started, started_wall = time.monotonic(), time.time()
    refused: GatewayError | None = None
    step: ToolStep | None = None
    run: RunState | None = None
    try:
        if not mcp.policy.allowed(qualified):
            detail = refusal_detail(qualified)
            with uncut(flight):  # the stop is decided: its client leaving now must not make it a cut
                if mcp.policy.on_violation == "reject":
                    held = await mcp.gw.store.stop(ident.run_id, ident.agent, "tool_not_allowed", detail, time.time())
                    if held.reason != "tool_not_allowed":  # stopped before: its own reason (a stopped run's)
                        raise Stopped(held.reason, held.detail)
                raise ToolNotAllowed(detail)
        unguarded = False
        try:
            run = await mcp.gw.store.get(ident.run_id, steps=False, reservations=False)
        except StateUnavailable:
            if ident.policy.state_failure != "fail_open":
                raise
            unguarded = True  # the call goes on without the run's guards, as the agent's model calls do
        refuse_if_stopped(run)
        await check_arguments(mcp, tool, arguments, size)
        args_json = canonical_json(arguments).decode()
        call = Call(protocol="mcp", operation="execute_tool", model=mcp.server_name, input_bytes=size,
                    tool_call=ToolCall(str(message.id), tool, args_json),
                    request_hash=digest(qualified.encode(), args_json.encode()), raw=message.body)
        ctx = StepContext(call, ident.agent, ident.run_id, ident.policy, run, time.time())
        step = ToolStep(mcp, message, call, qualified, arguments, ctx, started, unguarded=unguarded, flight=flight,
                        writes=mcp.policy.tier(qualified) in SIDE_EFFECT_TIERS)
        response = await (idempotent(step, run, _execute) if step.writes else _execute(step))
    except GatewayError as exc:
        refused = exc
        response = refusal(exc, message.id, mcp.headers)
    except asyncio.CancelledError:  # cut: nobody gets an answer, but the call is a step all the same
        refused = _cut_refusal(step)
        failure = cause_of(flight) if refused is None else None
        await _conclude(mcp, message, tool, step, run, refused, refused.status if refused else CUT_STATUS,
                        failure, started_wall, qualified=qualified, started=started)
        raise
    flight.recording = True  # the outcome is decided: its client leaving now must not cut the recording
    if step is not None and step.lost is not None:  # the agent got it as a JSON-RPC error on the stream
        refused = step.lost
    await _conclude(mcp, message, tool, step, run, refused, refused.status if refused else response.status,
                    CLIENT_LEFT if flight.client_left else None, started_wall, qualified=qualified, started=started)
    return response


async def _conclude(
    mcp: McpRequest, message: Message, tool: str, step: ToolStep | None, run: RunState | None,
    refused: GatewayError | None, status: int, failure: str | None, started_wall: float, *, qualified: str,
    started: float,
) -> None:
    """Stage `record`: the step in the run view (unless it is there already), the span, the ledger row.
    `failure`: nobody got the answer (`client_disconnected`, `shutting_down`)."""
    stop = refused.stop_reason if refused is not None else mcp.headers.get(STOP_HEADER)
    if step is None or not step.recorded:
        await record_tool_step(mcp, qualified, status, stop, refused, started, failure, epoch=_admitted_in(step))
    if step is not None and step.approved_run is not None:
        run = step.approved_run  # read once its approval wait ended, which may outlast an idle root
    await end_tool_span(mcp, message, tool, step.span if step else None, run=run,
                        outcome=step.response if step else None, refused=refused, stop=stop,
                        started_wall=started_wall, approved_by=step.approved_by if step else None,
                        failure=failure, replayed=step is not None and step.replayed, status=status,
                        decisions=step.decisions if step is not None else (),
                        replayed_reason=step.replayed_refusal if step is not None else None)


def _admitted_in(step: ToolStep | None) -> int | None:
    """The run epoch the call was judged in (None: refused before the run was read, or unguarded)."""
    return None if step is None or step.unguarded else step.ctx.run.epoch if step.ctx.run is not None else 1


def _cut_refusal(step: ToolStep | None) -> GatewayError | None:
    """The decision a cut call ended with: parked, it was denied when its client went away."""
    item = step.approval if step is not None else None
    if step is None or item is None or item.status != "denied":
        return None
    return ApprovalDenied(f"{step.qualified} was denied by {item.decided_by} (approval {item.id})")


# -- guards, approval, forward ---------------------------------------------------------------------------


async def _execute(step: ToolStep) -> web.StreamResponse:
    """Judge, count and forward the call. A reset of its run that ends the epoch the call was judged on
    before its stop or count landed (the store checks it atomically: RunReset) has the call judged again
    on the fresh run, as a model call is (`pipeline.guard_before`)."""
    judged = len(step.decisions)
    for _ in range(RESET_RETRIES):
        try:
            return await _judge_and_forward(step)
        except RunReset:
            del step.decisions[judged:]
            run = await _current(step)
            refuse_if_stopped(run)
            step.ctx = dataclasses.replace(step.ctx, run=run, now=time.time())
    raise StateUnavailable(f"run {step.ctx.run_id!r} was reset {RESET_RETRIES} times while this call was judged")


async def _judge_and_forward(step: ToolStep) -> web.StreamResponse:
    ctx = step.ctx
    assert step.call.tool_call is not None
    chain = step.mcp.gw.chain(ctx.agent, ctx.policy)
    verdict = chain.before(ctx)
    # the claims first, as for a model call: a call they refuse counts nothing (its effects are not written)
    claims = None
    if verdict.stop is None and not step.unguarded:
        claims = await reserve_claims(step.mcp.gw, ctx, verdict.claims)
    try:
        await _apply(step, verdict)
    except BaseException:
        if claims is not None:
            await asyncio.shield(release_claims(step.mcp.gw, claims))
        raise
    try:
        # counted in one section its client leaving cannot cut: a cut then comes once the count is written,
        # and carries it (below), as for a call cut while parked
        with uncut(step.flight):
            if not await _take_proposal(step, step.call.tool_call):
                proposal = dataclasses.replace(ctx, extra={"counts_tool_call": True})
                await _apply(step, chain.after(proposal, Answer()))
        return await _forward(step, chain)
    except asyncio.CancelledError:  # cut (gateway.mcp_flights), now counted
        if not step.sent:
            try:
                await _carry(step)  # the tool did not run (parked, or never sent)
            except GatewayError:
                pass  # the store is down: the retry counts again, the cut is still recorded as such
        elif not step.ran:
            step.unknown = True  # the server may run it
        raise
    finally:
        if claims is not None:  # shielded: a cut must not leave the claims reserved
            await asyncio.shield(settle_claims(step.mcp.gw, claims, may_have_run=step.sent and not step.not_run))


async def _forward(step: ToolStep, chain: GuardChain) -> web.StreamResponse:
    """Approval, then the call goes to the server; its answer is judged before the agent sees it."""
    mcp, ctx, message = step.mcp, step.ctx, step.message
    assert step.call.tool_call is not None
    try:
        if mcp.policy.needs_approval(step.qualified):
            await _approve(step)
        step.span, body = start_tool_span(mcp, message, step.call.tool_call.name,
                                         step.approved_run or ctx.run)  # a wait may outlast an idle root
        step.sending = Sending()
        # from here a side-effecting call runs on to its answer if its client leaves: the answer is
        # recorded for the identical retry, instead of the tool maybe running once unrecorded; for one
        # lease at most (a server that never answers must not hold the call and its claim forever)
        step.flight.keep, step.flight.keep_for = step.writes, lease_for(mcp.server.timeouts)
        upstream = await mcp.open("POST", body, step.sending)
    except (ApprovalDenied, UpstreamError) as exc:
        if not isinstance(exc, UpstreamError) or not exc.request_sent:
            await _carry(step)  # the tool did not run
        raise

    async def judge(response: dict[str, Any]) -> dict[str, Any]:
        step.flight.recording = True  # the answer is in hand: judging and recording it is not cut
        step.outcome = step.response = response
        result = response.get("result")
        if isinstance(result, dict) and is_task_handle(result):  # asked for none (`untasked`): it may be running
            step.unknown, step.lost = True, UpstreamUnavailable(TASK_ANSWER)
            return gateway_error(message.id, step.lost)[1]
        if isinstance(result, dict) and not is_final_result(result):
            step.not_run = True
            await _carry(step)  # SEP-2322 input_required: nothing ran yet, the retry with input is this call
            return response
        if not isinstance(result, dict):
            step.not_run = True
            return response  # a JSON-RPC error of the server: counted, as a retry is
        step.ran = True
        content, is_error = result_content(result)
        answer = Answer(is_error=is_error, tool_result=ToolResult(str(message.id), content, is_error))
        refused: InvalidRequest | None = None
        try:
            await _judge_result(step, chain, answer)
        except Stopped as exc:  # e.g. no_progress: the result is withheld
            mcp.headers[STOP_HEADER] = exc.reason
            response = step.outcome = gateway_error(message.id, exc)[1]
        except InvalidRequest as exc:  # a guard's reject: the result is withheld, the run goes on
            refused = exc
            response = step.outcome = gateway_error(message.id, exc)[1]
        step.record = True  # what the agent gets is what a repeat gets
        await record_write(step)
        step.recorded = True
        status = 200 if refused is None else refused.status
        await record_tool_step(mcp, step.qualified, status, mcp.headers.get(STOP_HEADER), refused, step.started,
                               epoch=_admitted_in(step))
        return response

    response = await relay(mcp, upstream, message.id, judge)
    if step.response is None and upstream.status < 300:  # relay ended the stream with an error for the call
        step.lost = mcp.lost or UpstreamUnavailable("the MCP server's stream ended without a response to the call")
    return response


async def _judge_result(step: ToolStep, chain: GuardChain, answer: Answer) -> None:
    """Judge a result on the run as it is now (calls of one run may overlap, see guard_after). With
    `stall_steps`, one result of a run at a time in this process from read to write, as a request's
    no-progress judgement (`pipeline.guard_before`): identical results back at once cannot each pass.
    A call admitted before a reset counts in no run. Raises Stopped, InvalidRequest (see `_apply`)."""
    ctx, loop = step.ctx, step.ctx.policy.loop
    async with step.mcp.gw.run_locks.hold(ctx.run_id) if loop and loop.stall_steps else contextlib.nullcontext():
        run = await _current(step) if loop is not None else ctx.run
        verdict = chain.after(dataclasses.replace(ctx, run=run, now=time.time()), answer)
        if changes_run(verdict) and reset_since(ctx.run, run if loop else await _current(step)):
            step.decisions.extend(d for d in verdict.decisions if not d.stopped)  # delivered: counts in no run
            return
        kept = len(step.decisions)
        try:
            await _apply(step, verdict, in_flight=True)
        except RunReset:  # the reset came after the read above: the same
            del step.decisions[kept:]
            step.decisions.extend(d for d in verdict.decisions if not d.stopped)


async def _current(step: ToolStep) -> RunState | None:
    """The run as it is now; with the store down, a fail_open agent's call goes on unguarded (and delivered)."""
    if step.unguarded:
        return step.ctx.run
    try:
        return await step.mcp.gw.store.get(step.ctx.run_id, steps=False, reservations=False)
    except StateUnavailable:
        if step.ctx.policy.state_failure != "fail_open":
            raise
        step.unguarded = True
        return step.ctx.run


async def _carry(step: ToolStep) -> None:
    """The call was counted but its tool did not run (approval refused, never sent, `input_required`):
    an identical retry of it is this call, as a model's proposal is, and does not count again."""
    assert step.call.tool_call is not None
    ctx = step.ctx
    if step.carried:
        return
    step.carried = True
    if step.unguarded:
        return
    carried = (Push(PENDING, (step.call.tool_call.fingerprint,), PENDING_KEEP),)
    with uncut(step.flight):  # once begun, the count is carried whoever leaves
        try:
            await step.mcp.gw.write_effects(ctx.run_id, ctx.agent, carried, epoch=_admitted_in(step))
        except RunReset:
            pass  # counted in the run a reset ended since: it counts in no run (atomically with the write)
        except StateUnavailable:
            if ctx.policy.state_failure != "fail_open":
                raise
            step.unguarded = True


async def _take_proposal(step: ToolStep, call: ToolCall) -> bool:
    """True when this call executes a tool call the model proposed in this run (already counted)."""
    pending = step.ctx.history(PENDING)
    if not pending or step.unguarded:
        return False
    store, run_id = step.mcp.gw.store, step.ctx.run_id
    names = proposed_names(step.mcp.server_name, call.name)
    for fingerprint in (dataclasses.replace(call, name=name).fingerprint for name in names):
        if fingerprint in pending and await store.take(run_id, PENDING, fingerprint):
            return True
    return False


async def _apply(step: ToolStep, verdict: Verdict, *, in_flight: bool = False, run: RunState | None = None) -> None:
    """A stop stops the run (a reject refuses only this call: InvalidRequest); effects go to the store in
    one atomic operation (an `Add` over its limit stops the run there; `in_flight`: the effects of the
    call's result, judged on the limits and not on a stop since, see `RunStore.apply`). Raises Stopped.
    Both only in the epoch of `run`, the run judged (default: as the call found it): RunReset, and the
    fresh run neither stopped nor counted, when a reset has ended it since."""
    gw, ctx = step.mcp.gw, step.ctx
    step.decisions.extend(verdict.decisions)
    if step.unguarded:
        return
    judged = run if run is not None else ctx.run
    epoch = judged.epoch if judged is not None else 1
    if verdict.stop is not None:
        if verdict.stop.action == "reject":  # this call refused as a bad request; the run goes on
            raise InvalidRequest(verdict.stop.detail, param=verdict.stop.param)
        reason, detail = verdict.stop.reason or "stopped", verdict.stop.detail
        with uncut(step.flight):  # the stop is decided: recorded as the stop, whoever leaves meanwhile
            held = await gw.store.stop(ctx.run_id, ctx.agent, reason, detail, time.time(), epoch=epoch)
            raise Stopped(held.reason, held.detail)  # the run's own, when another step stopped it first
    with uncut(step.flight):
        denial = await gw.write_effects(ctx.run_id, ctx.agent, verdict.effects, in_flight=in_flight, epoch=epoch)
        if denial is not None:
            raise Stopped(denial.reason, denial.detail)


async def _approve(step: ToolStep) -> None:
    mcp, ctx = step.mcp, step.ctx
    queue = queue_of(mcp.gw)
    item = step.approval = queue.request(ctx.run_id, ctx.agent, step.qualified, step.arguments,
                                         cancel_key=mcp.request_key(step.message.id))
    timeout = mcp.policy.approval_timeout_s
    await queue.wait(item, timeout)
    telemetry = telemetry_of(mcp.gw)
    if item.status != "approved" and not step.unguarded and telemetry is not None and telemetry.tracing:
        # its span goes under the run as it is now (the wait may outlast an idle root): best effort, the
        # refusal is what matters
        with contextlib.suppress(GatewayError):
            step.approved_run = await mcp.gw.store.get(ctx.run_id, steps=False, reservations=False)
    if item.status == "timed_out":
        raise ApprovalTimeout(f"nobody decided on {step.qualified} within {timeout:g}s (approval {item.id})")
    if item.status != "approved":
        raise ApprovalDenied(f"{step.qualified} was denied by {item.decided_by} (approval {item.id})")
    step.approved_by = item.decided_by
    if step.unguarded:
        return
    run = step.approved_run = await mcp.gw.store.get(ctx.run_id, steps=False, reservations=False)
    refuse_if_stopped(run)  # it may have stopped meanwhile
    # a guard may stop it now that did not when the call arrived (the time cap ran out while it waited)
    verdict = mcp.gw.chain(ctx.agent, ctx.policy).before(dataclasses.replace(ctx, run=run, now=time.time()))
    if verdict.stop is not None:
        try:
            await _apply(step, dataclasses.replace(verdict, effects=()), run=run)
        except RunReset:  # judged on the run a reset ended since: this call alone is refused
            raise Stopped(verdict.stop.reason or "stopped", verdict.stop.detail) from None
