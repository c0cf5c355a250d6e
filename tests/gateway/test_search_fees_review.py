"""Review of 271d6a1 (search fees reserved before the call): failing tests, one per defect found.

Each test states what the real provider does and what tollgate should therefore hold or send."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import orjson

from tests.conftest import GatewayFactory
from tests.fakes.responses import message_item, response_body
from tests.fakes.upstream import Reply, anthropic_message
from tests.gateway.test_search_fees import (
    CLAUDE,
    GPT,
    SEARCH_FEE,
    WEB_CALL,
    WEB_SEARCH,
    agents,
    ask_claude,
    headers,
    reserved_while_upstream,
    searched,
)

LOOKUP = {"name": "lookup", "description": "look a record up",
          "input_schema": {"type": "object", "properties": {"id": {"type": "string"}}}}


# 1. What a search adds to the input (its results: "search content tokens") is billed as input tokens, and
#    tollgate's input bound is the request's bytes only. OpenAI bills gpt-4.1-mini / gpt-4o-mini a fixed
#    block of 8,000 input tokens per web search call; other models the results at the model's rate;
#    Anthropic counts search results as input tokens too. A step that searches settles above what it
#    reserved, and the run ends above its budget.
async def test_search_content_tokens_are_reserved_so_the_budget_holds(gateway_factory: GatewayFactory) -> None:
    budget = 0.04
    h = await gateway_factory(agents=agents(budget))
    body = response_body("", model=GPT, usage=(20 + 8000, 0))  # the prompt + gpt-4.1-mini's 8,000-token block
    body["output"] = [WEB_CALL, message_item("found")]
    h.fake.queue(Reply(body=body, delay=0.3))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers("sc-1")) as client:
        task = asyncio.ensure_future(client.responses.create(model=GPT, input="news?", tools=[{"type": "web_search"}],
                                                             max_tool_calls=1))
        await asyncio.wait_for(h.fake.wait_seen(1), 5)
        granted = h.fake.seen[-1].json["max_output_tokens"]  # the answer uses all it was granted
        body["usage"].update(output_tokens=granted, total_tokens=8020 + granted)
        await task
    view = await h.run("sc-1")
    assert view["spent_usd"] <= budget + 1e-9, f"spent {view['spent_usd']} of a {budget} budget"


# 2. `unset_search_limit` hands the searches everything the budget left after the input bound, forgetting the
#    smallest answer (16 tokens, every choice) the same reservation must also pay. When the remainder of a
#    search fee is below 16 output tokens, the reservation tollgate itself shaped cannot be granted: the
#    run is stopped, sticky, with `budget_exhausted`, although it could pay this call (with one search fewer).
async def test_the_limit_tollgate_picks_leaves_room_for_the_smallest_answer(gateway_factory: GatewayFactory) -> None:
    raw = orjson.dumps({"model": CLAUDE, "max_tokens": 64, "tools": [WEB_SEARCH],
                        "messages": [{"role": "user", "content": "news?"}]})
    probe = await gateway_factory()
    price = probe.gateway.pricer.lookup(CLAUDE, "anthropic")
    assert price is not None and price.search_fee == SEARCH_FEE
    # 3 searches and 7.5 output tokens past the input bound: 16 tokens cost 16 * $4/Mtok = $0.000064
    budget = len(raw) * price.worst_input + 3 * SEARCH_FEE + 0.00003
    h = await gateway_factory(agents=agents(budget))
    h.fake.queue(Reply(body=searched(1)))
    async with h.session.post(f"{h.url}/v1/messages", data=raw,
                              headers={**headers("tight"), "content-type": "application/json"}) as resp:
        status, answer = resp.status, await resp.text()
    view = await h.run("tight")
    assert view["status"] == "active", f"{view['stop_reason']}: {view['stop_detail']}"
    assert status == 200, answer


# 3. An explicit search limit the budget cannot pay stops the run for good (`budget_exhausted`, sticky), while
#    the same request without a limit is given what the budget pays for, and a too-large `max_tokens` is
#    clamped ("never an error", DESIGN section 5). The run still has $0.05 and could search 4 times.
async def test_an_explicit_search_limit_the_budget_cannot_pay_does_not_stop_the_run(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents=agents(0.05))
    h.fake.queue(Reply(body=searched(1)))
    try:
        await ask_claude(h, "ws-ten", [{**WEB_SEARCH, "max_uses": 10}])
    except anthropic.PermissionDeniedError:
        pass
    view = await h.run("ws-ten")
    assert view["status"] == "active", f"{view['stop_reason']}: {view['stop_detail']}"


# 4. `search_limits` is parsed before the allow-list removes tools: a web search tool the agent may not use
#    (never sent upstream) is still reserved, and the searches it cannot run eat the output the budget pays
#    for (here the agent's max_tokens 4096 is clamped to ~2,400 for 4 phantom searches).
async def test_a_search_tool_the_allow_list_removed_is_not_reserved(gateway_factory: GatewayFactory) -> None:
    policy = {"bot": {"budget": {"usd": 0.05}, "tools": {"allow": ["lookup"]}}}
    h = await gateway_factory(agents=policy)
    h.fake.queue(Reply(body=anthropic_message("ok")))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers=headers("allow")) as client:
        await client.messages.create(model=CLAUDE, max_tokens=4096, tools=[WEB_SEARCH, LOOKUP],
                                     messages=[{"role": "user", "content": "news?"}])
    sent = h.fake.seen[-1].json
    assert [t.get("name") for t in sent["tools"]] == ["lookup"]  # no search can run
    assert sent["max_tokens"] == 4096  # $0.05 pays 4096 output tokens ($0.016) and the input


async def test_a_removed_search_tool_is_not_held_while_the_call_runs(gateway_factory: GatewayFactory) -> None:
    policy = {"bot": {"budget": {"usd": 5.0}, "tools": {"allow": ["lookup"]}}}
    h = await gateway_factory(agents=policy)
    reserved, _ = await reserved_while_upstream(h, "allow-held", Reply(body=anthropic_message("ok")),
                                                ask_claude(h, "allow-held", [WEB_SEARCH, LOOKUP]))
    assert reserved < SEARCH_FEE, f"{reserved} held for searches no tool can run"


# 5. When no search is paid for, Anthropic's `limit_hosted_calls(body, 0)` removes the server tools but keeps
#    a `tool_choice` that forces one of them while other tools remain: the body names a tool it no longer
#    offers, which the Messages API refuses (400 invalid_request_error). The Responses adapter drops such a
#    tool_choice; this one only drops it when no tool is left.
async def test_a_forced_search_tool_removed_for_the_budget_is_not_left_in_tool_choice(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents=agents(0.005))  # pays no search: the search tool is not offered
    h.fake.queue(Reply(body=anthropic_message("ok")))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers=headers("forced")) as client:
        await client.messages.create(model=CLAUDE, max_tokens=64, tools=[WEB_SEARCH, LOOKUP],
                                     tool_choice={"type": "tool", "name": "web_search"},
                                     messages=[{"role": "user", "content": "news?"}])
    sent = h.fake.seen[-1].json
    offered = {t.get("name") for t in sent.get("tools", [])}
    choice = sent.get("tool_choice")
    assert "web_search" not in offered
    assert choice is None or choice.get("type") != "tool" or choice.get("name") in offered, choice
