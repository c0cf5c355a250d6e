"""`bench.bodies`: the agent-sized request is a valid Chat Completions request tollgate parses, of the size
the benchmark reports."""

from __future__ import annotations

import orjson

from bench.bodies import agent_body
from gateway.config import Limits
from gateway.pipeline import parse_json
from gateway.providers.openai_chat import OpenAIChat


def test_agent_body_is_an_agents_request_of_about_64_kb() -> None:
    raw = agent_body()
    assert 60_000 < len(raw) < 70_000
    limits = Limits()
    call = OpenAIChat().parse_request(parse_json(raw, limits), raw, limits)
    assert len(call.tools) == 30 and call.max_tokens == 100
    messages = orjson.loads(raw)["messages"]
    assert len(messages) == 122 and messages[-1] == {"role": "user", "content": "go on"}
