"""Review of session 11 (44dedea..HEAD): defects found in the forwarded-path registry (`gateway.unguarded`),
the tier pricing (`gateway.pricing`) and Anthropic billing (`gateway.providers.anthropic_*`). Every test here
fails on the reviewed code and shows one defect; its docstring says what, the impact and what is expected."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson

from gateway.pricing import Pricer
from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, anthropic_message

MODEL = "claude-opus-4-8"




# -- gateway.pricing: the lookup cache is keyed by a tier string the caller chooses ----------------------


def test_tier_names_the_caller_invents_do_not_grow_the_price_cache_without_bound() -> None:
    """Defect: `reserved_tier` now returns any `service_tier` (OpenAI) or `speed` (Anthropic) string a
    request sends, and `Pricer.lookup` keys its process-wide, never-evicted `_cache` by it. Every distinct
    value an agent sends (a counter, a UUID, a 1 MiB string: `service_tier` is any non-empty string) adds
    an entry holding that string and a `ModelPrice`, before any guard runs and for agents without a
    budget too (the step's price is always looked up); each miss also re-runs the pricing of the model.
    Before this session only `priority`/`flex`/`default` reached the key.
    Impact: any agent can grow the gateway's memory without bound, one request at a time (the upstream
    refuses the tier afterwards, the cache entry stays).
    Expected: tiers the model does not list resolve to one key (the tier `ModelPrice.for_request` picks),
    so the cache stays bounded by the tiers genai-prices lists."""
    pricer = Pricer({})
    pricer.lookup("gpt-4o-mini", "openai")
    before = len(pricer._cache)
    for i in range(500):
        price = pricer.lookup("gpt-4o-mini", "openai", service_tier=f"tier-{i}-" + "x" * 1000)
        assert price is not None
    for i in range(500):
        pricer.lookup(MODEL, "anthropic", service_tier=f"speed-{i}")
    grown = len(pricer._cache) - before
    assert grown <= 10, f"{grown} cache entries for 1,000 invented tier names"


# -- Responses API parsing: the new checks walk the whole input several times on every request -------------


class _CountingList(list):  # type: ignore[type-arg]
    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingList.walks += 1
        return super().__iter__()


def test_parsing_a_responses_request_does_not_walk_its_input_once_per_new_check() -> None:
    """Defect: every `/v1/responses` request now walks its whole `input` list once for each new check,
    with no byte test first: `openai_responses._unbounded` twice (reasoning items by id, then
    `compaction_trigger` items) and `responses_tools.offered_tools` three times (`search_limits`,
    `offers_preview_search`, `unpriced_tools`), each step calling `isinstance(item, Mapping)` (an ABC
    check) per item; the pipeline walks it again in `limit_hosted_calls` under a tool cap or a search
    limit. A 300-item input (an Agents SDK conversation of 100 tool rounds) is walked 6 times instead of
    once, and `parse_request` went from ~525 us to ~1,005 us (best of 5 x 1,000 on this machine, at
    44dedea and at HEAD): ~0.5 ms on the event loop per request, more than all of tollgate's per-request
    budget the README's benchmark section counts in tens of microseconds.
    Expected: a cheap byte test (`common.may_contain(raw, b"reasoning", b"compaction_trigger")`,
    `b'"tools"'` beyond the top-level list) skips these
    walks for the requests that cannot need them, or they share one walk."""
    from gateway.config import Limits
    from gateway.providers.openai_responses import OpenAIResponses

    items: list[Any] = []
    for i in range(100):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"hi {i}"}]})
        items.append({"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"})
        items.append({"type": "function_call_output", "call_id": f"c{i}", "output": "ok"})
    body: dict[str, Any] = {"model": "gpt-4o-mini", "input": items,
                            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
    raw = orjson.dumps(body)
    body["input"] = _CountingList(items)
    _CountingList.walks = 0
    OpenAIResponses().parse_request(body, raw, Limits())
    assert _CountingList.walks <= 2, f"the input was walked {_CountingList.walks} times (once at 44dedea)"


# -- Anthropic compaction: billed on top of the reservation, never held nor refused ---------------------------


async def test_anthropic_compaction_cannot_take_a_run_past_its_budget(gateway_factory: GatewayFactory) -> None:
    """Defect: a Messages request with `context_management` holding a `compact_20260112` edit makes
    Anthropic run a compaction sub-inference whose tokens are billed on top of the top-level usage
    (`usage.iterations`, charged by `anthropic_billing.usage_from`). Its output (the summary) is bounded
    by nothing tollgate sends, and its input re-reads the context; nothing of it is reserved, and the
    request is not refused under a budget. The Responses API's in-response compaction is refused under a
    budget for exactly this reason (`openai_responses._unbounded`: "has no output limit tollgate can
    hold"), and the README names search results as "the one estimate that can take a run past its budget".
    Impact: a USD-budgeted agent using Anthropic's compaction ends past its budget. Here a request offering
    web fetch (5 uses of 8,000 tokens, all reserved) with a 30,000-token compaction trigger is reserved
    ~$0.27 of a $0.30 budget; its top-level usage stays within the reservation, but the compaction of the
    ~33,000-token context into a 4,000-token summary is settled on top: the run ends well past $0.30.
    Expected: under a budget, a compaction edit is refused with a 400 (like OpenAI's), or its worst case is
    reserved; either way the run's spend never passes its budget."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 0.30}}})
    body = anthropic_message("done", model=MODEL, input_tokens=41_000, output_tokens=100)
    body["usage"]["server_tool_use"] = {"web_search_requests": 0, "web_fetch_requests": 5}
    body["usage"]["iterations"] = [
        {"type": "compaction", "input_tokens": 33_000, "output_tokens": 4_000,
         "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        {"type": "message", "input_tokens": 41_000, "output_tokens": 100,
         "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
    ]
    h.fake.queue(Reply(body=body))
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                      default_headers={"x-tollgate-run-id": "compact", "x-tollgate-agent": "bot"})
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 5, "max_content_tokens": 8_000}
    async with client:
        try:
            await client.beta.messages.create(  # type: ignore[call-overload]
                model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "read these pages " * 150}],
                tools=[fetch],
                context_management={"edits": [{"type": "compact_20260112",
                                               "trigger": {"type": "input_tokens", "value": 30_000}}]},
            )
        except anthropic.BadRequestError:
            assert not h.fake.seen  # refused before it went upstream: acceptable
            return
    view = await h.settled("compact")
    assert view["spent_usd"] <= 0.30, f"a $0.30 budget settled at ${view['spent_usd']:.4f}"
