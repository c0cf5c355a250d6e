"""What one step can cost at most: the input bound and the searches the provider bills apart (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.call import RequestParams
from gateway.config import Budget
from gateway.pricing import ModelPrice, Rate
from guards.bounds import (
    IMAGE_TOKENS,
    MIN_OUTPUT_TOKENS,
    SEARCH_INPUT_TOKENS,
    SEARCHES_WHEN_UNSET,
    image_tokens,
    input_bound,
    search_input,
    search_limit,
    sized_uses,
)
from tests.guards.support import PRICE, call, run

# $1 / $4 per Mtok, $10 per 1,000 web searches; the request's input bound is 1,000 tokens
SEARCHING = ModelPrice(Rate(1e-6), Rate(4e-6), web_search=0.01, file_search=0.0025)
FIXED = 1000 * 1e-6 + MIN_OUTPUT_TOKENS * 4e-6  # the input bound and the smallest answer of one choice


def held_tokens(searches: int) -> int:
    """What `searches` searches add to a 1,000-token request: the k-th re-reads it with k results (as
    `search_input` counts it)."""
    return sum(1000 + k * SEARCH_INPUT_TOKENS for k in range(1, searches + 1))


def usd(searches: int) -> float:
    return searches * 0.01 + held_tokens(searches) * 1e-6


def pays_for(searches: int) -> float:
    """USD that pays for `searches` searches and not one more (beyond FIXED)."""
    return (usd(searches) + usd(searches + 1)) / 2


def test_input_bound_counts_each_image_apart() -> None:
    assert input_bound(call(model="gpt-4o", input_bytes=1000, input_images=2)) == 1000 + 2 * IMAGE_TOKENS


@pytest.mark.parametrize(("model", "per_image"), [
    ("gpt-4o", IMAGE_TOKENS), ("claude-sonnet-4-5", IMAGE_TOKENS),
    ("gpt-4o-mini", 48_169), ("gpt-4o-mini-2024-07-18", 48_169), ("openai/GPT-4o-mini", 48_169),
])
def test_an_image_is_bounded_at_what_the_model_bills_for_its_largest(model: str, per_image: int) -> None:
    """gpt-4o-mini bills 2,833 tokens plus 5,667 per tile, up to 8 tiles: 48,169 for one image."""
    assert image_tokens(model) == per_image
    assert input_bound(call(model=model, input_bytes=100, input_images=3)) == 100 + 3 * per_image


def test_input_bound_adds_what_the_provider_bills_beyond_the_body() -> None:
    assert input_bound(call(input_bytes=300, input_overhead=346)) == 646


@pytest.mark.parametrize(
    ("limits", "budget", "held", "sent"),
    [
        ((), {"usd": 5.0}, 0.0, None),  # no search tool
        ((None,), {}, 0.0, None),  # no budget: nothing to limit
        ((None,), {"usd": 5.0}, 0.0, SEARCHES_WHEN_UNSET),
        ((3,), {"usd": 5.0}, 0.0, None),  # the request's own limit is paid for: kept as sent
        ((None,), {"usd": FIXED + pays_for(4)}, 0.0, 4),  # what the budget left pays for
        ((None,), {"usd": 5.0}, 5.0 - FIXED - pays_for(3), 3),  # after what the run spent and holds
        ((10,), {"usd": FIXED + pays_for(4)}, 0.0, 4),  # an unpayable limit is lowered, like max_tokens
        ((None, None), {"usd": FIXED + pays_for(4)}, 0.0, 2),  # shared between the tools
        ((None,), {"usd": FIXED + usd(1) / 2}, 0.0, 0),  # none paid for: the tools are not offered
        ((None,), {"usd": FIXED - 1e-9}, 0.0, 0),  # not even the smallest answer: the store stops the run
        ((None,), {"tokens": 1000 + MIN_OUTPUT_TOKENS + held_tokens(2)}, 0.0, 2),  # a token budget
        ((5,), {"usd": 5.0, "tokens": 1000 + MIN_OUTPUT_TOKENS + held_tokens(2)}, 0.0, 2),  # the lower
    ],
)
def test_search_limit(limits: tuple[int | None, ...], budget: dict[str, float], held: float, sent: int | None) -> None:
    state = dataclasses.replace(run(), used={"usd": held / 2}, reserved={"usd": held / 2})
    assert search_limit(call(input_bytes=1000, search_limits=limits), SEARCHING, Budget(**budget), state) == sent


def test_search_limit_leaves_room_for_the_smallest_answer_of_every_choice() -> None:
    three = dataclasses.replace(call(input_bytes=1000, search_limits=(None,)), params=RequestParams(choice_count=3))
    budget = Budget(usd=1000 * 1e-6 + 3 * MIN_OUTPUT_TOKENS * 4e-6 + pays_for(2))
    assert search_limit(three, SEARCHING, budget, None) == 2


def test_free_searches_are_not_limited_by_the_budget() -> None:
    free = ModelPrice(Rate(0.0), Rate(0.0))
    assert search_limit(call(search_limits=(50,)), free, Budget(usd=1.0), None) is None
    assert search_limit(call(search_limits=(None,)), free, Budget(usd=1.0), None) == SEARCHES_WHEN_UNSET


@pytest.mark.parametrize(
    ("limits", "budget", "searches"),
    [
        ((), {"usd": 5.0}, 0),
        ((3,), {"usd": 5.0}, 3),
        ((None,), {}, SEARCHES_WHEN_UNSET),  # nothing sent: a bound for the books
        ((2, None, 5), {"usd": 5.0}, 7 + SEARCHES_WHEN_UNSET),
        ((2, 10), {"usd": FIXED + pays_for(8)}, 2 + 4),  # each tool held to the limit sent
    ],
)
def test_searches_allowed(limits: tuple[int | None, ...], budget: dict[str, float], searches: int) -> None:
    """The searches held once `search_limit` is sent (`sized_uses`; one unset and not limited counts
    `SEARCHES_WHEN_UNSET`)."""
    the_call = call(input_bytes=1000, search_limits=limits)
    uses = sized_uses(the_call, search_limit(the_call, SEARCHING, Budget(**budget), None))
    assert sum(count for count, _ in uses) == searches


def test_a_model_without_search_fees_still_holds_the_results_tokens() -> None:
    budget = Budget(usd=FIXED + (held_tokens(2) + held_tokens(3)) / 2 * PRICE.worst_input)
    assert search_limit(call(input_bytes=1000, search_limits=(None,)), PRICE, budget, None) == 2


def test_a_fetch_is_held_as_one_reread_with_its_whole_content() -> None:
    """Anthropic's adapter reports a web fetch of up to 5 uses of 20,000 tokens as one entry of size 20,000:
    each fetch is one more sampling over the context, plus its content."""
    the_call = call(input_bytes=1000, search_limits=(5,), search_sizes=(20_000,))
    one, two = search_input(1000, [(1, 20_000)]), search_input(1000, [(2, 20_000)])
    assert (one, two) == (1000 + 20_000, 2 * 1000 + 3 * 20_000)
    budget = Budget(tokens=1000 + MIN_OUTPUT_TOKENS + (one + two) // 2)
    assert search_limit(the_call, SEARCHING, budget, None) == 1
    assert search_limit(the_call, SEARCHING, Budget(tokens=10**6), None) is None  # paid for: kept as sent


@pytest.mark.parametrize(("bound", "searches", "held"), [
    (1000, 0, 0),
    (1000, 1, 1000 + SEARCH_INPUT_TOKENS),
    (1000, 3, 3 * 1000 + 6 * SEARCH_INPUT_TOKENS),
    (50_000, 5, 5 * 50_000 + 15 * SEARCH_INPUT_TOKENS),  # a long context: its re-reads dominate
])
def test_each_search_rereads_the_context_with_the_results_so_far(bound: int, searches: int, held: int) -> None:
    """After each search the model samples again over everything: the request and every result so far."""
    assert search_input(bound, [(searches, SEARCH_INPUT_TOKENS)]) == held


def test_results_of_several_sizes_are_held_largest_first() -> None:
    """The worst order reads the largest results the most times: a 20,000-token fetch then a search."""
    assert search_input(1000, [(1, SEARCH_INPUT_TOKENS), (1, 20_000)]) == (1000 + 20_000) + (1000 + 28_000)
