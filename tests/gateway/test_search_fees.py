"""Searches the provider runs and bills apart (web search, file search), through a running gateway with
the official SDKs: reserved before the call at their fee, limited when the agent sends no limit, and
charged at settlement from what the answer reports."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest

from guards.bounds import SEARCH_INPUT_TOKENS
from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import message_item, response_body
from tests.fakes.upstream import Reply, anthropic_message, openai_completion

CLAUDE = "claude-3-5-haiku-latest"  # genai-prices: $0.8 / $4 per Mtok, $10 per 1,000 web searches
GPT = "gpt-4.1-mini"  # genai-prices: $10 per 1,000 web searches, $2.50 per 1,000 file searches
SEARCH_FEE = 0.01
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search"}
WEB_CALL = {"id": "ws_1", "type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "q"}}
FILE_CALL = {"id": "fs_1", "type": "file_search_call", "status": "completed", "queries": ["q"], "results": None}


def headers(run: str) -> dict[str, str]:
    return {"x-tollgate-run-id": run, "x-tollgate-agent": "bot"}


def agents(usd: float) -> dict[str, Any]:
    return {"bot": {"budget": {"usd": usd}}}


async def ask_claude(h: Harness, run: str, tools: list[Any]) -> Any:
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers=headers(run)) as client:
        return await client.messages.create(model=CLAUDE, max_tokens=64, tools=tools,
                                            messages=[{"role": "user", "content": "news?"}])


async def ask_gpt(h: Harness, run: str, tools: list[Any], **fields: Any) -> Any:
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers(run)) as client:
        return await client.responses.create(model=GPT, input="news?", tools=tools, **fields)


def searched(searches: int, input_tokens: int = 100, output_tokens: int = 20) -> dict[str, Any]:
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens,
             "server_tool_use": {"web_search_requests": searches}}
    return {**anthropic_message("found"), "usage": usage}


async def reserved_while_upstream(h: Harness, run: str, reply: Reply, call: Any) -> tuple[float, Any]:
    """The run's reserved USD while `call` (a coroutine) waits at the upstream, and its result."""
    reply.delay = 0.3
    h.fake.queue(reply)
    task = asyncio.ensure_future(call)
    await asyncio.wait_for(h.fake.wait_seen(len(h.fake.seen) + 1), 5)
    reserved = (await h.run(run))["reserved_usd"]
    return reserved, await task


async def test_anthropic_search_without_max_uses_is_limited_reserved_and_charged(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents=agents(5.0))
    reply = Reply(body=searched(3))
    reserved, message = await reserved_while_upstream(h, "ws-unset", reply, ask_claude(h, "ws-unset", [WEB_SEARCH]))
    assert message.content[0].text == "found"
    sent = h.fake.seen[-1].json
    assert sent["tools"] == [{**WEB_SEARCH, "max_uses": 10}]  # tollgate's limit, reserved
    assert reserved >= 10 * SEARCH_FEE
    view = await h.run("ws-unset")
    assert view["reserved_usd"] == 0
    assert view["spent_usd"] == pytest.approx(100 * 0.8e-6 + 20 * 4e-6 + 3 * SEARCH_FEE)


async def test_anthropic_search_limit_of_the_agent_is_kept_and_reserved(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agents(5.0))
    tool = {**WEB_SEARCH, "max_uses": 2}
    reserved, _ = await reserved_while_upstream(h, "ws-two", Reply(body=searched(2)), ask_claude(h, "ws-two", [tool]))
    assert h.fake.seen[-1].json["tools"] == [tool]
    # 2 searches held and not 3: their fees and their results re-read (1 + 2 of them) at the input rate
    # (no cache_control: no cache write, $0.8/Mtok)
    assert 2 * SEARCH_FEE + 3 * SEARCH_INPUT_TOKENS * 0.8e-6 <= reserved < 3 * SEARCH_FEE + 6 * SEARCH_INPUT_TOKENS * 0.8e-6


async def test_anthropic_search_limit_follows_the_budget_left(gateway_factory: GatewayFactory) -> None:
    """$0.06 pays for 2 searches and not 3 after the input bound and the smallest answer: each costs $0.01
    and the input it bills at $0.8/Mtok (no cache_control, so no cache write; the k-th search re-reads the
    ~1,000-token request with k results of 8,000 tokens: ~$0.042 for 2, ~$0.073 for 3): max_uses 2."""
    h = await gateway_factory(agents=agents(0.06))
    h.fake.queue(Reply(body=searched(1)))
    await ask_claude(h, "ws-few", [WEB_SEARCH])
    assert h.fake.seen[-1].json["tools"] == [{**WEB_SEARCH, "max_uses": 2}]
    view = await h.run("ws-few")
    assert view["status"] == "active" and view["spent_usd"] <= 0.06


async def test_anthropic_search_nobody_can_pay_for_is_not_offered(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agents(0.005))
    h.fake.queue(Reply(body=anthropic_message("no search")))
    await ask_claude(h, "ws-none", [WEB_SEARCH])
    assert "tools" not in h.fake.seen[-1].json


async def test_searches_an_upstream_ran_past_its_limit_are_still_charged(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agents(5.0))
    h.fake.queue(Reply(body=searched(12)))
    await ask_claude(h, "ws-over", [WEB_SEARCH])
    assert (await h.run("ws-over"))["spent_usd"] == pytest.approx(100 * 0.8e-6 + 20 * 4e-6 + 12 * SEARCH_FEE)


async def test_responses_searches_are_limited_reserved_and_charged(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agents(5.0))
    body = response_body("", model=GPT, usage=(100, 20))
    body["output"] = [WEB_CALL, {**WEB_CALL, "id": "ws_2"}, FILE_CALL, message_item("found")]
    reserved, response = await reserved_while_upstream(h, "rs-unset", Reply(body=body), ask_gpt(
        h, "rs-unset", [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}]))
    assert response.output_text == "found"
    sent = h.fake.seen[-1].json
    assert sent["max_tool_calls"] == 10  # one limit over every call of the tools OpenAI runs
    assert reserved >= 10 * SEARCH_FEE  # at the dearer fee: web search
    view = await h.run("rs-unset")
    assert view["spent_usd"] == pytest.approx(100 * 0.4e-6 + 20 * 1.6e-6 + 2 * SEARCH_FEE + 0.0025)


async def test_responses_search_limit_of_the_agent_is_kept(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agents(5.0))
    h.fake.queue(Reply(body=response_body("ok", model=GPT)))
    await ask_gpt(h, "rs-two", [{"type": "web_search"}], max_tool_calls=2)
    assert h.fake.seen[-1].json["max_tool_calls"] == 2


@pytest.mark.parametrize("limit", [1000.0, 2.0**64])
async def test_a_search_limit_that_is_no_integer_is_refused_before_anything_is_reserved(
    gateway_factory: GatewayFactory, limit: float,
) -> None:
    """1000.0 is no count the budget can lower: forwarded, an API reading it as 1000 would run a thousand
    searches against a reservation for the few the budget pays. Refused in each wire format instead."""
    h = await gateway_factory(agents=agents(0.10))
    with pytest.raises(anthropic.BadRequestError) as claude:
        await ask_claude(h, "ws-float", [{**WEB_SEARCH, "max_uses": limit}])
    assert claude.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "tools[0].max_uses" in claude.value.message
    with pytest.raises(openai.BadRequestError) as gpt:
        await ask_gpt(h, "rs-float", [{"type": "web_search"}], max_tool_calls=limit)
    assert gpt.value.code == "invalid_request" and gpt.value.param == "max_tool_calls"
    assert h.fake.seen == []
    for run in ("ws-float", "rs-float"):  # refused while reading the request: no run began, nothing reserved
        async with h.session.get(f"{h.admin_url}/admin/runs/{run}") as resp:
            assert resp.status == 404


async def test_without_a_budget_the_request_is_forwarded_as_sent(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {}})
    h.fake.queue(Reply(body=searched(1)))
    await ask_claude(h, "ws-free", [WEB_SEARCH])
    assert h.fake.seen[-1].json["tools"] == [WEB_SEARCH]


async def test_a_token_budget_limits_searches_by_the_tokens_their_results_add(gateway_factory: GatewayFactory) -> None:
    # 2 searches hold ~2 re-reads of the ~1,000-token request and 3 x 8,000 result tokens; 3 hold 6 x 8,000
    h = await gateway_factory(agents={"bot": {"budget": {"tokens": 5 * SEARCH_INPUT_TOKENS}}})
    h.fake.queue(Reply(body=searched(1)))
    await ask_claude(h, "ws-tokens", [WEB_SEARCH])
    assert h.fake.seen[-1].json["tools"] == [{**WEB_SEARCH, "max_uses": 2}]


async def test_web_search_preview_on_a_model_that_does_not_reason_is_charged_openai_s_dearer_fee(
    gateway_factory: GatewayFactory,
) -> None:
    """OpenAI bills `web_search_preview` $25 per 1,000 searches on gpt-4o, gpt-4.1, ... (genai-prices: $10)."""
    h = await gateway_factory(agents=agents(5.0))
    body = response_body("", model=GPT, usage=(100, 20))
    body["output"] = [WEB_CALL, message_item("found")]
    reserved, _ = await reserved_while_upstream(h, "rs-preview", Reply(body=body), ask_gpt(
        h, "rs-preview", [{"type": "web_search_preview"}]))
    assert reserved >= 10 * 0.025
    view = await h.run("rs-preview")
    assert view["spent_usd"] == pytest.approx(100 * 0.4e-6 + 20 * 1.6e-6 + 0.025)


async def test_a_chat_completions_search_model_is_charged_its_search_on_every_call(
    gateway_factory: GatewayFactory,
) -> None:
    """`gpt-4o-mini-search-preview` searches on every call, at $25 per 1,000 (genai-prices: tokens only)."""
    h = await gateway_factory(agents=agents(5.0))
    model = "gpt-4o-mini-search-preview"
    reply = Reply(body=openai_completion("found", model=model, prompt_tokens=100, completion_tokens=20))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers("chat-search")) as client:
        reserved, completion = await reserved_while_upstream(h, "chat-search", reply, client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "news?"}], max_tokens=64))
    assert completion.choices[0].message.content == "found"
    assert reserved >= 0.025
    view = await h.run("chat-search")
    assert view["spent_usd"] == pytest.approx(100 * 0.15e-6 + 20 * 0.6e-6 + 0.025) and view["reserved_usd"] == 0


async def test_a_budget_that_cannot_pay_a_search_model_s_search_stops_the_run_before_the_call(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents=agents(0.02))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers("chat-search-poor")) as client:
        with pytest.raises(openai.PermissionDeniedError) as stopped:
            await client.chat.completions.create(model="gpt-4o-mini-search-preview", max_tokens=64,
                                                 messages=[{"role": "user", "content": "news?"}])
    assert stopped.value.response.headers["x-tollgate-stop-reason"] == "budget_exhausted"
    assert h.fake.seen == []


async def test_tools_openai_bills_apart_at_a_cost_tollgate_cannot_bound_are_refused_under_a_usd_budget(
    gateway_factory: GatewayFactory,
) -> None:
    """A Code Interpreter container and a generated image are billed apart and absent from `usage`."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 1.0}},
                                      "limited": {"budget": {"usd": 1.0}, "tools": {"allow": ["lookup"]}}})
    code = {"type": "code_interpreter", "container": {"type": "auto"}}
    with pytest.raises(openai.BadRequestError) as refused:
        await ask_gpt(h, "unpriced", [code])
    assert "code_interpreter" in refused.value.message and h.fake.seen == []
    h.fake.queue(Reply(body=response_body("ok", model=GPT)))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, default_headers={
            "x-tollgate-run-id": "unpriced-removed", "x-tollgate-agent": "limited"}) as client:
        await client.responses.create(model=GPT, input="news?", tools=[  # type: ignore[list-item]
            code, {"type": "function", "name": "lookup", "parameters": {"type": "object"}}])
    assert [t["type"] for t in h.fake.seen[-1].json["tools"]] == ["function"]  # the allow-list removed it


async def test_each_search_is_held_as_a_reread_of_the_whole_context(gateway_factory: GatewayFactory) -> None:
    """After each search the model samples again over the whole context, billed as input again: with a
    20,000-token conversation, 4 searches bill 5 x 20,000 + 8,000 x (1 + 2 + 3 + 4) = 180,000 input tokens,
    three times a 60,000-token budget that holding the results alone (20,000 + 4 x 8,000) let through.
    The limit sent is one whose re-reads the budget pays for; Anthropic bills what that allows."""
    h = await gateway_factory(agents={"bot": {"budget": {"tokens": 60_000}}})
    context = "x" * 20_000
    h.fake.queue(Reply(body=searched(1, input_tokens=2 * 21_000 + SEARCH_INPUT_TOKENS)))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers=headers("ws-reread")) as client:
        await client.messages.create(model=CLAUDE, max_tokens=64, tools=[WEB_SEARCH],  # type: ignore[list-item]
                                     messages=[{"role": "user", "content": context}])
    seen = h.fake.seen[-1]
    uses = seen.json["tools"][0]["max_uses"]
    bound = len(seen.body) + 804  # the body and Anthropic's tool-use system prompt
    worst = bound + sum(bound + k * SEARCH_INPUT_TOKENS for k in range(1, uses + 1)) + 64
    assert uses == 1 and worst <= 60_000, (uses, worst)
    view = await h.run("ws-reread")
    assert view["input_tokens"] + view["output_tokens"] <= 60_000
