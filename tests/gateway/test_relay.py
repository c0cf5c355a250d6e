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
