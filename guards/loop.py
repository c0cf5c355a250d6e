"""Loop and no-progress guards.

Loop: every proposed tool call has a fingerprint (name + canonical JSON arguments). Within the last
`window` calls of the run, `max_distinct` or fewer distinct fingerprints is a loop. The guard judges
the answer that proposes the repeating call, so the repeat never reaches the agent.

No progress: a step that sends back tool results none of which is new to the run, or a request
identical to the previous one, is a stalled step; `stall_steps` stalled steps in a row stop the run
before the next call goes upstream. A step with a new result or a new request is progress.
MCP tool results are judged in their own history, so a result seen by the MCP proxy and then sent
back to the model is not counted twice. A step the provider answered with an error its SDK retries on
its own (a 5xx, a 429 overload) marks its request (`retry_marks`): the identical retry is that step again,
neither a repeat nor a judge of its already-recorded results, while its request has had fewer than
`FORGIVEN_RETRIES` such answers (an agent resending a failing request forever is stalled again).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.call import Answer
from gateway.store.base import RunState
from gateway.store.logic import repeats
from guards.base import REASK, BaseGuard, Decision, Push, StepContext

RESULT_KEEP = 1000
RETRY = "retry:"  # prefix of a request hash in the "request" history: its step got no answer (`retry_marks`)
RETRIES = "retries"  # history: the request hashes of steps the provider answered so (`retry_marks`)
RETRIES_KEEP = 50  # and the most such answers forgiven in a run
FORGIVEN_RETRIES = 5  # error answers per request: more than the SDKs' retries (2 by default in openai, anthropic)


class LoopGuard(BaseGuard):
    name = "loop"

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        loop = ctx.policy.loop
        calls = list(answer.tool_calls)
        if ctx.call.operation == "execute_tool" and ctx.call.tool_call is not None and ctx.extra.get(
            "counts_tool_call"
        ):
            calls = [ctx.call.tool_call]
        if loop is None or not calls:
            return Decision.allow(self.name)
        prints = tuple(c.fingerprint for c in calls)
        names = ", ".join(sorted({c.name for c in calls}))
        # judged here on the snapshot, and again by the store on the run as it is when the push lands:
        # steps of the run on other gateways may have pushed since this snapshot was read
        push = Push("calls", prints, loop.window, distinct_limit=loop.max_distinct, code="loop_detected",
                    detail=f"the last {loop.window} tool calls have at most {loop.max_distinct} distinct "
                           f"name+argument combinations (max_distinct {loop.max_distinct}); repeating: {names}")
        history = ctx.history("calls")
        if repeats(history, push):
            distinct = len(set([*history, *prints][-loop.window :]))
            return Decision.stop(
                self.name,
                "loop_detected",
                f"the last {loop.window} tool calls have only {distinct} distinct name+argument "
                f"combinations (max_distinct {loop.max_distinct}); repeating: {names}",
            )
        return Decision.allow(self.name, effects=(push,))


class ProgressGuard(BaseGuard):
    name = "progress"

    def before(self, ctx: StepContext) -> Decision:
        loop = ctx.policy.loop
        if loop is None or loop.stall_steps is None:
            return Decision.allow(self.name)
        call = ctx.call
        if call.operation == "execute_tool" or ctx.extra.get(REASK):
            return Decision.allow(self.name)  # a re-ask is tollgate's request: the agent's was judged
        seen_key = "results"
        previous = ctx.history("request")
        marked = bool(previous) and previous[-1] == RETRY + call.request_hash
        if marked and forgiven(ctx.run, call.request_hash):  # judged when it first came: no new mark
            return Decision.allow(self.name, effects=(Push("request", (call.request_hash,), 1),))
        prints = tuple(r.fingerprint for r in call.tool_results)
        seen = set(ctx.history(seen_key))
        repeated = marked or (bool(previous) and previous[-1] == call.request_hash)
        new = [p for p in prints if p not in seen]
        stalled = repeated or (bool(prints) and not new)
        return self._judge(ctx, stalled, seen_key, tuple(new), loop.stall_steps, request=call.request_hash)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        loop = ctx.policy.loop
        result = answer.tool_result
        if loop is None or loop.stall_steps is None or ctx.call.operation != "execute_tool" or result is None:
            return Decision.allow(self.name)
        fp = result.fingerprint
        stalled = fp in set(ctx.history("mcp_results"))
        return self._judge(ctx, stalled, "mcp_results", () if stalled else (fp,), loop.stall_steps)

    def _judge(
        self, ctx: StepContext, stalled: bool, key: str, new: tuple[str, ...], stall_steps: int, request: str = ""
    ) -> Decision:
        marks = (ctx.history("progress") + ["0" if stalled else "1"])[-stall_steps:]
        effects = [Push("progress", ("0" if stalled else "1",), stall_steps)]
        if new:
            effects.append(Push(key, new, RESULT_KEEP))
        if request:
            effects.append(Push("request", (request,), 1))
        if stalled and len(marks) >= stall_steps and "1" not in marks:
            return Decision.stop(
                self.name,
                "no_progress",
                f"{stall_steps} consecutive steps brought no new tool result (or repeated the same request)",
            )
        return Decision.allow(self.name, effects=tuple(effects))


def forgiven(run: RunState | None, request_hash: str) -> bool:
    """Whether a step of `request_hash` the provider answered with an error its SDK retries is forgiven
    (no step without progress, no model call of the run): fewer than `FORGIVEN_RETRIES` such answers of
    it so far, and fewer than `RETRIES_KEEP` in the run (an agent hammering a rate-limited provider with
    ever new requests counts again too)."""
    if run is None:
        return True
    answered = run.lists.get(RETRIES, [])
    return len(answered) < RETRIES_KEEP and answered.count(request_hash) < FORGIVEN_RETRIES


def retry_marks(request_hash: str, decisions: Sequence[Decision]) -> tuple[Push, ...]:
    """The history writes for a step sent upstream that got an error its agent's SDK retries by itself
    with the same bytes (408, 409, 429, 5xx: the provider generated nothing): the request's count of
    such answers (`forgiven`), and, when the step recorded its request (`stall_steps`), the mark that
    makes its retry no repeat, whose tool results, recorded by this step, are not judged again."""
    marks = [Push(RETRIES, (request_hash,), RETRIES_KEEP)]
    for decision in decisions:
        if decision.guard == ProgressGuard.name:
            for effect in decision.effects:
                if isinstance(effect, Push) and effect.key == "request":
                    marks.append(Push("request", (RETRY + effect.values[0],), 1))
    return tuple(marks)
