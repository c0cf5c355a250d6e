"""Reasoning items this gateway saw answered, by id: what one costs when it comes back by id (pure).

The Responses API lets an agent send a reasoning item back as `{"type": "reasoning", "id": ...}` without
its content (the OpenAI Agents SDK's default with reasoning models): OpenAI reads the item from the stored
response and bills its tokens as input, which the request's body does not carry. An item produced by a
response tollgate relayed is bounded by that response's output tokens (its reasoning is part of them), so
such an item is held at that count (`Call.input_overhead`); one this gateway has not seen cannot be bounded
and stays in `Call.stored_reasoning`, which a budget refuses (`guards.budget`). What this process saw is
all it knows: a run spread over several gateways sends items another one answered with their content
(`include: ["reasoning.encrypted_content"]`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace

from gateway.call import Answer, Call

CAPACITY = 16_384
"""Items remembered; the least recently relayed or sent back are forgotten first (an agent sends every
item of its run back on each call, so a run in progress keeps its own)."""


class SeenReasoning:
    """The reasoning items relayed, by item id, each with the response it came in and that response's
    output tokens, at most `capacity` items. All the items of one response together bill at most its
    output tokens: items sent back are held once per response, not once per item."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def remember(self, answer: Answer) -> None:
        """The answer's reasoning items, bounded together by the answer's output tokens. An answer without
        a usage report bounds nothing: its items stay unknown."""
        if not answer.reasoning or answer.usage is None:
            return
        response = answer.reasoning[0]  # the response's key: ids are unique, `response_id` may be absent
        for item_id in answer.reasoning:
            self._items[item_id] = (response, answer.usage.output_tokens)
            self._items.move_to_end(item_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def held(self, ids: Iterable[str]) -> int | None:
        """The tokens the items may bill as input (each response's output tokens once), or None when any of
        them was not seen. Items found count as recently used."""
        tokens: dict[str, int] = {}
        for item_id in ids:
            seen = self._items.get(item_id)
            if seen is None:
                return None
            self._items.move_to_end(item_id)
            tokens[seen[0]] = seen[1]
        return sum(tokens.values())


def resolve(seen: SeenReasoning, call: Call) -> Call:
    """`call` with its stored reasoning items held as input (`input_overhead`) when every one was seen;
    the same call otherwise (a budget then refuses it)."""
    if not call.stored_reasoning:
        return call
    tokens = seen.held(call.stored_reasoning)
    if tokens is None:
        return call
    return replace(call, stored_reasoning=(), input_overhead=call.input_overhead + tokens)
