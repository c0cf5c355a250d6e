"""False refusals and broken normal flows a production agent meets under an ordinary budget ($1-$5, 200k-1M
tokens), through a running gateway with the official SDKs. Each test failed on the code it was written
against; each is fixed. One more finding, vector store search refused under a budget, is kept as
designed: it is billed per search and may run a model (`rewrite_query`), so the refusal names the
file_search tool of /v1/responses instead (tests/gateway/test_unguarded.py)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, anthropic_message, openai_completion

MODELS = {"gpt-*": "openai", "o*": "openai", "claude-*": "anthropic"}
CONVERSATION = "x " * 10000  # a 20 kB conversation so far: an ordinary agent's context a few turns in


def agents(**budget: Any) -> dict[str, Any]:
    return {"bot": {"budget": budget, "caps": {"llm_calls": 40, "tool_calls": 60}}}


def headers(run: str) -> dict[str, str]:
    return {"x-tollgate-run-id": run, "x-tollgate-agent": "bot"}


def openai_client(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, default_headers=headers(run))


def claude_client(h: Harness, run: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0, default_headers=headers(run))


async def test_chat_call_without_max_tokens_is_sent_an_output_limit_gpt_4o_mini_rejects(
        gateway_factory: GatewayFactory) -> None:
    """The most ordinary call there is: `client.chat.completions.create(model="gpt-4o-mini", messages=...)`
    with no `max_tokens`, by an agent with a $1 budget and the default provider config (`make run` from
    OPENAI_API_KEY). tollgate fills in the output limit the budget pays for, capped by the provider's
    `max_output_tokens` default of 32,768, and sends `max_completion_tokens: 32768`; gpt-4o-mini (and
    gpt-4o) accept at most 16,384 completion tokens, so OpenAI answers 400 "max_tokens is too large" and
    every such call of the agent fails. (The Responses API and the Agents SDK get `max_output_tokens:
    32768` the same way.) tollgate should never send a limit above the model's own: it should know the
    output limits of common models (or leave the field unset when the agent's budget pays the model's
    default and cap only what it must), not rely on every operator writing a `pricing:` entry per model."""
    h = await gateway_factory(models=MODELS, agents=agents(usd=1.0))
    h.fake.queue(Reply(body=openai_completion("hi")))
    async with openai_client(h, "chat-1") as client:
        await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    sent = h.fake.seen[-1].json
    assert sent.get("max_completion_tokens", 0) <= 16384, sent


async def test_web_fetch_with_a_content_limit_is_silently_removed_even_under_a_million_tokens(
        gateway_factory: GatewayFactory) -> None:
    """A research agent with a 1,000,000-token budget offers Claude the web fetch tool as Anthropic's docs
    show it, `{"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 1, "max_content_tokens":
    100000}`, on a 20 kB conversation. One fetch can add at most 100,000 tokens of content, re-read by the
    sampling after it: about 120-140k input tokens in all. tollgate counts the fetch as 13 "searches"
    (one per 8,000 content tokens) and holds each as a re-read of the whole context (`search_input`: 13 x
    the input bound + 8,000 x 13 x 14 / 2 = ~1,000,000 tokens), finds the budget cannot pay it and drops
    the tool from the request without a word: the model cannot fetch anything (the same happens at $1 and
    $5 on claude-sonnet-4-5). A single fetch adds its content once; it should be held as one sampling over
    the input plus `max_content_tokens` (guards/bounds.search_input / the Anthropic adapter's fetch
    limits), and a limit should lower `max_content_tokens` or `max_uses`, not remove the tool."""
    h = await gateway_factory(models=MODELS, agents=agents(tokens=1_000_000))
    h.fake.queue(Reply(body=anthropic_message("ok", model="claude-sonnet-4-5")))
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 1, "max_content_tokens": 100000}
    async with claude_client(h, "fetch-1") as client:
        await client.messages.create(model="claude-sonnet-4-5", max_tokens=4000, tools=[fetch],  # type: ignore[list-item]
                                     messages=[{"role": "user", "content": CONVERSATION}])
    sent = h.fake.seen[-1].json
    assert [tool.get("name") for tool in sent.get("tools", [])] == ["web_fetch"], sent.get("tools")


async def test_sonnet_web_search_is_held_at_the_one_hour_cache_write_long_context_rate(
        gateway_factory: GatewayFactory) -> None:
    """An agent with a $1 budget asks claude-sonnet-4-5 (input $3/MTok) for up to 5 web searches on a 20 kB
    conversation, with no `cache_control` anywhere and far below 200k tokens. Held at $3/MTok, 5 searches
    (5 x $0.01 plus 5 re-reads of the ~21k-token input and 8k per result so far: ~225k tokens, ~$0.73) fit
    the budget; even at the >200k-token rate ($6) 3 fit. tollgate prices every input token of the search
    reservation at `ModelPrice.worst_input`, the 1-hour cache write at the long-context tier ($12/MTok, 4x
    the real rate), and lowers `max_uses` to 1 (claude-opus-4-1 at $1 loses the tool entirely; offering
    web search and web fetch together on Sonnet at $1 loses both). Cache-write rates should apply only
    when the request marks `cache_control`, and the long-context tier only when the bound can pass 200k
    tokens (gateway/pricing.ModelPrice.worst_input as used by guards/bounds.search_limit)."""
    h = await gateway_factory(models=MODELS, agents=agents(usd=1.0))
    h.fake.queue(Reply(body=anthropic_message("ok", model="claude-sonnet-4-5")))
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    async with claude_client(h, "search-1") as client:
        await client.messages.create(model="claude-sonnet-4-5", max_tokens=4000, tools=[search],  # type: ignore[list-item]
                                     messages=[{"role": "user", "content": CONVERSATION}])
    sent = h.fake.seen[-1].json
    uses = [tool.get("max_uses") for tool in sent.get("tools", [])]
    assert uses and uses[0] >= 3, sent.get("tools")
