"""What one step can cost at most: its input bound, the smallest answer, and the searches the provider runs
and bills apart (web search, file search): how many a request may run and what each one holds. Pure: the
budget guard reserves from it and the pipeline sends the limits it picks, from the same run snapshot.

A search costs its fee (`ModelPrice.search_fee`, the dearer of web and file search) and the input tokens
its results add, which the provider bills as input: `SEARCH_INPUT_TOKENS` is held for them (OpenAI bills
its mini models a fixed block of that size per search; results larger than it can take a run past its
budget by the excess, the one estimate in the reservation). A request limits its searches itself
(`Call.search_limits`: an Anthropic web search tool's `max_uses`, a Responses request's `max_tool_calls`);
with a budget, tollgate sends a lower limit where the request sends none (`SEARCHES_WHEN_UNSET`) or more
than the budget left pays for, after the input bound and the smallest answer of every choice, like an
unpayable `max_tokens`. A limit of 0 means the tools the provider runs are not offered.

Anthropic's web fetch has no fee, but the content it fetches is billed as input: the adapter reports a
fetch tool as one search limit for each `SEARCH_INPUT_TOKENS` its `max_content_tokens` lets one fetch add
(a fetch sent without a content limit is given `SEARCH_INPUT_TOKENS` when limited), so the same limit and
reservation hold it whole, fee included (a fetch is held like a search: conservative by that fee).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gateway.call import Call
from gateway.config import Budget
from gateway.pricing import ModelPrice
from gateway.store.base import RunState

IMAGE_TOKENS = 8192
"""Tokens one image may cost at most: OpenAI bills a high-detail image ~1.5-2.5k, Anthropic ~1.6k (it
downsizes larger ones); the rest of the bound is conservative room for models that bill more. Models
that bill more than this are in `IMAGE_TOKENS_BY_MODEL`."""
IMAGE_TOKENS_BY_MODEL = {"gpt-4o-mini": 2_833 + 8 * 5_667}
"""Per-image bounds of models whose images cost more than `IMAGE_TOKENS`, by a part of their name:
gpt-4o-mini bills 2,833 tokens plus 5,667 per 512-pixel tile, and a high-detail image has up to 8 tiles
(its image tokens cost what gpt-4o's do at ~33x the count)."""
MIN_OUTPUT_TOKENS = 16
"""The smallest answer a reservation must pay for, per choice; a budget that cannot pay it stops the run."""
SEARCHES_WHEN_UNSET = 10
"""The limit tollgate sends for a billed search tool the request offers without one (with a budget)."""
SEARCH_INPUT_TOKENS = 8000
"""Input tokens held for what one search's results add to the input (`search_input`)."""
_UNLIMITED = 2**31


def input_bound(call: Call) -> int:
    """Most input tokens the request itself can be billed: its UTF-8 size, what the provider adds to it
    (`Call.input_overhead`) and `image_tokens` per image (a page of a base64 PDF counts as
    `gateway.providers.common.PDF_PAGE_IMAGES` images)."""
    bound = call.input_bytes + call.input_overhead
    return bound + call.input_images * image_tokens(call.model) if call.input_images else bound


def image_tokens(model: str) -> int:
    """Most input tokens one image can cost on `model` (`IMAGE_TOKENS`, `IMAGE_TOKENS_BY_MODEL`)."""
    name = model.lower()
    return next((tokens for part, tokens in IMAGE_TOKENS_BY_MODEL.items() if part in name), IMAGE_TOKENS)


def search_input(bound: int, uses: Iterable[tuple[int, int]]) -> int:
    """Input tokens the searches the provider runs can bill beyond the request's own `bound`, given as
    (uses, tokens one use adds) per tool. After each search the model samples again over the whole
    context, billed as input again: the request and the results of every search so far. So with results
    of one size the k-th search adds `bound + k x size`: quadratic in the searches, as providers bill it (a
    search-augmented Anthropic answer reports several times the input its first turn read); with several
    sizes, the worst order is the largest results first."""
    total = prefix = 0
    for count, size in sorted(uses, key=lambda use: -use[1]):
        total += count * (bound + prefix) + size * count * (count + 1) // 2
        prefix += count * size
    return total


def sized_uses(call: Call, sent: int | None) -> list[tuple[int, int]]:
    """(uses allowed, tokens one use adds) of each search tool once `sent` (`search_limit`) is sent: its
    own limit (`SEARCHES_WHEN_UNSET` when it sends none), held to `sent`."""
    sizes = call.search_sizes
    return [(min(SEARCHES_WHEN_UNSET if own is None else own, sent if sent is not None else _UNLIMITED),
             sizes[i] if i < len(sizes) else SEARCH_INPUT_TOKENS)
            for i, own in enumerate(call.search_limits)]


def search_limit(call: Call, price: ModelPrice | None, budget: Budget, run: RunState | None) -> int | None:
    """The limit to send for each billed search tool, or None to send none (no such tool, no budget, or
    every limit the request sends is already paid for)."""
    limits = call.search_limits
    if not limits:
        return None
    count = len(limits)
    choices = call.params.choice_count or 1
    bound = input_bound(call)
    affordable: list[int] = []
    sizes = [size for _, size in sized_uses(call, None)]

    def held(n: int) -> int:  # input held when each tool runs n searches
        return search_input(bound, [(n, size) for size in sizes])

    sent = [limit for limit in limits if limit is not None]
    wanted = SEARCHES_WHEN_UNSET if len(sent) < count else max(sent)
    if budget.usd is not None and price is not None:
        # the rate at the most input the searches asked for could bill: monotonic, so it holds for fewer
        fee, rate = price.search_fee, price.input_rate(bound + held(wanted), cache_writes=call.cache_writes)
        left = (budget.usd - _held(run, "usd") - bound * rate - choices * MIN_OUTPUT_TOKENS * price.output.worst)
        affordable.append(_per_tool(left, lambda n: count * n * fee + held(n) * rate))
    if budget.tokens is not None:
        left = budget.tokens - _held(run, "tokens") - bound - choices * MIN_OUTPUT_TOKENS
        affordable.append(_per_tool(left, held))
    if not affordable:
        return None
    limit = min(wanted, *affordable)
    return limit if len(sent) < count or limit < max(sent) else None


def _held(run: RunState | None, counter: str) -> float:
    return run.used.get(counter, 0.0) + run.reserved.get(counter, 0.0) if run is not None else 0.0


def _per_tool(left: float, cost: Callable[[int], float]) -> int:
    """Most searches per tool whose total `cost(searches per tool)` (increasing) fits in `left`."""
    if cost(1) <= 0:
        return _UNLIMITED  # free searches (a model priced at 0): the budget limits none
    if cost(1) > left:
        return 0
    low, high = 1, 2  # cost(low) fits; find one that does not, then bisect between them
    while high < _UNLIMITED and cost(high) <= left:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if cost(middle) <= left else (low, middle)
    return min(low, _UNLIMITED)
