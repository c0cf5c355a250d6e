"""Forwarded `/v1` calls the provider bills per token, metered like model calls (pure, no I/O).

`POST /v1/embeddings`, `/v1/completions` (legacy completions) and `/v1/responses/compact` are not model
calls tollgate judges (no tools, no grammars, no loop detection), but the provider bills them by the
token, so each is a step of its run whose worst case is reserved before it is forwarded and settled
after (`gateway.metered_forward` drives them through the pipeline's stages). What differs per path is
here, in `METERS`, keyed by canonical path:

- how a body is read into a `Call` (its input bound is the body's UTF-8 size plus images, as for model
  calls; what tollgate cannot bound is a 400);
- how its output is bounded (`Meter.output`): `none` (embeddings bill input only), `max_tokens`
  (legacy completions: the request's `max_tokens`, 16 when absent as upstream, per choice; lowered to
  what the budget pays like a model call's), `model_limit` (compaction: the request has no output
  limit, so the model's whole output limit is reserved, granted whole or refused);
- where the answer reports its usage (`Meter.usage`);
- whether it counts toward `caps.llm_calls` (`Meter.llm_call`).

The guards of a metered step are the time cap, the LLM-call cap when the path counts, and the budget
(`guards_for`); loop and no-progress detection judge tool calls and tool results, which these calls
have none of, and the agent's custom guards were written for model calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

import orjson

from gateway.call import Answer, Call, RequestParams, Usage, digest
from gateway.config import Limits
from gateway.errors import InvalidRequest
from gateway.frozen_init import fast_init
from gateway.providers.base import StreamStep
from gateway.providers.common import opt_int, opt_number, require_model, required_count
from gateway.providers.openai_chat import (
    MAX_CHOICES,
    OpenAIChat,
    OpenAIStreamReader,
    aligned_reasons,
    service_tier,
)
from gateway.providers.openai_chat import usage_from as completion_usage
from gateway.providers.openai_responses import OpenAIResponses
from gateway.providers.openai_responses import usage_from as responses_usage
from gateway.providers.sse import SseEvent
from gateway.store.base import Claim
from guards.base import BaseGuard, Decision, StepContext, StopCondition
from guards.bounds import MIN_OUTPUT_TOKENS
from guards.budget import USAGE_COUNTERS, BudgetGuard
from guards.caps import CapsGuard

__all__ = ["COMPLETION_DEFAULT_TOKENS", "METERS", "CompletionStreamReader", "Meter", "MeteredAdapter",
           "MeteredBudget", "MeteredCaps", "answer_of", "guards_for", "output_bound"]

COMPLETION_DEFAULT_TOKENS = 16
"""The output limit of a legacy completion that sends no `max_tokens` (OpenAI's default)."""
MAX_BEST_OF = 20
"""OpenAI's bound on a legacy completion's `best_of`."""

Output = Literal["none", "max_tokens", "model_limit"]


@fast_init
@dataclass(frozen=True, slots=True)
class Meter:
    """How one metered path is bounded and settled."""

    operation: str  # GenAI operation name: the span, the metrics, the ledger row, the run's step list
    upstream_path: str  # appended to the provider's base_url
    parse: Callable[[Mapping[str, Any], bytes, Limits], Call]  # raises InvalidRequest for what it refuses
    usage: Callable[[Any], Usage | None]  # the answer's `usage` object; None when it is no usable report
    output: Output
    llm_call: bool  # counts toward `caps.llm_calls`


def _no_stream(body: Mapping[str, Any], path: str) -> None:
    if body.get("stream") not in (None, False):
        raise InvalidRequest(f"{path} does not stream", param="stream")


def parse_embeddings(body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call:
    """`input` is a string or a non-empty array (of strings or token arrays): each token of it takes at
    least one byte of the body, so the body's size bounds the input tokens billed."""
    model = require_model(body)
    _no_stream(body, "/v1/embeddings")
    value = body.get("input")
    if not (isinstance(value, str) or (isinstance(value, list) and value)):
        raise InvalidRequest("'input' is required: a string or a non-empty array", param="input")
    return Call(protocol="openai", operation="embeddings", model=model, input_bytes=len(raw),
                request_hash=digest(raw), raw=body)


def prompt_count(prompt: Any) -> int:
    """How many prompts a legacy completion asks for: one for a string or an array of token ids, one per
    element of an array of strings or of token arrays. Each gets its own `n` (or `best_of`) choices."""
    if isinstance(prompt, str):
        return 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(part, int) and not isinstance(part, bool) for part in prompt):
            return 1
        return len(prompt)
    raise InvalidRequest("'prompt' is required: a string, or a non-empty array of strings or tokens",
                         param="prompt")


def parse_completions(body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call:
    """Output: `max_tokens` (16 when absent, as upstream; 0 with `echo` scores the prompt only) for each
    choice: `n` per prompt, or `best_of`, which the provider generates (and bills) server-side."""
    model = require_model(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    prompts = prompt_count(body.get("prompt"))
    max_tokens = opt_int(body, "max_tokens")
    # each choice is reserved: a wild count is a 400 (as upstream), not a budget stop
    n = opt_int(body, "n", minimum=1, maximum=MAX_CHOICES) or 1
    best_of = opt_int(body, "best_of", minimum=1, maximum=MAX_BEST_OF) or 1
    params = RequestParams(temperature=opt_number(body, "temperature"), top_p=opt_number(body, "top_p"),
                           choice_count=prompts * max(n, best_of))
    return Call(protocol="openai", operation="text_completion", model=model, stream=bool(stream),
                max_tokens=COMPLETION_DEFAULT_TOKENS if max_tokens is None else max_tokens,
                input_bytes=len(raw), params=params, request_hash=digest(raw), raw=body)


def parse_compact(body: Mapping[str, Any], raw: bytes, limits: Limits) -> Call:
    """Its input is a Responses API input, read (and refused where unbounded: `previous_response_id`,
    items or files stored upstream) as `/v1/responses` reads it; it has no tools and no output limit."""
    _no_stream(body, "/v1/responses/compact")
    call = OpenAIResponses().parse_request(body, raw, limits)
    # a compaction runs no tools: tool lists in its input items are context, billed as their bytes
    return replace(call, operation="chat", max_tokens=None, tools=(), tool_choice=None, tool_results=(),
                   search_limits=(), unpriced_tools=(), unreserved_tools=())


def embeddings_usage(usage: Any) -> Usage | None:
    """Embeddings bill their input only (`prompt_tokens`; `total_tokens` repeats it)."""
    if not isinstance(usage, Mapping):
        return None
    try:
        return Usage(input_tokens=required_count(usage.get("prompt_tokens")))
    except ValueError:  # a count no provider reports: settled at the reservation, never believed
        return None


METERS: Mapping[str, Meter] = MappingProxyType({
    "/v1/embeddings": Meter("embeddings", "/embeddings", parse_embeddings, embeddings_usage, "none", False),
    "/v1/completions": Meter("text_completion", "/completions", parse_completions, completion_usage,
                             "max_tokens", True),
    "/v1/responses/compact": Meter("chat", "/responses/compact", parse_compact, responses_usage,
                                   "model_limit", False),
})
"""The metered paths, by canonical path (`gateway.forward.canonical_path`)."""


def output_bound(meter: Meter, call: Call, model_limit: int) -> tuple[int, int] | None:
    """(min, max) output units to reserve per choice, or None for the request's `max_tokens` clamped to
    what the budget pays, as for a model call (`Step.output_bound`)."""
    if meter.output == "none" or (meter.output == "max_tokens" and call.max_tokens == 0):
        return (0, 0)
    if meter.output == "model_limit":  # whole or refused (`pipeline.guard_before`); a stop only as for chat
        return (min(MIN_OUTPUT_TOKENS, model_limit), model_limit)
    return None


def answer_of(meter: Meter, data: bytes) -> Answer:
    """The neutral answer of a whole (non-streamed) 2xx body: its usage when it reports one the meter
    believes, else none (the step is then charged its reservation). Never raises: the agent has the body
    already, whatever it holds."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return Answer()
    if not isinstance(body, dict):
        return Answer()
    choices = body.get("choices")
    choices = choices if isinstance(choices, list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    text = first.get("text")
    # a legacy completion's choices each end with a reason, as a streamed one's do (`aligned_reasons`)
    reasons = [str(c.get("finish_reason") or "") if isinstance(c, dict) else "" for c in choices]
    return Answer(response_id=body.get("id") if isinstance(body.get("id"), str) else None,
                  model=body.get("model") if isinstance(body.get("model"), str) else None,
                  text=text if isinstance(text, str) else "", finish_reasons=aligned_reasons(reasons),
                  usage=meter.usage(body.get("usage")),
                  service_tier=service_tier(body))  # the tier it was billed at (a compaction's `priority`)


class CompletionStreamReader(OpenAIStreamReader):
    """A streamed legacy completion: chat chunks' framing, usage chunk and `[DONE]`, with the text in
    `choices[].text` instead of `delta.content` (counted so a stream cut without usage is charged at
    least what it relayed)."""

    def __init__(self, hide_usage: bool, choices: int = 1) -> None:
        super().__init__(hide_usage, choices)
        self._relayed: list[str] = []
        self._text_chars = 0

    @property
    def output_chars(self) -> int:
        return self._text_chars

    def feed(self, event: SseEvent) -> StreamStep:
        step = super().feed(event)  # raises ValueError for what is not a JSON object, as for chat
        if event.data and event.data != "[DONE]":
            for choice in orjson.loads(event.data).get("choices") or ():
                text = choice.get("text") if isinstance(choice, dict) else None
                if isinstance(text, str):
                    self._text_chars += len(text)
                    if not choice.get("index"):
                        self._relayed.append(text)
        return step

    def answer(self) -> Answer:
        return replace(super().answer(), text="".join(self._relayed))


class MeteredAdapter(OpenAIChat):
    """OpenAI's wire (errors, error events, the usage chunk a stream is asked for) for a metered path:
    its operation and upstream path, a limit lowered in `max_tokens` (the legacy field), and the stream
    reader of a legacy completion."""

    def __init__(self, meter: Meter) -> None:
        self.operation = meter.operation
        self.upstream_path = meter.upstream_path

    def set_max_tokens(self, body: dict[str, Any], value: int, *, prefer_completion_field: bool) -> None:
        sent = body.get("max_tokens")
        body["max_tokens"] = value if not isinstance(sent, int) else min(sent, value)

    def stream_reader(self, *, hide_usage: bool, choices: int = 1) -> CompletionStreamReader:
        return CompletionStreamReader(hide_usage, choices)


class MeteredCaps(BaseGuard):
    """The time cap, and `caps.llm_calls` only for a path that counts as an LLM call."""

    name = "caps"

    def __init__(self, counts: bool) -> None:
        self._caps = CapsGuard()
        self._counts = counts

    def before(self, ctx: StepContext) -> Decision:
        decision = self._caps.before(ctx)
        if decision.action != "allow" or self._counts:
            return decision
        return Decision.allow(self.name)  # its one claim is the LLM call


class MeteredBudget(BaseGuard):
    """The budget guard's claims. For a call without output (`output_free`), a budget claim with no part
    per output unit (a model priced 0 for output) gets one: zero units are granted, so it holds nothing
    more, but the store then tells a budget held by steps in flight (this step alone is refused) from one
    spent (the run stops), as for a model call; a claim of a fixed amount only would stop the run."""

    name = "budget"

    def __init__(self, output_free: bool) -> None:
        self._budget = BudgetGuard()
        self._output_free = output_free

    def before(self, ctx: StepContext) -> Decision:
        decision = self._budget.before(ctx)
        if not self._output_free or not decision.claims:
            return decision
        return Decision.allow(self.name, claims=output_free_claims(decision.claims))


def output_free_claims(claims: Sequence[Claim]) -> tuple[Claim, ...]:
    return tuple(replace(c, per_unit=1.0) if c.counter in USAGE_COUNTERS and c.per_unit <= 0 else c
                 for c in claims)


def guards_for(meter: Meter, bound: tuple[int, int] | None) -> list[tuple[StopCondition, str]]:
    """The guards of a metered step, each failing closed (`GuardChain` input)."""
    return [(MeteredCaps(meter.llm_call), "fail_closed"), (MeteredBudget(bound == (0, 0)), "fail_closed")]
