"""The process-wide objects a request needs, built once from the config by the app factory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import Agent, Config
from gateway.identity import Identifier
from gateway.keyed_lock import KeyedLocks, WriteMarks
from gateway.pricing import Pricer
from gateway.providers.base import Adapter
from gateway.routing import Router
from gateway.store.base import Denial, RunStore
from gateway.tools import ToolPolicy
from gateway.upstream import Transport, Upstream
from guards.base import Add, Effect, Push, StopCondition
from guards.chain import GuardChain
from guards.registry import build_chain


@dataclass(slots=True)
class StepHooks:
    """Observers of finished steps (telemetry, metrics, ledger). Each must be cheap and never raise."""

    on_step: list[Callable[[Any], None]] = field(default_factory=list)
    on_guard_error: list[Callable[[str], None]] = field(default_factory=list)


@dataclass(slots=True)
class Gateway:
    config: Config
    identifier: Identifier
    router: Router
    adapters: dict[str, Adapter]
    pricer: Pricer
    store: RunStore
    upstream: Upstream
    hooks: StepHooks = field(default_factory=StepHooks)
    transports: dict[str, Transport] = field(default_factory=dict)
    services: dict[str, Any] = field(default_factory=dict)  # telemetry, metrics, ledger, grammars ...
    shutting_down: bool = False
    grace_ends: float | None = None  # the loop's time the shutdown's grace ends: a handler cut from then on
    run_locks: KeyedLocks = field(default_factory=KeyedLocks)  # per run: guard judgements that read history
    history_marks: WriteMarks = field(default_factory=WriteMarks)  # per run: this process's history writes
    guards: dict[str, list[tuple[StopCondition, str]]] = field(default_factory=dict)  # built at startup
    _chains: dict[str, GuardChain] = field(default_factory=dict)
    _tool_policies: dict[str, ToolPolicy] = field(default_factory=dict)

    def chain(self, agent: str, policy: Agent) -> GuardChain:
        chain = self._chains.get(agent)
        if chain is None:
            built = self.guards.get(agent) or build_chain(policy, agent)  # an agent not in the config
            chain = self._chains[agent] = GuardChain(built, self._guard_error)
        return chain

    async def write_effects(
        self, run_id: str, agent: str, effects: Sequence[Effect], *, in_flight: bool = False,
        epoch: int | None = None,
    ) -> Denial | None:
        """Guards' effects (counter additions, history pushes) in one atomic store operation; a denial when
        an `Add` went over its limit, or when the run is stopped and the effects are not `in_flight` (those
        of a step admitted before the stop: see `RunStore.apply`; `epoch` too). A history write moves the
        run's mark before it and again once it landed (a round trip to Redis): a step whose snapshot was
        read in between judges again."""
        adds = [e for e in effects if isinstance(e, Add)]
        pushes = [e for e in effects if isinstance(e, Push)]
        if not adds and not pushes:
            return None
        if pushes:
            self.history_marks.bump(run_id)
        try:
            return await self.store.apply(run_id, agent, adds, pushes, time.time(), in_flight=in_flight, epoch=epoch)
        finally:
            if pushes:
                self.history_marks.bump(run_id)

    def cut_reason(self) -> str:
        """Why a handler was cancelled: the shutdown cutting what its grace left running, or its client
        going away (aiohttp cancels the handler of a connection that closed)."""
        cut = self.grace_ends is not None and asyncio.get_running_loop().time() >= self.grace_ends
        return "shutting_down" if cut else "client_disconnected"

    def transport(self, provider_name: str) -> Transport:
        """The transport of a provider: the pooled HTTP client, unless one is registered for it
        (in-process local models register theirs)."""
        return self.transports.get(provider_name, self.upstream)

    def tool_policy(self, agent: str, policy: Agent) -> ToolPolicy:
        tools = self._tool_policies.get(agent)
        if tools is None:
            tools = self._tool_policies[agent] = ToolPolicy(policy.tools)
        return tools

    def _guard_error(self, guard: str) -> None:
        for hook in self.hooks.on_guard_error:
            hook(guard)

    def notify(self, step: Any) -> None:
        for hook in self.hooks.on_step:
            hook(step)
