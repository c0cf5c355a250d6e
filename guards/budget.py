"""Budget guard: USD and token budgets reserved before each call, settled after.

Worst case of a step = input upper bound + output limit for each choice asked for (OpenAI's `n`). The
input bound is the UTF-8 size of the request body: byte-level BPE tokenizers emit at most one token per
byte, and the JSON framing around each message outweighs the few template tokens a chat format adds;
plus an image bound for each image part (`guards.bounds.image_tokens`: `IMAGE_TOKENS`, more on models
that bill images more), whose tokens follow its pixels, not its bytes (a page of a PDF
sent as base64 counts as `PDF_PAGE_IMAGES` images: the adapter counts its pages; one it cannot count is
refused like a document named by URL).
The output limit is the request's `max_tokens` or, when absent, what the remaining budget can pay for
(clamped by the model's limit); the pipeline writes the granted value back into the request. Every
choice may use all of it, and the provider bills them all, so a unit of it is reserved `n` times.
Searches the provider runs and bills apart are held too, and Anthropic's web fetches, whose content it
bills as input (`guards.bounds`), and the input the provider bills beyond the body (`Call.input_overhead`).
What no reservation can hold is refused (a 400; the run goes on) rather than forwarded: under any budget,
documents named instead of sent, request fields whose input or models live upstream (`Call.unbounded`),
reasoning items read from storage that no answer of the run relayed (`Call.stored_reasoning`, `guards.reasoning`)
and tools whose uses bill what no reservation holds (`Call.unreserved_tools`: model calls of their own,
an MCP server's results read in as input); under a USD budget, tools
billed apart at a cost tollgate cannot price (`Call.unpriced_tools`).
An MCP tool execution (`execute_tool`) spends no tokens: it claims nothing from either budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.call import Answer, Usage
from gateway.config import Budget
from gateway.pricing import ModelPrice
from gateway.store.base import Claim, Reservation
from guards.base import BaseGuard, Decision, Push, StepContext
from guards.bounds import IMAGE_TOKENS, input_bound, search_input, search_limit, sized_uses
from guards.reasoning import KEEP as REASONING_KEEP
from guards.reasoning import KEY as REASONING_KEY
from guards.reasoning import entry as reasoning_entry

__all__ = ["IMAGE_TOKENS", "USAGE_COUNTERS", "BudgetGuard", "PriceOf", "answer_usage", "settlement", "usage_cost"]

PriceOf = Callable[[str], ModelPrice | None]
"""The price of a model by its name (the gateway's `Pricer.lookup` for the step's provider), or None."""


class BudgetGuard(BaseGuard):
    name = "budget"

    def before(self, ctx: StepContext) -> Decision:
        if ctx.call.operation == "execute_tool":
            return Decision.allow(self.name)
        budget = ctx.policy.budget
        budgeted = _has_budget(budget)
        documents = ctx.call.referenced_documents
        if documents and budgeted:
            return Decision.reject(
                self.name,
                "input_unbounded",
                f"the request names {documents} document(s) by file id or URL, or sends PDFs whose pages "
                "cannot be counted (encrypted, not a PDF), whose size tollgate cannot bound, so the budget "
                "could be overspent; send their content instead",
            )
        if ctx.call.unbounded and budgeted:
            return Decision.reject(self.name, "input_unbounded",
                                   f"{'; '.join(ctx.call.unbounded)} (under a budget, tollgate refuses what it "
                                   "cannot bound, since the budget could be overspent)",
                                   param=ctx.call.unbounded_params[0] if ctx.call.unbounded_params else None)
        if ctx.call.stored_reasoning and budgeted:
            return Decision.reject(
                self.name,
                "input_unbounded",
                f"the input has {len(ctx.call.stored_reasoning)} reasoning item(s) OpenAI reads from storage "
                "by id (no encrypted_content) that no answer of this run relayed, billed as input tollgate "
                "cannot see, so the budget could be overspent; ask for include: "
                "['reasoning.encrypted_content'] and send it back (OpenAI Agents SDK: "
                "ModelSettings(store=False, response_include=['reasoning.encrypted_content']))",
            )
        if ctx.call.unreserved_tools and budgeted:
            return Decision.reject(
                self.name,
                "input_unbounded",
                f"the request offers {', '.join(ctx.call.unreserved_tools)}, which the provider runs itself "
                "and bills beyond what any reservation can hold (an advisor's uses are model calls of their "
                "own over the whole conversation; a hosted MCP server's tool list and results are read into "
                "the context as input of any size), so the budget could be overspent; remove the tool (or "
                "call MCP servers through tollgate's MCP proxy, as the agent's own tools) or run this agent "
                "without a budget",
            )
        if ctx.call.unpriced_tools and budget.usd is not None:
            return Decision.reject(
                self.name,
                "input_unbounded",
                f"the request offers {', '.join(ctx.call.unpriced_tools)}, which the provider bills apart at a "
                "cost tollgate cannot bound (a container, an image), so a USD budget could be overspent; "
                "remove the tool or run this agent without a USD budget",
            )
        bound = input_bound(ctx.call)
        choices = float(ctx.call.params.choice_count or 1)
        uses = sized_uses(ctx.call, search_limit(ctx.call, ctx.price, budget, ctx.run)) if ctx.call.search_limits else []
        searches = sum(count for count, _ in uses)
        held = bound + search_input(bound, uses)  # each search re-reads the context and adds its results
        claims = [Claim("tokens", float(held), choices, _f(budget.tokens),
                        "token_budget_exhausted")]
        price = ctx.price
        if price is None:
            if budget.usd is not None:
                return Decision.reject(
                    self.name,
                    "price_unknown",
                    f"model {ctx.call.model!r} has no known price, so a USD budget cannot be enforced; "
                    "add it under `pricing:` in the config",
                )
        elif (ctx.call.audio_output and price.output_audio is None and price.source != "config"
              and budget.usd is not None):
            # genai-prices lists some audio models (gpt-4o-audio-preview) without their audio rates: the
            # text rate would undercharge spoken output several times over
            return Decision.reject(
                self.name,
                "price_unknown",
                f"model {ctx.call.model!r} has no known price for the audio it is asked to speak, so a USD "
                "budget cannot be enforced; add its prices under `pricing:` in the config",
            )
        else:
            # the dearest rate an input token of this request can cost (`ModelPrice.input_rate`)
            fixed = held * price.input_rate(held, cache_writes=ctx.call.cache_writes) + searches * price.search_fee
            fixed += price.per_call
            # `price` is at the tier the request asks for (`gateway.pricing.reserved_tier`); an audio rate
            # counts for output only when the request lets the model speak, for input always (`input_rate`)
            per_unit = choices * price.worst_output(ctx.call.audio_output)
            claims.append(Claim("usd", fixed, per_unit, budget.usd, "budget_exhausted"))
        return Decision.allow(self.name, claims=tuple(claims))

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        """The answer's reasoning items go into the run's history with its output tokens: an agent may send
        them back by id, held then at what they may bill (`guards.reasoning`). Without a budget nothing
        refuses them: nothing is written."""
        if not answer.reasoning:
            return Decision.allow(self.name)
        line = reasoning_entry(ctx.call, answer) if _has_budget(ctx.policy.budget) else None
        if line is None:
            return Decision.allow(self.name)
        return Decision.allow(self.name, effects=(Push(REASONING_KEY, (line,), REASONING_KEEP),))


USAGE_COUNTERS = frozenset({"usd", "tokens"})
"""Claimed counters whose settlement follows the provider's usage; any other claim is a count per step."""


def _has_budget(budget: Budget) -> bool:
    """A USD or token budget: what no reservation can hold is refused under either."""
    return budget.tokens is not None or budget.usd is not None


def _f(value: float | None) -> float | None:
    return None if value is None else float(value)


def settlement(
    usage: Usage | None, price: ModelPrice | None, reservation: Reservation, relayed_output: int = 0,
    choices: int = 1, service_tier: str | None = None, price_of: PriceOf | None = None,
) -> Mapping[str, float]:
    """Real amounts to settle a reservation with.

    Usage is priced at the service tier the answer reports (`service_tier`), which may differ from the
    one reserved (a priority request served at the standard tier, an `auto` one at a project's priority;
    Anthropic's fast mode is such a tier), and its parts billed on other models at their prices
    (`usage_cost`, `price_of`). Its tokens all count toward a token budget, those of sub-inferences the
    provider reports apart included (Anthropic's `usage.iterations`: the adapter sums them in).

    Without provider-reported usage (missing usage chunk, broken stream) the step is charged its
    whole reservation: never zero, never below what was relayed. Output relayed beyond the reserved
    units of its `choices` (an upstream that ignored `max_tokens`) is charged on top, at the worst
    output rate.
    """
    held = reservation.amounts
    if usage is None:
        out = dict(held)
        reserved_output = float(reservation.units) * choices
        excess = max(float(relayed_output) - reserved_output, 0.0)
        out["output_tokens"] = reserved_output + excess
        out["input_tokens"] = max(held.get("tokens", 0.0) - reserved_output, 0.0)
        if "tokens" in held:
            out["tokens"] = held["tokens"] + excess
        if "usd" in held and price is not None:
            out["usd"] = held["usd"] + excess * price.output.worst
        return out
    actual: dict[str, float] = {
        "tokens": float(usage.input_tokens + usage.output_tokens),
        "input_tokens": float(usage.input_tokens),
        "output_tokens": float(usage.output_tokens),
    }
    # counts claimed per step (`llm_calls`, a custom guard's own counters) are what they held
    actual.update({counter: amount for counter, amount in held.items() if counter not in USAGE_COUNTERS})
    if price is not None and "usd" in held:
        actual["usd"] = usage_cost(usage, price.at_tier(service_tier), price_of)
    return actual


def usage_cost(usage: Usage, price: ModelPrice, price_of: PriceOf | None = None) -> float:
    """USD for `usage` at `price`, but for the parts of it billed on another model (`Usage.other_models`:
    Anthropic's advisor sub-inferences), each at `price_of(model)`. A part whose model `price_of` does not
    price, or every part when there is no `price_of`, is priced at `price` with the rest."""
    own, elsewhere = usage, 0.0
    for model, part in usage.other_models:
        theirs = price_of(model) if price_of is not None else None
        if theirs is not None:
            own = own.minus(part)
            elsewhere += theirs.cost(part)
    return price.cost(own) + elsewhere


def answer_usage(answer: Answer | None) -> Usage | None:
    return None if answer is None else answer.usage
