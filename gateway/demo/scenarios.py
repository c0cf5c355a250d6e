"""The tour's three runs: what the scripted model says, which tools exist, each agent's policy, and
what each run must show.

| run    | agent      | policy                               | the model...          | must end with      |
|--------|------------|--------------------------------------|-----------------------|--------------------|
| budget | researcher | `budget: {usd: 0.02}` (priced model) | keeps searching       | `budget_exhausted` |
| loop   | looper     | `loop: {window: 3, max_distinct: 1}` | polls the same file   | `loop_detected`    |
| tools  | ops        | `tools.allow` without `delete_file`  | calls `delete_file`   | `tool_not_allowed` |

In the `tools` run the agent's own code then calls `delete_file` over MCP, which tollgate refuses
before the tool server sees it. A `Scenario.play` returns the problems it saw (empty: as expected).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.demo.agent import SampleAgent, openai_tools
from gateway.demo.model import Script, Turn
from gateway.demo.toolserver import DemoTool, ScriptedToolServer
from gateway.frozen_init import fast_init

__all__ = ["MCP_SERVER", "MODEL", "Scenario", "scenarios", "scripts", "tools"]

MODEL = "demo-model"
MCP_SERVER = "workspace"
_TOPICS = ("sidecar gateways", "run budgets", "loop detection", "tool allow-lists", "GenAI spans",
           "decision ledgers", "MCP proxies", "structured outputs", "Prometheus metrics")


def _schema(argument: str) -> dict[str, Any]:
    return {"type": "object", "properties": {argument: {"type": "string"}}, "required": [argument]}


def _search(arguments: Mapping[str, Any]) -> str:
    query = str(arguments.get("query", ""))
    hits = [f"[{i}] notes on {query}, page {i}: an excerpt worth quoting, with cross-references."
            for i in range(1, 4)]
    return "\n".join(hits)


def _read(arguments: Mapping[str, Any]) -> str:
    path = str(arguments.get("path", ""))
    if path == "status.txt":
        return "deploy #42: pending (check again later)"
    return f"{path}: build 1187 ok\nbuild 1188 ok\nbuild 1189 failed: disk full"


def tools() -> list[DemoTool]:
    """The tool server's tools (`delete_file` exists on the server; the ops agent may not use it)."""
    return [
        DemoTool("search_docs", "Search the team's notes.", _schema("query"), _search),
        DemoTool("read_file", "Read a file of the workspace.", _schema("path"), _read),
        DemoTool("delete_file", "Delete a file of the workspace.", _schema("path"),
                 lambda a: f"deleted {a.get('path')}"),
    ]


def _research(turn: int) -> Turn:
    if turn < 8:
        return Turn(tool="search_docs", arguments={"query": _TOPICS[turn]}, output_tokens=220)
    return Turn(text="Brief: tollgate decides at the boundary; the model only proposes.", output_tokens=120)


def _poll(turn: int) -> Turn:
    if turn < 8:
        return Turn(tool="read_file", arguments={"path": "status.txt"}, output_tokens=30)
    return Turn(text="The deploy is still pending.", output_tokens=20)


def _ops(turn: int) -> Turn:
    if turn == 0:
        return Turn(tool="read_file", arguments={"path": "build.log"}, output_tokens=30)
    if turn == 1:
        return Turn(tool="delete_file", arguments={"path": "build.log"}, output_tokens=30)
    return Turn(text="Cleaned up the old build log.", output_tokens=20)


def scripts() -> dict[str, Script]:
    """The scripted model's scripts, by the `[script:NAME]` tag of each agent's system message."""
    return {"research": _research, "poll": _poll, "ops": _ops}


Play = Callable[[SampleAgent, ScriptedToolServer], Awaitable[list[str]]]


@fast_init
@dataclass(frozen=True, slots=True)
class Scenario:
    """One run of the tour. `policy` is the agent's config section (its key is added by the tour)."""

    name: str
    agent: str
    title: str
    policy: Mapping[str, Any]
    expected: str
    play: Play


def _expect(code: str | None, expected: str, what: str) -> list[str]:
    return [] if code == expected else [f"{what}: expected {expected}, got {code or 'no refusal'}"]


async def _play_budget(agent: SampleAgent, server: ScriptedToolServer) -> list[str]:
    offered = openai_tools(await agent.connect())
    end = await agent.run_loop("You are a researcher. [script:research]", "Write a brief about tollgate.",
                               offered, max_turns=12, max_tokens=300)
    return _expect(end.code, "budget_exhausted", "model call")


async def _play_loop(agent: SampleAgent, server: ScriptedToolServer) -> list[str]:
    offered = openai_tools(await agent.connect())
    end = await agent.run_loop("You watch deploys. [script:poll]", "Tell me when deploy #42 is done.",
                               offered, max_turns=12)
    return _expect(end.code, "loop_detected", "model call")


async def _play_tools(agent: SampleAgent, server: ScriptedToolServer) -> list[str]:
    listed = await agent.connect()
    problems = [] if "delete_file" not in {t["name"] for t in listed} else [
        "tools/list through tollgate still shows delete_file"]
    end = await agent.run_loop("You keep the workspace tidy. [script:ops]", "Clean up the old build log.",
                               openai_tools(listed), max_turns=6)
    problems += _expect(end.code, "tool_not_allowed", "model call")
    agent.say("agent  now calls delete_file over MCP itself, bypassing the model")
    _, error = await agent.call_tool("delete_file", {"path": "build.log"})
    code = (error.get("data") or {}).get("code") if error is not None else None
    problems += _expect(code, "tool_not_allowed", "MCP tools/call delete_file")
    if any(name == "delete_file" for name, _ in server.calls):
        problems.append("delete_file reached the tool server")
    else:
        agent.say("server the tool server never received delete_file")
    return problems


def scenarios() -> tuple[Scenario, ...]:
    """The three runs, in the order the tour plays them."""
    return (
        Scenario("budget", "researcher", "a USD budget runs out", {"budget": {"usd": 0.02}},
                 "budget_exhausted", _play_budget),
        Scenario("loop", "looper", "the model loops on one tool call",
                 {"loop": {"window": 3, "max_distinct": 1}}, "loop_detected", _play_loop),
        Scenario("tools", "ops", "a tool outside the allow-list",
                 {"tools": {"allow": ["read_file", "search_docs", f"{MCP_SERVER}/read_file",
                                      f"{MCP_SERVER}/search_docs"], "on_violation": "reject"}},
                 "tool_not_allowed", _play_tools),
    )
