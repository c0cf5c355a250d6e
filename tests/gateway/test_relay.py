"""`gateway.relay`: a streamed answer relayed event by event, checked as it goes and judged at its end,
through a running gateway with the official `anthropic` SDK."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from gateway.relay import PREAMBLE_BYTES
from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_stream
from tests.fakes.upstream import FakeProvider, Reply, anthropic_message, anthropic_stream, openai_stream

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


WEATHER = {"name": "get_weather", "description": "weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_CALL = {"id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
SCHEMA_GRAMMAR = 'json_schema:{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'


async def tool_turn(h: Harness, run: str, *, streamed: bool) -> tuple[list[str], list[str], str | None]:
    """The turn's text blocks, tool names and stop reason, as the agent's SDK sees them."""
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                      default_headers={"x-tollgate-run-id": run})
    async with client:
        if streamed:
            async with client.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG,
                                              tools=[WEATHER]) as events:  # type: ignore[list-item]
                message = await events.get_final_message()
        else:
            message = await client.messages.create(model=CLAUDE, max_tokens=64, messages=MSG,  # type: ignore[arg-type]
                                                   tools=[WEATHER])  # type: ignore[list-item]
    return ([b.text for b in message.content if b.type == "text"],
            [b.name for b in message.content if b.type == "tool_use"], message.stop_reason)


@pytest.mark.parametrize("streamed", [False, True])
async def test_text_before_a_client_tool_call_is_a_preamble_not_the_answer(
    gateway_factory: GatewayFactory, streamed: bool,
) -> None:
    """Claude starts most tool turns with a sentence ("I'll check the weather."): a turn that calls a
    tool is no final answer, so its text is not held to the answer's grammar. It used to be: the call was
    dropped for a re-ask (non-streamed) or the stream cut at its first letter."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": SCHEMA_GRAMMAR, "retries": 1}}})
    preamble = "I'll check the weather in Oslo for you."
    if streamed:
        h.fake.queue(Reply(chunks=anthropic_stream([preamble], tool_uses=[WEATHER_CALL])))
    else:
        h.fake.queue(Reply(body=anthropic_message(preamble, tool_uses=[WEATHER_CALL])))
    assert await tool_turn(h, f"preamble-{streamed}", streamed=streamed) == ([preamble], ["get_weather"], "tool_use")
    assert len(h.fake.seen) == 1  # not re-asked


async def test_a_stream_that_offers_tools_and_ends_without_a_call_is_held_to_the_grammar(
    gateway_factory: GatewayFactory,
) -> None:
    """Its text may have been a preamble until the end showed no call followed: then it is the answer,
    which breaks the grammar. The agent gets the error, and none of the text from where it broke on."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": SCHEMA_GRAMMAR, "retries": 0}}})
    h.fake.queue(Reply(chunks=anthropic_stream(['{"answer": "sunny"} ', "and more prose"])))
    body = {"model": CLAUDE, "max_tokens": 64, "messages": MSG, "tools": [WEATHER], "stream": True}
    async with h.session.post(f"{h.url}/v1/messages", json=body, headers={"x-tollgate-run-id": "no-call"}) as resp:
        assert resp.status == 200
        text = (await resp.read()).decode()
    assert "output_nonconforming" in text and "more prose" not in text
    with pytest.raises(anthropic.APIStatusError) as caught:
        h.fake.queue(Reply(chunks=anthropic_stream(["Sunny, I think."])))
        await tool_turn(h, "no-call-sdk", streamed=True)
    assert "constraint" in orjson.dumps(caught.value.body).decode()


async def test_a_broken_text_held_for_a_call_that_never_comes_is_cut_past_a_preamble_s_size(
    gateway_factory: GatewayFactory,
) -> None:
    """Held text is bounded by `relay.PREAMBLE_BYTES`, not by `limits.max_answer_bytes` (64 MiB a stream):
    past it no call is coming, and the stream ends with the grammar's error, nothing of the text sent."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": SCHEMA_GRAMMAR, "retries": 0}}})
    prose = ["lorem ipsum " * 100] * (PREAMBLE_BYTES // 1200 + 20) + ["never reached"]
    h.fake.queue(Reply(chunks=anthropic_stream(prose)))
    body = {"model": CLAUDE, "max_tokens": 64, "messages": MSG, "tools": [WEATHER], "stream": True}
    async with h.session.post(f"{h.url}/v1/messages", json=body, headers={"x-tollgate-run-id": "long"}) as resp:
        text = (await resp.read()).decode()
    assert "output_nonconforming" in text and "lorem" not in text and len(text) < 4096


async def metric_sums(h: Harness, family: str) -> list[tuple[dict[str, str], float, float]]:
    """Each series of histogram `family` on `/metrics`: its labels, count and sum."""
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        text = await resp.text()
    series: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples if fam.name == family else ():
            for suffix in ("_count", "_sum"):
                if s.name == family + suffix:
                    series.setdefault(tuple(sorted(s.labels.items())), {})[suffix] = s.value
    return [(dict(k), v["_count"], v["_sum"]) for k, v in series.items()]


async def test_each_streamed_chunk_after_the_first_is_a_time_per_output_chunk_sample(
    gateway_factory: GatewayFactory,
) -> None:
    """semconv gen_ai.client.operation.time_per_output_chunk: the time between the chunks the client
    receives, next to the time to first chunk, with the same labels."""
    h = await gateway_factory()
    chunks = anthropic_stream(["one ", "two ", "three"])
    h.fake.queue(Reply(chunks=chunks, chunk_delay=0.02))
    assert (await stream(h, "gaps"))[0] == "one two three"
    await h.settled("gaps")
    family = "gen_ai_client_operation_time_per_output_chunk_seconds"
    deadline = asyncio.get_running_loop().time() + 5
    while not (gaps := await metric_sums(h, family)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)  # the span ends after the last byte, which no client can await
    [(labels, count, total)] = gaps
    [(first_labels, first_count, _)] = await metric_sums(h, "gen_ai_client_operation_time_to_first_chunk_seconds")
    assert labels == first_labels and labels["gen_ai_provider_name"] == "anthropic"
    assert first_count == 1 and count == len(chunks) - 1  # one event per chunk here
    assert total >= 0.015 * count  # every gap holds the upstream's pause before its chunk


@pytest.mark.parametrize("writes", ["coalesced", "split"])
async def test_time_per_output_chunk_counts_events_not_network_reads(gateway_factory: GatewayFactory,
                                                                     writes: str) -> None:
    """A chunk is an event as the SDKs yield it: 24 events flushed in one write are 23 gaps, and one event
    written in 20-byte pieces is one chunk, not one per read (each read would be a ~10 ms gap)."""
    h = await gateway_factory()
    events = anthropic_stream([f"w{i} " for i in range(20)])
    if writes == "coalesced":
        h.fake.queue(Reply(chunks=[b"".join(events)]))
    else:
        pieces = [event[i:i + 20] for event in events for i in range(0, len(event), 20)]
        h.fake.queue(Reply(chunks=pieces, chunk_delay=0.002))
    assert (await stream(h, writes))[0] == "".join(f"w{i} " for i in range(20))
    await h.settled(writes)
    family = "gen_ai_client_operation_time_per_output_chunk_seconds"
    deadline = asyncio.get_running_loop().time() + 5
    while not (gaps := await metric_sums(h, family)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    [(_, count, _)] = gaps
    assert count == len(events) - 1


PING = b'event: ping\ndata: {"type": "ping"}\n\n'
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: an event without data
DATED = "gpt-4o-mini-2024-07-18"  # the model the answer names, not the one asked for


async def sdk_chunks(h: Harness, api: str, run: str) -> int:
    """The chunks the official SDK yields to the agent for one streamed call through `h`."""
    headers = {"x-tollgate-run-id": run}
    yielded = 0
    if api == "messages":
        client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0, default_headers=headers)
        async with client:
            events = await client.messages.create(model=CLAUDE, max_tokens=64, messages=MSG,  # type: ignore[arg-type]
                                                  stream=True)
            async for _ in events:  # type: ignore[union-attr]
                yielded += 1
        return yielded
    sdk = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="k", max_retries=0, default_headers=headers)
    async with sdk:
        if api == "responses":
            async for _ in await sdk.responses.create(model="gpt-4o-mini", input="go", stream=True):
                yielded += 1
            return yielded
        usage = {"stream_options": {"include_usage": True}} if api == "chat+usage" else {}
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        async for _ in await sdk.chat.completions.create(  # type: ignore[call-overload]
                model="gpt-4o-mini", messages=MSG, stream=True, **usage,
                **({"tools": tools} if api == "chat-buffered" else {})):
            yielded += 1
    return yielded


@pytest.mark.parametrize("api", ["chat", "chat+usage", "chat-buffered", "responses", "messages"])
async def test_chunk_metrics_count_the_events_the_agents_sdk_yields(gateway_factory: GatewayFactory,
                                                                     api: str) -> None:
    """README: one time-per-output-chunk sample per streamed event after the first, as the SDKs yield
    them: not OpenAI's `[DONE]` (the SDK stops there), not the usage chunk tollgate asked for and hides
    from an agent that did not, not Anthropic's `ping` (its SDK skips it), not a keep-alive comment;
    relayed as it arrives or held whole (`stream_check: buffer`) alike. Both chunk metrics carry the
    response model, as the stream's duration does."""
    buffered = {"agents": {"default": {"output": {"stream_check": "buffer"}}}} if api == "chat-buffered" else {}
    h = await gateway_factory(**buffered)
    if api == "messages":
        events = anthropic_stream(["one ", "two"], model=DATED)
        chunks = [KEEPALIVE, events[0], PING, *events[1:3], PING, *events[3:]]
    elif api == "responses":
        chunks = [KEEPALIVE, *response_stream(["one ", "two"], model=DATED)]
    else:
        events = openai_stream(["one ", "two"], model=DATED)
        chunks = [KEEPALIVE, *events[:2], KEEPALIVE, *events[2:]]
    h.fake.queue(Reply(chunks=chunks))
    yielded = await sdk_chunks(h, api, api)
    await h.settled(api)
    family = "gen_ai_client_operation_time_per_output_chunk_seconds"
    deadline = asyncio.get_running_loop().time() + 5
    while not (gaps := await metric_sums(h, family)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)  # the span ends after the last byte, which no client can await
    [(labels, count, _)] = gaps
    [(first_labels, first_count, _)] = await metric_sums(h, "gen_ai_client_operation_time_to_first_chunk_seconds")
    [(duration_labels, _, _)] = await metric_sums(h, "gen_ai_client_operation_duration_seconds")
    assert (first_count, count) == (1, yielded - 1), (api, yielded)
    assert labels == first_labels and labels["gen_ai_response_model"] == DATED
    assert labels == {k: v for k, v in duration_labels.items() if k != "error_type"}


class Rated(BaseModel):
    answer: str
    score: int


WITHOUT_SCORE = ['{"answer": ', '"hi"}']  # valid JSON that misses the required "score"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_the_sdk_parsing_helpers_see_the_verdict_not_a_parse_error(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], api: str
) -> None:
    """The agent's own schema (`response_format` / `text_format` / `output_format` from a pydantic model),
    on a provider that does not constrain natively: the stream is checked for JSON syntax as it comes and
    against the schema at its end. The SDKs parse the text where it ends (a finish reason, an
    `output_text.done`, a text block's stop), so those events wait for the verdict: the agent's SDK raises
    tollgate's `output_nonconforming`, not a pydantic error of its own over an answer it should not see."""
    fake_url = fake[1]
    h = await gateway_factory(providers={
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-x", "structured_outputs": "none"},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-x"}})
    chunks = {"chat": openai_stream, "responses": response_stream, "messages": anthropic_stream}[api](WITHOUT_SCORE)
    h.fake.queue(Reply(chunks=chunks))
    error: type[Exception] = anthropic.APIError if api == "messages" else openai.APIError
    with pytest.raises(error, match="breaks its constraint: .*'score' is a required property"):
        if api == "messages":
            client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0)
            async with client, client.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG,
                                                      output_format=Rated) as events:
                await events.get_final_message()
        else:
            sdk = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="k", max_retries=0)
            async with sdk:
                if api == "chat":
                    async with sdk.chat.completions.stream(model="gpt-4o-mini", messages=MSG,  # type: ignore[arg-type]
                                                           response_format=Rated) as chat:
                        await chat.get_final_completion()
                else:
                    async with sdk.responses.stream(model="gpt-4o-mini", input="go", text_format=Rated) as resp:
                        await resp.get_final_response()


async def test_a_responses_stream_cut_for_its_grammar_numbers_its_error_after_its_events(
    gateway_factory: GatewayFactory,
) -> None:
    """Responses stream events are numbered in order (`sequence_number`): the error that ends a stream cut
    for its grammar follows the events relayed before it (it was 0)."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[0-9]+", "retries": 0}}})
    h.fake.queue(Reply(chunks=response_stream(["12", "a3"])))
    async with h.session.post(h.url + "/v1/responses", json={"model": "gpt-4o-mini", "input": "x", "stream": True}) as r:
        raw = (await r.read()).decode()
    events = [orjson.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    numbers = [e["sequence_number"] for e in events]
    assert events[-1]["type"] == "error" and len(numbers) > 2
    assert numbers == sorted(set(numbers)), numbers


async def test_a_stream_event_of_the_wrong_shape_is_named_by_kind_not_by_python_s_text(
    gateway_factory: GatewayFactory,
) -> None:
    """`{"choices": ["x"]}` trips the reader on `'str' object has no attribute 'get'`: the agent got that
    text; it gets what happened, in its SDK's error event."""
    h = await gateway_factory()
    h.fake.queue(Reply(chunks=[b'data: {"id":"c","object":"chat.completion.chunk","choices":["x"]}\n\n']))
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with h.session.post(h.url + "/v1/chat/completions", json=body) as resp:
        text = (await resp.read()).decode()
    assert "an event of the wrong shape (AttributeError)" in text and "has no attribute" not in text
