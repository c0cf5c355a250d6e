"""gateway/pricing.py: per-token rates from the config's `pricing:` table or genai-prices, and costs."""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from genai_prices import Usage as GPUsage
from genai_prices import calc_price

from gateway import pricing
from gateway.call import Usage
from gateway.config import Price
from gateway.pricing import ModelPrice, Pricer, Rate

M = 1_000_000


def per_tok(usd_per_mtok: float) -> float:
    return usd_per_mtok / M


# -- Rate --------------------------------------------------------------------------------------------

TIERED = Rate(per_tok(1.0), ((1000, per_tok(2.0)), (5000, per_tok(3.0))))


@pytest.mark.parametrize(
    ("rate", "input_tokens", "expected"),
    [
        (Rate(per_tok(4.0)), 0, per_tok(4.0)),
        (Rate(per_tok(4.0)), 10**9, per_tok(4.0)),  # no tiers: always the base
        (TIERED, 0, per_tok(1.0)),
        (TIERED, 1000, per_tok(1.0)),  # a tier applies above its start, not at it
        (TIERED, 1001, per_tok(2.0)),
        (TIERED, 5000, per_tok(2.0)),
        (TIERED, 5001, per_tok(3.0)),
    ],
)
def test_rate_at_picks_the_tier_by_input_tokens(rate: Rate, input_tokens: int, expected: float) -> None:
    assert rate.at(input_tokens) == expected


@pytest.mark.parametrize(
    ("rate", "worst"),
    [
        (Rate(per_tok(4.0)), per_tok(4.0)),
        (TIERED, per_tok(3.0)),
        (Rate(per_tok(5.0), ((100, per_tok(1.0)),)), per_tok(5.0)),  # a cheaper tier never lowers it
    ],
)
def test_rate_worst(rate: Rate, worst: float) -> None:
    assert rate.worst == worst


@pytest.mark.parametrize(
    ("price", "worst_input"),
    [
        (ModelPrice(Rate(per_tok(3.0)), Rate(per_tok(15.0))), per_tok(3.0)),
        (ModelPrice(TIERED, Rate(per_tok(15.0))), per_tok(3.0)),
        # a cache write costs more than plain input
        (ModelPrice(Rate(per_tok(3.0)), Rate(per_tok(15.0)), cache_write=Rate(per_tok(3.75))), per_tok(3.75)),
        # a cache read is never the worst case
        (ModelPrice(Rate(per_tok(3.0)), Rate(per_tok(15.0)), cache_read=Rate(per_tok(9.0))), per_tok(3.0)),
    ],
)
def test_worst_input(price: ModelPrice, worst_input: float) -> None:
    assert price.worst_input == worst_input


# -- ModelPrice.cost ---------------------------------------------------------------------------------

PLAIN = ModelPrice(Rate(per_tok(2.0)), Rate(per_tok(10.0)))
CACHED = ModelPrice(Rate(per_tok(2.0)), Rate(per_tok(10.0)), cache_read=Rate(per_tok(0.5)),
                    cache_write=Rate(per_tok(4.0)))
LONG = ModelPrice(Rate(per_tok(3.0), ((200_000, per_tok(6.0)),)),
                  Rate(per_tok(15.0), ((200_000, per_tok(22.5)),)))


@pytest.mark.parametrize(
    ("price", "usage", "usd"),
    [
        (PLAIN, Usage(), 0.0),
        (PLAIN, Usage(1_000_000, 0), 2.0),
        (PLAIN, Usage(0, 1_000_000), 10.0),
        (PLAIN, Usage(500_000, 100_000), 2.0),
        # no cache rates: cached tokens are plain input
        (PLAIN, Usage(1_000_000, 0, cache_read_tokens=400_000, cache_creation_tokens=100_000), 2.0),
        # input includes cached tokens: 500k plain, 400k read, 100k written
        (CACHED, Usage(1_000_000, 0, cache_read_tokens=400_000, cache_creation_tokens=100_000),
         1.0 + 0.2 + 0.4),
        (CACHED, Usage(100, 0, cache_read_tokens=300), 300 * per_tok(0.5)),  # plain never negative
        (CACHED, Usage(0, 0, reasoning_tokens=1000), 0.0),  # reasoning tokens are in output already
        (LONG, Usage(200_000, 1000), 0.6 + 0.015),
        (LONG, Usage(200_001, 1000), 200_001 * per_tok(6.0) + 1000 * per_tok(22.5)),  # the whole step
    ],
)
def test_cost(price: ModelPrice, usage: Usage, usd: float) -> None:
    assert price.cost(usage) == pytest.approx(usd, rel=1e-12)


# -- _rate: genai-prices values to per-token rates ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "rate"),
    [
        (None, None),
        (Decimal("2.5"), Rate(2.5e-6)),
        (3, Rate(3e-6)),
        (0.5, Rate(0.5e-6)),
        (SimpleNamespace(base=Decimal(3), tiers=[SimpleNamespace(start=200_000, price=Decimal(6))]),
         Rate(3e-6, ((200_000, 6e-6),))),
        (SimpleNamespace(base=Decimal(3)), Rate(3e-6)),
        (SimpleNamespace(tiers=[]), None),  # no base: unusable
        ("3.0", None),
    ],
)
def test_rate_from_genai_prices_value(value: Any, rate: Rate | None) -> None:
    assert pricing._rate(value) == rate


# -- Pricer: config overrides ------------------------------------------------------------------------

OVERRIDES = {
    "gpt-4o": Price(input_per_mtok=1.0, output_per_mtok=2.0, max_output_tokens=4096),
    "my-local-*": Price(input_per_mtok=0.0, output_per_mtok=0.0),
    "gpt-*": Price(input_per_mtok=7.0, output_per_mtok=8.0),
    "claude-[0-9]*": Price(input_per_mtok=5.0, output_per_mtok=6.0),
}


@pytest.mark.parametrize(
    ("model", "provider_type", "price"),
    [
        # search fees the config does not set stay genai-prices' (OpenAI: $10 per 1,000 web searches,
        # $2.50 per 1,000 file searches)
        ("gpt-4o", "openai", ModelPrice(Rate(1e-6), Rate(2e-6), max_output_tokens=4096, source="config",
                                        web_search=0.01, file_search=0.0025)),
        # exact before globs, globs in the order of the table
        ("gpt-4o-mini", "openai", ModelPrice(Rate(7e-6), Rate(8e-6), source="config", web_search=0.01,
                                             file_search=0.0025)),
        ("my-local-llama", "openai", ModelPrice(Rate(0.0), Rate(0.0), source="config")),
        ("claude-3", "anthropic", ModelPrice(Rate(5e-6), Rate(6e-6), source="config")),
        # the config decides whatever the provider type (genai-prices has no gpt-4o under anthropic)
        ("gpt-4o", "anthropic", ModelPrice(Rate(1e-6), Rate(2e-6), max_output_tokens=4096, source="config")),
    ],
)
def test_config_prices_override_genai_prices(model: str, provider_type: str, price: ModelPrice) -> None:
    assert Pricer(OVERRIDES).lookup(model, provider_type, searches=True) == price


def test_config_search_fees_replace_genai_prices_ones() -> None:
    pricer = Pricer({"gpt-4o": Price(input_per_mtok=1.0, output_per_mtok=2.0, web_search_per_k=25.0,
                                     file_search_per_k=0.0)})
    price = pricer.lookup("gpt-4o", "openai", searches=True)
    assert price is not None and (price.web_search, price.file_search) == (0.025, 0.0)
    assert price.search_fee == 0.025


def test_searches_are_charged_at_their_fees() -> None:
    price = ModelPrice(Rate(1e-6), Rate(4e-6), web_search=0.01, file_search=0.0025)
    usage = Usage(input_tokens=100, output_tokens=10, web_search_requests=3, file_search_requests=2)
    assert price.cost(usage) == pytest.approx(100e-6 + 40e-6 + 0.03 + 0.005)
    assert price.search_fee == 0.01


def test_openai_search_fees_come_from_genai_prices() -> None:
    price = Pricer({}).lookup("gpt-4.1-mini", "openai")
    assert price is not None and (price.web_search, price.file_search) == (0.01, 0.0025)


def test_config_price_has_no_cache_rates_so_cached_input_costs_full_price() -> None:
    price = Pricer(OVERRIDES).lookup("gpt-4o", "openai")
    assert price is not None
    assert price.cost(Usage(1_000_000, 1_000_000, cache_read_tokens=900_000)) == pytest.approx(3.0)


def test_glob_overrides_are_case_sensitive_and_whole_name() -> None:
    pricer = Pricer({"my-local-*": Price(input_per_mtok=0.0, output_per_mtok=0.0)})
    assert pricer.lookup("My-Local-x", "openai") is None
    assert pricer.lookup("x-my-local-y", "openai") is None


# -- Pricer: genai-prices ----------------------------------------------------------------------------

USAGES = [
    ("gpt-4o", "openai", Usage(1000, 500)),
    ("gpt-4o", "openai", Usage(1000, 500, cache_read_tokens=400)),
    ("gpt-4o-mini", "openai", Usage(123_456, 7890, cache_read_tokens=100_000)),
    ("claude-3-5-sonnet-latest", "anthropic",
     Usage(1000, 500, cache_read_tokens=300, cache_creation_tokens=200)),
    ("claude-3-5-haiku-latest", "anthropic", Usage(50_000, 2000, cache_creation_tokens=50_000)),
    ("claude-sonnet-4-5", "anthropic", Usage(200_000, 1000)),  # at the long-context tier's start
    ("claude-sonnet-4-5", "anthropic", Usage(250_000, 1000)),  # above it: every token at the tier rate
    ("claude-sonnet-4-5", "anthropic",
     Usage(200_001, 1000, cache_read_tokens=100_000, cache_creation_tokens=50_000)),
]


@pytest.mark.parametrize(("model", "provider_type", "usage"), USAGES)
def test_cost_agrees_with_genai_prices(model: str, provider_type: str, usage: Usage) -> None:
    """Costs come from cached per-token rates; they must equal genai-prices' own calculation."""
    price = Pricer({}).lookup(model, provider_type)
    assert price is not None and price.source == "genai-prices"
    expected = calc_price(
        GPUsage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                cache_read_tokens=usage.cache_read_tokens, cache_write_tokens=usage.cache_creation_tokens),
        model_ref=model, provider_id=provider_type,
    ).total_price
    assert price.cost(usage) == pytest.approx(float(expected), rel=1e-9)


def test_genai_prices_tiers_are_kept() -> None:
    price = Pricer({}).lookup("claude-sonnet-4-5", "anthropic")
    assert price is not None
    assert price.input.tiers != () and price.input.worst > price.input.base
    writes = [r.worst for r in (price.cache_write, price.cache_write_1h) if r is not None]
    assert price.worst_input == max(price.input.worst, *writes)
    assert price.cache_write_1h is not None and price.worst_input == price.cache_write_1h.worst  # the dearest


def test_a_cache_written_for_an_hour_is_priced_at_its_rate() -> None:
    """Anthropic's `cache_creation.ephemeral_1h_input_tokens` cost more than 5-minute writes."""
    price = ModelPrice(Rate(1e-6), Rate(4e-6), Rate(0.1e-6), Rate(1.25e-6), cache_write_1h=Rate(2e-6))
    usage = Usage(input_tokens=1100, output_tokens=10, cache_creation_tokens=1000, cache_write_1h_tokens=600)
    assert price.cost(usage) == pytest.approx(100 * 1e-6 + 400 * 1.25e-6 + 600 * 2e-6 + 10 * 4e-6)


@pytest.mark.parametrize(
    ("model", "provider_type"),
    [
        ("no-such-model-xyz", "openai"),
        ("no-such-model-xyz", "anthropic"),
        ("gpt-4o", "anthropic"),  # genai-prices is asked under the provider's type
        ("", "openai"),
    ],
)
def test_unknown_models_have_no_price(model: str, provider_type: str) -> None:
    assert Pricer({}).lookup(model, provider_type) is None


def test_lookups_are_cached_per_provider_type_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []

    def fake(model: str, provider_type: str, output_billed: bool = True) -> ModelPrice | None:
        calls.append((model, provider_type))
        return None if model == "unknown" else PLAIN

    monkeypatch.setattr(pricing, "_from_genai_prices", fake)
    pricer = Pricer({"cfg-*": Price(input_per_mtok=1.0, output_per_mtok=1.0)})
    for _ in range(3):
        assert pricer.lookup("gpt-4o", "openai") is PLAIN
        assert pricer.lookup("gpt-4o", "anthropic") is PLAIN
        assert pricer.lookup("unknown", "openai") is None  # a miss is cached too
        assert pricer.lookup("cfg-x", "openai") is not None  # config prices do not ask genai-prices
    assert calls == [("gpt-4o", "openai"), ("gpt-4o", "anthropic"), ("unknown", "openai")]
    for _ in range(2):  # but for the search fees they do not set, when a request can search: once
        assert pricer.lookup("cfg-x", "openai", searches=True) is not None
    assert calls[3:] == [("cfg-x", "openai")]


def test_a_model_listed_with_an_input_price_alone_is_priced_only_for_calls_that_bill_no_output() -> None:
    pricer = Pricer({})
    assert pricer.lookup("text-embedding-3-small", "openai") is None  # a call that generates needs both
    price = pricer.lookup("text-embedding-3-small", "openai", output_billed=False)
    assert price is not None and price.output.base == 0.0
    assert price.input.base == pytest.approx(0.02 / 1e6)


@pytest.mark.parametrize(("model", "reasoning"), [
    ("o3", True), ("o4-mini", True), ("gpt-5", True), ("gpt-5-mini-2025-08-07", True), ("openai/o1", True),
    ("gpt-5-chat-latest", False), ("gpt-4o", False), ("gpt-4.1-mini", False), ("my-model", False),
])
def test_reasons(model: str, reasoning: bool) -> None:
    assert pricing.reasons(model) is reasoning


@pytest.mark.parametrize(("model", "preview", "per_k", "web_search", "per_call"), [
    ("gpt-4o", True, None, 0.025, 0.0),  # preview, no reasoning: OpenAI's $25 per 1,000
    ("gpt-4o", False, None, 0.01, 0.0),  # the web_search tool: genai-prices' $10
    ("o3", True, None, 0.01, 0.0),  # preview on a reasoning model: $10
    ("gpt-4o-mini-search-preview", False, None, 0.01, 0.025),  # a search model: a search every call
    ("gpt-4o-mini-search-preview-2025-03-11", False, None, 0.01, 0.025),
    ("gpt-5-search-api", False, None, 0.01, 0.01),  # a reasoning search model: the web_search fee
    ("o1", True, None, 0.01, 0.0),  # genai-prices gives o1 no search fee: OpenAI's $10 is the floor
    ("gpt-4o", True, 30.0, 0.03, 0.0),  # a configured fee is the fee
    ("gpt-4o-mini-search-preview", False, 30.0, 0.03, 0.03),
])
def test_openai_search_fees_genai_prices_lacks(
    model: str, preview: bool, per_k: float | None, web_search: float, per_call: float
) -> None:
    overrides = {} if per_k is None else {model: Price(input_per_mtok=0.15, output_per_mtok=0.6, web_search_per_k=per_k)}
    price = Pricer(overrides).lookup(model, "openai", searches=True, preview_search=preview)
    assert price is not None
    assert (price.web_search, price.per_call) == (pytest.approx(web_search), pytest.approx(per_call))


def test_other_providers_keep_their_fees_and_a_per_call_fee_is_in_every_cost() -> None:
    price = Pricer({}).lookup("claude-3-5-haiku-latest", "anthropic", searches=True, preview_search=True)
    assert price is not None and (price.web_search, price.per_call) == (pytest.approx(0.01), 0.0)
    fee = ModelPrice(Rate(1e-6), Rate(2e-6), per_call=0.025)
    assert fee.cost(Usage(input_tokens=10, output_tokens=5)) == pytest.approx(10e-6 + 10e-6 + 0.025)


def test_a_local_model_a_config_prices_on_an_openai_wire_provider_gets_no_openai_fees() -> None:
    price = Pricer({"my-local-*": Price(input_per_mtok=0.0, output_per_mtok=0.0)}).lookup(
        "my-local-search-preview", "openai", searches=True, preview_search=True)
    assert price is not None and (price.web_search, price.per_call) == (0.0, 0.0)


# -- service tiers and audio -------------------------------------------------------------------------


def genai_total(model: str, tier: str | None = None, **usage: int) -> float:
    context = {"service_tier": tier} if tier else None
    return float(calc_price(GPUsage(**usage), model_ref=model, provider_id="openai", price_context=context).total_price)


@pytest.mark.parametrize(("requested", "reserved"), [
    (None, "default"), ("auto", "default"), ("default", "default"), ("scale", "default"), ("", "default"),
    ("priority", "priority"), ("flex", "flex"), ("fast", "fast"), ("ultrafast", "ultrafast"),
])
def test_reserved_tier(requested: str | None, reserved: str) -> None:
    assert pricing.reserved_tier(requested) == reserved


@pytest.mark.parametrize(("requested", "tier"), [(None, None), ("auto", None), ("priority", "priority"),
                                                  ("flex", "flex")])
def test_a_lookup_is_priced_at_the_tier_asked_for_as_genai_prices_prices_it(requested: str | None,
                                                                             tier: str | None) -> None:
    price = Pricer({}).lookup("o3", "openai", service_tier=requested)
    assert price is not None
    usage = {"input_tokens": 1000, "output_tokens": 700, "cache_read_tokens": 300}
    assert price.cost(Usage(1000, 700, cache_read_tokens=300)) == pytest.approx(genai_total("o3", tier, **usage))


@pytest.mark.parametrize(("requested", "reserved"), [("fast", "fast"), ("ultrafast", "priority"), ("flex", "priority")])
def test_a_tier_genai_prices_does_not_list_for_the_model_is_reserved_at_the_dearest_it_lists(
    requested: str, reserved: str
) -> None:
    """gpt-4.1 lists `fast` and `priority` (both $3.50 / $14 per Mtok against $2 / $8) and no `flex`: a
    request for a tier it does not list may cost more than standard, so it holds the dearest rates."""
    price = Pricer({}).lookup("gpt-4.1", "openai", service_tier=requested)
    assert price is not None
    want = genai_total("gpt-4.1", reserved, input_tokens=1000, output_tokens=700)
    assert price.cost(Usage(1000, 700)) == pytest.approx(want)
    assert want > genai_total("gpt-4.1", None, input_tokens=1000, output_tokens=700)


@pytest.mark.parametrize("answered", ["default", "priority", "flex", "scale", "made-up"])
@pytest.mark.parametrize("requested", [None, "priority", "flex"])
def test_a_settlement_follows_the_tier_the_answer_reports(requested: str | None, answered: str) -> None:
    price = Pricer({}).lookup("gpt-4o-mini", "openai", searches=True, service_tier=requested)
    assert price is not None
    settled = price.at_tier(answered)
    # a tier named standard (`scale` too) is billed at the standard rates; one nobody lists at the dearest
    listed = answered if answered in ("priority", "flex") else "priority" if answered == "made-up" else None
    want = genai_total("gpt-4o-mini", listed, input_tokens=2000, output_tokens=500)
    assert settled.cost(Usage(2000, 500)) == pytest.approx(want)
    assert settled.web_search == price.web_search  # fees do not depend on the tier


def test_at_tier_keeps_prices_when_the_answer_names_no_tier_or_the_prices_have_none() -> None:
    price = Pricer({}).lookup("gpt-4o", "openai", service_tier="priority")
    assert price is not None and price.service_tier == "priority"
    assert price.at_tier(None) is price
    assert price.at_tier("priority") is price
    configured = Pricer({"gpt-4o": Price(input_per_mtok=1.0, output_per_mtok=2.0)}).lookup(
        "gpt-4o", "openai", service_tier="priority")
    assert configured is not None and configured.service_tiers == ()
    assert configured.at_tier("flex") is configured  # one configured rate for every tier
    assert configured.output == Rate(per_tok(2.0))


def test_prices_are_cached_per_tier_and_genai_prices_is_read_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = pricing._from_genai_prices

    def counted(model: str, provider_type: str, output_billed: bool = True) -> ModelPrice | None:
        calls.append(model)
        return real(model, provider_type, output_billed)

    monkeypatch.setattr(pricing, "_from_genai_prices", counted)
    pricer = Pricer({})
    standard = pricer.lookup("gpt-4o", "openai")
    assert pricer.lookup("gpt-4o", "openai", service_tier="auto") is standard  # `auto` shares the standard key
    priority = pricer.lookup("gpt-4o", "openai", service_tier="priority")
    assert pricer.lookup("gpt-4o", "openai", service_tier="priority") is priority
    assert priority is not None and standard is not None and priority.output.base > standard.output.base
    assert calls == ["gpt-4o"]


def test_a_configured_model_never_loads_genai_prices_for_a_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> ModelPrice | None:
        raise AssertionError("genai-prices looked up")

    monkeypatch.setattr(pricing, "_from_genai_prices", boom)
    price = Pricer({"mine-*": Price(input_per_mtok=1.0, output_per_mtok=2.0)}).lookup("mine-1", "openai",
                                                                                     service_tier="priority")
    assert price is not None and price.source == "config"


def test_audio_tokens_are_priced_at_the_audio_rates_as_genai_prices_prices_them() -> None:
    price = Pricer({}).lookup("gpt-audio", "openai")
    assert price is not None and price.input_audio is not None and price.output_audio is not None
    usage = Usage(1000, 1000, input_audio_tokens=800, output_audio_tokens=600)
    want = genai_total("gpt-audio", input_tokens=1000, output_tokens=1000, input_audio_tokens=800,
                       output_audio_tokens=600)
    assert price.cost(usage) == pytest.approx(want)


def test_audio_reservation_rates() -> None:
    price = ModelPrice(Rate(per_tok(2.5)), Rate(per_tok(10.0)), input_audio=Rate(per_tok(32.0)),
                       output_audio=Rate(per_tok(64.0)))
    assert price.worst_input == per_tok(32.0)  # audio input is always possible
    assert price.worst_output(audio=True) == per_tok(64.0)
    assert price.worst_output(audio=False) == per_tok(10.0)  # the model speaks only when asked to
    text = ModelPrice(Rate(per_tok(2.5)), Rate(per_tok(10.0)))
    assert text.worst_output(audio=True) == per_tok(10.0)


def test_audio_tokens_cost_text_rates_without_audio_rates_and_never_more_than_the_counts() -> None:
    price = ModelPrice(Rate(per_tok(1.0)), Rate(per_tok(2.0)))
    assert price.cost(Usage(100, 50, input_audio_tokens=80, output_audio_tokens=40)) == price.cost(Usage(100, 50))
    audio = ModelPrice(Rate(per_tok(1.0)), Rate(per_tok(2.0)), input_audio=Rate(per_tok(10.0)),
                       output_audio=Rate(per_tok(20.0)))
    # a report of more audio tokens than tokens is capped at the counts: nothing is priced twice
    assert audio.cost(Usage(100, 50, input_audio_tokens=500, output_audio_tokens=500)) == pytest.approx(
        100 * per_tok(10.0) + 50 * per_tok(20.0))


# -- Anthropic's fast mode: a tier of the `speed` price context ------------------------------------------


def anthropic_total(model: str, speed: str | None = None, **usage: int) -> float:
    context = {"speed": speed} if speed else None
    return float(calc_price(GPUsage(**usage), model_ref=model, provider_id="anthropic",
                            price_context=context).total_price)


@pytest.mark.parametrize(("requested", "answered", "speed"), [
    (None, None, None), ("fast", None, "fast"),  # reserved at the speed asked for
    (None, "fast", "fast"), ("fast", "standard", None),  # settled at the speed the answer reports
    ("turbo", None, "fast"),  # a speed genai-prices does not list: the dearest it lists for the model
])
def test_fast_mode_is_priced_as_genai_prices_prices_it(requested: str | None, answered: str | None,
                                                       speed: str | None) -> None:
    price = Pricer({}).lookup("claude-opus-4-8", "anthropic", service_tier=requested)
    assert price is not None
    usage = {"input_tokens": 1000, "output_tokens": 700, "cache_read_tokens": 300}
    want = anthropic_total("claude-opus-4-8", speed, **usage)
    assert price.at_tier(answered).cost(Usage(1000, 700, cache_read_tokens=300)) == pytest.approx(want)
    assert anthropic_total("claude-opus-4-8", "fast", **usage) > anthropic_total("claude-opus-4-8", None, **usage)


@pytest.mark.parametrize(("variants", "listed"), [
    ([], ()),
    ([{"speed": "fast"}], (("fast", "speed"),)),
    ([{"service_tier": "priority"}, {"service_tier": "default"}, {"processing": "batch"}],
     (("priority", "service_tier"),)),  # batch is no tier a request asks for here; default is the standard
    ([{"speed": "fast", "processing": "batch"}], ()),  # a variant of two contexts is no tier
    ([{"speed": "fast"}, {"service_tier": "fast"}], (("fast", "service_tier"),)),  # one name: the service tier
])
def test_listed_tiers_read_the_service_tier_and_speed_variants(variants: list[dict[str, str]],
                                                               listed: tuple[tuple[str, str], ...]) -> None:
    model = SimpleNamespace(price_variants=[SimpleNamespace(when=when) for when in variants])
    assert pricing._listed_tiers(model) == listed


def test_a_model_without_fast_rates_is_reserved_at_its_standard_rates_for_a_fast_request() -> None:
    """claude-3-5-haiku has no fast mode in genai-prices (nor at Anthropic): nothing dearer to hold."""
    fast = Pricer({}).lookup("claude-3-5-haiku-latest", "anthropic", service_tier="fast")
    standard = Pricer({}).lookup("claude-3-5-haiku-latest", "anthropic")
    assert fast is not None and standard is not None and fast.cost(Usage(1000, 1000)) == standard.cost(Usage(1000, 1000))


def test_the_price_caches_stay_bounded_whatever_names_requests_send() -> None:
    """Model names and service tiers come from requests: a flood of new ones empties a full cache rather
    than growing it (each is looked up again when next asked for)."""
    pricer = Pricer({"gpt-*": Price(input_per_mtok=1.0, output_per_mtok=2.0)})
    for i in range(pricing.CACHE_MAX + 10):
        assert pricer.lookup(f"gpt-{i}", "openai") is not None
    assert len(pricer._cache) <= pricing.CACHE_MAX
    listed = Pricer({})
    for i in range(50):
        listed.lookup("gpt-4.1", "openai", service_tier=f"made-up-{i}")
    assert len(listed._cache) == 2  # the standard price and the one every unlisted tier shares


def test_the_input_rate_follows_the_tier_the_tokens_reach_and_the_cache_writes_a_request_may_make() -> None:
    price = ModelPrice(Rate(3e-6, ((200_000, 6e-6),)), Rate(15e-6), cache_write=Rate(3.75e-6, ((200_000, 7.5e-6),)),
                       cache_write_1h=Rate(6e-6, ((200_000, 12e-6),)))
    assert price.input_rate(20_000, cache_writes=False) == 3e-6
    assert price.input_rate(300_000, cache_writes=False) == 6e-6
    assert price.input_rate(20_000) == 6e-6  # a 1-hour cache write
    assert price.input_rate(300_000) == price.worst_input == 12e-6
