"""Review of 2c6d13c (hosted MCP under a budget) and a3a3a67 (reasoning items sent back by id): each test
failed on those commits for the defect its docstring states, and passes since its fix (held once per
response, kept in the run's own history, a compaction offers no tools)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body
from tests.fakes.upstream import Reply, openai_compaction

MODEL = "gpt-5-mini"
MCP = {"type": "mcp", "server_label": "wiki", "server_url": "https://mcp.example/mcp",
       "require_approval": "never"}
LOOKUP = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}


def reasoning(item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": []}


async def post(h: Harness, run: str, body: dict[str, Any],
               path: str = "/v1/responses") -> tuple[int, dict[str, Any]]:
    async with h.session.post(f"{h.url}{path}", json=body, headers={"x-tollgate-run-id": run}) as resp:
        return resp.status, await resp.json()


def turn(*extra: dict[str, Any], max_output: int = 50) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": max_output,
            "input": [{"role": "user", "content": "Weather in Oslo and Bergen?"}, *extra]}


async def test_reasoning_items_of_one_response_are_held_once_not_once_each(
        gateway_factory: GatewayFactory) -> None:
    """Defect: the first design's `held` added the whole response's `output_tokens` for EVERY reasoning item of
    that response. A response with k reasoning items (OpenAI interleaves one before each hosted call, e.g.
    reasoning / web_search_call / reasoning / web_search_call / reasoning / message) is then held k times
    over when the agent sends its items back by id, as the Agents SDK does on every later turn. Every item
    of one response is part of that response's output tokens, so together they bill at most
    `output_tokens` as input: the correct hold is once per response. The overcount is not harmless: a
    hold the budget cannot pay is a budget stop (sticky 403 `token_budget_exhausted`), so a run that can
    afford its real worst case is stopped.

    Here: 30,000 tokens; turn 1 spends 9,100 (9,000 output, 3 reasoning items). Turn 2 sends the three
    items back: its true worst case is ~9,000 + its body + 50 output (< 20,900 left), but it is held at
    27,000 + body and the run is stopped. Expected: turn 2 is forwarded (200)."""
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 30_000}}})
    first = response_body("", calls=[("get_weather", "{}", "c1")], model=MODEL, usage=(100, 9_000))
    first["output"][:0] = [reasoning("rs_a"), {"id": "ws_1", "type": "web_search_call", "status": "completed",
                                               "action": {"type": "search", "query": "oslo"}},
                           reasoning("rs_b"), {"id": "ws_2", "type": "web_search_call", "status": "completed",
                                               "action": {"type": "search", "query": "bergen"}},
                           reasoning("rs_c")]
    h.fake.queue(Reply(body=first),
                 Reply(body=response_body("Sunny in both.", model=MODEL, usage=(9_300, 5))))
    status, body = await post(h, "per-item", turn(max_output=9_500))
    assert status == 200, body
    status, body = await post(h, "per-item", turn(reasoning("rs_a"), reasoning("rs_b"), reasoning("rs_c"),
                                                  CALL, OUTPUT))
    assert status == 200, ("three items of one 9,000-output-token response bill at most 9,000 input tokens, "
                           f"which the budget left pays: {body}")


async def test_an_item_the_run_keeps_sending_back_is_not_forgotten_for_other_runs(
        gateway_factory: GatewayFactory) -> None:
    """Defect (of the first design, one memory per process forgetting in insertion order): the Agents SDK
    sends back every reasoning item of the run's history on every turn, so a long-running run's FIRST item
    was evicted once 16,384 items of other runs were relayed after it; from then on every call of that run
    was a 400 (its input always carries the item). Fixed by keeping each run's items in its own history in
    the run store (`guards.reasoning`): other runs cannot make it forget them.

    Here: turn 1 relays rs_first; another run is answered with 17,000 items; turn 2 sends rs_first back."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 5.0}}})

    def answer_with(*item_ids: str) -> Reply:
        body = response_body("", calls=[("get_weather", "{}", "c1")], model=MODEL, usage=(50, 200))
        body["output"][:0] = [reasoning(item_id) for item_id in item_ids]
        return Reply(body=body)

    h.fake.queue(answer_with("rs_first"), answer_with(*(f"rs_other_{i}" for i in range(17_000))),
                 Reply(body=response_body("Sunny.", model=MODEL, usage=(500, 5))))
    assert (await post(h, "long-run", turn()))[0] == 200
    assert (await post(h, "other-run", turn()))[0] == 200
    status, body = await post(h, "long-run", turn(reasoning("rs_first"), CALL, OUTPUT))
    assert status == 200, f"rs_first was relayed in this run, yet it is forgotten: {body}"


@pytest.mark.parametrize("budget", [{"usd": 1.0}, {"tokens": 1_000_000}])
async def test_a_compaction_is_not_refused_for_an_mcp_tool_in_its_input(gateway_factory: GatewayFactory,
                                                                        budget: dict[str, Any]) -> None:
    """Defect: `/v1/responses/compact` runs no tool (its parse, `gateway.metered.parse_compact`, drops
    `tools` and `search_limits` for that reason) but keeps the `unreserved_tools` 2c6d13c now reads from
    the tool lists of input items, and the metered path applies no allow-list. An agent whose allow-list
    removes the hosted `mcp` tool runs under its budget on `/v1/responses` (the `additional_tools` item
    loses the tool there), but compacting that same conversation, whose input still carries the item as
    the agent wrote it, is refused with "the request offers mcp": the conversation can no longer be
    compacted. Expected: the compaction (no tool runs, its input is the body, bounded by its bytes) is
    forwarded."""
    h = await gateway_factory(agents={"default": {"budget": budget, "tools": {"allow": ["lookup"]}}})
    items = [{"type": "additional_tools", "role": "developer", "tools": [MCP, LOOKUP]},
             {"role": "user", "content": "Look it up."}]
    h.fake.queue(Reply(body=response_body("Done.", model=MODEL, usage=(40, 5))),
                 Reply(body=openai_compaction()))
    status, body = await post(h, "compact-mcp", {"model": MODEL, "max_output_tokens": 50, "input": items})
    assert status == 200, f"the allow-list removes the mcp tool on /v1/responses: {body}"
    assert [t["name"] for t in h.fake.seen[-1].json["input"][0]["tools"]] == ["lookup"]
    status, body = await post(h, "compact-mcp", {"model": MODEL, "input": items}, "/v1/responses/compact")
    assert status == 200, f"a compaction runs no tool, the mcp one included: {body}"
