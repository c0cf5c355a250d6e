"""Guard registry: the built-in chain, custom guards by `module:Class` or entry point, config errors."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

import pytest

from gateway.call import Answer
from gateway.config import Agent, GuardSpec, parse_config
from gateway.errors import ConfigError
from guards import registry
from guards.base import BaseGuard, Decision, StepContext, StopCondition
from guards.budget import BudgetGuard
from guards.caps import CapsGuard
from guards.chain import GuardChain
from guards.loop import LoopGuard, ProgressGuard
from guards.registry import BUILTIN, DEFAULT_ORDER, ENTRY_POINT_GROUP, build_chain, build_custom, load_class
from tests.guards.support import call, ctx, policy

HERE = "tests.guards.test_registry"


class MyGuard:
    """A custom guard that implements the protocol without inheriting anything."""

    name = "my_guard"

    def __init__(self, max_bytes: int = 100) -> None:
        self.max_bytes = max_bytes

    def before(self, ctx: StepContext) -> Decision:
        if ctx.call.input_bytes > self.max_bytes:
            return Decision.stop(self.name, "too_big", f"{ctx.call.input_bytes} > {self.max_bytes}")
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        return Decision.allow(self.name)


class PolicyGuard(BaseGuard):
    """A custom guard that wants the agent's policy."""

    name = "policy_guard"

    def __init__(self, policy: Agent, label: str = "") -> None:
        self.policy = policy
        self.label = label


class NotAGuard:
    """Has hooks but no name: does not implement StopCondition."""

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow("x")


not_a_class = 42


def spec(use: str, **options: Any) -> dict[str, Any]:
    return {"use": use, "options": options}


def test_builtin_chain_order() -> None:
    chain = build_chain(policy(), "bot")
    assert DEFAULT_ORDER == ("caps", "progress", "budget", "loop")
    assert set(DEFAULT_ORDER) == set(BUILTIN)
    assert [type(g) for g, _ in chain] == [CapsGuard, ProgressGuard, BudgetGuard, LoopGuard]
    assert [g.name for g, _ in chain] == list(DEFAULT_ORDER)
    assert [on_error for _, on_error in chain] == ["fail_closed"] * 4
    assert all(isinstance(g, StopCondition) for g, _ in chain)


def test_custom_guards_follow_the_builtins_in_config_order() -> None:
    p = policy(
        guards=[
            {**spec(f"{HERE}:MyGuard", max_bytes=5), "on_error": "fail_open"},
            spec(f"{HERE}:PolicyGuard", label="second"),
        ]
    )
    chain = build_chain(p, "bot")
    assert [g.name for g, _ in chain] == [*DEFAULT_ORDER, "my_guard", "policy_guard"]
    mine, policy_guard = chain[4][0], chain[5][0]
    assert isinstance(mine, MyGuard) and mine.max_bytes == 5 and chain[4][1] == "fail_open"
    assert isinstance(policy_guard, PolicyGuard)
    assert policy_guard.policy is p and policy_guard.label == "second" and chain[5][1] == "fail_closed"


def test_a_custom_guard_stops_through_the_chain() -> None:
    p = policy(guards=[spec(f"{HERE}:MyGuard", max_bytes=500)])
    chain = GuardChain(build_chain(p, "bot"))
    assert chain.before(ctx(call(input_bytes=100), p)).stop is None
    verdict = chain.before(ctx(call(input_bytes=1000), p))
    assert verdict.stop is not None and (verdict.stop.guard, verdict.stop.reason) == ("my_guard", "too_big")
    assert [d.guard for d in verdict.decisions] == [*DEFAULT_ORDER, "my_guard"]


@pytest.mark.parametrize(
    ("use", "options", "message"),
    [
        (
            "no_such_guard",
            {},
            f"unknown guard 'no_such_guard': not `module:Class` and not in entry point group '{ENTRY_POINT_GROUP}'",
        ),
        ("no_such_module_xyz:Guard", {}, "cannot import 'no_such_module_xyz'"),
        (f"{HERE}:Missing", {}, f"'{HERE}' has no attribute 'Missing'"),
        (f"{HERE}:NotAGuard", {}, "does not implement StopCondition (name, before, after)"),
        (f"{HERE}:not_a_class", {}, "not a callable"),
        (f"{HERE}:MyGuard", {"no_such_option": 1}, "no_such_option"),
    ],
    ids=["unknown-name", "no-module", "no-attribute", "not-a-guard", "not-callable", "bad-option"],
)
def test_bad_guards_are_config_errors_naming_the_key(use: str, options: dict[str, Any], message: str) -> None:
    p = policy(guards=[spec(f"{HERE}:MyGuard"), {"use": use, "options": options}])
    with pytest.raises(ConfigError) as info:
        build_chain(p, "support-bot")
    [(path, text)] = info.value.problems
    assert path == "agents.support-bot.guards.1.use"
    assert message in text
    assert str(info.value).startswith("agents.support-bot.guards.1.use: ")


def test_entry_point_guards_load_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        seen.append(group)
        return [EntryPoint(name="mine", value=f"{HERE}:MyGuard", group=group)]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    assert load_class("mine") is MyGuard
    assert seen == [ENTRY_POINT_GROUP]
    guard = build_custom(GuardSpec(use="mine", options={"max_bytes": 7}), policy())
    assert isinstance(guard, MyGuard) and guard.max_bytes == 7
    with pytest.raises(ValueError, match="unknown guard 'other'"):
        load_class("other")


def test_guards_from_a_parsed_config() -> None:
    config = parse_config(
        {
            "agents": {
                "bot": {
                    "guards": [
                        {"use": f"{HERE}:MyGuard", "options": {"max_bytes": 9}, "on_error": "fail_open"}
                    ]
                }
            }
        },
        env={},
    )
    chain = build_chain(config.agents["bot"], "bot")
    assert chain[-1][1] == "fail_open" and isinstance(chain[-1][0], MyGuard)


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ({"use": f"{HERE}:MyGuard", "option": {}}, "agents.bot.guards.0.option"),  # unknown key
        ({"options": {}}, "agents.bot.guards.0.use"),  # use is required
        ({"use": f"{HERE}:MyGuard", "on_error": "ignore"}, "agents.bot.guards.0.on_error"),
    ],
)
def test_guard_specs_are_validated_with_key_paths(entry: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"agents": {"bot": {"guards": [entry]}}}, env={})
    assert path in [p for p, _ in info.value.problems]
