"""Runs an agent's guards in order. A guard that raises fails closed unless configured otherwise.

A guard that returns something other than a `Decision` has failed like one that raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.call import Answer
from gateway.frozen_init import fast_init
from gateway.store.base import Claim
from guards.base import Decision, Effect, StepContext, StopCondition

GUARD_ERROR = "guard_error"


@fast_init
@dataclass(frozen=True, slots=True)
class Verdict:
    """The chain's combined decision: the first stop (if any), all claims and effects, every decision."""

    stop: Decision | None
    claims: tuple[Claim, ...]
    effects: tuple[Effect, ...]
    decisions: tuple[Decision, ...]


class GuardChain:
    def __init__(
        self,
        guards: Sequence[tuple[StopCondition, str]],
        on_guard_error: Callable[[str], None] | None = None,
    ) -> None:
        self._guards = tuple(guards)
        self._on_error = on_guard_error

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g, _ in self._guards)

    def before(self, ctx: StepContext) -> Verdict:
        return self._run(lambda g: g.before(ctx))

    def after(self, ctx: StepContext, answer: Answer) -> Verdict:
        return self._run(lambda g: g.after(ctx, answer))

    def _run(self, hook: Callable[[StopCondition], Decision]) -> Verdict:
        decisions: list[Decision] = []
        claims: list[Claim] = []
        effects: list[Effect] = []
        for guard, on_error in self._guards:
            try:
                decision = hook(guard)
                if not isinstance(decision, Decision):
                    raise TypeError(f"returned {type(decision).__name__}, not a Decision")
            except Exception as exc:  # a guard is user code: any failure is a decision, never a crash
                if self._on_error is not None:
                    self._on_error(guard.name)
                if on_error == "fail_open":
                    decisions.append(Decision.allow(guard.name))
                    continue
                decision = Decision.stop(guard.name, GUARD_ERROR, f"guard {guard.name} failed: {type(exc).__name__}: {exc}")
            decisions.append(decision)
            if decision.action != "allow":
                return Verdict(decision, (), (), tuple(decisions))
            claims.extend(decision.claims)
            effects.extend(decision.effects)
        return Verdict(None, tuple(claims), tuple(effects), tuple(decisions))
