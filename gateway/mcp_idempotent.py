"""Side-effecting MCP tool calls (`write` and `dangerous` tiers) run at most once per key in a run.

The key is the tool with its canonical arguments, or the call's `params._meta["tollgate/idempotency_key"]`
alone. Concurrent duplicates in one process wait for the first (`gateway.idempotency`); the first claims
the call in the run store, so a duplicate through another sidecar meanwhile is refused
`tool_call_in_progress`, and a repeat through any sidecar once it ran gets the recorded result
(`duplicate_tool_call` when none was kept). A call that may have run is never run again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway import exact_json
from gateway.call import digest
from gateway.errors import DuplicateToolCall, GatewayError, StateUnavailable, WriteInProgress
from gateway.idempotency import Key, Outcome, WriteLease, lease_for
from gateway.jsonrpc import (
    IDEMPOTENCY_META_KEY,
    POLICY_REFUSED,
    UPSTREAM_FAILED,
    BadArguments,
    error_message,
    gateway_error,
    replayed,
)
from gateway.mcp_flights import cause_of
from gateway.mcp_step import ToolStep
from gateway.mcp_transport import state_of
from gateway.store.base import RunState, WriteClaim

LEGACY_WRITES = "tool_writes"  # the run's list of write calls that ran, kept by tollgate before the run store's claims


async def idempotent(step: ToolStep, run: RunState | None,
                     execute: Callable[[ToolStep], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Run a side-effecting call at most once per key in its run (module docstring): replay what was
    recorded, refuse what another caller holds, else claim it and `execute` it."""
    mcp, message = step.mcp, step.message
    meta = message.params.get("_meta")
    explicit = meta.get(IDEMPOTENCY_META_KEY) if isinstance(meta, dict) else None
    if explicit is not None and (not isinstance(explicit, str) or not 0 < len(explicit) <= 256):
        raise BadArguments(f'"_meta.{IDEMPOTENCY_META_KEY}" must be a string of 1-256 characters')
    assert step.call.tool_call is not None
    fingerprint = digest(b"key", explicit.encode()) if explicit else step.call.tool_call.fingerprint
    key: Key = (mcp.identity.run_id, run.epoch if run is not None else 1, f"{step.qualified}:{fingerprint}")
    cache = state_of(mcp.gw).results
    recorded = cache.recorded(key)
    if recorded is not None:
        return _replay(step, recorded)
    leader, future = cache.begin(key)
    if not leader:
        return _replay(step, await asyncio.shield(future))
    lease = WriteLease(mcp.gw.store, mcp.identity.agent, key, lease_for(mcp.server.timeouts))
    try:
        found = await _claim(step, lease)
        if found is not None and found.state == "done":
            if found.result is None:
                raise DuplicateToolCall(f"{step.qualified} already ran in this run with these arguments; its result "
                                        "was not recorded (too large, or the run store failed while it was "
                                        "recorded), so it is not run again")
            step.outcome, step.record = exact_json.loads(found.result), True
            return _replay(step, step.outcome)
        if run is not None and key[2] in run.lists.get(LEGACY_WRITES, ()):
            raise DuplicateToolCall(f"{step.qualified} already ran in this run with these arguments (recorded by an "
                                    "earlier version of tollgate, without its result), so it is not run again")
        if found is not None and found.state == "running":
            raise WriteInProgress(f"{step.qualified} with these arguments is running in this run now (an "
                                  "earlier request, e.g. through another sidecar); it is not run twice: retry "
                                  "for its recorded result")
        step.lease = lease if found is not None else None
        response = await execute(step)
        if 400 <= response.status < 500 and not step.ran:
            step.not_run = True  # the server refused the request itself (authorization, a bad request)
        return response
    except GatewayError as exc:
        if not step.record:  # a result the tool answered stays what a repeat gets, whatever went wrong since
            step.outcome = gateway_error(message.id, exc)[1]
        raise
    finally:
        step.flight.recording = True  # the outcome is decided: storing it is not cut (a cut claim would linger)
        # sent, and no answer says it did not run (a timeout, a broken answer, a 5xx, a cut): it may have
        step.unknown = step.unknown or (step.sent and not step.ran and not step.not_run)
        if step.unknown and not step.record:
            why = cause_of(step.flight) if step.flight.cut else "no answer said whether it ran"
            step.outcome = gateway_error(message.id, DuplicateToolCall(
                f"{step.qualified} with these arguments was sent to the server and got no final result "
                f"({why}); it may have run, so it is not run again"))[1]
        outcome = step.outcome or error_message(
            message.id, UPSTREAM_FAILED, "upstream_failed: the identical call in flight got no result")
        # before any await: the duplicates waiting in this process are answered whatever happens next.
        # A call that ran is never run again by this process, even when judging it failed (then the
        # error its agent got is what a repeat gets)
        cache.finish(key, outcome, record=step.record or step.ran or step.unknown)
        # a call that may have run keeps its claim, marked done without a result: never run twice
        await lease.close(ran=step.ran or step.unknown)


async def _claim(step: ToolStep, lease: WriteLease) -> WriteClaim | None:
    """The call's claim in the run store; None when the store is down and the policy says
    `state_failure: fail_open` (the call goes on unguarded, deduplicated in this process only)."""
    if step.unguarded:
        return None
    try:
        return await lease.claim()
    except StateUnavailable:
        if step.ctx.policy.state_failure != "fail_open":
            raise
        step.unguarded = True
        return None


async def record_write(step: ToolStep) -> None:
    """The judged response goes to the run store as the call's recorded result, before the agent sees
    it, so a repeat the agent sends at once through another sidecar gets it. With the store down, a
    fail_open agent gets its result unrecorded; otherwise the result is withheld (503)."""
    if step.lease is None or step.outcome is None:
        return
    try:
        await step.lease.finish(step.outcome)
    except StateUnavailable:
        if step.ctx.policy.state_failure != "fail_open":
            raise
        step.unguarded = True


def _replay(step: ToolStep, outcome: Outcome) -> web.Response:
    mcp, message = step.mcp, step.message
    assert message.id is not None
    step.replayed, step.replayed_refusal = True, refusal_code(outcome)
    headers = {**mcp.headers, "x-tollgate-idempotent-replay": "true"}
    body = replayed(outcome, message.id, mcp.request.headers.get("MCP-Protocol-Version"))
    return web.Response(body=body, content_type="application/json", headers=headers)


def refusal_code(outcome: Outcome) -> str | None:
    """The code of the refusal a recorded response holds (`approval_denied` shared by duplicates,
    `duplicate_tool_call`): a replay's ledger reason, so a replayed refusal does not read as a result."""
    error = outcome.get("error")
    if not isinstance(error, dict) or error.get("code") != POLICY_REFUSED:
        return None  # the server's own error: its data is the server's to say, not a decision of tollgate
    data = error.get("data")
    code = data.get("code") if isinstance(data, dict) else None
    return code if isinstance(code, str) else None
