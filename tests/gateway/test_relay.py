"""`gateway.relay`: a streamed answer relayed event by event, checked as it goes and judged at its end,
through a running gateway with the official `anthropic` SDK."""

from __future__ import annotations

import anthropic
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, anthropic_stream

CLAUDE = "claude-3-5-haiku-latest"
MSG = [{"role": "user", "content": "go"}]
GRAMMAR = "regex:[a-z ]+!"  # "let me search" is a prefix of an answer, not an answer


def paused(chunks: list[bytes]) -> list[bytes]:
    """The stream as Anthropic ends a turn it paused (a long server-tool turn the agent sends back)."""
    return [c.replace(b'"stop_reason":"end_turn"', b'"stop_reason":"pause_turn"') for c in chunks]


async def stream(h: Harness, run: str) -> tuple[str, str | None]:
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                      default_headers={"x-tollgate-run-id": run})
    async with client, client.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG) as events:
        message = await events.get_final_message()
    return "".join(b.text for b in message.content if b.type == "text"), message.stop_reason


async def test_a_paused_turn_is_relayed_unjudged(gateway_factory: GatewayFactory) -> None:
    """Its text is a fragment of the turn: the constraint holds for the turn's final answer."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": GRAMMAR, "retries": 0}}})
    chunks = paused(anthropic_stream(["let me ", "search"]))
    assert any(b"pause_turn" in c for c in chunks)
    h.fake.queue(Reply(chunks=chunks))
    assert await stream(h, "paused") == ("let me search", "pause_turn")


async def test_a_finished_turn_that_breaks_its_constraint_ends_with_an_error(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": GRAMMAR, "retries": 0}}})
    h.fake.queue(Reply(chunks=anthropic_stream(["let me ", "search"])))
    with pytest.raises(anthropic.APIStatusError) as caught:
        await stream(h, "finished")
    assert "constraint" in orjson.dumps(caught.value.body).decode()


def ev(name: str, data: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def searched_stream(preamble: str, answer: str) -> list[bytes]:
    """A turn with Anthropic's web search: a preamble, the search it ran, then the answer."""
    text = {"type": "text", "text": ""}
    return [
        ev("message_start", {"message": {"id": "msg_1", "type": "message", "role": "assistant", "model": CLAUDE,
                                         "content": [], "stop_reason": None, "usage": {"input_tokens": 10,
                                                                                     "output_tokens": 1}}}),
        ev("content_block_start", {"index": 0, "content_block": text}),
        ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": preamble}}),
        ev("content_block_stop", {"index": 0}),
        ev("content_block_start", {"index": 1, "content_block": {"type": "server_tool_use", "id": "srvtoolu_1",
                                                                 "name": "web_search", "input": {"query": "q"}}}),
        ev("content_block_stop", {"index": 1}),
        ev("content_block_start", {"index": 2, "content_block": {"type": "web_search_tool_result",
                                                                 "tool_use_id": "srvtoolu_1", "content": []}}),
        ev("content_block_stop", {"index": 2}),
        ev("content_block_start", {"index": 3, "content_block": text}),
        ev("content_block_delta", {"index": 3, "delta": {"type": "text_delta", "text": answer}}),
        ev("content_block_stop", {"index": 3}),
        ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"output_tokens": 20, "server_tool_use": {"web_search_requests": 1}}}),
        ev("message_stop", {}),
    ]


async def searched(h: Harness, run: str) -> list[str]:
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                      default_headers={"x-tollgate-run-id": run})
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]
    async with client, client.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG,
                                              tools=tools) as events:  # type: ignore[arg-type]
        message = await events.get_final_message()
    return [b.text for b in message.content if b.type == "text"]


async def test_the_preamble_to_a_provider_s_tool_is_not_held_to_the_answer_s_constraint(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": 'json_schema:{"type": "object"}',
                                                             "retries": 0}}})
    h.fake.queue(Reply(chunks=searched_stream("Let me search.", '{"a": 1}')))
    assert await searched(h, "preamble") == ["Let me search.", '{"a": 1}']


async def test_the_answer_after_a_provider_s_tool_is_held_to_the_constraint(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"output": {"grammar": 'json_schema:{"type": "object"}',
                                                             "retries": 0}}})
    h.fake.queue(Reply(chunks=searched_stream("Let me search.", "no json here")))
    with pytest.raises(anthropic.APIStatusError) as caught:
        await searched(h, "bad-answer")
    assert "constraint" in orjson.dumps(caught.value.body).decode()
