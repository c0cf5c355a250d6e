"""Loop and no-progress guards: tables of single decisions, then scripted agent loops (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from gateway.call import Answer, Call, ToolCall, ToolResult
from gateway.config import Agent
from gateway.store.base import RunState
from guards.base import Decision, Push
from guards.chain import GuardChain
from guards.loop import (
    FORGIVEN_RETRIES,
    RESULT_KEEP,
    RETRIES,
    RETRIES_KEEP,
    RETRY,
    LoopGuard,
    ProgressGuard,
    forgiven,
    retry_marks,
)
from tests.guards.support import answer, apply_effects, call, ctx, mcp_call, policy, run, snapshot, tool

LOOP = LoopGuard()
PROGRESS = ProgressGuard()
SMALL = policy(loop={"window": 4, "max_distinct": 2, "stall_steps": 3})

A = tool("search", '{"q": "a", "page": 1}')
A_REORDERED = tool("search", '{"page": 1,  "q": "a"}', "other-id")
B = tool("search", '{"q": "b"}')
C = tool("fetch", '{"id": 7}')
D = tool("fetch", '{"id": 8}')


def fp(*calls: ToolCall) -> list[str]:
    return [c.fingerprint for c in calls]


def res(text: str) -> str:
    return ToolResult("x", text).fingerprint


# -- fingerprints ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "right", "same"),
    [
        (A, A_REORDERED, True),  # key order and whitespace do not matter; the call id does not either
        (A, B, False),  # arguments differ
        (tool("search", '{"id": 7}'), tool("fetch", '{"id": 7}'), False),  # names differ
        (tool("x", ""), tool("x", "{}"), True),  # empty arguments are an empty object
        (tool("x", "not json"), tool("x", "not json"), True),  # non-JSON kept verbatim
        (tool("x", "not json"), tool("x", "not  json"), False),
    ],
)
def test_tool_call_fingerprint(left: ToolCall, right: ToolCall, same: bool) -> None:
    assert (left.fingerprint == right.fingerprint) is same


# -- loop: one decision ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "history", "calls", "expected"),
    [
        (policy(), [], [A, A, A, A, A, A, A], "allow-nothing"),  # no loop policy: nothing recorded
        (SMALL, [], [], "allow-nothing"),  # an answer without tool calls
        (SMALL, None, [A], fp(A)),  # first step of the run
        (SMALL, fp(A, A), [A], fp(A)),  # window not yet full: identical calls are fine
        (SMALL, fp(A, A, A), [A], "loop_detected"),  # window full, one distinct call
        (SMALL, fp(A, B, A), [B], "loop_detected"),  # two distinct <= max_distinct 2
        (SMALL, fp(A, B, C), [A], fp(A)),  # three distinct > max_distinct 2
        (SMALL, fp(A, A, A), [A_REORDERED], "loop_detected"),  # same call, arguments reordered
        (SMALL, fp(A, A, A), [B], "loop_detected"),  # one varied call among repeats: still 2 distinct
        (SMALL, fp(A, A, B), [C], fp(C)),  # varied arguments are new fingerprints
        (SMALL, fp(A, C, A, C), [B], fp(B)),  # only the last `window` calls count
        (SMALL, fp(B, C, D, A), [A], fp(A)),
        (SMALL, [], [A, A, A, A], "loop_detected"),  # parallel calls in one answer fill the window
        (SMALL, [], [A, B, C, D], fp(A, B, C, D)),
        (SMALL, fp(A, A), [B, B], "loop_detected"),
    ],
    ids=[
        "no-policy",
        "no-calls",
        "first-step",
        "not-full",
        "one-distinct",
        "two-distinct",
        "three-distinct",
        "reordered-args",
        "varied-b",
        "varied-c",
        "window-slides",
        "window-slides-2",
        "parallel-loop",
        "parallel-varied",
        "mixed",
    ],
)
def test_loop_after(p: Agent, history: list[str] | None, calls: list[ToolCall], expected: Any) -> None:
    state = None if history is None else run(lists={"calls": history})
    decision = LOOP.after(ctx(call(), p, state), answer(*calls))
    if expected == "allow-nothing":
        assert decision == Decision.allow("loop")
    elif expected == "loop_detected":
        assert decision.stopped and decision.reason == "loop_detected"
        assert "last 4 tool calls" in decision.detail and "max_distinct 2" in decision.detail
        for name in {c.name for c in calls}:
            assert name in decision.detail
        assert decision.effects == ()
    else:
        assert decision == Decision.allow("loop", effects=(loop_push(tuple(expected), *calls),))


def test_loop_before_allows() -> None:
    assert LOOP.before(ctx(call(), SMALL, run(lists={"calls": fp(A, A, A, A)}))) == Decision.allow("loop")


@pytest.mark.parametrize(
    ("extra", "history", "expected"),
    [
        # an MCP tools/call nobody proposed is judged like a proposal
        ({"counts_tool_call": True}, fp(A, A, A), "loop_detected"),
        ({"counts_tool_call": True}, fp(A, A), fp(A)),
        # the execution of a proposal was judged when proposed
        ({"counts_tool_call": False}, fp(A, A, A), "allow-nothing"),
        ({}, fp(A, A, A), "allow-nothing"),
    ],
    ids=["unproposed-loop", "unproposed-ok", "proposed", "default"],
)
def test_loop_mcp_execute_tool(extra: dict[str, Any], history: list[str], expected: Any) -> None:
    c = mcp_call(A.name, A.arguments)
    decision = LOOP.after(ctx(c, SMALL, run(lists={"calls": history}), extra=extra), answer(result="r"))
    if expected == "allow-nothing":
        assert decision == Decision.allow("loop")
    elif expected == "loop_detected":
        assert decision.stopped and decision.reason == "loop_detected"
    else:
        assert decision.effects == (loop_push(tuple(expected), A),)


# -- no progress: one decision ---------------------------------------------------------------------


def progress_effects(mark: str, new: tuple[str, ...] = (), request: str = "req-0") -> tuple[Push, ...]:
    effects = [Push("progress", (mark,), 3)]
    if new:
        effects.append(Push("results", new, RESULT_KEEP))
    effects.append(Push("request", (request,), 1))
    return tuple(effects)


@pytest.mark.parametrize(
    ("p", "c", "lists", "expected"),
    [
        (policy(), call(results=("r1",)), {}, Decision.allow("progress")),  # no loop policy
        (policy(loop={}), call(results=("r1",)), {}, Decision.allow("progress")),  # stall_steps unset
        (SMALL, mcp_call(), {"progress": ["0", "0"]}, Decision.allow("progress")),  # MCP: judged after
        (SMALL, call(), None, Decision.allow("progress", effects=progress_effects("1"))),  # first step
        (
            SMALL,
            call(results=("r1",)),
            {},
            Decision.allow("progress", effects=progress_effects("1", (res("r1"),))),
        ),
        # a step that brings one new result among old ones is progress
        (
            SMALL,
            call(results=("r1", "r2"), request_hash="req-1"),
            {"results": [res("r1")], "request": ["req-0"]},
            Decision.allow("progress", effects=progress_effects("1", (res("r2"),), "req-1")),
        ),
        # all results seen before: stalled
        (
            SMALL,
            call(results=("r1", "r1"), request_hash="req-1"),
            {"results": [res("r1")], "request": ["req-0"]},
            Decision.allow("progress", effects=progress_effects("0", (), "req-1")),
        ),
        # the identical request again: stalled, even without tool results
        (SMALL, call(), {"request": ["req-0"]}, Decision.allow("progress", effects=progress_effects("0"))),
        # a different request without tool results is progress
        (
            SMALL,
            call(request_hash="req-9"),
            {"request": ["req-0"]},
            Decision.allow("progress", effects=progress_effects("1", (), "req-9")),
        ),
        # the third stalled step in a row stops before the call goes upstream
        (SMALL, call(), {"request": ["req-0"], "progress": ["0", "0"]}, "no_progress"),
        (
            SMALL,
            call(results=("r1",), request_hash="req-2"),
            {"results": [res("r1")], "progress": ["0", "0"]},
            "no_progress",
        ),
        # ... but not when a progress step lies inside the window, nor before stall_steps marks exist
        (
            SMALL,
            call(),
            {"request": ["req-0"], "progress": ["1", "0"]},
            Decision.allow("progress", effects=progress_effects("0")),
        ),
        (
            SMALL,
            call(),
            {"request": ["req-0"], "progress": ["0"]},
            Decision.allow("progress", effects=progress_effects("0")),
        ),
        # progress resets the streak
        (
            SMALL,
            call(results=("r3",), request_hash="req-3"),
            {"results": [res("r1")], "progress": ["0", "0"]},
            Decision.allow("progress", effects=progress_effects("1", (res("r3"),), "req-3")),
        ),
    ],
    ids=[
        "no-policy",
        "no-stall-steps",
        "mcp-before",
        "first-step",
        "new-result",
        "one-new-among-old",
        "all-seen",
        "identical-request",
        "new-request",
        "third-stall-repeat",
        "third-stall-results",
        "progress-in-window",
        "streak-too-short",
        "progress-resets",
    ],
)
def test_progress_before(p: Agent, c: Call, lists: dict[str, list[str]] | None, expected: Any) -> None:
    state = None if lists is None else run(lists=lists)
    decision = PROGRESS.before(ctx(c, p, state))
    if isinstance(expected, str):
        assert decision.stopped and decision.reason == expected
        assert "3 consecutive steps" in decision.detail
    else:
        assert decision == expected


@pytest.mark.parametrize(
    ("c", "ans", "lists", "expected"),
    [
        (call(results=("r1",)), answer(), {}, Decision.allow("progress")),  # model calls: judged before
        (mcp_call(), answer(), {}, Decision.allow("progress")),  # MCP answer without a result
        (
            mcp_call(),
            answer(result="r1"),
            {},
            Decision.allow(
                "progress",
                effects=(Push("progress", ("1",), 3), Push("mcp_results", (res("r1"),), RESULT_KEEP)),
            ),
        ),
        (
            mcp_call(),
            answer(result="r1"),
            {"mcp_results": [res("r1")]},
            Decision.allow("progress", effects=(Push("progress", ("0",), 3),)),
        ),
        # a result the model already saw is new to the MCP history: each is judged once
        (
            mcp_call(),
            answer(result="r1"),
            {"results": [res("r1")]},
            Decision.allow(
                "progress",
                effects=(Push("progress", ("1",), 3), Push("mcp_results", (res("r1"),), RESULT_KEEP)),
            ),
        ),
        (
            mcp_call(),
            answer(result="r1"),
            {"mcp_results": [res("r1")], "progress": ["0", "0"]},
            "no_progress",
        ),
    ],
    ids=["chat", "mcp-no-result", "mcp-new", "mcp-seen", "mcp-own-history", "mcp-third-stall"],
)
def test_progress_after(c: Call, ans: Answer, lists: dict[str, list[str]], expected: Any) -> None:
    decision = PROGRESS.after(ctx(c, SMALL, run(lists=lists)), ans)
    if isinstance(expected, str):
        assert decision.stopped and decision.reason == expected
    else:
        assert decision == expected


# -- scripted agent loops --------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    call: Call
    answer: Answer


def drive(p: Agent, steps: list[Step]) -> tuple[int, str] | None:
    """Run steps through loop + progress as the pipeline does: before, effects, after, effects.

    Returns (index of the stopped step, reason) or None when every step passed.
    """
    chain = GuardChain([(PROGRESS, "fail_closed"), (LOOP, "fail_closed")])
    state = RunState(run_id="run-1", agent="bot")
    for index, step in enumerate(steps):
        for verdict in (
            chain.before(ctx(step.call, p, snapshot(state))),
            chain.after(ctx(step.call, p, snapshot(state)), step.answer),
        ):
            if verdict.stop is not None:
                return index, verdict.stop.reason or ""
            for decision in verdict.decisions:
                apply_effects(state, decision)
    return None


def chat(n: int, results: list[str], proposes: ToolCall) -> Step:
    return Step(call(results=tuple(results), request_hash=f"req-{n}"), answer(proposes))


def test_agent_repeating_one_tool_call_is_stopped_at_the_window() -> None:
    """Default loop policy: window 6, max_distinct 3. The 6th identical proposal is withheld."""
    p = policy(loop={})
    steps = [chat(n, [f"page {k}" for k in range(n)], A) for n in range(10)]
    assert drive(p, steps) == (5, "loop_detected")


def test_agent_varying_arguments_with_the_same_result_makes_no_progress() -> None:
    """Every call is new (no loop), but every result is the same: stall_steps 3 stops it."""
    p = policy(loop={"stall_steps": 3})
    steps = [chat(n, ["no results"] * n, tool("search", f'{{"q": "attempt {n}"}}')) for n in range(10)]
    # step 0: no results yet; step 1: first result is new; steps 2, 3, 4 bring nothing new
    assert drive(p, steps) == (4, "no_progress")


def test_identical_repeated_requests_make_no_progress() -> None:
    p = policy(loop={"stall_steps": 3})
    steps = [Step(call(request_hash="same"), answer()) for _ in range(10)]
    assert drive(p, steps) == (3, "no_progress")


def test_an_agent_making_progress_is_never_stopped() -> None:
    p = policy(loop={"window": 4, "max_distinct": 2, "stall_steps": 2})
    steps = [chat(n, [f"result {k}" for k in range(n)], tool("read", f'{{"page": {n}}}')) for n in range(30)]
    assert drive(p, steps) is None


def test_mcp_executions_returning_the_same_result_make_no_progress() -> None:
    p = policy(loop={"stall_steps": 3})
    steps = [Step(mcp_call("search", f'{{"q": {n}}}'), answer(result="nothing")) for n in range(6)]
    assert drive(p, steps) == (3, "no_progress")


def loop_push(prints: tuple[str, ...], *calls: ToolCall) -> Push:
    """The push an allowed answer makes under SMALL: also a claim the store judges atomically."""
    names = ", ".join(sorted({c.name for c in calls}))
    return Push("calls", prints, 4, distinct_limit=2, code="loop_detected",
                detail=f"the last 4 tool calls have at most 2 distinct name+argument combinations (max_distinct 2); "
                       f"repeating: {names}")


def test_the_sdk_retry_of_a_step_that_got_no_answer_is_that_step_again() -> None:
    """A step the provider answered with an error its SDK retries marks its request (`retry_marks`): the
    identical retry is no repeat and brings no mark, even though its results were recorded by the first
    try; once it is answered, the same request again is a repeat."""
    p = policy(loop={"stall_steps": 2})
    state = run()
    sent = call(results=("r1",), request_hash="req-1")
    first = PROGRESS.before(ctx(sent, p, snapshot(state)))
    assert apply_effects(state, first) is None
    marks = retry_marks("req-1", [Decision.allow("caps"), first])
    assert marks == (Push(RETRIES, ("req-1",), RETRIES_KEEP), Push("request", (RETRY + "req-1",), 1))
    assert apply_effects(state, Decision.allow("x", effects=marks)) is None
    for _ in range(3):  # the SDK's retries, each answered with an error again
        retried = PROGRESS.before(ctx(sent, p, snapshot(state)))
        assert retried.action == "allow" and retried.effects == (Push("request", ("req-1",), 1),)
        assert apply_effects(state, retried) is None
        assert apply_effects(state, Decision.allow("x", effects=marks)) is None
    assert state.lists["progress"] == ["1"]
    state.lists["request"] = ["req-1"]  # the last retry was answered
    assert PROGRESS.before(ctx(sent, p, snapshot(state))).action == "allow"  # a repeat: one stalled step
    assert retry_marks("req-2", [Decision.allow("progress")]) == (Push(RETRIES, ("req-2",), RETRIES_KEEP),)


def test_a_request_resent_forever_after_errors_is_stalled_again() -> None:
    """Forgiven `FORGIVEN_RETRIES` times per request: an agent looping on a failing request is then a
    repeat again, and `stall_steps` stops it (the caps count it again too, `forgiven`)."""
    p = policy(loop={"stall_steps": 2})
    state = run()
    sent = call(request_hash="req-1")
    decisions = [PROGRESS.before(ctx(sent, p, snapshot(state)))]
    verdicts = []
    for _ in range(FORGIVEN_RETRIES + 2):
        assert apply_effects(state, decisions[-1]) is None
        assert apply_effects(state, Decision.allow("x", effects=retry_marks("req-1", decisions))) is None
        decisions = [PROGRESS.before(ctx(sent, p, snapshot(state)))]
        verdicts.append(decisions[-1].action)
    # error answers 1-4 are forgiven (their retries skipped), the 5th's retry is a repeat: stalled, and the
    # next one the second stalled step in a row
    assert verdicts == ["allow"] * FORGIVEN_RETRIES + ["stop", "stop"]
    assert not forgiven(state, "req-1") and forgiven(state, "req-2") and forgiven(None, "req-1")


def test_errors_are_forgiven_at_most_retries_keep_times_in_a_run() -> None:
    state = run(lists={RETRIES: [f"req-{i}" for i in range(RETRIES_KEEP - 1)]})
    assert forgiven(state, "new")
    state.lists[RETRIES].append("one-more")
    assert not forgiven(state, "new")  # ever new failing requests count again once the run had its share
