"""gateway/providers/anthropic_billing.py (and the adapter's use of it): what Anthropic bills beyond the
top-level counts — fast mode, `usage.iterations` — and the request fields no budget can bound.

Fixtures are checked against the anthropic SDK 2.15 types (`BetaUsage`, `BetaMessageDeltaUsage`,
`MessageCreateParams`), so the wire shapes read here are the ones the SDK sends and parses."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.types.beta import BetaMessageDeltaUsage, BetaUsage

from gateway.call import Usage
from gateway.config import Limits
from gateway.providers.anthropic_billing import (
    UNBOUNDED_FIELDS,
    answer_tier,
    speed_tier,
    unbounded_params,
    unbounded_reasons,
    usage_from,
)
from gateway.providers.anthropic_messages import AnthropicMessages
from gateway.providers.sse import SseParser, format_event

ADAPTER = AnthropicMessages()
MODEL = "claude-opus-4-8"
MSG = [{"role": "user", "content": "hi"}]


def iteration(kind: str, inp: int, out: int, model: str | None = None, **cache: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": kind, "input_tokens": inp, "output_tokens": out,
                             "cache_read_input_tokens": cache.get("read", 0),
                             "cache_creation_input_tokens": cache.get("created", 0)}
    return {**entry, "model": model} if model else entry


def usage(*iterations: dict[str, Any], **extra: Any) -> dict[str, Any]:
    body = {"input_tokens": 10, "output_tokens": 5, "iterations": list(iterations), **extra}
    BetaUsage.model_validate(body)  # the SDK's own shape
    return body


@pytest.mark.parametrize(("speed", "tier"), [
    (None, None), ("standard", None), ("fast", "fast"),
    ("turbo", "turbo"),  # a speed tollgate does not know: reserved at the dearest tier genai-prices lists
    (1, None),  # not a speed: the API refuses it
])
def test_speed_tier(speed: Any, tier: str | None) -> None:
    assert speed_tier({} if speed is None else {"speed": speed}) == tier


@pytest.mark.parametrize(("reported", "tier"), [
    ({"speed": "fast"}, "fast"), ({"speed": "standard"}, "standard"), ({}, None), ({"speed": None}, None),
    (None, None), ({"speed": 3}, None),
])
def test_answer_tier(reported: Any, tier: str | None) -> None:
    assert answer_tier(reported) == tier


CONTINUE = {"type": "continue", "previous_message_id": "msg_01"}


@pytest.mark.parametrize(("fields", "reasons"), [
    ({}, ()),
    ({"thread": None, "fallbacks": None}, ()),
    ({"thread": {"type": "create"}}, ()),  # the body holds the whole conversation
    ({"fallbacks": []}, ()),
    ({"thread": CONTINUE}, (UNBOUNDED_FIELDS["thread"],)),
    ({"thread": {"type": "fork"}}, (UNBOUNDED_FIELDS["thread"],)),  # not known to be bounded: refused
    ({"thread": "msg_01"}, (UNBOUNDED_FIELDS["thread"],)),
    ({"fallbacks": [{"model": "claude-opus-4-8", "max_tokens": 64000}]}, (UNBOUNDED_FIELDS["fallbacks"],)),
    ({"fallbacks": "default"}, (UNBOUNDED_FIELDS["fallbacks"],)),  # the server picks the models
    ({"thread": CONTINUE, "fallbacks": "default"}, (UNBOUNDED_FIELDS["thread"], UNBOUNDED_FIELDS["fallbacks"])),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, ()),  # clearing lowers the input
    ({"context_management": {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens",
                                                                               "value": 30000}}]}},
     (UNBOUNDED_FIELDS["context_management"],)),
    ({"context_management": {"edits": "compact"}}, ()),  # not a list of edits: nothing Anthropic would run
    ({"context_management": ["compact"]}, ()),
])
def test_unbounded_fields(fields: dict[str, Any], reasons: tuple[str, ...]) -> None:
    assert unbounded_reasons(unbounded_params(fields)) == reasons


ADVISED = Usage(150_000, 4_000)


@pytest.mark.parametrize(("reported", "expected"), [
    (usage(), Usage(10, 5)),
    # the sampling turns are what the top-level counts sum: nothing added
    (usage(iteration("message", 6, 2), iteration("message", 4, 3)), Usage(10, 5)),
    (usage(iteration("fallback_message", 10, 5, "claude-sonnet-4-5")), Usage(10, 5)),
    # a compaction is billed on top of them, on the request's model
    (usage(iteration("compaction", 150_000, 4_000, read=1000), iteration("message", 10, 5)),
     Usage(151_010, 4_005, cache_read_tokens=1000)),
    # an advisor on the answering model is priced with it; on another, listed apart to be priced at its rates
    (usage(iteration("advisor_message", 150_000, 4_000, MODEL)), Usage(150_010, 4_005)),
    (usage(iteration("advisor_message", 150_000, 4_000, "claude-opus-4-1")),
     Usage(150_010, 4_005, other_models=(("claude-opus-4-1", ADVISED),))),
    # a type tollgate does not know is charged on top: twice rather than never
    (usage(iteration("message", 10, 5)) | {"iterations": [{"type": "rerank", "input_tokens": 7, "output_tokens": 1}]},
     Usage(17, 6)),
    # entries that are no object, or no list, are ignored; counts that are none a provider reports are no report
    (usage() | {"iterations": ["x", None]}, Usage(10, 5)),
    (usage() | {"iterations": {"type": "compaction"}}, Usage(10, 5)),
    (usage() | {"iterations": [{"type": "compaction", "input_tokens": -3, "output_tokens": 1}]}, None),
    (usage() | {"iterations": [{"type": "compaction", "input_tokens": 3}]}, None),
])
def test_usage_from_charges_the_iterations_the_top_level_counts_leave_out(reported: Any,
                                                                         expected: Usage | None) -> None:
    assert usage_from(reported, MODEL) == expected


def parse(**fields: Any) -> Any:
    body = {"model": MODEL, "max_tokens": 256, "messages": MSG, **fields}
    return ADAPTER.parse_request(body, orjson.dumps(body), Limits())


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, {"service_tier": None, "unbounded": (), "unpriced_tools": (), "unreserved_tools": (), "input_overhead": 0}),
    ({"speed": "fast"}, {"service_tier": "fast"}),
    ({"speed": "standard"}, {"service_tier": None}),
    ({"thread": CONTINUE}, {"unbounded": (UNBOUNDED_FIELDS["thread"],), "unbounded_params": ("thread",)}),
    ({"compaction": {"type": "summarize"}},
     {"unbounded": (UNBOUNDED_FIELDS["compaction"],), "unbounded_params": ("compaction",)}),
    ({"fallbacks": "default", "thread": CONTINUE},
     {"unbounded": (UNBOUNDED_FIELDS["thread"], UNBOUNDED_FIELDS["fallbacks"]),
      "unbounded_params": ("thread", "fallbacks")}),
    ({"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]},
     {"unpriced_tools": ("code_execution_20250825",), "unreserved_tools": ()}),
    ({"tools": [{"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-4-8"}]},
     {"unreserved_tools": ("advisor_20260301",), "unpriced_tools": ()}),
])
def test_parse_request_says_what_the_request_makes_anthropic_bill(fields: dict[str, Any],
                                                                  expected: dict[str, Any]) -> None:
    call = parse(**fields)
    assert {key: getattr(call, key) for key in expected} == expected


def test_parse_answer_reads_the_speed_and_the_iterations() -> None:
    reported = usage(iteration("compaction", 100, 20), speed="fast")
    body: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
            "stop_reason": "end_turn", "stop_sequence": None, "usage": reported}
    answer = ADAPTER.parse_answer(body)
    assert (answer.service_tier, answer.usage) == ("fast", Usage(110, 25))


def ev(data: dict[str, Any]) -> Any:
    [event] = SseParser().feed(format_event(orjson.dumps(data), str(data["type"])))
    return event


def test_a_stream_is_settled_with_its_iterations_and_speed() -> None:
    """`message_start` reports the speed (`BetaUsage.speed`); `message_delta` the final iterations
    (`BetaMessageDeltaUsage.iterations`); the last report of each counts."""
    final = {"output_tokens": 5, "input_tokens": 10,
             "iterations": [iteration("advisor_message", 1000, 200, "claude-opus-4-1"), iteration("message", 10, 5)]}
    BetaMessageDeltaUsage.model_validate(final)
    start_usage = {"input_tokens": 10, "output_tokens": 1, "speed": "fast", "iterations": []}
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                                              "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": start_usage}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": final},
        {"type": "message_stop"},
    ]
    reader = ADAPTER.stream_reader(hide_usage=False)
    for data in events:
        reader.feed(ev(data))
    answer = reader.answer()
    advised = Usage(1000, 200)
    assert answer.service_tier == "fast"
    assert answer.usage == Usage(1010, 205, other_models=(("claude-opus-4-1", advised),))
