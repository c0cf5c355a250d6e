"""What Anthropic bills a Messages call for beyond its top-level token counts, read from the wire (pure).

A request: the price tier it asks for (fast mode, `speed: "fast"`, bills fast-mode rates: `speed_tier`)
and the fields whose cost tollgate cannot bound, refused under a budget (`unbounded_params`). An answer:
its usage (`usage_from`), counting the sub-inferences Anthropic reports only in `usage.iterations`, and the
speed it was billed at (`answer_tier`). Field names follow the anthropic SDK 2.15 types (`BetaUsage`,
`BetaIterationsUsage`, `MessageCreateParams.speed`, `.thread`, `.fallbacks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gateway.call import Usage
from gateway.providers.common import required_count, token_count

STANDARD_SPEED = "standard"
"""The speed a request asks for, or an answer reports, billed at the standard rates."""

COUNTED_ITERATIONS = frozenset({"message", "fallback_message"})
"""`usage.iterations` entry types whose tokens the top-level counts already hold: the sampling turns of
the model that answered (`message`; `fallback_message` stands in for the last one when a fallback model
served). Every other entry is billed on top of them and charged on top: a `compaction` ("its tokens are not
included in the top-level usage fields"), an `advisor_message` (the advisor tool's sub-inference, on its
own `model`), and a type tollgate does not know (charging it twice errs on the side of the budget)."""


def speed_tier(body: Mapping[str, Any]) -> str | None:
    """The price tier a request's `speed` asks for (`Call.service_tier`): None for the standard speed or
    none sent, else the speed as sent (`fast`; a speed tollgate does not know is reserved at the dearest
    tier genai-prices lists for the model, `gateway.pricing.ModelPrice.for_request`)."""
    speed = body.get("speed")
    return speed if isinstance(speed, str) and speed != STANDARD_SPEED else None


def answer_tier(usage: Any) -> str | None:
    """The price tier an answer was billed at (`Answer.service_tier`): its `usage.speed` (`fast`, or
    `standard`, which `ModelPrice.at_tier` bills at the standard rates); None when it reports none."""
    speed = usage.get("speed") if isinstance(usage, Mapping) else None
    return speed if isinstance(speed, str) else None


UNBOUNDED_FIELDS: dict[str, str] = {
    "thread": "'thread' continues a conversation Anthropic holds, whose input tollgate cannot see or bound; "
              "send the whole conversation instead",
    "fallbacks": "'fallbacks' lets Anthropic answer on other models, with limits of their own, that the "
                 "budget neither prices nor holds; send the request without fallbacks",
    "context_management": "a 'context_management' compaction edit makes Anthropic summarize the context in a "
                          "sampling of its own, on top of the answer, whose output no limit tollgate sends "
                          "bounds; send the request without it (or compact the context yourself)",
    "compaction": "a 'compaction' request makes Anthropic summarize the conversation in a sampling of its own, "
                  "reported apart from the answer's usage, whose output no limit tollgate sends bounds; compact "
                  "the context yourself, or run this agent without a budget",
}
"""Request fields whose cost tollgate cannot bound, and why (`Call.unbounded`: any budget refuses them)."""


def unbounded_reasons(fields: tuple[str, ...]) -> tuple[str, ...]:
    """Why the request's cost cannot be bounded, one reason per field `unbounded_params` found."""
    return tuple(UNBOUNDED_FIELDS[field] for field in fields)


def unbounded_params(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The request fields whose cost cannot be bounded (`UNBOUNDED_FIELDS`), `thread` first: a `thread`
    other than `{"type": "create"}` (which starts holding a conversation the body carries whole),
    `fallbacks` other than none or an empty list (`"default"` too: the server picks the models), and a
    compaction among the `context_management` edits (clearing edits only lower the input: they pass), and a
    compaction request (a top-level `compaction`)."""
    fields: list[str] = []
    thread = body.get("thread")
    if thread is not None and not (isinstance(thread, Mapping) and thread.get("type") == "create"):
        fields.append("thread")
    if body.get("fallbacks") not in (None, []):
        fields.append("fallbacks")
    management = body.get("context_management")
    edits = management.get("edits") if isinstance(management, Mapping) else None
    if isinstance(edits, list) and any(isinstance(e, Mapping) and str(e.get("type", "")).startswith("compact")
                                       for e in edits):
        fields.append("context_management")
    if body.get("compaction") is not None:
        fields.append("compaction")
    return tuple(fields)


def _counts(usage: Mapping[str, Any]) -> Usage:
    """One usage object's counts in semconv terms: input = input + cache read + cache creation (Anthropic
    excludes the cache). Raises ValueError for a count no provider reports."""
    read = token_count(usage.get("cache_read_input_tokens"))
    created = token_count(usage.get("cache_creation_input_tokens"))
    breakdown = usage.get("cache_creation")  # {ephemeral_5m_input_tokens, ephemeral_1h_input_tokens}
    hour = token_count(breakdown.get("ephemeral_1h_input_tokens")) if isinstance(breakdown, Mapping) else 0
    server = usage.get("server_tool_use")  # {web_search_requests, web_fetch_requests}: billed apart
    searches = token_count(server.get("web_search_requests")) if isinstance(server, Mapping) else 0
    return Usage(
        input_tokens=required_count(usage.get("input_tokens")) + read + created,
        output_tokens=required_count(usage.get("output_tokens")),
        cache_read_tokens=read,
        cache_creation_tokens=created,
        cache_write_1h_tokens=hour,
        web_search_requests=searches,
    )


def usage_from(usage: Any, model: str | None = None) -> Usage | None:
    """The usage Anthropic bills for an answer by `model` (the answer's `model`): the top-level counts plus
    every `usage.iterations` entry they leave out (`COUNTED_ITERATIONS`); of those, an entry naming another
    model than `model` is listed in `Usage.other_models` too, to be priced at that model's rates. None when a
    count is not one a provider reports (settled at the reservation, never believed)."""
    if not isinstance(usage, Mapping):
        return None
    try:
        total = _counts(usage)
        others: list[tuple[str, Usage]] = []
        iterations = usage.get("iterations")
        for entry in iterations if isinstance(iterations, list) else ():
            if not isinstance(entry, Mapping) or entry.get("type") in COUNTED_ITERATIONS:
                continue
            part = _counts(entry)
            total = total.plus(part)
            ran_on = entry.get("model")
            if isinstance(ran_on, str) and ran_on and ran_on != model:
                others.append((ran_on, part))
    except ValueError:
        return None
    return replace(total, other_models=tuple(others)) if others else total
