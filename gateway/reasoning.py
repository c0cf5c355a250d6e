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
"""Items remembered; the oldest are forgotten first (an agent sends back the latest turns' items)."""


class SeenReasoning:
    """Output tokens of the response each reasoning item came from, by item id, at most `capacity` items."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._tokens: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tokens)

    def remember(self, answer: Answer) -> None:
        """The answer's reasoning items, each bounded by the answer's output tokens. An answer without a
        usage report bounds nothing: its items stay unknown."""
        if not answer.reasoning or answer.usage is None:
            return
        for item_id in answer.reasoning:
            self._tokens[item_id] = answer.usage.output_tokens
            self._tokens.move_to_end(item_id)
        while len(self._tokens) > self._capacity:
            self._tokens.popitem(last=False)

    def held(self, ids: Iterable[str]) -> int | None:
        """The tokens the items may bill as input, or None when any of them was not seen."""
        total = 0
        for item_id in ids:
            tokens = self._tokens.get(item_id)
            if tokens is None:
                return None
            total += tokens
        return total


def resolve(seen: SeenReasoning, call: Call) -> Call:
    """`call` with its stored reasoning items held as input (`input_overhead`) when every one was seen;
    the same call otherwise (a budget then refuses it)."""
    if not call.stored_reasoning:
        return call
    tokens = seen.held(call.stored_reasoning)
    if tokens is None:
        return call
    return replace(call, stored_reasoning=(), input_overhead=call.input_overhead + tokens)
