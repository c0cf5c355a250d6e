"""Run root spans: a run's `invoke_agent` root is exported with its totals when the run stops (`claim_stop`
then `end_with`; `end_root`) or is reset (`end_reset`), and by `end_idle_runs` once it was idle for
`otel.run_idle_s`, not for good (a step of the run after that goes under its next root: `otel.runs`).
Each export is claimed in the run store first (`RunStore.claim_root`): of the gateway processes sharing
it, one exports each root."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from gateway.errors import GatewayError
from gateway.observe import telemetry_of
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import UNREPORTED_USAGE, RootClaim, RunState
from otel.attributes import provider_name_for
from otel.runs import RunTotals, path_fingerprint
from otel.telemetry import Telemetry

_SWEPT_SERVICE: Final = "observe.idle_swept"
_LATE_SERVICE: Final = "observe.late_roots"  # the `_export_if_claimed` tasks, while they run
_LATE_READS_S: Final = (0.0, 0.5, 2.0)  # when a claim whose answer was lost is looked for in the run
# step.extra: the run (RunState) the step stopped and the root it claimed, which `end_with` exports
ENDS_RUN: Final = "ends_run"


async def claim_stop(gw: Gateway, step: Step) -> None:
    """For a step that stopped its run (or was refused by the stop): read the run and claim its final root,
    for `end_with` to export once the step's own span ended. Nothing when tracing is off or the epoch's
    roots ended already. A claim whose answer is lost (the store failing, the client leaving) is looked
    for afterwards (`_claim`)."""
    telemetry = telemetry_of(gw)
    if telemetry is None or not telemetry.tracing:
        return
    state = await gw.store.get(step.run_id, steps=True, reservations=False)
    claimed = await _claim_stop(gw, state)
    if state is not None and claimed is not None:
        step.extra[ENDS_RUN] = (state, claimed)


def end_with(gw: Gateway, step: Step) -> None:
    """A step hook after `observe.on_step`: the root of the run the step stopped is exported after the
    step's own span ended, so the run's root spans its stopping step (it ended 1-2 ms before it)."""
    ends = step.extra.pop(ENDS_RUN, None)
    if ends is not None:
        state, claimed = ends
        export_root(gw, state, claimed)


async def end_root(gw: Gateway, state: RunState) -> bool:
    """Claim the final root of the run's epoch in the store when the run stopped, and export it when this
    process won the claim (a reset claims its own: `end_reset`). False when nothing was exported (tracing
    off, claimed elsewhere, the epoch's roots ended already, nothing new since its last root, the store
    failing: counted)."""
    claimed = await _claim_stop(gw, state)
    if claimed is None:
        return False
    export_root(gw, state, claimed)
    return True


def end_reset(gw: Gateway, fresh: RunState) -> None:
    """After a reset: export the ended epoch's final root the reset claimed, with that epoch's totals as
    the reset found them (`RunStore.reset`)."""
    if fresh.ended is not None:
        before, claimed = fresh.ended
        export_root(gw, before, claimed)


async def _claim_stop(gw: Gateway, state: RunState | None) -> RootClaim | None:
    """The final root of a stopped run's epoch, claimed; None when tracing is off, the run is not stopped or
    its epoch's roots ended already (a refusal of a stopped run: no round trip), or the claim was not won."""
    telemetry = telemetry_of(gw)
    if telemetry is None or not telemetry.tracing or state is None or not state.stopped or state.roots_final:
        return None
    return await _claim(gw, telemetry, state, final=True)


async def _claim(gw: Gateway, telemetry: Telemetry, state: RunState, *, final: bool, upto: float | None = None,
                 quiet: bool = True) -> RootClaim | None:
    """Claim the run epoch's next root (`RunStore.claim_root`). A claim whose answer was lost (the store
    failing or too slow to answer, the caller cancelled) may have landed all the same, and then no process
    would export its root: the run is read again in the background (`_export_if_claimed`). A failing
    store is then counted and answered None, or with `quiet=False` raised (a sweep is retried whole).
    Not a task of its own for every claim: that would be a turn of the loop between a step's answer and
    its span's end, for a store that answers at once."""
    now = time.time()
    try:
        return await gw.store.claim_root(state.run_id, state.epoch, final=final, stopped=state.stopped, upto=upto,
                                         now=now)
    except (GatewayError, asyncio.CancelledError) as exc:
        late: set[asyncio.Task[None]] = gw.services.setdefault(_LATE_SERVICE, set())
        task = asyncio.get_running_loop().create_task(_export_if_claimed(gw, state, now, final))
        late.add(task)
        task.add_done_callback(late.discard)
        if isinstance(exc, GatewayError) and quiet:
            telemetry.record_error("end_run")
            return None
        raise


async def _export_if_claimed(gw: Gateway, state: RunState, now: float, final: bool) -> None:
    """Export the root of a claim whose answer was lost, when the run says it was this one's: its count of
    roots one more than `state`'s, with the `roots_end` (`now`) the claim wrote. Read again a few times
    (a script cut by a deadline may run after a read on another connection, or the store may be away)."""
    for delay in _LATE_READS_S:
        await asyncio.sleep(delay)
        try:
            after = await gw.store.get(state.run_id, steps=False, reservations=False)
        except GatewayError:
            continue
        if after is None or after.epoch != state.epoch:
            return
        if after.roots > state.roots:  # claimed since: by this claim, or by another
            if after.roots == state.roots + 1 and after.roots_end == now and after.roots_final == final:
                export_root(gw, state, (state.roots, state.roots_end))
            return


async def end_late_claims(gw: Gateway) -> None:
    """At shutdown, before the store closes: stop looking for claims whose answer was lost (what is left of
    them is lost with the process, as a span still queued would be)."""
    late: set[asyncio.Task[None]] = gw.services.get(_LATE_SERVICE) or set()
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)


def export_root(gw: Gateway, state: RunState, claimed: RootClaim) -> None:
    """Export the root span `claimed` for the run (`end_root`), with the run's totals as `state` has them."""
    telemetry = telemetry_of(gw)
    if telemetry is None:
        return
    decisions = [f"{s.get('operation')}:{s.get('decision')}:{s.get('stop_reason') or ''}" for s in state.steps]
    providers = {str(s.get("provider")) for s in state.steps if s.get("operation") != "execute_tool"}
    provider = None
    if len(providers) == 1:
        only = gw.config.providers.get(next(iter(providers)))
        if only is not None:
            provider = provider_name_for(only.type, only.base_url, custom=next(iter(providers)))
    totals = RunTotals(
        cost_usd=state.used.get("usd", 0.0),
        input_tokens=int(state.used.get("input_tokens", 0)),
        output_tokens=int(state.used.get("output_tokens", 0)),
        llm_calls=int(state.used.get("llm_calls", 0)),
        tool_calls=int(state.used.get("tool_calls", 0)),
        stop_reason=state.stop_reason,
        path_fingerprint=path_fingerprint(decisions),
        provider_name=provider,
        usage_estimated=state.used.get(UNREPORTED_USAGE, 0.0) > 0,  # counted by the store: steps are trimmed
    )
    segment, start = claimed
    telemetry.end_run(state.run_id, state.agent, started_at=state.started_at or time.time(), totals=totals,
                      epoch=state.epoch, segment=segment, start=start)


# -- idle runs ------------------------------------------------------------------------------------


class _Swept:
    """How far the idle sweeps of this process have looked: every run last updated at or before
    `upto` was judged (None before the first sweep)."""

    __slots__ = ("upto",)

    def __init__(self) -> None:
        self.upto: float | None = None


async def end_idle_runs(gw: Gateway, idle_s: float, now: float) -> int:
    """End (export the root span of) every active run with no step for `idle_s`. Returns how many runs
    it judged idle (one with nothing new since its last root exports nothing).

    A sweep reads only the runs that went idle since the previous sweep (`RunStore.runs_updated`), so
    however many runs the store holds, each is reached once it is idle, without loading all of them
    each time. The first sweep of a process starts where the sweeps of the processes before it stopped
    (`RunStore.idle_swept`), however long the gateway was down (one idle period back for a store no sweep
    has marked): runs that went idle while nobody was sweeping are ended too. A run that became active
    again and went idle again is seen again, and its next root exported (`RunStore.claim_root`); one
    with nothing new since its last root, or whose root another process sharing the store exported,
    exports nothing. A sweep the store fails is retried whole."""
    telemetry: Telemetry | None = gw.services.get("telemetry")
    if telemetry is None or not telemetry.tracing:
        return 0
    swept = gw.services.get(_SWEPT_SERVICE)
    if not isinstance(swept, _Swept):
        swept = gw.services[_SWEPT_SERVICE] = _Swept()
    before = now - idle_s
    after = swept.upto
    if after is None:  # where the sweeps of the processes before this one stopped, however long ago
        kept = await gw.store.idle_swept()
        after = min(kept, before) if kept is not None else before - idle_s
    ended = 0
    async for page in gw.store.runs_updated(after, before):
        for state in page:
            # what the page shows is current: a run busy again since the window was read is left out
            if state.status == "active" and state.updated_at is not None and state.updated_at <= before:
                # a step after this goes under the run's next root; another process may claim it first. A
                # store that fails the claim fails the sweep, retried whole (its mark does not move)
                claimed = await _claim(gw, telemetry, state, final=False, upto=before, quiet=False)
                if claimed is not None:
                    export_root(gw, state, claimed)
                ended += 1
        await asyncio.sleep(0)  # a backlog is many pages: let requests run between them
    swept.upto = max(after, before)
    await gw.store.set_idle_swept(swept.upto)
    return ended
