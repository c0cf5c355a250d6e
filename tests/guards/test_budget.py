"""Budget guard: claims before the step, `settlement()` after it (pure, no event loop)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.call import RequestParams, Usage
from gateway.pricing import ModelPrice, Rate
from gateway.store import logic
from gateway.store.base import Claim, Denial, Reservation
from guards.bounds import SEARCH_INPUT_TOKENS, SEARCHES_WHEN_UNSET
from guards.budget import IMAGE_TOKENS, BudgetGuard, answer_usage, settlement
from tests.guards.support import NOW, PRICE, answer, call, ctx, mcp_call, policy, reserve, run

GUARD = BudgetGuard()
TIERED = ModelPrice(Rate(1e-6, ((200_000, 2e-6),)), Rate(4e-6, ((200_000, 8e-6),)))
CACHE_WRITE = ModelPrice(Rate(1e-6), Rate(4e-6), cache_write=Rate(1.25e-6))


def tokens(limit: float | None, fixed: float = 1000.0) -> Claim:
    return Claim("tokens", fixed, 1.0, limit, "token_budget_exhausted")


def usd(limit: float | None, fixed: float = 1000 * 1e-6, per_unit: float = 4e-6) -> Claim:
    return Claim("usd", fixed, per_unit, limit, "budget_exhausted")


@pytest.mark.parametrize(
    ("budget", "price", "claims"),
    [
        ({}, PRICE, (tokens(None), usd(None))),
        ({"usd": 2.0}, PRICE, (tokens(None), usd(2.0))),
        ({"tokens": 5000}, PRICE, (tokens(5000.0), usd(None))),
        ({"usd": 2.0, "tokens": 5000}, PRICE, (tokens(5000.0), usd(2.0))),
        ({}, None, (tokens(None),)),  # unknown price without a USD budget: tokens only
        ({"tokens": 5000}, None, (tokens(5000.0),)),
        # input at the tier the input bound reaches (1,000 tokens: below the long-context threshold); output
        # at the highest tier, so the worst case is never under-reserved
        ({"usd": 1.0}, TIERED, (tokens(None), usd(1.0, 1000 * 1e-6, 8e-6))),
        # a cache write costs more than plain input: the input bound is priced at it
        ({"usd": 1.0}, CACHE_WRITE, (tokens(None), usd(1.0, 1000 * 1.25e-6, 4e-6))),
    ],
    ids=["none", "usd", "tokens", "both", "no-price", "no-price-tokens", "tiered", "cache-write"],
)
def test_before_claims(budget: dict[str, Any], price: ModelPrice | None, claims: tuple[Claim, ...]) -> None:
    decision = GUARD.before(ctx(call(input_bytes=1000), policy(budget=budget), price=price))
    assert not decision.stopped
    assert decision.effects == ()
    assert len(decision.claims) == len(claims)
    for got, want in zip(decision.claims, claims, strict=True):
        assert (got.counter, got.limit, got.code) == (want.counter, want.limit, want.code)
        assert got.fixed == pytest.approx(want.fixed) and got.per_unit == pytest.approx(want.per_unit)


def test_unknown_price_with_usd_budget_rejects_with_a_clear_detail() -> None:
    decision = GUARD.before(ctx(call(model="mystery-1"), policy(budget={"usd": 1.0}), price=None))
    assert decision.action == "reject" and not decision.stopped and decision.reason == "price_unknown"
    assert "mystery-1" in decision.detail and "pricing:" in decision.detail
    assert decision.claims == ()


@pytest.mark.parametrize("price", [None, PRICE])
@pytest.mark.parametrize("budget", [{}, {"usd": 1.0, "tokens": 10}])
def test_mcp_tool_execution_claims_nothing(budget: dict[str, Any], price: ModelPrice | None) -> None:
    decision = GUARD.before(ctx(mcp_call(), policy(budget=budget), price=price))
    assert decision == GUARD.before(ctx(mcp_call(), policy(), price=None))
    assert not decision.stopped and decision.claims == () and decision.effects == ()


@pytest.mark.parametrize(
    "state", [None, run(used={"usd": 1.99}, started_at=0.0)], ids=["first-step", "later"]
)
def test_before_does_not_read_the_run(state: Any) -> None:
    """The guard only claims: whether the claim fits is decided atomically by the store."""
    decision = GUARD.before(ctx(p=policy(budget={"usd": 2.0}), state=state))
    assert not decision.stopped and len(decision.claims) == 2


def test_after_allows_without_effects() -> None:
    assert GUARD.after(ctx(), answer(usage=Usage(10, 10))).effects == ()


# -- claims through the pure reserve ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "input_bytes", "max_units", "granted", "denied_with"),
    [
        # 1000 B in ($0.001) + 250 out ($0.001) = $0.002 per call; $0.01 pays for exactly 5
        ({"usd": 0.01}, 1000, 250, [250] * 5, "budget_exhausted"),
        # no max_tokens: the most the remaining budget pays for, capped by the output limit
        ({"usd": 0.01}, 1000, 32768, [2250], "budget_exhausted"),
        # tokens: 1000 in + 500 out per call; 4500 pays for exactly 3
        ({"tokens": 4500}, 1000, 500, [500] * 3, "token_budget_exhausted"),
        # the last call gets what is left, as long as that is at least the minimal 16 tokens
        ({"tokens": 3000}, 1000, 800, [800, 200], "token_budget_exhausted"),
        # not even a minimal call fits: stop before any byte goes upstream
        ({"usd": 0.001 + 15 * 4e-6}, 1000, 250, [], "budget_exhausted"),
        ({"tokens": 1015}, 1000, 250, [], "token_budget_exhausted"),
        # both budgets: the tighter one limits units and names the stop
        ({"usd": 1.0, "tokens": 1100}, 1000, 250, [100], "token_budget_exhausted"),
        ({"usd": 0.0014, "tokens": 10**6}, 1000, 250, [100], "budget_exhausted"),
    ],
    ids=[
        "usd-exact-5",
        "usd-clamp",
        "tokens-exact-3",
        "tokens-remainder",
        "usd-min",
        "tokens-min",
        "tokens-tighter",
        "usd-tighter",
    ],
)
def test_reserve_grants_what_the_budget_pays_for(
    budget: dict[str, Any], input_bytes: int, max_units: int, granted: list[int], denied_with: str
) -> None:
    state = run()
    p = policy(budget=budget)
    got: list[int] = []
    for _ in range(len(granted) + 1):
        grant = reserve(state, GUARD.before(ctx(call(input_bytes=input_bytes), p)), max_units)
        if isinstance(grant, Denial):
            assert grant.reason == denied_with
            break
        got.append(grant.units)
    assert got == granted
    assert isinstance(grant, Denial)
    if granted:  # nothing settled yet: the budget is held by the steps in flight, so the run goes on
        assert grant.held and not state.stopped
    else:  # not even a minimal call fits what is left unspent: the run stops
        assert not grant.held and state.stop_reason == denied_with
    for counter, limit in (("usd", budget.get("usd")), ("tokens", budget.get("tokens"))):
        if limit is not None:
            assert state.reserved.get(counter, 0.0) <= limit + logic.EPS


def choices(n: int | None, input_bytes: int = 1000) -> Any:
    return dataclasses.replace(call(input_bytes=input_bytes), params=RequestParams(choice_count=n))


@pytest.mark.parametrize("n", [None, 1, 2, 8])
def test_every_choice_asked_for_reserves_the_output_limit(n: int | None) -> None:
    """OpenAI bills `n` choices, each up to the output limit: a unit of output is claimed `n` times."""
    decision = GUARD.before(ctx(choices(n), policy(budget={"usd": 1.0, "tokens": 5000})))
    per_choice = {"tokens": 1.0, "usd": 4e-6}
    for claim in decision.claims:
        assert claim.per_unit == pytest.approx(per_choice[claim.counter] * (n or 1))


@pytest.mark.parametrize(("n", "granted"), [(1, 2000), (8, 250), (200, None)])
def test_n_choices_fit_the_token_budget_together(n: int, granted: int | None) -> None:
    """3000 tokens, 1000 of input bound: 2000 output tokens for all choices (none, 16 each, at n=200)."""
    state = run()
    grant = reserve(state, GUARD.before(ctx(choices(n), policy(budget={"tokens": 3000}))), 10_000)
    if granted is None:
        assert isinstance(grant, Denial) and grant.reason == "token_budget_exhausted"
        return
    assert not isinstance(grant, Denial)
    assert grant.units == granted
    assert state.reserved["tokens"] <= 3000 + logic.EPS


def test_settlement_without_usage_charges_every_choice_reserved() -> None:
    reservation = Reservation("r1", "run-1", 1, 100, {"tokens": 1200.0, "llm_calls": 1.0})
    actual = settlement(None, None, reservation, relayed_output=150, choices=2)  # 2 x 100 reserved
    assert (actual["output_tokens"], actual["input_tokens"], actual["tokens"]) == (200.0, 1000.0, 1200.0)
    beyond = settlement(None, None, reservation, relayed_output=260, choices=2)
    assert (beyond["output_tokens"], beyond["tokens"]) == (260.0, 1260.0)


# -- settlement ------------------------------------------------------------------------------------


def held(
    units: int = 250, tokens_: float = 1250.0, usd_: float = 0.002, llm_calls: bool = True
) -> Reservation:
    amounts = {"tokens": tokens_, "usd": usd_}
    if llm_calls:
        amounts["llm_calls"] = 1.0
    return Reservation("r1", "run-1", 1, units, amounts)


@pytest.mark.parametrize(
    ("usage", "price", "reservation", "expected"),
    [
        (
            Usage(100, 50),
            PRICE,
            held(),
            {
                "tokens": 150.0,
                "input_tokens": 100.0,
                "output_tokens": 50.0,
                "llm_calls": 1.0,
                "usd": 100 * 1e-6 + 50 * 4e-6,
            },
        ),
        (  # no price known (token budget only): no USD line
            Usage(100, 50),
            None,
            Reservation("r1", "run-1", 1, 250, {"tokens": 1250.0, "llm_calls": 1.0}),
            {"tokens": 150.0, "input_tokens": 100.0, "output_tokens": 50.0, "llm_calls": 1.0},
        ),
        (  # a call count is only settled when it was claimed
            Usage(100, 50),
            PRICE,
            held(llm_calls=False),
            {"tokens": 150.0, "input_tokens": 100.0, "output_tokens": 50.0, "usd": 100 * 1e-6 + 50 * 4e-6},
        ),
        (  # usage reported as zero is still the provider's word
            Usage(0, 0),
            PRICE,
            held(),
            {"tokens": 0.0, "input_tokens": 0.0, "output_tokens": 0.0, "llm_calls": 1.0, "usd": 0.0},
        ),
        (  # a custom guard's own count per step is what it claimed, usage or not
            Usage(100, 50),
            None,
            Reservation("r1", "run-1", 1, 250, {"tokens": 1250.0, "llm_calls": 1.0, "probe_calls": 1.0}),
            {"tokens": 150.0, "input_tokens": 100.0, "output_tokens": 50.0, "llm_calls": 1.0, "probe_calls": 1.0},
        ),
    ],
    ids=["usage", "usage-no-price", "usage-no-llm-claim", "usage-zero", "usage-custom-count"],
)
def test_settlement_with_usage(
    usage: Usage, price: ModelPrice | None, reservation: Reservation, expected: dict[str, float]
) -> None:
    actual = dict(settlement(usage, price, reservation))
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value), key


@pytest.mark.parametrize(
    ("relayed", "tokens_", "usd_", "output_tokens"),
    [
        (0, 1250.0, 0.002, 250.0),  # usage missing: the whole reservation, never zero
        (100, 1250.0, 0.002, 250.0),  # relayed less than reserved: still the reservation
        (250, 1250.0, 0.002, 250.0),
        # an upstream that ignored max_tokens relayed more: never below what was relayed
        (400, 1400.0, 0.002 + 150 * 4e-6, 400.0),
    ],
    ids=["nothing-relayed", "partial", "all", "beyond-reservation"],
)
def test_settlement_without_usage(relayed: int, tokens_: float, usd_: float, output_tokens: float) -> None:
    actual = settlement(None, PRICE, held(), relayed_output=relayed)
    assert actual["tokens"] == pytest.approx(tokens_)
    assert actual["usd"] == pytest.approx(usd_) and actual["usd"] > 0
    assert actual["output_tokens"] == output_tokens >= relayed
    assert actual["input_tokens"] == 1000.0  # the input bound, never eaten into by the output
    assert actual["llm_calls"] == 1.0


def test_settlement_without_usage_or_price_settles_tokens_at_the_reservation() -> None:
    reservation = Reservation("r1", "run-1", 1, 64, {"tokens": 564.0, "llm_calls": 1.0})
    actual = settlement(None, None, reservation, relayed_output=10)
    assert actual == {"tokens": 564.0, "llm_calls": 1.0, "output_tokens": 64.0, "input_tokens": 500.0}


def test_a_missing_usage_chunk_settles_at_the_reservation_through_the_store_logic() -> None:
    state = run()
    grant = reserve(state, GUARD.before(ctx(call(input_bytes=1000), policy(budget={"usd": 1.0}))), 250)
    assert isinstance(grant, Reservation)
    logic.settle(state, grant, settlement(None, PRICE, grant, relayed_output=40), NOW)
    assert state.used["usd"] == pytest.approx(0.002) and state.used["tokens"] == 1250.0
    assert state.reserved["usd"] == pytest.approx(0.0) and state.reserved["tokens"] == 0.0
    assert state.open == {}


def test_real_usage_releases_the_rest_of_the_reservation() -> None:
    state = run()
    grant = reserve(state, GUARD.before(ctx(call(input_bytes=1000), policy(budget={"usd": 0.004}))), 250)
    assert isinstance(grant, Reservation)
    logic.settle(state, grant, settlement(Usage(300, 20), PRICE, grant), NOW)
    assert state.used["usd"] == pytest.approx(300e-6 + 80e-6)
    # the released budget pays for more calls: 0.004 - 0.00038 left, 0.002 each
    grants = [
        reserve(state, GUARD.before(ctx(call(input_bytes=1000), policy(budget={"usd": 0.004}))), 250)
        for _ in range(2)
    ]
    assert [isinstance(g, Reservation) and g.units for g in grants] == [250, 155]


@pytest.mark.parametrize(
    ("ans", "expected"),
    [(None, None), (answer(), None), (answer(usage=Usage(1, 2)), Usage(1, 2))],
)
def test_answer_usage(ans: Any, expected: Usage | None) -> None:
    assert answer_usage(ans) == expected


@pytest.mark.parametrize("images", [0, 1, 3])
def test_each_image_adds_its_own_bound(images: int) -> None:
    """An image's tokens follow its pixels, not its bytes: each one is bounded apart."""
    decision = GUARD.before(ctx(call(model="gpt-4o", input_bytes=1000, input_images=images), policy(budget={"tokens": 10**6}),
                                price=PRICE))
    tokens_claim, usd_claim = decision.claims
    assert tokens_claim.fixed == 1000 + images * IMAGE_TOKENS
    assert usd_claim.fixed == pytest.approx((1000 + images * IMAGE_TOKENS) * PRICE.worst_input)


@pytest.mark.parametrize(("budget", "refused"), [({"tokens": 10**6}, True), ({"usd": 5.0}, True), ({}, False)])
def test_documents_named_not_sent_are_refused_under_a_budget(budget: dict[str, Any], refused: bool) -> None:
    decision = GUARD.before(ctx(call(referenced_documents=2), policy(budget=budget), price=PRICE))
    assert (decision.action == "reject") is refused
    if refused:
        assert decision.reason == "input_unbounded" and "2 document(s)" in decision.detail
        assert "PDFs whose pages cannot be counted" in decision.detail  # a base64 PDF the adapter could not count


SEARCHING = ModelPrice(Rate(1e-6), Rate(4e-6), web_search=0.01, file_search=0.0025)


@pytest.mark.parametrize("limits", [(3,), (None,), (2, 5)])
def test_searches_are_reserved_at_their_fee_and_the_tokens_their_results_add(limits: tuple[int | None, ...]) -> None:
    the_call = call(input_bytes=1000, search_limits=limits)
    searches = sum(SEARCHES_WHEN_UNSET if n is None else n for n in limits)
    decision = GUARD.before(ctx(the_call, policy(budget={"usd": 5.0}), price=SEARCHING))
    tokens_claim, usd_claim = decision.claims
    # each search makes the model read the whole context again, with the results of every search so far
    held = 1000 + sum(1000 + k * SEARCH_INPUT_TOKENS for k in range(1, searches + 1))
    assert tokens_claim.fixed == held
    assert usd_claim.fixed == pytest.approx(held * 1e-6 + searches * 0.01)


def test_settlement_charges_the_searches_the_provider_reported() -> None:
    reservation = held(usd_=1000 * 1e-6 + 10 * 0.01 + 100 * 4e-6)
    usage = Usage(input_tokens=500, output_tokens=20, web_search_requests=2, file_search_requests=4)
    got = settlement(usage, SEARCHING, reservation)
    assert got["usd"] == pytest.approx(500e-6 + 80e-6 + 0.02 + 0.01)


# -- service tiers and audio -------------------------------------------------------------------------

AUDIO = ModelPrice(Rate(2.5e-6), Rate(10e-6), input_audio=Rate(32e-6), output_audio=Rate(64e-6))
TIERS = ModelPrice(Rate(1e-6), Rate(4e-6), service_tiers=(
    ("default", ModelPrice(Rate(1e-6), Rate(4e-6))), ("priority", ModelPrice(Rate(2e-6), Rate(8e-6)))))


@pytest.mark.parametrize(("speaks", "per_unit"), [(False, 10e-6), (True, 64e-6)])
def test_output_is_reserved_at_the_audio_rate_when_the_request_lets_the_model_speak(speaks: bool,
                                                                                      per_unit: float) -> None:
    c = dataclasses.replace(call(), audio_output=speaks)
    d = GUARD.before(ctx(c, policy(budget={"usd": 1.0}), price=AUDIO))
    [claim] = [cl for cl in d.claims if cl.counter == "usd"]
    assert claim.per_unit == pytest.approx(per_unit)
    assert claim.fixed == pytest.approx(1000 * 32e-6)  # input: audio is always possible


@pytest.mark.parametrize(("tier", "usd_"), [(None, 1000 * 1e-6 + 100 * 4e-6), ("default", 1000 * 1e-6 + 100 * 4e-6),
                                             ("priority", 1000 * 2e-6 + 100 * 8e-6),
                                             ("scale", 1000 * 1e-6 + 100 * 4e-6)])
def test_settlement_prices_usage_at_the_tier_the_answer_reports(tier: str | None, usd_: float) -> None:
    r = Reservation("r", "run", 1, 1000, {"usd": 1.0, "tokens": 5000.0})
    actual = settlement(Usage(1000, 100), TIERS, r, service_tier=tier)
    assert actual["usd"] == pytest.approx(usd_)


def test_input_past_a_tier_threshold_is_held_at_the_tier_rate() -> None:
    decision = GUARD.before(ctx(call(input_bytes=300_000), policy(budget={"usd": 5.0}), price=TIERED))
    assert decision.claims[1].fixed == pytest.approx(300_000 * 2e-6)


@pytest.mark.parametrize(("cache_writes", "rate"), [(True, 1.25e-6), (False, 1e-6)])
def test_a_request_that_writes_no_cache_is_not_held_at_the_cache_write_rate(cache_writes: bool, rate: float) -> None:
    """Anthropic writes its prompt cache only where a `cache_control` marks it (`Call.cache_writes`)."""
    the_call = dataclasses.replace(call(input_bytes=1000), cache_writes=cache_writes)
    decision = GUARD.before(ctx(the_call, policy(budget={"usd": 5.0}), price=CACHE_WRITE))
    assert decision.claims[1].fixed == pytest.approx(1000 * rate)
