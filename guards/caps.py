"""Cap guard: LLM calls, tool calls and wall time per run.

LLM calls are claimed before the call (so concurrent steps cannot all slip under the cap); tool calls
count when the model proposes them in an answer tollgate returns, with those the provider ran itself
(`Answer.hosted_calls`); wall time counts from the run's first step.
"""

from __future__ import annotations

from gateway.call import Answer
from gateway.store.base import Claim
from guards.base import Add, BaseGuard, Decision, Push, StepContext

PENDING_CALLS = "pending_calls"
PENDING_KEEP = 256


class CapsGuard(BaseGuard):
    name = "caps"

    def before(self, ctx: StepContext) -> Decision:
        caps = ctx.policy.caps
        run = ctx.run
        if caps.seconds is not None and run is not None and run.started_at is not None:
            elapsed = ctx.now - run.started_at
            if elapsed > caps.seconds:
                return Decision.stop(
                    self.name, "time_cap", f"run time cap of {caps.seconds:g}s reached ({elapsed:.1f}s elapsed)"
                )
        if ctx.call.operation == "execute_tool":
            return Decision.allow(self.name)
        limit = None if caps.llm_calls is None else float(caps.llm_calls)
        return Decision.allow(self.name, claims=(Claim("llm_calls", 1.0, 0.0, limit, "llm_call_cap"),))

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        # calls the provider already ran count too: the cap cannot stop them, but stops the run after
        count = len(answer.tool_calls) + answer.hosted_calls
        if ctx.call.operation == "execute_tool" and ctx.extra.get("counts_tool_call"):
            count = 1
        if count == 0:
            return Decision.allow(self.name)
        limit = ctx.policy.caps.tool_calls
        effects: tuple[Add | Push, ...] = (
            Add("tool_calls", float(count), None if limit is None else float(limit), "tool_call_cap"),
        )
        if ctx.call.operation != "execute_tool":
            # proposals the agent may execute through the MCP proxy: that execution does not count again
            effects += (Push(PENDING_CALLS, tuple(c.fingerprint for c in answer.tool_calls), PENDING_KEEP),)
        return Decision.allow(self.name, effects=effects)
