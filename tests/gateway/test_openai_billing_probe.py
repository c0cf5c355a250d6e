"""Hostile probes of budget correctness on OpenAI's billing surfaces (README "How budgets are held").

The promise: a run's budget is reserved at its worst case before each call and never overspent, the
settlement charges what the provider bills (priced from genai-prices or the config), nothing stays
reserved, and what tollgate cannot bound is refused with a 4xx in OpenAI's error format. Each test drives
the official `openai` SDK against a running gateway whose upstream is the loopback fake; the oracle is
genai-prices itself (`calc_price`, with the `price_context` it documents for "the response service tier",
and the audio token fields its OpenAI extractor reads).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import openai
import pytest
from genai_prices import Usage as GPUsage
from genai_prices import calc_price

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body
from tests.fakes.upstream import Reply, openai_completion

MSG = [{"role": "user", "content": "hello"}]
MODELS = {"gpt-*": "openai", "o*": "openai"}
REL = 1e-9


def headers(run: str) -> dict[str, str]:
    return {"x-tollgate-run-id": run, "x-tollgate-agent": "bot"}


def oa(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, default_headers=headers(run))




def genai(model: str, *, tier: str | None = None, **usage: int) -> float:
    calc = calc_price(GPUsage(**usage), model_ref=model, provider_id="openai",
                      price_context={"service_tier": tier} if tier else None)
    return float(calc.total_price)


def per_token(model: str, field: str, tier: str | None = None) -> float:
    """genai-prices' USD per token of `field` (`output_tokens`, `output_audio_tokens`, ...)."""
    usage = {"input_tokens": 0, "output_tokens": 0}
    usage[field] = 1_000_000
    if field.startswith("output_") and field != "output_tokens":
        usage["output_tokens"] = 1_000_000
    return float(Decimal(str(genai(model, tier=tier, **usage)))) / 1_000_000


def sent_limit(h: Harness) -> int:
    body = h.fake.seen[-1].json
    limits = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    assert limits, body
    return max(limits)


def priced_oracle_sane() -> None:
    """The pricing facts the tests rely on, as genai-prices itself states them."""
    assert per_token("gpt-4o", "output_tokens", "priority") > per_token("gpt-4o", "output_tokens") * 1.5
    assert per_token("o3", "output_tokens", "flex") < per_token("o3", "output_tokens") * 0.75
    assert per_token("gpt-audio", "output_audio_tokens") > per_token("gpt-audio", "output_tokens") * 5


# -- service_tier ------------------------------------------------------------------------------------------


async def test_priority_tier_reservation_bounds_priority_rate(gateway_factory: GatewayFactory) -> None:
    """`service_tier: "priority"` is billed at OpenAI's Priority rates (genai-prices: gpt-4o $4.25/$17 per
    MTok against $2.50/$10 standard, selected by `price_context={"service_tier": "priority"}`). README:
    the budget guard "reserves the worst case" and a `max_tokens` the budget cannot pay is lowered to what
    it can pay, so the output limit sent upstream must be payable at the priority output rate. Tollgate
    prices every call at the standard rate, sends the agent's 800-token limit on a $0.01 budget (800 x $17
    per MTok = $0.0136), and the provider can bill 36% more than the whole budget."""
    priced_oracle_sane()
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 0.01}}})
    body = {**openai_completion("hi", model="gpt-4o"), "service_tier": "priority"}
    h.fake.queue(Reply(body=body))
    async with oa(h, "prio-reserve") as client:
        await client.chat.completions.create(model="gpt-4o", messages=MSG,  # type: ignore[arg-type]
                                             max_completion_tokens=800, service_tier="priority")
    worst_output = sent_limit(h) * per_token("gpt-4o", "output_tokens", "priority")
    assert worst_output <= 0.01, (
        f"upstream may bill {sent_limit(h)} priority output tokens = ${worst_output:.4f} on a $0.01 budget")


async def test_priority_tier_settled_at_priority_rate(gateway_factory: GatewayFactory) -> None:
    """README: "After the answer the reservation is settled to the provider's usage", priced from
    genai-prices. A chat completion answered with `service_tier: "priority"` is billed at the priority rate
    (genai-prices, `price_context={"service_tier": "priority"}`: 1000 in + 1000 out on gpt-4o = $0.02125).
    Tollgate charges the standard $0.0125: 41% of the money actually spent is never counted, so later steps
    spend budget that is already gone."""
    priced_oracle_sane()
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 10.0}}})
    body = {**openai_completion("hi", model="gpt-4o", prompt_tokens=1000, completion_tokens=1000),
            "service_tier": "priority"}
    h.fake.queue(Reply(body=body))
    async with oa(h, "prio-settle") as client:
        await client.chat.completions.create(model="gpt-4o", messages=MSG,  # type: ignore[arg-type]
                                             max_completion_tokens=2000, service_tier="priority")
    view = await h.settled("prio-settle")
    want = genai("gpt-4o", tier="priority", input_tokens=1000, output_tokens=1000)
    assert view["spent_usd"] == pytest.approx(want, rel=REL), f"spent {view['spent_usd']}, provider bills {want}"


async def test_a_priority_compaction_is_reserved_and_settled_at_the_priority_rate(
    gateway_factory: GatewayFactory,
) -> None:
    """`/v1/responses/compact` takes `service_tier` (the `openai` SDK's `responses.compact`) and its answer
    reports the tier billed, as `/v1/responses` does; compactions were priced at the standard rate
    whatever the tier, so a priority compaction was counted at about half its cost."""
    priced_oracle_sane()
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 10.0}}})
    compaction = {"id": "resp_c", "object": "response.compaction", "created_at": 1, "model": "gpt-4o",
                  "output": [{"type": "compaction", "id": "cmp_1", "encrypted_content": "xyz"}],
                  "usage": {"input_tokens": 1000, "output_tokens": 1000, "total_tokens": 2000},
                  "service_tier": "priority"}
    h.fake.queue(Reply(body=compaction))
    async with oa(h, "prio-compact") as client:
        result = await client.responses.compact(model="gpt-4o", input="summarise", service_tier="priority")
    assert result.service_tier == "priority"
    view = await h.settled("prio-compact")
    want = genai("gpt-4o", tier="priority", input_tokens=1000, output_tokens=1000)
    assert view["spent_usd"] == pytest.approx(want, rel=REL), f"spent {view['spent_usd']}, provider bills {want}"


async def test_flex_tier_settled_at_flex_rate(gateway_factory: GatewayFactory) -> None:
    """`service_tier: "flex"` is billed at half price on o3 (genai-prices, `price_context={"service_tier":
    "flex"}`: 1000 in + 1000 out = $0.005 against $0.010 standard). README: settlement follows what the
    provider bills. Tollgate charges the standard $0.010, so a flex run is stopped for budget_exhausted
    after spending half its budget."""
    priced_oracle_sane()
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 10.0}}})
    body = {**openai_completion("hi", model="o3", prompt_tokens=1000, completion_tokens=1000),
            "service_tier": "flex"}
    h.fake.queue(Reply(body=body))
    async with oa(h, "flex-settle") as client:
        await client.chat.completions.create(model="o3", messages=MSG,  # type: ignore[arg-type]
                                             max_completion_tokens=2000, service_tier="flex")
    view = await h.settled("flex-settle")
    want = genai("o3", tier="flex", input_tokens=1000, output_tokens=1000)
    assert view["spent_usd"] == pytest.approx(want, rel=REL), f"spent {view['spent_usd']}, provider bills {want}"


# -- audio -------------------------------------------------------------------------------------------------


AUDIO_ANSWER = {"id": "audio_1", "expires_at": 1700003600, "data": "UklGRg==", "transcript": "hi"}


async def test_audio_output_reservation_bounds_audio_rate(gateway_factory: GatewayFactory) -> None:
    """With `modalities: ["text", "audio"]` the completion is audio tokens, billed at the audio output rate
    (genai-prices for gpt-audio: $64 per MTok, against $10 for text output). README: the worst case is
    reserved and a limit the budget cannot pay is lowered. Tollgate reserves output at the text rate and
    forwards a 500-token limit on a $0.01 budget: 500 audio tokens bill $0.032, over three times the
    budget."""
    priced_oracle_sane()
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 0.01}}})
    body = openai_completion("", model="gpt-audio")
    body["choices"][0]["message"]["audio"] = AUDIO_ANSWER
    h.fake.queue(Reply(body=body))
    async with oa(h, "audio-reserve") as client:
        await client.chat.completions.create(model="gpt-audio", messages=MSG,  # type: ignore[arg-type]
                                             modalities=["text", "audio"],
                                             audio={"voice": "alloy", "format": "wav"},
                                             max_completion_tokens=500)
    worst_output = sent_limit(h) * per_token("gpt-audio", "output_audio_tokens")
    assert worst_output <= 0.01, (
        f"upstream may bill {sent_limit(h)} audio output tokens = ${worst_output:.4f} on a $0.01 budget")


async def test_audio_tokens_settled_at_audio_rates(gateway_factory: GatewayFactory) -> None:
    """OpenAI reports audio tokens inside the counts (`prompt_tokens_details.audio_tokens`,
    `completion_tokens_details.audio_tokens`) and bills them at the audio rates; genai-prices prices them
    so (gpt-audio: 800 of 1000 input tokens audio at $32/MTok, 600 of 1000 output audio at $64/MTok =
    $0.0685). README: the settlement is the provider's usage priced by genai-prices, "by its parts".
    Tollgate drops the audio details and charges everything as text ($0.0125): less than a fifth of what
    was billed."""
    priced_oracle_sane()
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 10.0}}})
    body = openai_completion("", model="gpt-audio", prompt_tokens=1000, completion_tokens=1000)
    body["choices"][0]["message"]["audio"] = AUDIO_ANSWER
    body["usage"]["prompt_tokens_details"] = {"cached_tokens": 0, "audio_tokens": 800}
    body["usage"]["completion_tokens_details"] = {"reasoning_tokens": 0, "audio_tokens": 600}
    h.fake.queue(Reply(body=body))
    async with oa(h, "audio-settle") as client:
        await client.chat.completions.create(model="gpt-audio", messages=MSG,  # type: ignore[arg-type]
                                             modalities=["text", "audio"],
                                             audio={"voice": "alloy", "format": "wav"},
                                             max_completion_tokens=2000)
    view = await h.settled("audio-settle")
    want = genai("gpt-audio", input_tokens=1000, output_tokens=1000, input_audio_tokens=800,
                 output_audio_tokens=600)
    assert view["spent_usd"] == pytest.approx(want, rel=REL), f"spent {view['spent_usd']}, provider bills {want}"


# -- Responses API: tools OpenAI runs and bills apart -------------------------------------------------------


@pytest.mark.parametrize("tool", [
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
], ids=["code_interpreter", "image_generation"])
async def test_responses_fee_tool_unbounded_on_tiny_budget(gateway_factory: GatewayFactory,
                                                           tool: dict[str, Any]) -> None:
    """OpenAI bills tools it runs apart from the response's usage: a Code Interpreter container is $0.03
    each (OpenAI's price list, "Built-in tools"), an `image_generation` call bills the image model's image
    output tokens (gpt-image-1: $0.011-$0.25 per image). Neither is in `usage`, and neither is reserved: on
    a $0.002 budget tollgate forwards the tool, so one call that uses it costs 5-15x the whole budget. README:
    searches billed apart are reserved per call (or the tools are not offered: "0: the tools the provider
    runs are not offered"); a tool whose fee tollgate neither reserves nor charges must be held the same
    way or refused with a 4xx (the promise: "what tollgate cannot bound is refused"), never forwarded."""
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 0.002}}})
    h.fake.queue(Reply(body=response_body("ok", model="gpt-4o-mini")))
    async with oa(h, f"fee-{tool['type']}") as client:
        try:
            await client.responses.create(model="gpt-4o-mini", input="plot y=x^2",  # type: ignore[arg-type]
                                          tools=[tool], max_output_tokens=64)
        except openai.BadRequestError:
            return  # refused with a 400 in OpenAI's format: held
        except openai.PermissionDeniedError:
            return
    sent = h.fake.seen[-1].json
    offered = [t.get("type") for t in sent.get("tools") or ()]
    assert tool["type"] not in offered, (
        f"{tool['type']} (billed apart, never reserved) was forwarded on a $0.002 budget: {sent}")

