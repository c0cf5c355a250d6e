"""The answers tollgate itself gives in OpenAI Responses form (I/O-free): a stop as a completed response
whose message says why, or as the stream events that add that message and complete the response."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.call import Call
from gateway.providers.common import stop_text
from gateway.providers.sse import format_event

ZERO_USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
              "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
              "output_tokens_details": {"reasoning_tokens": 0}}


def _now_id(prefix: str) -> str:
    return f"{prefix}_tollgate_{int(time.time() * 1000)}"


def stop_item(reason: str, detail: str, *, status: str = "completed") -> dict[str, Any]:
    return {"id": _now_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": stop_text(reason, detail), "annotations": []}]}


def response_shell(call: Call, output: list[Any], *, status: str = "completed") -> dict[str, Any]:
    return {"id": _now_id("resp"), "object": "response", "created_at": int(time.time()), "status": status,
            "model": call.model, "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "usage": ZERO_USAGE}


def stream_event(kind: str, sequence: int, **fields: Any) -> bytes:
    return format_event(orjson.dumps({"type": kind, "sequence_number": sequence, **fields}), kind)


def stop_events(reason: str, detail: str, *, index: int, sequence: int, response: Mapping[str, Any]) -> bytes:
    """Events that add a message saying why the run stopped at output `index`, then complete
    `response` (the one the stream created: the SDK refuses another id) with its output so far
    followed by that message."""
    item = stop_item(reason, detail)
    text = item["content"][0]["text"]
    empty = {**item, "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    events = [
        ("response.output_item.added", {"output_index": index, "item": empty}),
        ("response.content_part.added", {**where, "part": part}),
        ("response.output_text.delta", {**where, "delta": text, "logprobs": []}),
        ("response.output_text.done", {**where, "text": text, "logprobs": []}),
        ("response.content_part.done", {**where, "part": {**part, "text": text}}),
        ("response.output_item.done", {"output_index": index, "item": item}),
        ("response.completed", {"response": {**response, "status": "completed", "usage": ZERO_USAGE,
                                             "output": [*(response.get("output") or ()), item]}}),
    ]
    return b"".join(stream_event(kind, sequence + n, **fields) for n, (kind, fields) in enumerate(events))
