"""gateway/reasoning.py: reasoning items relayed, by id, and what one costs when sent back by id."""

from __future__ import annotations

import dataclasses

from gateway.call import Answer, Call, Usage
from gateway.reasoning import SeenReasoning, resolve


def answer(*ids: str, output_tokens: int = 700, usage: bool = True) -> Answer:
    return Answer(reasoning=ids, usage=Usage(input_tokens=10, output_tokens=output_tokens) if usage else None)


def call(*ids: str, overhead: int = 0) -> Call:
    return Call(protocol="openai_responses", operation="chat", model="gpt-5-mini", stream=False, max_tokens=None,
                input_bytes=100, stored_reasoning=ids, input_overhead=overhead)


def test_items_are_held_at_the_output_tokens_of_their_response_once_per_response() -> None:
    seen = SeenReasoning()
    seen.remember(answer("rs_1", "rs_2", output_tokens=700))  # each may be all of it, both together too
    seen.remember(answer("rs_3", output_tokens=50))
    assert seen.held(["rs_1"]) == seen.held(["rs_2"]) == seen.held(["rs_1", "rs_2"]) == 700
    assert seen.held(["rs_1", "rs_3"]) == seen.held(["rs_1", "rs_2", "rs_3"]) == 750
    assert seen.held(["rs_3", "rs_3"]) == 50
    assert seen.held([]) == 0


def test_an_unseen_item_or_one_without_usage_is_not_held() -> None:
    seen = SeenReasoning()
    seen.remember(answer("rs_1"))
    seen.remember(answer("rs_2", usage=False))  # no usage report: nothing bounds it
    assert seen.held(["rs_1", "rs_2"]) is None
    assert seen.held(["rs_9"]) is None
    assert seen.held([""]) is None


def test_the_least_recently_used_items_are_forgotten_past_the_capacity() -> None:
    seen = SeenReasoning(capacity=3)
    for item_id in ("rs_1", "rs_2", "rs_3"):
        seen.remember(answer(item_id))
    assert seen.held(["rs_1"]) == 700  # sent back: used, so kept over rs_2
    seen.remember(answer("rs_4"))
    assert len(seen) == 3
    assert seen.held(["rs_2"]) is None
    assert seen.held(["rs_1", "rs_3", "rs_4"]) == 2_100


def test_resolve_holds_seen_items_as_input_overhead() -> None:
    seen = SeenReasoning()
    seen.remember(answer("rs_1", output_tokens=300))
    assert resolve(seen, call("rs_1", overhead=10)) == dataclasses.replace(call(overhead=310))
    unseen = call("rs_1", "rs_2")
    assert resolve(seen, unseen) is unseen  # left for the budget to refuse
    plain = call()
    assert resolve(seen, plain) is plain
