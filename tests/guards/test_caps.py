"""Cap guard: LLM calls claimed before, tool calls counted after, wall time since the first step."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.store.base import Claim, Denial, Reservation, RunState
from guards.base import Add, Decision, Push
from guards.caps import CapsGuard
from tests.guards.support import answer, apply_effects, call, ctx, mcp_call, policy, reserve, run, tool

GUARD = CapsGuard()


def llm_claim(limit: float | None) -> tuple[Claim, ...]:
    return (Claim("llm_calls", 1.0, 0.0, limit, "llm_call_cap"),)


ALLOW = Decision.allow("caps", claims=llm_claim(None))
ALLOW_40 = Decision.allow("caps", claims=llm_claim(40.0))
T0 = run(started_at=0.0)


@pytest.mark.parametrize(
    ("caps", "state", "now", "operation", "expected"),
    [
        ({}, None, 0.0, "chat", ALLOW),
        ({"llm_calls": 40}, None, 0.0, "chat", ALLOW_40),
        # the guard claims; the store decides whether the 41st call fits
        ({"llm_calls": 40}, run(used={"llm_calls": 40.0}), 0.0, "chat", ALLOW_40),
        # time cap: counted from the run's first step
        ({"seconds": 600}, None, 10**9, "chat", ALLOW),  # first step of the run
        ({"seconds": 600}, T0, 599.0, "chat", ALLOW),
        ({"seconds": 600}, T0, 600.0, "chat", ALLOW),
        ({"seconds": 600}, T0, 600.5, "chat", "time_cap"),
        ({"seconds": 600, "llm_calls": 1}, T0, 900.0, "chat", "time_cap"),
        # a run just reset has no start yet: its clock starts again
        ({"seconds": 600}, run(started_at=None), 10**9, "chat", ALLOW),
        # MCP tool executions: no LLM call claimed, but the time cap applies
        ({"llm_calls": 1}, T0, 1.0, "execute_tool", Decision.allow("caps")),
        ({"seconds": 60}, T0, 61.0, "execute_tool", "time_cap"),
    ],
    ids=[
        "no-caps",
        "llm-cap",
        "llm-cap-full",
        "time-first-step",
        "time-under",
        "time-boundary",
        "time-over",
        "time-before-llm",
        "time-after-reset",
        "mcp",
        "mcp-time-over",
    ],
)
def test_before(
    caps: dict[str, Any], state: RunState | None, now: float, operation: str, expected: Any
) -> None:
    c = mcp_call() if operation == "execute_tool" else call()
    decision = GUARD.before(ctx(c, policy(caps=caps), state, now=now))
    if isinstance(expected, str):
        assert decision.stopped and decision.reason == expected
        assert f"{caps['seconds']:g}s" in decision.detail
        assert decision.claims == () and decision.effects == ()
    else:
        assert decision == expected


@pytest.mark.parametrize(
    ("caps", "calls", "operation", "extra", "effects"),
    [
        ({}, 0, "chat", {}, ()),
        ({}, 2, "chat", {}, (Add("tool_calls", 2.0, None, "tool_call_cap"),)),
        ({"tool_calls": 60}, 1, "chat", {}, (Add("tool_calls", 1.0, 60.0, "tool_call_cap"),)),
        ({"tool_calls": 60}, 3, "chat", {}, (Add("tool_calls", 3.0, 60.0, "tool_call_cap"),)),
        # an MCP tools/call with no matching proposal counts on its own
        (
            {"tool_calls": 5},
            0,
            "execute_tool",
            {"counts_tool_call": True},
            (Add("tool_calls", 1.0, 5.0, "tool_call_cap"),),
        ),
        # ... the execution of a proposal already counted does not count again
        ({"tool_calls": 5}, 0, "execute_tool", {"counts_tool_call": False}, ()),
        ({"tool_calls": 5}, 0, "execute_tool", {}, ()),
    ],
    ids=["no-calls", "uncapped", "one", "parallel", "mcp-unproposed", "mcp-proposed", "mcp-default"],
)
def test_after(caps: dict[str, Any], calls: int, operation: str, extra: dict[str, Any], effects: Any) -> None:
    c = mcp_call() if operation == "execute_tool" else call()
    ans = answer(*(tool("search", f'{{"q": {i}}}', f"t{i}") for i in range(calls)))
    decision = GUARD.after(ctx(c, policy(caps=caps), run(), extra=extra), ans)
    if operation == "chat" and calls:
        # proposals are remembered so that their MCP execution does not count twice
        effects += (Push("pending_calls", tuple(tc.fingerprint for tc in ans.tool_calls), 256),)
    assert decision == Decision.allow("caps", effects=effects)


@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later"])
def test_after_on_first_step(first: bool) -> None:
    decision = GUARD.after(
        ctx(p=policy(caps={"tool_calls": 2}), state=None if first else run()), answer(tool("a"))
    )
    assert decision.effects[0] == Add("tool_calls", 1.0, 2.0, "tool_call_cap")


def test_llm_call_cap_grants_exactly_the_cap() -> None:
    state = run()
    p = policy(caps={"llm_calls": 3})
    grants = [reserve(state, GUARD.before(ctx(call(), p, state)), 0) for _ in range(5)]
    assert [isinstance(g, Reservation) for g in grants] == [True, True, True, False, False]
    assert isinstance(grants[3], Denial) and grants[3].reason == "llm_call_cap"
    assert "llm_calls limit 3 would be exceeded" in grants[3].detail
    assert state.stopped and state.stop_reason == "llm_call_cap"
    assert isinstance(grants[4], Denial) and grants[4].reason == "llm_call_cap"  # sticky


@pytest.mark.parametrize(
    ("proposed", "stopped_at"),
    [
        ([1, 1, 1], None),  # exactly the cap
        ([1, 1, 1, 1], 3),  # the answer that would cross it is withheld
        ([2, 2], 1),  # parallel calls cross it together
        ([3], None),
        ([4], 0),
    ],
)
def test_tool_call_cap(proposed: list[int], stopped_at: int | None) -> None:
    state = run()
    p = policy(caps={"tool_calls": 3})
    for index, n in enumerate(proposed):
        ans = answer(*(tool("t", f'{{"i": {index}, "j": {j}}}') for j in range(n)))
        denial = apply_effects(state, GUARD.after(ctx(call(), p, state), ans))
        if denial is not None:
            assert index == stopped_at
            assert denial.reason == "tool_call_cap" and state.stop_reason == "tool_call_cap"
            break
    else:
        assert stopped_at is None
        assert state.used["tool_calls"] == sum(proposed)
    assert state.used.get("tool_calls", 0.0) <= 3


@pytest.mark.parametrize(("calls", "hosted", "added"), [(0, 2, 2.0), (1, 3, 4.0)])
def test_after_counts_calls_the_provider_ran(calls: int, hosted: int, added: float) -> None:
    """Web searches or MCP calls the provider ran itself count toward the cap (after they ran)."""
    ans = replace(answer(*(tool("search", f'{{"q": {i}}}', f"t{i}") for i in range(calls))), hosted_calls=hosted)
    decision = GUARD.after(ctx(call(), policy(caps={"tool_calls": 10}), run()), ans)
    assert decision.effects[0] == Add("tool_calls", added, 10.0, "tool_call_cap")
