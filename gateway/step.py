"""The state of one step as it moves through the pipeline stages, and what is recorded about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.call import Answer, Call
from gateway.identity import Identity
from gateway.outputs import OutputPlan
from gateway.pricing import ModelPrice
from gateway.providers.base import Adapter
from gateway.routing import Route
from gateway.store.base import Reservation
from gateway.tools import ToolPolicy
from guards.base import Decision
from guards.chain import GuardChain


@dataclass(slots=True)
class Step:
    """Mutable per-request state. Only the pipeline writes it; recorders read it at the end."""

    adapter: Adapter
    identity: Identity
    call: Call
    route: Route
    body: dict[str, Any]
    raw: bytes
    price: ModelPrice | None = None
    outputs: OutputPlan | None = None
    tools: ToolPolicy | None = None
    original: dict[str, Any] = field(default_factory=dict)  # the agent's body, for re-asks
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    decisions: list[Decision] = field(default_factory=list)
    reservation: Reservation | None = None
    changed: bool = False  # the body differs from what the agent sent
    hide_usage: bool = False
    max_tokens_set: int | None = None
    answer: Answer | None = None
    attempts: int = 0
    status: int = 0
    cost_usd: float = 0.0  # the settled cost of the current attempt
    spent: dict[str, float] = field(default_factory=dict)  # settled usd / input / output, every attempt
    stop_reason: str | None = None
    stop_detail: str | None = None
    error_type: str | None = None
    first_chunk_at: float | None = None
    relayed_chars: int = 0
    reasks: int = 0
    violations: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # a metered forwarded call (`gateway.metered`): the guards that judge it instead of its agent's chain,
    # and the (min, max) output units its reservation holds instead of the request's `max_tokens`
    guards: GuardChain | None = None
    output_bound: tuple[int, int] | None = None

    @property
    def run_id(self) -> str:
        return self.identity.run_id

    @property
    def agent(self) -> str:
        return self.identity.agent

    def summary(self) -> dict[str, Any]:
        """The step as the admin API lists it under a run."""
        answer = self.answer
        spent = self.spent
        summary = {
            "at": self.started_wall,
            "operation": self.call.operation,
            "model": self.call.model,
            "provider": self.route.provider_name,
            "stream": self.call.stream,
            "status": self.status,
            # an error (refused, cut, failed upstream) is no allow: the ledger row says `error` too
            "decision": "stop" if self.stop_reason else "error" if self.error_type else "allow",
            "stop_reason": self.stop_reason,
            "error": None if self.stop_reason else self.error_type,
            "cost_usd": round(spent.get("usd", 0.0), 10),  # all attempts, as the run is charged
            "input_tokens": int(spent["input_tokens"]) if "input_tokens" in spent else None,
            "output_tokens": int(spent["output_tokens"]) if "output_tokens" in spent else None,
            "tool_calls": [c.name for c in answer.tool_calls] if answer else [],
            "attempts": self.attempts,
            "reasks": self.reasks,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 3),
        }
        if "epoch" in self.extra:
            summary["epoch"] = self.extra["epoch"]
        return summary
