"""Reasoning items sent back by id (`guards.reasoning`), through a running gateway: the OpenAI Agents
SDK's default with a reasoning model runs its tool loop under a budget, each item held at the output
tokens of the response that produced it; an item no answer of the run relayed is still refused."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply, openai_compaction
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401 - a fixture

MODEL = "gpt-5-mini"
CLIENTS: list[openai.AsyncOpenAI] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def client(h: Harness, run: str) -> openai.AsyncOpenAI:
    made = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})
    CLIENTS.append(made)
    return made


@pytest.fixture(autouse=True)
async def _close() -> AsyncIterator[None]:
    yield
    while CLIENTS:
        await CLIENTS.pop().close()


def reasoning(item_id: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]}


def with_reasoning(body: dict[str, Any], item_id: str, reasoning_tokens: int) -> dict[str, Any]:
    body["output"].insert(0, reasoning(item_id))
    body["usage"]["output_tokens_details"]["reasoning_tokens"] = reasoning_tokens
    return body


def streamed_with_reasoning(events: list[bytes], item_id: str) -> list[bytes]:
    """The stream's final event lists the reasoning item first, as OpenAI's does."""
    name, data = events[-1].split(b"\ndata: ", 1)
    final = orjson.loads(data)
    final["response"]["output"].insert(0, reasoning(item_id))
    return [*events[:-1], name + b"\ndata: " + orjson.dumps(final) + b"\n\n"]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_agents_sdk_reasoning_tool_loop_runs_under_a_budget(gateway_factory: GatewayFactory,
                                                                      stream: bool) -> None:
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}})
    call = ("get_weather", '{"city":"Oslo"}', "c1")
    if stream:
        h.fake.queue(Reply(chunks=streamed_with_reasoning(response_stream([], calls=[call], model=MODEL,
                                                                          usage=(40, 300)), "rs_s1")),
                     Reply(chunks=response_stream(["Sunny ", "in Oslo."], model=MODEL)))
    else:
        h.fake.queue(Reply(body=with_reasoning(response_body("", calls=[call], model=MODEL, usage=(40, 300)),
                                               "rs_1", 280)),
                     Reply(body=response_body("Sunny in Oslo.", model=MODEL, usage=(400, 6))))
    agent = Agent(name="assistant", instructions="Be brief.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client(h, f"sdk-{stream}")))
    config = RunConfig(tracing_disabled=True)  # no trace upload to OpenAI: loopback only
    if stream:
        streamed = Runner.run_streamed(agent, "Weather in Oslo?", run_config=config)
        async for _ in streamed.stream_events():
            pass
        final = streamed.final_output
    else:
        final = (await Runner.run(agent, "Weather in Oslo?", run_config=config)).final_output
    assert final == "Sunny in Oslo."
    sent_back = [i for i in h.fake.seen[-1].json["input"] if i.get("type") == "reasoning"]
    assert [i["id"] for i in sent_back] == ["rs_s1" if stream else "rs_1"]
    assert "encrypted_content" not in sent_back[0]  # OpenAI reads it from storage: held, not refused
    view = await h.settled(f"sdk-{stream}")
    assert view["llm_calls"] == 2


async def post(h: Harness, run: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with h.session.post(f"{h.url}/v1/responses", json=body, headers={"x-tollgate-run-id": run}) as resp:
        return resp.status, await resp.json()


def turn(*extra: dict[str, Any], max_output: int = 50) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": max_output,
            "input": [{"role": "user", "content": "Weather in Oslo?"}, *extra]}


async def test_a_relayed_item_is_held_at_the_output_tokens_of_its_response(gateway_factory: GatewayFactory) -> None:
    """9,000 output tokens of a 10,000-token budget spent: a turn without the item fits what is left, the
    same turn sending the item back by id would bill up to 9,000 more input tokens and is stopped."""
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 10_000}}})
    h.fake.queue(Reply(body=with_reasoning(response_body("", calls=[("get_weather", "{}", "c1")], model=MODEL,
                                                         usage=(100, 9_000)), "rs_big", 8_990)),
                 Reply(body=response_body("ok", model=MODEL, usage=(80, 5))))
    status, _ = await post(h, "held", turn(max_output=9_500))
    assert status == 200
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    status, _ = await post(h, "held", turn(call, output))
    assert status == 200, "the turn without the item fits the budget"
    status, body = await post(h, "held", turn({"type": "reasoning", "id": "rs_big", "summary": []}, call, output))
    assert status == 403 and body["error"]["code"] == "token_budget_exhausted", body
    assert len(h.fake.seen) == 2


@pytest.mark.parametrize("budget", [{"usd": 1.0}, {"tokens": 100_000}])
async def test_an_item_this_gateway_did_not_relay_is_refused(gateway_factory: GatewayFactory,
                                                             budget: dict[str, Any]) -> None:
    h = await gateway_factory(agents={"default": {"budget": budget}})
    status, body = await post(h, "unseen", turn({"type": "reasoning", "id": "rs_elsewhere", "summary": []}))
    assert status == 400 and "reads from storage" in body["error"]["message"], body
    assert "encrypted_content" in body["error"]["message"]
    assert not h.fake.seen


async def test_a_compaction_holds_relayed_items_and_refuses_others(gateway_factory: GatewayFactory) -> None:
    """`/v1/responses/compact` reads its input as `/v1/responses` does, reasoning sent back by id too."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}})
    h.fake.queue(Reply(body=with_reasoning(response_body("", calls=[("get_weather", "{}", "c1")], model=MODEL),
                                           "rs_c", 5)),
                 Reply(body=openai_compaction()))
    assert (await post(h, "compact", turn()))[0] == 200
    for item_id, expected in (("rs_unseen", 400), ("rs_c", 200)):
        body = {"model": MODEL, "input": [{"role": "user", "content": "hi"},
                                          {"type": "reasoning", "id": item_id, "summary": []}]}
        async with h.session.post(f"{h.url}/v1/responses/compact", json=body,
                                  headers={"x-tollgate-run-id": "compact"}) as resp:
            assert resp.status == expected, await resp.text()
    assert h.fake.seen[-1].path == "/v1/responses/compact"


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_items_relayed_by_one_sidecar_are_held_by_another_sharing_the_store(
        gateway_factory: GatewayFactory, redis_server: RedisServer, tmp_path: Path,  # noqa: F811
        backend: str) -> None:
    """The items are in the run's history in the store: a second gateway on the same Redis (replicas), or
    one restarted on the same SQLite file, holds them as the first would."""
    state = ({"backend": "redis", "url": redis_server.url} if backend == "redis"
             else {"backend": "sqlite", "path": str(tmp_path / "shared.db")})
    run = f"shared-{uuid.uuid4().hex}"  # the Redis server is the session's
    first = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}}, state=state)
    first.fake.queue(Reply(body=with_reasoning(response_body("", calls=[("get_weather", "{}", "c1")], model=MODEL),
                                               "rs_shared", 5)),
                     Reply(body=response_body("ok", model=MODEL)))
    assert (await post(first, run, turn()))[0] == 200
    if backend == "sqlite":
        await first.gateway.store.close()  # a restart: the file is all the next process has
    second = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}}, state=state)
    item = {"type": "reasoning", "id": "rs_shared", "summary": []}
    status, body = await post(second, run, turn(item))
    assert status == 200, body
    status, body = await post(second, run, turn({**item, "id": "rs_never"}))
    assert status == 400, body
