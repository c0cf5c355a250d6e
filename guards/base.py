"""The `StopCondition` protocol: one guard, two hooks, typed decisions.

A guard is pure: it reads the step (`StepContext`: the neutral `Call`, the agent's policy, a snapshot of
the run taken before the step) and returns a `Decision`. It never touches the store itself. Its wishes
reach the store as data: `claims` (amounts reserved atomically before the call, with limits) and
`effects` (counters and histories updated after). The pipeline applies them atomically, so a limit
holds even when concurrent steps race, and the same guard works for every provider.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from gateway.call import Answer, Call
from gateway.config import Agent
from gateway.frozen_init import fast_init
from gateway.pricing import ModelPrice
from gateway.store.base import Add, Claim, Push, RunState

__all__ = ["REASK", "Add", "BaseGuard", "Decision", "Effect", "Push", "StepContext", "StopCondition"]


Effect = Add | Push


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    """What one guard decided about one step."""

    guard: str
    action: Literal["allow", "stop", "reject"] = "allow"  # reject: refuse this step, the run goes on
    reason: str | None = None  # the stop code when action == "stop"
    detail: str = ""
    claims: tuple[Claim, ...] = ()
    effects: tuple[Effect, ...] = ()
    param: str | None = None  # a reject's request field at fault, named in the error (`InvalidRequest.param`)

    @classmethod
    def allow(cls, guard: str, *, claims: tuple[Claim, ...] = (), effects: tuple[Effect, ...] = ()) -> Decision:
        if not claims and not effects and cls is Decision:
            return _plain_allow(guard)  # immutable: one shared instance per guard name
        return cls(guard, "allow", claims=claims, effects=effects)

    @classmethod
    def stop(cls, guard: str, reason: str, detail: str) -> Decision:
        return cls(guard, "stop", reason, detail)

    @classmethod
    def reject(cls, guard: str, reason: str, detail: str, *, param: str | None = None) -> Decision:
        """Refuse this step as a bad request (400) without stopping the run: retrying cannot help,
        but fixing the request (`param`, when one field is at fault) or the config can."""
        return cls(guard, "reject", reason, detail, param=param)

    @property
    def stopped(self) -> bool:
        return self.action == "stop"


@functools.lru_cache(maxsize=1024)
def _plain_allow(guard: str) -> Decision:
    # guards allow most steps with nothing to claim: building the frozen dataclass each time costs more
    return Decision(guard, "allow")


REASK = "reask"  # StepContext.extra: the step is a re-ask tollgate sends, not the agent's own request


@fast_init
@dataclass(frozen=True, slots=True)
class StepContext:
    """Everything a guard may read about a step. `run` is None for a run's first step."""

    call: Call
    agent: str
    run_id: str
    policy: Agent
    run: RunState | None
    now: float
    price: ModelPrice | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def history(self, key: str) -> list[str]:
        return [] if self.run is None else self.run.lists.get(key, [])


@runtime_checkable
class StopCondition(Protocol):
    """A guard. `before` runs before the step is forwarded; `after` once its answer is known.

    `after` sees the answer before the agent does: a stop there withholds the answer.
    """

    name: str

    def before(self, ctx: StepContext) -> Decision: ...

    def after(self, ctx: StepContext, answer: Answer) -> Decision: ...


class BaseGuard:
    """Convenience base: allow on both hooks; subclasses override what they need."""

    name = "guard"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)
