"""Run root spans: `end_run` exports a run's `invoke_agent` root with its totals when the run stops or is
reset; `end_idle_runs` does so for runs idle for `otel.run_idle_s`, not for good (a step of the run after
that starts its next root: `otel.runs.RunRoots`)."""

from __future__ import annotations

import asyncio
import time
from typing import Final

from gateway.observe import telemetry_of
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import UNREPORTED_USAGE, RunState
from otel.attributes import provider_name_for
from otel.runs import RunTotals, path_fingerprint
from otel.telemetry import Telemetry

_SWEPT_SERVICE: Final = "observe.idle_swept"
ENDS_RUN: Final = "ends_run"  # step.extra: the run (RunState) the step stopped, whose root `end_with` exports


def end_with(gw: Gateway, step: Step) -> None:
    """A step hook after `observe.on_step`: the root of the run the step stopped is exported after the
    step's own span ended, so the run's root spans its stopping step (it ended 1-2 ms before it)."""
    state = step.extra.pop(ENDS_RUN, None)
    if isinstance(state, RunState):
        end_run(gw, state)


def end_run(gw: Gateway, state: RunState, *, final: bool = True) -> None:
    """Export the run's `invoke_agent` root span with its totals: when the run stops or is reset
    (`final`), or went idle."""
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
    telemetry.end_run(state.run_id, state.agent, started_at=state.started_at or time.time(), totals=totals,
                      epoch=state.epoch, final=final)


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
    again and went idle again is seen again, and its next root exported (`otel.runs.RunRoots`); one
    with no step since its last root exports nothing. A sweep the store fails is retried whole."""
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
                end_run(gw, state, final=False)  # a step after this starts the run's next root
                ended += 1
        await asyncio.sleep(0)  # a backlog is many pages: let requests run between them
    swept.upto = max(after, before)
    await gw.store.set_idle_swept(swept.upto)
    return ended
