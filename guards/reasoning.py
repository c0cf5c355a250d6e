"""Reasoning items sent back by id: what they may bill, from the run's history (pure).

The Responses API lets an agent send a reasoning item back as `{"type": "reasoning", "id": ...}` without
its content (the OpenAI Agents SDK's default with reasoning models): OpenAI reads the item from the stored
response and bills its tokens as input, which the request's body does not carry. The budget guard records,
for each answer of the run with reasoning items, their ids and the answer's output tokens (its reasoning is
part of them) in the run's history (`entry`, pushed under `KEY`). An item sent back is held at its
answer's output tokens, the items of one answer together once (`resolve`: `Call.input_overhead`); one the
run's history does not hold cannot be bounded and stays in `Call.stored_reasoning`, which a budget refuses
(`guards.budget`). The history is the run store's, so it holds across sidecars sharing a store and across
restarts, and a reset run starts without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from gateway.call import Answer, Call
from gateway.store.base import RunState

KEY = "reasoning"
KEEP = 1000
"""Answers with reasoning items a run keeps (their items are what an agent may send back): an agent that
sends back items of older answers sends their content (`include: ["reasoning.encrypted_content"]`)."""


def entry(call: Call, answer: Answer) -> str | None:
    """The history entry of an answer's reasoning items: its output tokens, then the item ids, separated by
    spaces. None when it has none, when no usage report bounds them (they stay unknown), or when the request
    asked OpenAI not to store its output (`store: false`: no item of it can be read back by id)."""
    if not answer.reasoning or answer.usage is None or call.raw.get("store") is False:
        return None
    ids = [item_id for item_id in answer.reasoning if item_id and not any(c.isspace() for c in item_id)]
    return f"{answer.usage.output_tokens} {' '.join(ids)}" if ids else None


def held(entries: Sequence[str], ids: Iterable[str]) -> int | None:
    """The input tokens the items may bill (each answer's output tokens once, whatever number of its items
    is sent back), or None when any of them is in no entry."""
    wanted = set(ids)
    tokens = 0
    for line in reversed(entries):  # the latest answers first: an agent sends back its latest turns' items
        count, *items = line.split(" ")
        found = wanted.intersection(items)
        if found:
            tokens += int(count)
            wanted -= found
            if not wanted:
                return tokens
    return None if wanted else tokens


def resolve(call: Call, run: RunState | None) -> Call:
    """`call` with its stored reasoning items held as input (`input_overhead`) when the run's history has
    every one of them; the same call otherwise (a budget then refuses it)."""
    if not call.stored_reasoning:
        return call
    tokens = held(run.lists.get(KEY, []) if run is not None else [], call.stored_reasoning)
    if tokens is None:
        return call
    return replace(call, stored_reasoning=(), input_overhead=call.input_overhead + tokens)
