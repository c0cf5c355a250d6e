"""GuardChain: run order, first stop wins, claims and effects collected, failing guards (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.call import Answer
from gateway.store.base import Claim
from guards.base import Add, Decision, Push, StepContext
from guards.chain import GUARD_ERROR, GuardChain
from tests.guards.support import answer, ctx


class Scripted:
    """A guard that returns (or raises) what it is told, and logs every hook call."""

    def __init__(self, name: str, outcome: Any, log: list[str]) -> None:
        self.name = name
        self._outcome = outcome
        self._log = log

    def _hook(self, hook: str) -> Decision:
        self._log.append(f"{self.name}.{hook}")
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        if self._outcome == "allow":
            return Decision.allow(
                self.name, claims=(Claim(self.name, 1.0),), effects=(Push(self.name, ("x",), 1),)
            )
        if self._outcome == "stop":
            return Decision.stop(self.name, f"{self.name}_stop", f"{self.name} says stop")
        return self._outcome  # type: ignore[no-any-return]

    def before(self, ctx: StepContext) -> Decision:
        return self._hook("before")

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return self._hook("after")


def run_chain(hook: str, spec: list[tuple[str, Any, str]]) -> tuple[Any, list[str], list[str]]:
    log: list[str] = []
    errors: list[str] = []
    chain = GuardChain(
        [(Scripted(name, outcome, log), on_error) for name, outcome, on_error in spec], errors.append
    )
    verdict = chain.before(ctx()) if hook == "before" else chain.after(ctx(), answer())
    return verdict, log, errors


HOOKS = pytest.mark.parametrize("hook", ["before", "after"])


@HOOKS
def test_all_allow_runs_every_guard_in_order_and_collects_claims_and_effects(hook: str) -> None:
    verdict, log, errors = run_chain(hook, [(n, "allow", "fail_closed") for n in ("a", "b", "c")])
    assert log == [f"a.{hook}", f"b.{hook}", f"c.{hook}"]
    assert verdict.stop is None
    assert [d.guard for d in verdict.decisions] == ["a", "b", "c"]
    assert [c.counter for c in verdict.claims] == ["a", "b", "c"]
    assert [e.key for e in verdict.effects if isinstance(e, Push)] == ["a", "b", "c"]
    assert errors == []


@HOOKS
@pytest.mark.parametrize(
    ("outcomes", "stopper", "ran"),
    [
        (["stop", "allow", "allow"], "a", ["a"]),
        (["allow", "stop", "allow"], "b", ["a", "b"]),
        (["allow", "allow", "stop"], "c", ["a", "b", "c"]),
        (["allow", "stop", "stop"], "b", ["a", "b"]),  # the first stop wins
        (["stop", "stop", "stop"], "a", ["a"]),
    ],
)
def test_first_stop_wins(hook: str, outcomes: list[str], stopper: str, ran: list[str]) -> None:
    spec = [(n, o, "fail_closed") for n, o in zip("abc", outcomes, strict=True)]
    verdict, log, _ = run_chain(hook, spec)
    assert verdict.stop == Decision.stop(stopper, f"{stopper}_stop", f"{stopper} says stop")
    assert log == [f"{n}.{hook}" for n in ran]  # later guards never run
    assert [d.guard for d in verdict.decisions] == ran
    # a stopped step reserves nothing and changes nothing
    assert verdict.claims == () and verdict.effects == ()


@HOOKS
@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (RuntimeError("boom"), "guard b failed: RuntimeError: boom"),
        (KeyError("k"), "guard b failed: KeyError: 'k'"),
        (None, "guard b failed: TypeError: returned NoneType, not a Decision"),  # not a Decision: a failure
        ("allow please", "guard b failed: TypeError: returned str, not a Decision"),
    ],
    ids=["runtime-error", "key-error", "returns-none", "returns-str"],
)
def test_a_failing_guard_fails_closed(hook: str, failure: Any, message: str) -> None:
    verdict, log, errors = run_chain(
        hook, [("a", "allow", "fail_closed"), ("b", failure, "fail_closed"), ("c", "allow", "fail_closed")]
    )
    assert verdict.stop is not None
    assert (verdict.stop.guard, verdict.stop.reason, verdict.stop.detail) == ("b", GUARD_ERROR, message)
    assert GUARD_ERROR == "guard_error"
    assert log == [f"a.{hook}", f"b.{hook}"]
    assert errors == ["b"]  # the on_guard_error callback counts it
    assert verdict.claims == () and verdict.effects == ()


@HOOKS
@pytest.mark.parametrize("failure", [RuntimeError("boom"), None], ids=["raises", "returns-none"])
def test_a_failing_guard_configured_fail_open_allows(hook: str, failure: Any) -> None:
    verdict, log, errors = run_chain(
        hook, [("a", "allow", "fail_closed"), ("b", failure, "fail_open"), ("c", "allow", "fail_closed")]
    )
    assert verdict.stop is None
    assert log == [f"a.{hook}", f"b.{hook}", f"c.{hook}"]
    assert verdict.decisions[1] == Decision.allow("b")
    assert [c.counter for c in verdict.claims] == ["a", "c"]
    assert errors == ["b"]  # still counted


def test_fail_open_does_not_hide_a_later_stop() -> None:
    verdict, _, errors = run_chain(
        "before", [("a", RuntimeError("x"), "fail_open"), ("b", "stop", "fail_closed")]
    )
    assert verdict.stop is not None and verdict.stop.reason == "b_stop"
    assert errors == ["a"]


def test_without_a_callback_a_failure_is_still_a_stop() -> None:
    chain = GuardChain([(Scripted("a", ValueError("bad"), []), "fail_closed")])
    verdict = chain.before(ctx())
    assert verdict.stop is not None and verdict.stop.reason == GUARD_ERROR


def test_base_exceptions_are_not_swallowed() -> None:
    chain = GuardChain([(Scripted("a", KeyboardInterrupt(), []), "fail_open")])
    with pytest.raises(KeyboardInterrupt):
        chain.before(ctx())


def test_names_and_an_empty_chain() -> None:
    log: list[str] = []
    chain = GuardChain(
        [(Scripted("x", "allow", log), "fail_closed"), (Scripted("y", "allow", log), "fail_open")]
    )
    assert chain.names == ("x", "y")
    empty = GuardChain([])
    verdict = empty.before(ctx())
    assert empty.names == () and verdict.stop is None and verdict.decisions == ()


def test_effects_keep_their_types_and_order_within_a_guard() -> None:
    effects = (Add("tool_calls", 1.0, 3.0, "tool_call_cap"), Push("calls", ("f",), 6))
    chain = GuardChain([(Scripted("a", Decision.allow("a", effects=effects), []), "fail_closed")])
    assert chain.after(ctx(), answer()).effects == effects
