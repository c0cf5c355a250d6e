"""Guard registry: built-in guards by name, custom guards by entry point or `module:Class`.

The default chain is an explicit ordered list, like mitmproxy's default addons: order is run order.
A custom guard class is constructed as `cls(policy, **options)` if it accepts a policy, else
`cls(**options)`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from gateway.config import Agent, GuardSpec
from gateway.errors import ConfigError
from guards.base import StopCondition
from guards.budget import BudgetGuard
from guards.caps import CapsGuard
from guards.loop import LoopGuard, ProgressGuard

BUILTIN: dict[str, Callable[[], StopCondition]] = {
    "caps": CapsGuard,
    "progress": ProgressGuard,
    "budget": BudgetGuard,
    "loop": LoopGuard,
}
DEFAULT_ORDER = ("caps", "progress", "budget", "loop")
ENTRY_POINT_GROUP = "tollgate.guards"


def load_class(ref: str) -> type[Any]:
    """Resolve a registered name (entry point group `tollgate.guards`) or `module:Class`."""
    if ":" in ref:
        module_name, _, attr = ref.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - a module's code runs on import: whatever it raises
            raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
        cls = getattr(module, attr, None)
        if cls is None:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        return cls  # type: ignore[no-any-return]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == ref:
            return ep.load()  # type: ignore[no-any-return]
    raise ValueError(f"unknown guard {ref!r}: not `module:Class` and not in entry point group {ENTRY_POINT_GROUP!r}")


def build_custom(spec: GuardSpec, policy: Agent) -> StopCondition:
    if spec.use in BUILTIN:
        raise ValueError(
            f"{spec.use!r} is a built-in guard and always runs; configure it with the agent's "
            "budget/caps/loop keys. `guards:` adds custom guards"
        )
    cls = load_class(spec.use)
    param = inspect.signature(cls).parameters.get("policy")
    if param is None:
        guard = cls(**spec.options)
    elif param.kind is inspect.Parameter.POSITIONAL_ONLY:
        guard = cls(policy, **spec.options)
    else:  # by name: `policy` may come after other parameters, or be keyword-only
        guard = cls(**spec.options, policy=policy)
    if not isinstance(guard, StopCondition):
        raise ValueError(f"{spec.use!r} does not implement StopCondition (name, before, after)")
    return guard


def build_chain(policy: Agent, agent_name: str) -> list[tuple[StopCondition, str]]:
    """The ordered guards of one agent, each with its on-error policy."""
    chain: list[tuple[StopCondition, str]] = [(BUILTIN[name](), "fail_closed") for name in DEFAULT_ORDER]
    for index, spec in enumerate(policy.guards):
        try:
            chain.append((build_custom(spec, policy), spec.on_error))
        except Exception as exc:  # noqa: BLE001 - the guard's own constructor is user code: a config error
            message = str(exc) if isinstance(exc, ValueError | TypeError) else (
                f"{spec.use!r} could not be built: {type(exc).__name__}: {exc}")
            raise ConfigError([(f"agents.{agent_name}.guards.{index}.use", message)]) from None
    return chain
