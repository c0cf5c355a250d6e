"""Builders for guard table tests: calls, answers, policies, contexts, and a pure 'pipeline' that applies
a decision's claims and effects to a `RunState` through `gateway.store.logic` (no event loop, no store)."""

from __future__ import annotations

import itertools
from typing import Any

from gateway.call import Answer, Call, ToolCall, ToolResult, Usage
from gateway.config import Agent
from gateway.pricing import ModelPrice, Rate
from gateway.store import logic
from gateway.store.base import Denial, Reservation, ReserveRequest, RunState
from guards.base import Add, Decision, Push, StepContext

# $1 per million input tokens, $4 per million output tokens.
PRICE = ModelPrice(Rate(1e-6), Rate(4e-6))
NOW = 1_000.0
_ids = itertools.count(1)


def policy(**fields: Any) -> Agent:
    """An agent policy from config-shaped keyword arguments: policy(budget={"usd": 1})."""
    return Agent.model_validate(fields)


def call(
    *,
    operation: str = "chat",
    model: str = "gpt-4o-mini",
    input_bytes: int = 1000,
    input_images: int = 0,
    input_overhead: int = 0,
    referenced_documents: int = 0,
    max_tokens: int | None = None,
    results: tuple[str, ...] = (),
    request_hash: str = "req-0",
    tool_call: ToolCall | None = None,
    search_limits: tuple[int | None, ...] = (),
    search_sizes: tuple[int, ...] = (),
) -> Call:
    protocol = "mcp" if operation == "execute_tool" else "openai"
    return Call(
        protocol=protocol,
        operation=operation,
        model=model,
        max_tokens=max_tokens,
        input_bytes=input_bytes,
        input_images=input_images,
        input_overhead=input_overhead,
        referenced_documents=referenced_documents,
        tool_results=tuple(ToolResult(f"c{i}", text) for i, text in enumerate(results)),
        tool_call=tool_call,
        request_hash=request_hash,
        search_limits=search_limits,
        search_sizes=search_sizes,
    )


def mcp_call(name: str = "search", arguments: str = "{}") -> Call:
    return call(
        operation="execute_tool", model="", input_bytes=200, tool_call=ToolCall("m1", name, arguments)
    )


def tool(name: str, arguments: str = "{}", call_id: str = "t") -> ToolCall:
    return ToolCall(call_id, name, arguments)


def answer(*calls: ToolCall, usage: Usage | None = None, result: str | None = None) -> Answer:
    return Answer(
        text="ok",
        tool_calls=tuple(calls),
        usage=usage,
        tool_result=None if result is None else ToolResult("m1", result),
    )


def run(**fields: Any) -> RunState:
    """A run snapshot: run(used={"llm_calls": 3}, lists={"calls": [...]}, started_at=0.0)."""
    return RunState(run_id="run-1", agent="bot", **fields)


def ctx(
    c: Call | None = None,
    p: Agent | None = None,
    state: RunState | None = None,
    *,
    now: float = NOW,
    price: ModelPrice | None = PRICE,
    extra: dict[str, Any] | None = None,
) -> StepContext:
    return StepContext(
        call=c if c is not None else call(),
        agent="bot",
        run_id="run-1",
        policy=p if p is not None else policy(),
        run=state,
        now=now,
        price=price,
        extra=extra or {},
    )


def snapshot(state: RunState) -> RunState:
    """What `store.get` hands a guard: an independent copy."""
    return logic.from_dict(logic.to_dict(state))


def apply_effects(state: RunState, decision: Decision, now: float = NOW) -> Denial | None:
    """Apply effects as the pipeline does: an `Add` over its limit stops the run."""
    for effect in decision.effects:
        if isinstance(effect, Add):
            denial = logic.add(state, effect.counter, effect.amount, effect.limit, effect.code, now)
            if denial is not None:
                return denial
        elif isinstance(effect, Push):
            logic.push(state, effect.key, effect.values, effect.keep)
    return None


def reserve(state: RunState, decision: Decision, max_units: int, min_units: int = 16) -> Reservation | Denial:
    request = ReserveRequest(decision.claims, min(min_units, max_units), max_units)
    return logic.reserve(state, request, NOW, f"r{next(_ids)}")
