"""Request bodies the benchmark sends besides its short one: what an agent's request looks like after
some rounds of tool use, where the work a gateway does per request follows the body's size."""

from __future__ import annotations

import orjson


def agent_body(tools: int = 30, rounds: int = 60) -> bytes:
    """A Chat Completions request of an agent `rounds` tool calls into its run (about 64 KB at the
    defaults): a system prompt, each round's assistant tool call (200-byte arguments) and its tool result
    (300 bytes), and `tools` function tools of six string parameters each, as frameworks send them."""
    specs = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Does one thing the agent needs. " * 4,
        "parameters": {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 40}
                                                        for j in range(6)}, "required": ["p0"]}}}
             for i in range(tools)]
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are an agent. " * 40}]
    for i in range(rounds):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": f"tool_{i % tools}", "arguments": orjson.dumps({"p0": "v" * 200}).decode()}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": "r" * 300})
    messages.append({"role": "user", "content": "go on"})
    return orjson.dumps({"model": "gpt-4o-mini", "messages": messages, "tools": specs, "max_tokens": 100})
