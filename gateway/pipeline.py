"""The fixed pipeline of named stages (DESIGN section 6):

    identify -> parse -> guard.before -> shape -> forward -> inspect -> guard.after -> record -> respond

`run_step` drives one model call through them. Each stage is a small function over the `Step`; the
streaming variant of forward/inspect lives in `gateway.relay`, the respond stage in `gateway.respond`.
Guards see `Call`s only, and the store applies their claims and effects atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, NoReturn

import orjson
from multidict import CIMultiDict

from gateway.call import Answer
from gateway.config import Limits, Provider
from gateway.duplicate_keys import repeated_key
from gateway.errors import (
    HELD,
    BudgetHeld,
    GatewayError,
    InvalidRequest,
    OutputNonconforming,
    RunReset,
    StateUnavailable,
    Stopped,
    TokenBudgetHeld,
    ToolNotAllowed,
)
from gateway.output_limits import known_limit
from gateway.providers.common import MAX_TOKEN_COUNT, json_depth_ok
from gateway.respond import JSON
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import UNREPORTED_USAGE, Claim, Denial, Reservation, ReserveRequest
from gateway.upstream import forwardable
from guards.base import REASK, Add, Decision, StepContext
from guards.bounds import MIN_OUTPUT_TOKENS, search_limit
from guards.budget import USAGE_COUNTERS, settlement
from guards.chain import GuardChain, Verdict
from guards.reasoning import resolve as resolve_reasoning

JUDGED = "judged"  # step.extra: guard_after ran on the step's answer
_MARK = "history_mark"  # step.extra: the run's in-process history version when its snapshot was read
RESET_RETRIES = 3  # judgements of one step a reset of its run may interrupt before it is refused (503)
# trace context is tollgate's to set (the step's span); baggage carries tollgate's run id, not the provider's
TRACE_HEADERS = frozenset({"baggage", "traceparent", "tracestate"})
CREDENTIALS = frozenset({"authorization", "x-api-key"})
_DROP_TRACE = (TRACE_HEADERS, TRACE_HEADERS | CREDENTIALS)  # [passthrough auth or not]


# -- parse -------------------------------------------------------------------------------------------


def parse_json(raw: bytes, limits: Limits) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    depth = limits.max_json_depth
    # each level takes two bytes at least: a body that short cannot nest deeper, and needs no walk (the
    # walk is cheaper than counting brackets in the bytes of a large body: ~70 against ~45 + 45 us at 64 KB)
    if len(raw) > 2 * depth and not json_depth_ok(body, depth):
        raise InvalidRequest(f"request JSON nests deeper than {depth} levels")
    if (repeated := repeated_key(raw, body)) is not None:  # forwarded as sent, a provider may read the other one
        raise InvalidRequest(f"request JSON repeats the key {repeated!r} in one object", param=repeated)
    return body


# -- guard.before ------------------------------------------------------------------------------------


async def guard_before(gw: Gateway, step: Step) -> None:
    """Run the guards, reserve their claims atomically, then apply their effects. Raises Stopped on a
    stop, BudgetHeld when only the reservations of steps in flight refuse the claims. A reset of the run
    that ends the epoch the guards judged before their stop, reservation or effects landed (the store
    checks it atomically: RunReset) has the step judged again on the fresh run, which it alone changes."""
    call, judged = step.call, len(step.decisions)
    for _ in range(RESET_RETRIES):
        try:
            return await _judge_before(gw, step)
        except RunReset:
            step.call = call
            del step.decisions[judged:]
    raise StateUnavailable(f"run {step.run_id!r} was reset {RESET_RETRIES} times while this step was judged")


async def _judge_before(gw: Gateway, step: Step) -> None:
    ident = step.identity
    now = time.time()
    try:
        snapshot = await gw.store.get(ident.run_id, steps=False, reservations=False)
    except StateUnavailable as exc:
        await _state_failed(step, exc)
        return
    step.extra["snapshot"] = snapshot
    epoch = snapshot.epoch if snapshot is not None else 1
    if step.extra.get("epoch", epoch) != epoch:  # reset since the last attempt: its provider's calls count nowhere
        step.extra.pop("hosted_discarded", None)
    step.extra["epoch"] = epoch
    step.extra["segment"] = snapshot.root_segment() if snapshot is not None else 0  # of the run's roots
    step.extra[_MARK] = gw.history_marks.version(ident.run_id)
    if snapshot is not None and snapshot.stopped:  # sticky: the run's own reason, whatever else holds now
        step.stop_reason = snapshot.stop_reason or "stopped"
        step.stop_detail = snapshot.stop_detail or f"the run is stopped ({step.stop_reason})"
        raise Stopped(step.stop_reason, step.stop_detail)
    # reasoning items sent back by id are held at what the run's answers said they cost
    step.call = resolve_reasoning(step.call, snapshot)
    # a re-ask is tollgate's own request, not a step of the agent: `reask` tells the guards so
    extra = {REASK: True} if step.attempts else {}
    ctx = StepContext(step.call, ident.agent, ident.run_id, ident.policy, snapshot, now, step.price, extra)
    verdict = _chain(gw, step).before(ctx)
    step.decisions.extend(verdict.decisions)
    if verdict.stop is not None:
        if verdict.stop.action == "reject":
            raise InvalidRequest(verdict.stop.detail, param=verdict.stop.param)
        await stop_run(gw, step, verdict.stop.reason or "stopped", verdict.stop.detail)
    call = step.call
    if step.output_bound is not None:  # a metered forwarded call: its path fixes the output it may bill
        min_units, max_units = step.output_bound
    else:
        provider = step.route.provider  # an in-process model given no max_tokens generates `max_new_tokens`
        unset = provider.max_new_tokens if provider.engine != "http" else output_limit(step)
        max_units = min(call.max_tokens or unset, MAX_TOKEN_COUNT)  # no answer is longer
        if step.price is not None and step.price.max_output_tokens:
            max_units = min(max_units, step.price.max_output_tokens)  # a known model limit clamps the request
        min_units = min(MIN_OUTPUT_TOKENS, max_units)
    # a re-ask the budget cannot pay ends its step, not the run: the agent's next request is judged itself
    # (a re-ask over `caps.llm_calls` stops it: no further call fits, whatever its size)
    # (a metered call's bound is granted whole or refused: no clamp, so a refusal names what the budget pays)
    clamp = output_limit(step) if step.output_bound is None else None
    request = ReserveRequest(verdict.claims, min_units, max_units, clamp_units=clamp, refuse_only=bool(step.attempts))
    try:
        grant = await gw.store.reserve(ident.run_id, ident.agent, request, now)
    except StateUnavailable as exc:
        await _state_failed(step, exc)
        return
    if isinstance(grant, Denial):
        if grant.held and step.attempts:
            _refuse_reask(step, grant)
        if grant.held:  # steps in flight hold the budget: this step alone is refused, the run goes on
            raise HELD.get(grant.reason, BudgetHeld)(grant.detail)
        step.stop_reason, step.stop_detail = grant.reason, grant.detail
        raise Stopped(grant.reason, grant.detail)
    if grant.epoch != epoch:  # reserved in a fresh run the guards did not judge
        with contextlib.suppress(StateUnavailable):
            await gw.store.settle(grant, {}, time.time())
        raise RunReset(ident.run_id, epoch, grant.epoch)
    if step.output_bound is not None and grant.units < step.output_bound[1]:
        await _refuse_partial(gw, step, grant, verdict.claims)
    budgeted = any(c.per_unit > 0 and c.limit is not None for c in verdict.claims)
    # the bound of a metered call is granted whole or refused: its body has no limit to lower
    clamped = step.output_bound is None and grant.units != call.max_tokens
    clamped = clamped and (budgeted or call.max_tokens is not None)
    unclamped = dict(step.body) if clamped else None  # what a retry after a reset judges again
    if clamped:  # written before the effects: a limit the request cannot take refuses the step uncounted
        await _write_max_tokens(gw, step, grant, verdict.claims)
    step.reservation = grant
    # the guards' effects (counters, histories) only for a step that goes on: a refused one, even
    # refused by a held budget, must not count as a step (no_progress would stop an agent that retries)
    try:
        loop = ident.policy.loop
        if loop is not None and loop.stall_steps is not None:
            async with gw.run_locks.hold(ident.run_id):
                await apply_effects(gw, step, await _rejudge(gw, step, ctx, verdict))
        else:
            await apply_effects(gw, step, verdict)
    except BaseException:
        step.reservation = None
        if unclamped is not None:  # the limit written was this grant's (set_max_tokens sets top-level keys)
            step.body.clear()
            step.body.update(unclamped)
        with contextlib.suppress(StateUnavailable):  # the store is down: a restart charges it
            await gw.store.settle(grant, {}, time.time())  # released: nothing went upstream
        raise
    if clamped:
        step.max_tokens_set = grant.units
        step.changed = True
    elif step.output_bound is None and step.max_tokens_set is not None and grant.units == call.max_tokens:
        # a re-ask sends the agent's own limit again (its body is rebuilt from the original): a clamp of
        # an earlier attempt no longer describes what the upstream is given
        step.max_tokens_set = grant.units
    # billed searches were reserved up to the limit tollgate picked (guards.bounds): the upstream gets it
    searches = search_limit(call, step.price, ident.policy.budget, snapshot)
    if searches is not None and step.adapter.limit_hosted_calls(step.body, searches):
        step.changed = True
    cap = ident.policy.caps.tool_calls
    if cap is not None:
        # tools the provider runs itself cannot be stopped once asked for: ask for no more than the cap
        # leaves (steps in flight may still each use it; the count after the answer stops the run)
        left = cap - int(snapshot.used.get("tool_calls", 0)) if snapshot is not None else cap
        if step.adapter.limit_hosted_calls(step.body, left):
            step.changed = True


async def _rejudge(gw: Gateway, step: Step, ctx: StepContext, verdict: Verdict) -> Verdict:
    """The verdict to apply, for guards that read the run's history before a call (`no_progress`):
    judged again on the run as it is now when its history moved while the reservation was written (other
    steps of the run may have landed meanwhile: SQLite batches their writes, Redis is a round trip away).
    The caller holds the run's lock from here to the effects, so in one process identical requests sent
    at once cannot each pass. The run is read again only when a step of this process wrote its history
    since the snapshot (`Gateway.history_marks`): a lone step costs no second read (other processes'
    writes are the few milliseconds of overlap Redis leaves). Raises like the first judgement; the caller
    releases the reservation."""
    if step.extra.get("state_failed"):
        return verdict
    ident = step.identity
    if step.extra.get(_MARK) == gw.history_marks.version(ident.run_id):
        return verdict  # no step of this process wrote the run's history since the snapshot: no re-read
    try:
        fresh = await gw.store.get(ident.run_id, steps=False, reservations=False)
    except StateUnavailable as exc:
        await _state_failed(step, exc)
        return verdict
    if fresh is None or (fresh.lists == (ctx.run.lists if ctx.run is not None else {}) and not fresh.stopped):
        return verdict
    if fresh.stopped:  # another step stopped the run meanwhile: its reason, as for a stopped snapshot
        step.stop_reason = fresh.stop_reason or "stopped"
        step.stop_detail = fresh.stop_detail or f"the run is stopped ({step.stop_reason})"
        raise Stopped(step.stop_reason, step.stop_detail)
    again = _chain(gw, step).before(dataclasses.replace(ctx, run=fresh))
    if again.stop is None:
        return again
    step.decisions.append(again.stop)
    if again.stop.action == "reject":
        raise InvalidRequest(again.stop.detail, param=again.stop.param)
    await stop_run(gw, step, again.stop.reason or "stopped", again.stop.detail)


def _refuse_reask(step: Step, denial: Denial) -> NoReturn:
    """A re-ask the run's limits cannot pay: the step ends with what made it re-ask (the run goes on)."""
    if step.violations:
        raise OutputNonconforming(f"the answer breaks its {step.violations[-1].partition(':')[0]} constraint and "
                                  f"its re-ask does not fit the run's limits ({denial.detail}); the run goes on")
    raise ToolNotAllowed(f"the answer called only tools that are not allowed, and its re-ask does not fit the "
                         f"run's limits ({denial.detail}); the run goes on")


async def _state_failed(step: Step, error: StateUnavailable) -> None:
    """The run store is unreachable. Fail closed (re-raise: 503 `state_unavailable`) unless the agent's
    policy says `state_failure: fail_open`; then the step goes on unguarded and says so."""
    if step.identity.policy.state_failure != "fail_open":
        raise error
    step.extra["state_failed"] = True
    step.decisions.append(Decision("state", "allow", "state_unavailable", f"fail_open: {error.message}"))


async def _refuse_partial(gw: Gateway, step: Step, grant: Reservation, claims: Sequence[Claim]) -> NoReturn:
    """A metered call whose output bound is reserved whole (it takes no output limit to lower) got less:
    the budget left pays a smaller step, so this one is refused and the run goes on (a stop is only for a
    budget that cannot pay the smallest answer, as for model calls)."""
    assert step.output_bound is not None
    await _refuse_held(gw, grant, claims, f"this call reserves {step.output_bound[1]} output tokens whole (it "
                       f"takes no output limit) and the budget left pays {grant.units}; the run goes on")


async def _write_max_tokens(gw: Gateway, step: Step, grant: Reservation, claims: Sequence[Claim]) -> None:
    """Write the granted output limit into the request. An adapter refuses a limit its request cannot be
    sent with (BudgetHeld: Anthropic's extended thinking needs more than 1,024 tokens): this step alone
    is refused and the run goes on, as in `_refuse_partial` (it may pay smaller steps)."""
    prefer = step.route.provider.dialect == "openai"
    try:
        step.adapter.set_max_tokens(step.body, grant.units, prefer_completion_field=prefer)
    except BudgetHeld as exc:
        await _refuse_held(gw, grant, claims, exc.message)


async def _refuse_held(gw: Gateway, grant: Reservation, claims: Sequence[Claim], detail: str) -> NoReturn:
    """Release `grant` (nothing went upstream) and refuse this step alone, in the currency it claims."""
    with contextlib.suppress(StateUnavailable):  # the store is down: a restart charges it
        await gw.store.settle(grant, {}, time.time())
    usd = any(c.counter == "usd" and c.limit is not None for c in claims)
    raise (BudgetHeld if usd else TokenBudgetHeld)(detail)


def _chain(gw: Gateway, step: Step) -> GuardChain:
    """The guards that judge the step: its own (`Step.guards`, a metered forwarded call's), else its agent's."""
    return step.guards if step.guards is not None else gw.chain(step.identity.agent, step.identity.policy)


def output_limit(step: Step) -> int:
    """The model's output limit: its `pricing:` entry's, else the provider's `max_output_tokens`, lowered
    to the model's own when it is known to be lower (`gateway.output_limits`)."""
    price = step.price
    if price is not None and price.max_output_tokens:
        return price.max_output_tokens
    default = step.route.provider.max_output_tokens
    return min(known_limit(step.route.model) or default, default)


async def stop_run(gw: Gateway, step: Step, reason: str, detail: str) -> NoReturn:
    """Stop the run (sticky) and raise the stop it holds: another step's, when that one stopped it first.
    RunReset, and nothing stopped, when a reset has ended the epoch the step judged (`extra["epoch"]`)."""
    before = step.stop_reason, step.stop_detail
    step.stop_reason, step.stop_detail = reason, detail
    try:
        held = await gw.store.stop(step.run_id, step.agent, reason, detail, time.time(),
                                   epoch=step.extra.get("epoch"))
    except RunReset:
        step.stop_reason, step.stop_detail = before
        raise
    step.stop_reason, step.stop_detail = held.reason, held.detail
    raise Stopped(held.reason, held.detail)


async def stop_answer(gw: Gateway, step: Step, reason: str, detail: str) -> NoReturn:
    """`stop_run` for an answer that is withheld whatever the run's epoch (a disallowed tool call): after a
    reset since the step was judged, the step alone is refused with `reason`, the fresh run goes on."""
    try:
        await stop_run(gw, step, reason, detail)
    except RunReset:
        step.stop_reason, step.stop_detail = reason, detail
        raise Stopped(reason, detail) from None


async def apply_effects(gw: Gateway, step: Step, verdict: Verdict, *, in_flight: bool = False) -> None:
    """A step's counter additions and history pushes, in one atomic store operation (`in_flight`: those
    of its answer, see `RunStore.apply`); RunReset, nothing written, when a reset has ended the epoch the
    step judged."""
    if not verdict.effects or step.extra.get("state_failed"):
        return
    try:
        denial = await gw.write_effects(step.run_id, step.agent, verdict.effects, in_flight=in_flight,
                                        epoch=step.extra.get("epoch"))
    except StateUnavailable as exc:
        await _state_failed(step, exc)
        return
    if denial is not None:
        step.stop_reason, step.stop_detail = denial.reason, denial.detail
        raise Stopped(denial.reason, denial.detail)


# -- shape -------------------------------------------------------------------------------------------


def shape(step: Step) -> bytes:
    """Apply request changes; forward the original bytes when nothing had to change."""
    if step.route.prefixed:
        step.body["model"] = step.route.model
        step.changed = True
    if step.call.stream and step.adapter.ask_usage(step.body):
        step.hide_usage = True
        step.changed = True
    return orjson.dumps(step.body) if step.changed else step.raw


def upstream_request(step: Step, headers: Mapping[str, str]) -> tuple[str, CIMultiDict[str]]:
    """URL and headers for the upstream: provider credentials replace the agent's own. A header the
    agent repeated (two `anthropic-beta` lines) is forwarded as it came, every line of it."""
    provider = step.route.provider
    out = forwardable(headers, drop=_DROP_TRACE[not provider.passthrough_auth])
    add_credentials(provider, out)
    path = step.adapter.upstream_path
    out["Content-Type"] = JSON
    return provider.base_url.rstrip("/") + path, out


def provider_secret(provider: Provider) -> str | None:
    """The credential tollgate sends this provider, which nothing relayed to the agent may carry; None
    when the agent's own passes through."""
    return None if provider.passthrough_auth else provider.api_key


def add_credentials(provider: Provider, headers: MutableMapping[str, str]) -> None:
    """The provider's key where its API expects it, unless the agent's own credentials pass through
    (the caller has dropped the agent's otherwise: CREDENTIALS)."""
    key = None if provider.passthrough_auth else provider.api_key
    if provider.type == "anthropic":
        if key:
            headers["x-api-key"] = key
        headers.setdefault("anthropic-version", "2023-06-01")
    elif key:
        headers["Authorization"] = f"Bearer {key}"


# -- guard.after / settle ----------------------------------------------------------------------------


async def settle(gw: Gateway, step: Step, answer: Answer | None, *, charged: bool = True,
                 counted: bool = True) -> None:
    """Settle the reservation: real usage, or all of it when usage is unknown. `charged=False` (an error
    status) settles the step's counts only; `counted=False`, none of its model call (`caps.llm_calls`)."""
    reservation = step.reservation
    if reservation is None:
        return
    step.reservation = None
    if charged:
        usage, tier = (answer.usage, answer.service_tier) if answer else (None, None)
        choices = step.call.params.choice_count or 1
        provider = step.route.provider.type  # sub-inferences on other models (Anthropic's advisor): their prices
        actual = dict(settlement(usage, step.price, reservation, step.relayed_chars // 4, choices, tier,
                                 price_of=lambda model: gw.pricer.lookup(model, provider)))
        if usage is None and ("input_tokens" in actual or "output_tokens" in actual):
            actual[UNREPORTED_USAGE] = 1.0  # the run's tokens are then no provider's count (its root says so)
    else:
        actual = {k: v for k, v in reservation.amounts.items()  # the step counts
                  if k not in USAGE_COUNTERS and (counted or k != "llm_calls")}
    step.cost_usd = actual.get("usd", 0.0)
    for key in ("usd", "input_tokens", "output_tokens"):
        if key in actual:
            step.spent[key] = step.spent.get(key, 0.0) + actual[key]
    try:
        await gw.store.settle(reservation, actual, time.time())
    except StateUnavailable as exc:  # the store keeps the settlement for replay; the answer exists
        await _state_failed(step, exc)


async def guard_after(gw: Gateway, step: Step, answer: Answer) -> None:
    """Judge the answer before the agent sees it; a stop withholds it. Raises Stopped (InvalidRequest for
    a guard's reject: the answer is withheld, the run goes on)."""
    ident = step.identity
    step.extra[JUDGED] = True  # what the provider ran is counted here (see count_unjudged_hosted)
    # the tool-call cap is applied atomically; the histories (loop detection) and the calls the provider ran
    # are judged on the run as it is now when the answer has calls (steps overlap, a reset may come)
    snapshot, reset = step.extra.get("snapshot"), False
    if (answer.tool_calls or answer.hosted_calls) and not step.extra.get("state_failed"):
        try:
            snapshot = await gw.store.get(ident.run_id, steps=False, reservations=False)
        except StateUnavailable as exc:
            await _state_failed(step, exc)
        reset = snapshot is not None and snapshot.epoch != step.extra.get("epoch", snapshot.epoch)
    ctx = StepContext(step.call, ident.agent, ident.run_id, ident.policy, snapshot, time.time(), step.price,
                      step.extra)
    verdict = _chain(gw, step).after(ctx, answer)
    if verdict.stop is not None and verdict.stop.action == "reject":  # even across a reset: withheld
        step.decisions.extend(verdict.decisions)
        del step.extra[JUDGED]  # nothing of the answer was applied: what the provider ran is counted at the end
        raise InvalidRequest(verdict.stop.detail, param=verdict.stop.param)  # withheld; the run goes on
    kept = len(step.decisions)
    step.decisions.extend(verdict.decisions)
    try:
        if reset:
            raise RunReset(ident.run_id, step.extra.get("epoch", 1), snapshot.epoch if snapshot else 1)
        if verdict.stop is not None:
            await stop_run(gw, step, verdict.stop.reason or "stopped", verdict.stop.detail)
        # admitted before any stop of its run since: its answer is judged on the limits, not on that stop
        await apply_effects(gw, step, verdict, in_flight=True)
    except RunReset:  # reset since the step was admitted (seen, or refused by the store's epoch check):
        del step.decisions[kept:]  # it counts in no run, and stops none (span, metrics)
        step.decisions.extend(d for d in verdict.decisions if not d.stopped)


async def count_unjudged_hosted(gw: Gateway, step: Step) -> None:
    """Tool calls the provider ran itself (web search, its MCP client, ...) in a step that ended before
    its answer was judged (a stream that broke, an answer still nonconforming after its re-asks): they
    ran, so they count toward `caps.tool_calls`, and crossing the cap stops the run. Never raises."""
    if step.extra.get(JUDGED) or step.extra.get("state_failed") or step.error_type == StateUnavailable.code:
        return
    hosted = step.extra.get("hosted_discarded", 0) + (step.answer.hosted_calls if step.answer is not None else 0)
    if not hosted:
        return
    limit = step.identity.policy.caps.tool_calls
    add = Add("tool_calls", float(hosted), None if limit is None else float(limit), "tool_call_cap")
    try:
        denial = await gw.write_effects(step.run_id, step.agent, (add,), in_flight=True,
                                        epoch=step.extra.get("epoch", 1))
    except RunReset:
        return  # a step from before a reset counts in no run
    except GatewayError:
        step.extra["record_failed"] = True  # the store is down; the answer is already decided
        return
    if denial is not None and not step.stop_reason:  # the run stopped here: say so (span, ledger, run)
        step.stop_reason, step.stop_detail = denial.reason, denial.detail
