"""Anthropic billing through the gateway, with the anthropic SDK: a streamed answer's `usage.iterations` and
`usage.speed` settle the run, and the tools a budget cannot hold are refused unless the allow-list removes
them (README "How budgets are held")."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anthropic
import orjson
import pytest
from genai_prices import Usage as GPUsage
from genai_prices import calc_price

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, anthropic_message

MSG = [{"role": "user", "content": "hello"}]
MODEL = "claude-opus-4-8"


def an(h: Harness, run: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                    default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


def genai(model: str, input_tokens: int, output_tokens: int, ctx: dict[str, str] | None = None) -> float:
    usage = GPUsage(input_tokens=input_tokens, output_tokens=output_tokens)
    return float(calc_price(usage, model_ref=model, provider_id="anthropic", price_context=ctx).total_price)


def sse(data: dict[str, Any]) -> bytes:
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def spent(h: Harness, run: str) -> dict[str, Any]:
    deadline = time.monotonic() + 5
    while True:
        view = await h.run(run)
        if view.get("steps") and not view.get("reserved_usd"):
            return view
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.02)


async def test_a_streamed_answer_is_settled_with_its_iterations_at_its_speed(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 10.0}}})
    compaction = {"type": "compaction", "input_tokens": 150_000, "output_tokens": 4_000,
                  "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    message: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 10, "output_tokens": 1, "speed": "fast"}}
    chunks = [
        sse({"type": "message_start", "message": message}),
        sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
        sse({"type": "content_block_stop", "index": 0}),
        sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"input_tokens": 10, "output_tokens": 5, "iterations": [compaction]}}),
        sse({"type": "message_stop"}),
    ]
    h.fake.queue(Reply(chunks=chunks))
    async with an(h, "stream-iter") as client, client.beta.messages.stream(
        model=MODEL, max_tokens=100, messages=MSG, speed="fast",  # type: ignore[arg-type]
    ) as stream:
        await stream.get_final_message()
    view = await spent(h, "stream-iter")
    billed = genai(MODEL, 150_010, 4_005, {"speed": "fast"})
    assert view["spent_usd"] == pytest.approx(billed, rel=1e-6)
    assert view["input_tokens"] + view["output_tokens"] == 154_015


# `gateway.proxy.offered` reads the billed tools the allow-list left from the Responses API's tool types
# alone, and keeps `Call.unreserved_tools` as parsed: an Anthropic tool kept while another is dropped is
# forwarded, an advisor the allow-list removes is still refused. Fixed by asking the adapter
# (`AnthropicMessages.unpriced_tools` / `.unreserved_tools`), in files this change does not own.
CODE = {"type": "code_execution_20250825", "name": "code_execution"}
ADVISOR = {"type": "advisor_20260301", "name": "advisor", "model": MODEL, "max_uses": 2}
LOOKUP = {"name": "lookup", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(("tool", "budget"), [
    (CODE, {"usd": 1.0}),
    (ADVISOR, {"usd": 1.0}),
    (ADVISOR, {"tokens": 100_000}),
])
async def test_a_tool_the_budget_cannot_hold_goes_when_the_allow_list_removes_it(
    gateway_factory: GatewayFactory, tool: dict[str, Any], budget: dict[str, Any],
) -> None:
    h = await gateway_factory(agents={"bot": {"budget": budget, "tools": {"allow": ["lookup"]}}})
    h.fake.queue(Reply(body=anthropic_message("ok", model=MODEL)))
    async with an(h, "removed") as client:
        await client.beta.messages.create(model=MODEL, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                          tools=[tool, LOOKUP])  # type: ignore[list-item]
    assert [t["name"] for t in h.fake.seen[-1].json["tools"]] == ["lookup"]


@pytest.mark.parametrize(("tool", "budget"), [
    (CODE, {"usd": 1.0}),
    (ADVISOR, {"usd": 1.0}),
    (ADVISOR, {"tokens": 100_000}),
])
async def test_a_tool_the_budget_cannot_hold_is_refused_when_the_allow_list_keeps_it(
    gateway_factory: GatewayFactory, tool: dict[str, Any], budget: dict[str, Any],
) -> None:
    """The allow-list drops another tool, so `gateway.proxy.offered` reads the tools left in the body."""
    h = await gateway_factory(agents={"bot": {"budget": budget, "tools": {"allow": [tool["name"]]}}})
    h.fake.queue(Reply(body=anthropic_message("ok", model=MODEL)))
    async with an(h, "kept") as client:
        with pytest.raises(anthropic.BadRequestError):
            await client.beta.messages.create(model=MODEL, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                              tools=[tool, LOOKUP])  # type: ignore[list-item]
    assert not h.fake.seen


async def test_an_advisor_on_another_model_is_charged_at_its_rates(gateway_factory: GatewayFactory) -> None:
    """Without a budget the advisor runs (a budget refuses it), and the run's spend still counts each of
    its sub-inferences at the advisor model's rates, not the executor's."""
    h = await gateway_factory(agents={"bot": {}})
    body = anthropic_message("hi", model="claude-3-5-haiku-20241022", input_tokens=10, output_tokens=5)
    advice = {"type": "advisor_message", "model": MODEL, "input_tokens": 20_000, "output_tokens": 1_000,
              "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    body["usage"]["iterations"] = [advice]
    h.fake.queue(Reply(body=body))
    async with an(h, "advised") as client:
        await client.beta.messages.create(model="claude-3-5-haiku-20241022", max_tokens=100,
                                          messages=MSG, tools=[ADVISOR])  # type: ignore[arg-type, list-item]
    view = await spent(h, "advised")
    billed = genai("claude-3-5-haiku-20241022", 10, 5) + genai(MODEL, 20_000, 1_000)
    assert view["spent_usd"] == pytest.approx(billed, rel=1e-6)
