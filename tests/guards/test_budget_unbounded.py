"""Budget guard: what no reservation can hold is refused under a budget, and the settlement of usage billed
on other models (Anthropic's `usage.iterations`) and at other price tiers (Anthropic's fast mode)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.call import Answer, Call, Usage
from gateway.pricing import ModelPrice, Rate
from gateway.store.base import Push, Reservation
from guards.budget import BudgetGuard, settlement, usage_cost
from guards.reasoning import KEEP as REASONING_KEEP
from guards.reasoning import KEY as REASONING_KEY
from tests.guards.support import PRICE, call, ctx, policy

GUARD = BudgetGuard()
DEAR = ModelPrice(Rate(5e-6), Rate(25e-6))  # another model's rates ($5 / $25 per MTok)
FAST = dataclasses.replace(PRICE, service_tiers=(("default", PRICE), ("fast", ModelPrice(Rate(2e-6), Rate(8e-6)))))
THREAD = "'thread' continues a conversation"
FALLBACKS = "'fallbacks' lets Anthropic answer"


def with_fields(**fields: Any) -> Call:
    return dataclasses.replace(call(), **fields)


@pytest.mark.parametrize(("fields", "budget", "refused"), [
    ({"unbounded": (THREAD,)}, {"usd": 1.0}, THREAD),
    ({"unbounded": (THREAD,)}, {"tokens": 10_000}, THREAD),
    ({"unbounded": (THREAD, FALLBACKS)}, {"usd": 1.0, "tokens": 10_000}, f"{THREAD}; {FALLBACKS}"),
    ({"unbounded": (THREAD,)}, {}, None),  # nothing to overspend: forwarded, and charged what it reports
    ({"unreserved_tools": ("advisor_20260301",)}, {"usd": 1.0}, "advisor_20260301"),
    ({"unreserved_tools": ("advisor_20260301",)}, {"tokens": 10_000}, "advisor_20260301"),
    ({"unreserved_tools": ("advisor_20260301",)}, {}, None),
    ({"unpriced_tools": ("code_execution_20250825",)}, {"usd": 1.0}, "code_execution_20250825"),
    ({"unpriced_tools": ("code_execution_20250825",)}, {"tokens": 10_000}, None),  # its tokens are in `usage`
    ({"unpriced_tools": ("code_execution_20250825",)}, {}, None),
    ({"stored_reasoning": ("rs_1", "rs_2")}, {"usd": 1.0}, "2 reasoning item(s) OpenAI reads from storage"),
    ({"stored_reasoning": ("rs_1",)}, {"tokens": 10_000}, "reasoning.encrypted_content"),
    ({"stored_reasoning": ("rs_1",)}, {}, None),
])
def test_what_no_reservation_holds_is_refused_under_a_budget(
    fields: dict[str, Any], budget: dict[str, Any], refused: str | None
) -> None:
    decision = GUARD.before(ctx(with_fields(**fields), policy(budget=budget)))
    if refused is None:
        assert decision.action == "allow" and decision.claims
    else:
        assert (decision.action, decision.reason) == ("reject", "input_unbounded")  # a 400; the run goes on
        assert refused in decision.detail and "budget" in decision.detail


@pytest.mark.parametrize(("overhead", "budget", "fixed_tokens"), [
    (0, {"tokens": 10_000}, 1000),
    (2983, {"tokens": 10_000}, 3983),  # Anthropic's tool-use prompt and tool overheads: reserved as input
])
def test_the_input_the_provider_adds_is_reserved(overhead: int, budget: dict[str, Any], fixed_tokens: int) -> None:
    decision = GUARD.before(ctx(call(input_bytes=1000, input_overhead=overhead), policy(budget=budget)))
    tokens_claim, usd_claim = decision.claims
    assert tokens_claim.fixed == fixed_tokens
    assert usd_claim.fixed == pytest.approx(fixed_tokens * PRICE.input.base)


def price_of(known: dict[str, ModelPrice]) -> Any:
    return known.get


ADVISOR = Usage(150_000, 4_000)


@pytest.mark.parametrize(("usage", "prices", "want"), [
    (Usage(10, 5), None, 10 * 1e-6 + 5 * 4e-6),
    # a part billed on another model, priced at its rates; the rest at the step's
    (Usage(150_010, 4_005, other_models=(("opus", ADVISOR),)), {"opus": DEAR},
     10 * 1e-6 + 5 * 4e-6 + 150_000 * 5e-6 + 4_000 * 25e-6),
    # a model the lookup does not price, or no lookup: the part is priced with the rest
    (Usage(150_010, 4_005, other_models=(("mystery", ADVISOR),)), {"opus": DEAR},
     150_010 * 1e-6 + 4_005 * 4e-6),
    (Usage(150_010, 4_005, other_models=(("opus", ADVISOR),)), None, 150_010 * 1e-6 + 4_005 * 4e-6),
    # two parts on two models
    (Usage(300_010, 8_005, other_models=(("opus", ADVISOR), ("self", ADVISOR))), {"opus": DEAR, "self": PRICE},
     10 * 1e-6 + 5 * 4e-6 + 150_000 * 5e-6 + 4_000 * 25e-6 + 150_000 * 1e-6 + 4_000 * 4e-6),
])
def test_usage_cost_prices_each_part_at_its_models_rates(
    usage: Usage, prices: dict[str, ModelPrice] | None, want: float
) -> None:
    assert usage_cost(usage, PRICE, price_of(prices) if prices is not None else None) == pytest.approx(want)


RESERVED = Reservation("r1", "run-1", 1, 100, {"tokens": 1100.0, "usd": 0.001, "llm_calls": 1.0})


def test_settlement_charges_every_token_and_prices_other_models_apart() -> None:
    """The tokens of sub-inferences count toward a token budget, whatever model ran them."""
    usage = Usage(150_010, 4_005, other_models=(("opus", ADVISOR),))
    got = settlement(usage, PRICE, RESERVED, price_of=price_of({"opus": DEAR}))
    assert (got["tokens"], got["input_tokens"], got["output_tokens"]) == (154_015.0, 150_010.0, 4_005.0)
    assert got["usd"] == pytest.approx(10 * 1e-6 + 5 * 4e-6 + 150_000 * 5e-6 + 4_000 * 25e-6)


@pytest.mark.parametrize(("tier", "rates"), [
    (None, (1e-6, 4e-6)), ("fast", (2e-6, 8e-6)), ("standard", (1e-6, 4e-6)), ("default", (1e-6, 4e-6)),
])
def test_settlement_follows_the_speed_the_answer_reports(tier: str | None, rates: tuple[float, float]) -> None:
    got = settlement(Usage(1000, 1000), FAST, RESERVED, service_tier=tier)
    assert got["usd"] == pytest.approx(1000 * rates[0] + 1000 * rates[1])


def test_an_answers_reasoning_items_go_into_the_runs_history() -> None:
    """What `guards.reasoning.resolve` reads when the agent sends them back by id."""
    the_ctx = ctx(call(), policy(budget={"usd": 1.0}))
    with_items = Answer(reasoning=("rs_1", "rs_2"), usage=Usage(10, 900))
    assert GUARD.after(the_ctx, with_items).effects == (Push(REASONING_KEY, ("900 rs_1 rs_2",), REASONING_KEEP),)
    assert GUARD.after(the_ctx, Answer(usage=Usage(10, 900))).effects == ()
    assert GUARD.after(the_ctx, Answer(reasoning=("rs_1",))).effects == ()  # no usage: nothing bounds them
    unbudgeted = ctx(call(), policy(caps={"llm_calls": 10}))
    assert GUARD.after(unbudgeted, with_items).effects == ()  # nothing refuses them: nothing written


def test_a_refusal_names_the_first_field_at_fault() -> None:
    decision = GUARD.before(ctx(with_fields(unbounded=(THREAD, FALLBACKS), unbounded_params=("thread", "fallbacks")),
                                policy(budget={"usd": 1.0})))
    assert (decision.action, decision.param) == ("reject", "thread")
    assert GUARD.before(ctx(with_fields(unbounded=(THREAD,)), policy(budget={"usd": 1.0}))).param is None
