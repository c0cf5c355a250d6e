"""docs/custom-guards.md works as written: its Python guard, YAML config and entry point, run through the
registry and GuardChain."""

from __future__ import annotations

import re
import sys
import tomllib
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml

from gateway.call import Answer
from gateway.config import Agent, parse_config
from guards import registry
from guards.base import StopCondition
from guards.chain import GuardChain
from guards.registry import DEFAULT_ORDER, ENTRY_POINT_GROUP, build_chain
from tests.guards.support import call, ctx

DOC = Path(__file__).resolve().parents[2] / "docs" / "custom-guards.md"


def block(lang: str) -> str:
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"expected one {lang} block in {DOC.name}, found {len(blocks)}"
    return str(blocks[0])


@pytest.fixture
def mypkg(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The doc's Python block, importable as `mypkg.guards` as the config names it."""
    package = types.ModuleType("mypkg")
    package.__path__ = []
    module = types.ModuleType("mypkg.guards")
    monkeypatch.setitem(sys.modules, "mypkg", package)
    monkeypatch.setitem(sys.modules, "mypkg.guards", module)
    exec(compile(block("python"), str(DOC), "exec"), module.__dict__)  # noqa: S102 - our own doc
    package.guards = module  # type: ignore[attr-defined]
    return module


def test_the_python_block_is_a_short_guard(mypkg: types.ModuleType) -> None:
    assert len(block("python").strip().splitlines()) <= 25
    guard = mypkg.MaxPromptBytes()
    assert isinstance(guard, StopCondition) and guard.name == "max_prompt_bytes"


def check(chain: GuardChain, agent_policy: Agent) -> None:
    small = chain.before(ctx(call(input_bytes=50_000), agent_policy))
    assert small.stop is None
    assert [d.guard for d in small.decisions] == [*DEFAULT_ORDER, "max_prompt_bytes"]
    big = chain.before(ctx(call(input_bytes=150_000), agent_policy))
    assert big.stop is not None
    assert (big.stop.guard, big.stop.reason) == ("max_prompt_bytes", "prompt_too_large")
    assert big.stop.detail == "request of 150000 bytes exceeds 100000"
    assert chain.after(ctx(call(), agent_policy), Answer()).stop is None


def test_the_yaml_config_loads_the_guard_and_it_stops_big_prompts(mypkg: types.ModuleType) -> None:
    config = parse_config(yaml.safe_load(block("yaml")), env={})
    policy = config.agents["support-bot"]
    assert policy.guards[0].on_error == "fail_closed"
    errors: list[str] = []
    chain = GuardChain(build_chain(policy, "support-bot"), errors.append)
    check(chain, policy)
    assert errors == []


def test_the_entry_point_name_loads_the_same_guard(
    mypkg: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tomllib.loads(block("toml"))["project"]["entry-points"][ENTRY_POINT_GROUP]
    monkeypatch.setattr(
        registry,
        "entry_points",
        lambda *, group: [EntryPoint(name=n, value=v, group=group) for n, v in table.items()],
    )
    data = yaml.safe_load(block("yaml"))
    data["agents"]["support-bot"]["guards"][0]["use"] = "max_prompt_bytes"
    policy = parse_config(data, env={}).agents["support-bot"]
    check(GuardChain(build_chain(policy, "support-bot")), policy)
