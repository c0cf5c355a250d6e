"""Review of e5e43dd (OpenAI search fees), 1c5b426 (Redis tool writes expire with the run) and 43c6e26
(proxy.conclude/respond): each test fails on a real defect and states the correct behaviour."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import openai
import pytest
from redis.asyncio import Redis

from gateway.store.base import WriteClaim
from gateway.store.redis import RedisRunStore
from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import message_item, response_body
from tests.fakes.upstream import Reply, openai_completion
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

WEB_CALL = {"id": "ws_1", "type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "q"}}
OPENAI_WEB_SEARCH_FEE = 10.0 / 1000  # OpenAI's price list: web_search, and web_search_preview on reasoning models


def headers(run: str) -> dict[str, str]:
    return {"x-tollgate-run-id": run, "x-tollgate-agent": "bot"}


async def reserved_while_upstream(h: Harness, run: str, reply: Reply, call: Any) -> tuple[float, Any]:
    reply.delay = 0.3
    h.fake.queue(reply)
    task = asyncio.ensure_future(call)
    await asyncio.wait_for(h.fake.wait_seen(len(h.fake.seen) + 1), 5)
    reserved = (await h.run(run))["reserved_usd"]
    return reserved, await task


def searched_response(model: str, searches: int, usage: tuple[int, int] = (100, 20)) -> dict[str, Any]:
    body = response_body("", model=model, usage=usage)
    body["output"] = [{**WEB_CALL, "id": f"ws_{i}"} for i in range(searches)] + [message_item("found")]
    return body


# -- e5e43dd: OpenAI search fees ------------------------------------------------------------------


async def test_web_search_preview_on_a_reasoning_model_genai_prices_gives_no_fee_is_still_reserved_and_charged(
    gateway_factory: GatewayFactory,
) -> None:
    """OpenAI bills `web_search_preview` on a reasoning model (o-series, gpt-5) $10 per 1,000 searches: the
    commit's own rule ("cost what `web_search` ones do") is OpenAI's $10, but the code takes genai-prices'
    web-search fee for these models, which is $0 for o3-pro (and o1, o1-pro, o3-mini, gpt-5.1-codex-mini).
    So a request offering the tool holds nothing for its searches and each search is charged $0: a run can
    spend past its budget by every search. Each search must be reserved and charged at least $10 / 1,000."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 20.0}}})
    run = "o3pro-preview"
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers(run)) as client:
        reserved, _ = await reserved_while_upstream(
            h, run, Reply(body=searched_response("o3-pro", 2)),
            client.responses.create(model="openai/o3-pro", input="news?", max_output_tokens=64,
                                    tools=[{"type": "web_search_preview"}], max_tool_calls=2))
    tokens = 100 * 20e-6 + 20 * 80e-6  # o3-pro: $20 / $80 per Mtok
    view = await h.run(run)
    assert view["spent_usd"] >= tokens + 2 * OPENAI_WEB_SEARCH_FEE - 1e-9, view["spent_usd"]
    assert reserved >= 2 * OPENAI_WEB_SEARCH_FEE


async def test_gpt_5_search_api_a_chat_completions_search_model_pays_its_search_on_every_call(
    gateway_factory: GatewayFactory,
) -> None:
    """`gpt-5-search-api` is OpenAI's Chat Completions search model of the gpt-5 generation: like the
    `*-search-preview` models it searches on every call and OpenAI bills that search per call. The commit
    recognises search models only by the `-search-preview` substring (`pricing.searches_every_call`), so
    this model is reserved and charged its tokens only (genai-prices lists it with no search fee): the
    per-call search must be reserved and charged (at least OpenAI's $10 per 1,000)."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 5.0}}})
    run = "gpt5-search"
    model = "gpt-5-search-api"
    reply = Reply(body=openai_completion("found", model=model, prompt_tokens=100, completion_tokens=20))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers(run)) as client:
        reserved, completion = await reserved_while_upstream(h, run, reply, client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "news?"}], max_tokens=64))
    assert completion.choices[0].message.content == "found"
    tokens = 100 * 1.25e-6 + 20 * 10e-6
    view = await h.run(run)
    assert view["spent_usd"] >= tokens + OPENAI_WEB_SEARCH_FEE - 1e-9, view["spent_usd"]
    assert reserved >= OPENAI_WEB_SEARCH_FEE


async def test_a_preview_tool_the_allow_list_removes_does_not_make_web_search_dearer(
    gateway_factory: GatewayFactory,
) -> None:
    """An agent allowed `web_search` but not `web_search_preview` sends both; tollgate offers the upstream
    `web_search` alone, which OpenAI bills $10 per 1,000. The price is looked up from the request as the
    agent sent it (`Call.search_preview`, before `shape_tools`), so the search is reserved and charged
    the preview tool's $25: the README's "a search tool the allow-list removes holds nothing" is broken,
    and the run's spend is overstated by $0.015 a search (a budget stops the run early). The price must
    follow the tools actually offered upstream."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 5.0}, "tools": {"allow": ["web_search"]}}})
    run = "allow-web-only"
    h.fake.queue(Reply(body=searched_response("gpt-4.1-mini", 1)))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers(run)) as client:
        await client.responses.create(model="gpt-4.1-mini", input="news?", max_output_tokens=64,
                                      tools=[{"type": "web_search"}, {"type": "web_search_preview"}])
    assert [t["type"] for t in h.fake.seen[-1].json["tools"]] == ["web_search"]
    view = await h.run(run)
    assert view["spent_usd"] == pytest.approx(100 * 0.4e-6 + 20 * 1.6e-6 + OPENAI_WEB_SEARCH_FEE)


# -- 1c5b426: Redis tool writes expire with the run -----------------------------------------------


async def test_redis_reset_does_not_keep_the_former_life_s_recorded_writes_alive(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """A reset run starts with nothing recorded: the former life's entries can never be read again (their
    fields carry the old epoch, and the next claim wipes them). Before 1c5b426 they expired on their own
    TTL; now `touch()` renews the writes keys on every write of the fresh run, while `_RESET` deletes only
    the run hash and its steps. So up to 1,000 recorded results (64 KB each) of a life that is over stay in
    Redis for as long as the fresh run is used and never makes a tool write. `reset` has the writes keys
    (KEYS[4], KEYS[5]) and must delete them with the rest of the run (or at least not renew them)."""
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisRunStore.open(redis_server.url, prefix=prefix, ttl_s=50, idle_ttl_s=100)
    raw = Redis.from_url(redis_server.url)
    try:
        claimed = await store.claim_write("run-1", "bot", 1, "files/write:a", "tok", lease_s=30, keep=100, now=1000.0)
        assert claimed == WriteClaim("claimed")
        await store.finish_write("run-1", "bot", 1, "files/write:a", "tok", b"x" * 60_000, keep=100, now=1000.0)
        await raw.expire(f"{prefix}writes:run-1", 5)  # as if the last tool write were long ago
        fresh = await store.reset("run-1", 1001.0)
        assert fresh is not None and fresh.epoch == 2
        await store.record_step("run-1", "bot", {"n": 1}, 1002.0)  # the fresh run goes on, no tool write
        ttl = await raw.ttl(f"{prefix}writes:run-1")
        assert ttl <= 5, f"the former life's recorded writes were renewed to {ttl} s by the fresh run"
    finally:
        await raw.aclose()
        await store.close()

