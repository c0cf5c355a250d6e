"""Pure state transitions of a run. Backends call these inside their own atomic section.

Amounts are floats (USD and token counts); comparisons allow `EPS` of rounding so that a budget that
pays for exactly N calls grants exactly N.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.errors import RunReset
from gateway.store.base import (
    UNREPORTED_USAGE,
    Add,
    Claim,
    Denial,
    Push,
    Reservation,
    ReserveRequest,
    RootClaim,
    RunState,
)

EPS = 1e-9
MAX_STEPS = 50


def reserve(state: RunState, request: ReserveRequest, now: float, reservation_id: str) -> Reservation | Denial:
    """Grant every claim of `request` with the most units that fit. Else stop the run, unless only the
    reservations of its steps in flight stand in the way: then refuse this step alone (`Denial.held`)."""
    if state.stopped:
        return Denial(state.stop_reason or "stopped", state.stop_detail or "the run is stopped")
    if state.started_at is None:
        state.started_at = now
    units = request.max_units
    limiting: Claim | None = None
    for claim in request.claims:
        if claim.limit is None:
            continue
        available = claim.limit - state.used.get(claim.counter, 0.0) - state.reserved.get(claim.counter, 0.0)
        if claim.per_unit > 0:
            fit = math.floor((available - claim.fixed + EPS) / claim.per_unit)
            if fit < units:
                units, limiting = fit, claim
        elif claim.fixed > available + EPS:
            return _deny(state, claim, request, now)
    if units < request.min_units and limiting is not None:
        spent = next((c for c in request.claims if not _fits_spent(state, c, request.min_units)), None)
        if spent is None:  # every limit still has room against what was spent: reservations refuse
            return _held(state, limiting, request.min_units)
        return _deny(state, spent, request, now)
    units = max(units, 0)
    if limiting is not None and request.clamp_units is not None and units > request.clamp_units:
        units = request.clamp_units  # a limit the budget cannot pay gets the most the model can use
    amounts = {c.counter: c.fixed + c.per_unit * units for c in request.claims}
    for counter, amount in amounts.items():
        state.reserved[counter] = state.reserved.get(counter, 0.0) + amount
    # the output tokens it holds: `units` per choice (`n` > 1 claims `per_unit` = n), for `charged`
    output = next((c.per_unit * units for c in request.claims if c.counter == "tokens"), float(units))
    state.open[reservation_id] = {"amounts": amounts, "at": now, "units": units, "output": output}
    state.updated_at = now
    return Reservation(reservation_id, state.run_id, state.epoch, units, amounts)


def _deny(state: RunState, claim: Claim, request: ReserveRequest, now: float) -> Denial:
    limit = claim.limit or 0.0
    available = limit - state.used.get(claim.counter, 0.0) - state.reserved.get(claim.counter, 0.0)
    detail = (
        f"{claim.counter} limit {_fmt(claim.limit)} would be exceeded: {_fmt(max(available, 0.0))} left, "
        f"this step needs at least {_fmt(claim.fixed + claim.per_unit * request.min_units)}"
    )
    if request.refuse_only and claim.per_unit > 0:  # a budget, sized by the request: another may fit
        return Denial(claim.code or f"{claim.counter}_limit", detail, held=True)
    stop(state, claim.code or f"{claim.counter}_limit", detail, now)
    return Denial(state.stop_reason or claim.code, detail)


def _fits_spent(state: RunState, claim: Claim, min_units: int) -> bool:
    """The smallest step fits the claim's limit (if any) against what was spent, reservations aside."""
    if claim.limit is None:
        return True
    need = claim.fixed + claim.per_unit * min_units
    return claim.limit - state.used.get(claim.counter, 0.0) - need >= -EPS


def _held(state: RunState, claim: Claim, min_units: int) -> Denial:
    reserved = state.reserved.get(claim.counter, 0.0)
    detail = (
        f"{claim.counter} limit {_fmt(claim.limit)}: {_fmt(reserved)} is held by {len(state.open)} step(s) "
        f"in flight and this step needs at least {_fmt(claim.fixed + claim.per_unit * min_units)}; "
        "the run goes on: retry once they settle"
    )
    return Denial(claim.code or f"{claim.counter}_limit", detail, held=True)


def _fmt(value: float | None) -> str:
    if value is None:
        return "none"
    return f"{value:.6g}"


def settle(state: RunState, reservation: Reservation, actual: Mapping[str, float], now: float) -> None:
    """Move real amounts to used and release the reservation. Idempotent; stale epochs are dropped."""
    if reservation.epoch != state.epoch or reservation.id not in state.open:
        return
    held = state.open.pop(reservation.id)["amounts"]
    for counter, amount in held.items():
        state.reserved[counter] = max(state.reserved.get(counter, 0.0) - amount, 0.0)
    if not state.open:  # nothing in flight holds anything (what float sums lost is not kept held)
        for counter in state.reserved:
            state.reserved[counter] = 0.0
    for counter, amount in actual.items():
        state.used[counter] = state.used.get(counter, 0.0) + amount
    state.updated_at = now


def recover(state: RunState, now: float) -> int:
    """Settle reservations left open by a crashed process at their reserved amount (never at zero)."""
    count = 0
    for rid in list(state.open):
        record = state.open[rid]
        settle(state, Reservation(rid, state.run_id, state.epoch, 0, record["amounts"]), charged(record), now)
        count += 1
    return count


def charged(record: Mapping[str, Any]) -> dict[str, float]:
    """What an open reservation charges when its process is gone: what it held, its tokens split as a
    settlement without usage splits them (its output tokens, every choice's, the rest input). Records
    written before `output` was kept count `units`."""
    held: dict[str, float] = dict(record["amounts"])
    if "tokens" in held:
        output = min(float(record.get("output", record.get("units", 0))), held["tokens"])
        held["output_tokens"] = output
        held["input_tokens"] = held["tokens"] - output
        held[UNREPORTED_USAGE] = 1.0  # no provider said what it used
    return held


def expire(state: RunState, before: float, now: float) -> int:
    """Charge what they held to the reservations made before `before` (their process is presumed dead:
    the Redis store's lease); how many. What `reserve` runs first in the Redis twin."""
    stale = [rid for rid, record in state.open.items() if record["at"] < before]
    for rid in stale:
        record = state.open[rid]
        settle(state, Reservation(rid, state.run_id, state.epoch, 0, record["amounts"]), charged(record), now)
    return len(stale)


def add(state: RunState, counter: str, amount: float, limit: float | None, code: str, now: float) -> Denial | None:
    """Add to a used counter; exceeding `limit` stops the run with `code` (default `<counter>_limit`)
    and adds nothing."""
    if state.stopped:
        return Denial(state.stop_reason or "stopped", state.stop_detail or "the run is stopped")
    if state.started_at is None:
        state.started_at = now
    current = state.used.get(counter, 0.0) + state.reserved.get(counter, 0.0)
    if limit is not None and current + amount > limit + EPS:
        detail = f"{counter} limit {_fmt(limit)} would be exceeded: {_fmt(current)} used, this step adds {_fmt(amount)}"
        code = code or f"{counter}_limit"
        stop(state, code, detail, now)
        return Denial(code, detail)
    state.used[counter] = state.used.get(counter, 0.0) + amount
    state.updated_at = now
    return None


def same_epoch(state: RunState, epoch: int | None) -> None:
    """Raise RunReset when `epoch` (the one a stop or an effect was judged on; None: not checked) is no
    longer the run's: a reset came in between, and the judgement was of the run it ended."""
    if epoch is not None and epoch != state.epoch:
        raise RunReset(state.run_id, epoch, state.epoch)


def apply(
    state: RunState, adds: Sequence[Add], pushes: Sequence[Push], now: float, *, in_flight: bool = False,
    epoch: int | None = None,
) -> Denial | None:
    """All adds and pushes of a step, or nothing: a limit breach stops the run and applies nothing.
    `epoch` (`same_epoch`): RunReset, nothing applied, when a reset has ended it.

    A stopped run refuses the adds with its own reason (sticky), unless `in_flight`: the effects of a
    step admitted before the stop (its answer) are judged against the limits as if it had ended first,
    which is what a serial order of the steps gives, and only a breach is refused, with the run's own
    reason. Without that, one refused step of a parallel agent withheld every answer it had paid for."""
    same_epoch(state, epoch)
    if adds and state.stopped and not in_flight:
        return Denial(state.stop_reason or "stopped", state.stop_detail or "the run is stopped")
    for a in adds:
        current = state.used.get(a.counter, 0.0) + state.reserved.get(a.counter, 0.0)
        if a.limit is not None and current + a.amount > a.limit + EPS:
            return add(state, a.counter, a.amount, a.limit, a.code, now)  # stops the run, adds nothing
    for p in pushes:
        if repeats(state.lists.get(p.key, []), p):
            stop(state, p.code, p.detail, now)
            return Denial(state.stop_reason or p.code, state.stop_detail or p.detail)
    for a in adds:  # added as they are: a stopped run refuses nothing more here (judged above)
        state.used[a.counter] = state.used.get(a.counter, 0.0) + a.amount
    if adds:
        if state.started_at is None:
            state.started_at = now
        state.updated_at = now
    for p in pushes:
        push(state, p.key, p.values, p.keep)
    if pushes:
        state.updated_at = now
    return None


def repeats(items: Sequence[str], p: Push) -> bool:
    """`p` would leave `keep` values in its list with at most `distinct_limit` distinct ones."""
    window = [*items, *p.values][-p.keep:]
    return p.distinct_limit is not None and len(window) >= p.keep and len(set(window)) <= p.distinct_limit


def push(state: RunState, key: str, values: Sequence[str], keep: int) -> list[str]:
    items = state.lists.setdefault(key, [])
    items.extend(values)
    if len(items) > keep:
        del items[: len(items) - keep]
    return list(items)


def take(state: RunState, key: str, value: str) -> bool:
    items = state.lists.get(key)
    if not items or value not in items:
        return False
    items.remove(value)
    return True


def stop(state: RunState, reason: str, detail: str, now: float, *, epoch: int | None = None) -> Denial:
    """Stop the run; the first stop wins and stays until reset. Answers the stop the run holds.
    `epoch` (`same_epoch`): RunReset, nothing stopped, when a reset has ended it."""
    same_epoch(state, epoch)
    if not state.stopped:
        state.status = "stopped"
        state.stop_reason = reason
        state.stop_detail = detail
        state.updated_at = now
    return Denial(state.stop_reason or "stopped", state.stop_detail or "the run is stopped")


def record_step(state: RunState, step: Mapping[str, Any], now: float) -> int:
    """Append the step to the run's list; one that names an epoch a reset has ended since (it was in
    flight then) is left out: the fresh run lists its own steps (SQLite files it under its epoch).
    Answers the step's epoch (`RunStore.record_step`)."""
    given = step.get("epoch")
    if given is not None and int(given) != state.epoch:
        return int(given)
    state.steps.append(dict(step))
    if len(state.steps) > MAX_STEPS:
        del state.steps[: len(state.steps) - MAX_STEPS]
    state.updated_at = now
    return state.epoch


def claim_root(state: RunState, epoch: int, *, final: bool, stopped: bool, upto: float | None,
               now: float) -> RootClaim | None:
    """Claim the export of the epoch's next `invoke_agent` root span (`RunStore.claim_root`).

    `final`: the run stops or is reset (its root ends the epoch for good; later steps go under it); else
    it went idle, and `upto` is the latest `updated_at` the caller judged idle (a run busy again since,
    or stopped, is not claimed: its stop exports it). There is something to export when no root was, or
    the run's `updated_at` moved since the last one (a step, a settlement, a stop: `roots_mark`), or
    the run `stopped` (news even with nothing written since its idle root: a step in flight stopped it).
    A final claim with nothing to export still ends the epoch's roots. The claim writes no `updated_at`:
    it is no activity of the run."""
    if state.epoch != epoch or state.roots_final:
        return None
    if not final and (state.stopped or (upto is not None and (state.updated_at or 0.0) > upto)):
        return None
    news = state.roots == 0 or state.updated_at != state.roots_mark
    if not news and not (final and stopped):
        state.roots_final = final
        return None
    claimed = state.roots, state.roots_end
    state.roots += 1
    state.roots_final, state.roots_mark, state.roots_end = final, state.updated_at, now
    return claimed


def reset(state: RunState, now: float) -> RootClaim | None:
    """Start the run afresh under a new epoch; reservations in flight settle into nothing. Answers the
    ending epoch's final root when the reset claims it (`claim_root`): with the reset, so that a reset
    refused leaves the epoch's roots as they were."""
    ended = claim_root(state, state.epoch, final=True, stopped=state.stopped, upto=None, now=now)
    state.epoch += 1
    state.roots, state.roots_final, state.roots_mark, state.roots_end = 0, False, None, None
    state.status = "active"
    state.stop_reason = None
    state.stop_detail = None
    state.started_at = None
    state.used.clear()
    state.reserved.clear()
    state.lists.clear()
    state.open.clear()
    state.steps.clear()
    state.updated_at = now
    return ended


def to_dict(state: RunState) -> dict[str, Any]:
    return {
        "run_id": state.run_id,
        "agent": state.agent,
        "epoch": state.epoch,
        "status": state.status,
        "stop_reason": state.stop_reason,
        "stop_detail": state.stop_detail,
        "started_at": state.started_at,
        "updated_at": state.updated_at,
        "used": state.used,
        "reserved": state.reserved,
        "lists": state.lists,
        "open": state.open,
        "steps": state.steps,
        "roots": state.roots,
        "roots_final": state.roots_final,
        "roots_mark": state.roots_mark,
        "roots_end": state.roots_end,
    }


def from_dict(data: Mapping[str, Any]) -> RunState:
    return RunState(
        run_id=data["run_id"],
        agent=data["agent"],
        epoch=int(data.get("epoch", 1)),
        status=data.get("status", "active"),
        stop_reason=data.get("stop_reason"),
        stop_detail=data.get("stop_detail"),
        started_at=data.get("started_at"),
        updated_at=data.get("updated_at"),
        used=dict(data.get("used", {})),
        reserved=dict(data.get("reserved", {})),
        lists={k: list(v) for k, v in data.get("lists", {}).items()},
        open=dict(data.get("open", {})),
        steps=list(data.get("steps", [])),
        roots=int(data.get("roots", 0)),  # absent from a run written before roots were kept
        roots_final=bool(data.get("roots_final", False)),
        roots_mark=data.get("roots_mark"),
        roots_end=data.get("roots_end"),
    )
