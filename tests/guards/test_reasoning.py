"""guards/reasoning.py: a run's answers with reasoning items, and what items sent back by id may bill."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.call import Answer, Call, Usage
from gateway.store.base import RunState
from guards.reasoning import KEY, entry, held, resolve


def answer(*ids: str, output_tokens: int = 700, usage: bool = True) -> Answer:
    return Answer(reasoning=ids, usage=Usage(input_tokens=10, output_tokens=output_tokens) if usage else None)


def call(*ids: str, overhead: int = 0) -> Call:
    return Call(protocol="openai_responses", operation="chat", model="gpt-5-mini", stream=False, max_tokens=None,
                input_bytes=100, stored_reasoning=ids, input_overhead=overhead)


@pytest.mark.parametrize(("the_answer", "line"), [
    (answer("rs_1", "rs_2", output_tokens=700), "700 rs_1 rs_2"),
    (answer("rs_1", usage=False), None),  # no usage report: nothing bounds them
    (answer(), None),
    (answer("rs 1", "", "rs_2"), "700 rs_2"),  # an id no entry can hold is never held
    (answer("rs 1"), None),
])
def test_entry(the_answer: Answer, line: str | None) -> None:
    assert entry(call(), the_answer) == line


def test_no_entry_for_a_request_whose_output_openai_does_not_store() -> None:
    stored = dataclasses.replace(call(), raw={"store": True})
    assert entry(stored, answer("rs_1")) == "700 rs_1"
    assert entry(dataclasses.replace(call(), raw={"store": False}), answer("rs_1")) is None


ENTRIES = ["700 rs_1 rs_2", "50 rs_3", "9000 rs_4 rs_5 rs_6"]


@pytest.mark.parametrize(("ids", "tokens"), [
    (["rs_1"], 700), (["rs_2"], 700), (["rs_1", "rs_2"], 700),  # one answer's items bill its output once
    (["rs_1", "rs_3"], 750), (["rs_3", "rs_3"], 50),
    (["rs_4", "rs_5", "rs_6", "rs_1"], 9_700),
    ([], 0),
    (["rs_9"], None), (["rs_1", "rs_9"], None), ([""], None),
])
def test_held(ids: list[str], tokens: int | None) -> None:
    assert held(ENTRIES, ids) == tokens


def run(*entries: str) -> RunState:
    return RunState("r1", "bot", lists={KEY: list(entries)})


def test_resolve_holds_items_the_run_relayed_as_input_overhead() -> None:
    assert resolve(call("rs_1", overhead=10), run("300 rs_1")) == dataclasses.replace(call(overhead=310))
    unseen = call("rs_1", "rs_2")
    assert resolve(unseen, run("300 rs_1")) is unseen  # left for the budget to refuse
    assert resolve(unseen, None) is unseen  # a run's first step relayed nothing
    plain = call()
    assert resolve(plain, run()) is plain
