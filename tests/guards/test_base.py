"""The decision type, effects, step context and the StopCondition protocol (pure, no event loop)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.call import Answer
from gateway.store.base import Claim
from guards.base import Add, BaseGuard, Decision, Push, StepContext, StopCondition
from guards.budget import BudgetGuard
from guards.caps import CapsGuard
from guards.loop import LoopGuard, ProgressGuard
from tests.guards.support import answer, ctx, run

CLAIM = Claim("usd", 0.01, 1e-6, 2.0, "budget_exhausted")
PUSH = Push("calls", ("a",), 6)


@pytest.mark.parametrize(
    ("decision", "action", "reason", "detail", "stopped", "claims", "effects"),
    [
        (Decision.allow("g"), "allow", None, "", False, (), ()),
        (Decision.allow("g", claims=(CLAIM,)), "allow", None, "", False, (CLAIM,), ()),
        (Decision.allow("g", effects=(PUSH,)), "allow", None, "", False, (), (PUSH,)),
        (Decision.stop("g", "loop_detected", "why"), "stop", "loop_detected", "why", True, (), ()),
        (Decision("g"), "allow", None, "", False, (), ()),
        (Decision("g", "stop", "time_cap", "late"), "stop", "time_cap", "late", True, (), ()),
    ],
    ids=["allow", "allow-claims", "allow-effects", "stop", "default", "explicit-stop"],
)
def test_decision_table(
    decision: Decision,
    action: str,
    reason: str | None,
    detail: str,
    stopped: bool,
    claims: tuple[Claim, ...],
    effects: tuple[Any, ...],
) -> None:
    assert decision.guard == "g"
    assert (decision.action, decision.reason, decision.detail) == (action, reason, detail)
    assert decision.stopped is stopped
    assert decision.claims == claims
    assert decision.effects == effects


def test_a_stop_carries_no_claims_or_effects() -> None:
    stop = Decision.stop("g", "no_progress", "stalled")
    assert stop.claims == () and stop.effects == ()


@pytest.mark.parametrize("value", [Decision.allow("g"), Add("c", 1.0), PUSH, CLAIM])
def test_decisions_claims_and_effects_are_frozen(value: Any) -> None:
    field = dataclasses.fields(value)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, "changed")


@pytest.mark.parametrize(
    ("effect", "expected"),
    [
        (Add("tool_calls", 2.0), ("tool_calls", 2.0, None, "")),
        (Add("tool_calls", 1.0, 60.0, "tool_call_cap"), ("tool_calls", 1.0, 60.0, "tool_call_cap")),
    ],
)
def test_add_fields(effect: Add, expected: tuple[Any, ...]) -> None:
    assert (effect.counter, effect.amount, effect.limit, effect.code) == expected


def test_equal_decisions_compare_equal() -> None:
    assert Decision.allow("g", effects=(PUSH,)) == Decision.allow("g", effects=(Push("calls", ("a",), 6),))
    assert Decision.stop("g", "x", "d") != Decision.stop("g", "y", "d")


@pytest.mark.parametrize(
    ("state", "key", "expected"),
    [
        (None, "calls", []),  # first step of a run: no snapshot yet
        (run(), "calls", []),
        (run(lists={"calls": ["a", "b"]}), "calls", ["a", "b"]),
        (run(lists={"calls": ["a"]}), "results", []),
    ],
    ids=["first-step", "empty-run", "present", "other-key"],
)
def test_step_context_history(state: Any, key: str, expected: list[str]) -> None:
    assert ctx(state=state).history(key) == expected


def test_step_context_defaults() -> None:
    c = StepContext(call=ctx().call, agent="a", run_id="r", policy=ctx().policy, run=None, now=0.0)
    assert c.price is None and dict(c.extra) == {}


def test_base_guard_allows_both_hooks() -> None:
    guard = BaseGuard()
    assert guard.before(ctx()) == Decision.allow("guard")
    assert guard.after(ctx(), answer()) == Decision.allow("guard")


class _NoAfter:
    name = "x"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)


class _NoName:
    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow("x")

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow("x")


@pytest.mark.parametrize(
    ("obj", "conforms"),
    [
        (BaseGuard(), True),
        (BudgetGuard(), True),
        (CapsGuard(), True),
        (LoopGuard(), True),
        (ProgressGuard(), True),
        (_NoAfter(), False),
        (_NoName(), False),
        (object(), False),
    ],
    ids=["base", "budget", "caps", "loop", "progress", "no-after", "no-name", "object"],
)
def test_stop_condition_protocol(obj: object, conforms: bool) -> None:
    assert isinstance(obj, StopCondition) is conforms


@pytest.mark.parametrize(
    ("guard", "name"),
    [(BudgetGuard(), "budget"), (CapsGuard(), "caps"), (LoopGuard(), "loop"), (ProgressGuard(), "progress")],
)
def test_builtin_guards_sign_their_decisions(guard: StopCondition, name: str) -> None:
    assert guard.name == name
    assert guard.before(ctx()).guard == name
    assert guard.after(ctx(), answer()).guard == name
