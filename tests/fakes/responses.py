"""OpenAI Responses bodies and event streams, as the API sends them, for `FakeProvider` replies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

Call = tuple[str, str, str]  # name, arguments, call_id


def _usage(usage: tuple[int, int]) -> dict[str, Any]:
    return {"input_tokens": usage[0], "output_tokens": usage[1], "total_tokens": sum(usage),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(text: str, item_id: str = "msg_1") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(name: str, arguments: str = "{}", call_id: str = "call_1") -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "status": "completed", "name": name,
            "arguments": arguments, "call_id": call_id}


def response_body(text: str = "Hello!", *, calls: Sequence[Call] = (), usage: tuple[int, int] = (10, 5),
                  model: str = "gpt-4o-mini", status: str = "completed") -> dict[str, Any]:
    output: list[dict[str, Any]] = [message_item(text)] if text else []
    output += [call_item(*call) for call in calls]
    return {"id": "resp_fake", "object": "response", "created_at": 1700000000, "status": status, "model": model,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": _usage(usage)}


def response_stream(parts: Sequence[str], *, calls: Sequence[Call] = (), usage: tuple[int, int] = (10, 5),
                    model: str = "gpt-4o-mini", complete: bool = True) -> list[bytes]:
    """The events of a streamed response: a message item whose text comes in `parts`, then each call."""
    events: list[bytes] = []

    def ev(kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(events), **fields}
        events.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    final = response_body("".join(parts), calls=calls, usage=usage, model=model)
    ev("response.created", response={**final, "status": "in_progress", "output": [], "usage": None})
    ev("response.in_progress", response={**final, "status": "in_progress", "output": [], "usage": None})
    index = 0
    if parts:
        item = message_item("".join(parts))
        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        ev("response.output_item.added", output_index=0, item={**item, "status": "in_progress", "content": []})
        ev("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
        for part in parts:
            ev("response.output_text.delta", **where, delta=part, logprobs=[])
        ev("response.output_text.done", **where, text="".join(parts), logprobs=[])
        ev("response.content_part.done", **where, part=item["content"][0])
        ev("response.output_item.done", output_index=0, item=item)
        index = 1
    for offset, call in enumerate(calls):
        item = call_item(*call)
        at = index + offset
        ev("response.output_item.added", output_index=at, item={**item, "status": "in_progress", "arguments": ""})
        ev("response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=item["arguments"])
        ev("response.function_call_arguments.done", item_id=item["id"], output_index=at, arguments=item["arguments"])
        ev("response.output_item.done", output_index=at, item=item)
    if complete:
        ev("response.completed", response=final)
    return events
