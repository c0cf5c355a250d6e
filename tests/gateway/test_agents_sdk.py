"""The OpenAI Agents SDK, unmodified, runs its tool loop through tollgate on its default model (the
Responses API): the guards hold it like any other agent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply

RAN: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    RAN.append(f"get_weather:{city}")
    return f"sunny in {city}"


@function_tool
def delete_all() -> str:
    """Delete everything."""
    RAN.append("delete_all")
    return "deleted"


CLIENTS: list[openai.AsyncOpenAI] = []


def agent(h: Harness, run: str) -> Agent:
    client = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                default_headers={"x-tollgate-run-id": run})
    CLIENTS.append(client)
    return Agent(name="assistant", instructions="Be brief.", tools=[get_weather, delete_all],
                 model=OpenAIResponsesModel(model="gpt-4o-mini", openai_client=client))


@pytest.fixture(autouse=True)
async def _clear() -> AsyncIterator[None]:
    RAN.clear()
    yield
    while CLIENTS:
        await CLIENTS.pop().close()


CONFIG = RunConfig(tracing_disabled=True)  # no trace upload to OpenAI: loopback only


async def test_tool_loop_is_budgeted_step_by_step(gw: Harness) -> None:
    gw.fake.queue(Reply(body=response_body("", calls=[("get_weather", '{"city":"Oslo"}', "c1")], usage=(40, 8))),
                  Reply(body=response_body("It is sunny in Oslo.", usage=(60, 6))))
    result = await Runner.run(agent(gw, "sdk-1"), "Weather in Oslo?", run_config=CONFIG)
    assert result.final_output == "It is sunny in Oslo."
    assert RAN == ["get_weather:Oslo"]
    second = gw.fake.seen[-1].json
    outputs = [i for i in second["input"] if i.get("type") == "function_call_output"]
    assert outputs == [{"call_id": "c1", "output": "sunny in Oslo", "type": "function_call_output"}]
    run = await gw.run("sdk-1")
    assert (run["llm_calls"], run["tool_calls"]) == (2, 1)
    assert (run["input_tokens"], run["output_tokens"], run["reserved_tokens"]) == (100, 14, 0)


async def test_streamed_tool_loop(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=response_stream([], calls=[("get_weather", '{"city":"Rome"}', "c1")])),
                  Reply(chunks=response_stream(["Sunny ", "in Rome."])))
    result = Runner.run_streamed(agent(gw, "sdk-2"), "Weather in Rome?", run_config=CONFIG)
    async for _ in result.stream_events():
        pass
    assert result.final_output == "Sunny in Rome."
    assert RAN == ["get_weather:Rome"]
    assert (await gw.run("sdk-2"))["reserved_tokens"] == 0


async def test_disallowed_tool_is_never_offered_nor_run(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["get_weather"]}}})
    h.fake.queue(Reply(body=response_body("", calls=[("delete_all", "{}", "c1")])))
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await Runner.run(agent(h, "sdk-3"), "Clean up.", run_config=CONFIG)
    assert caught.value.code == "tool_not_allowed"
    assert RAN == []
    assert [t["name"] for t in h.fake.seen[-1].json["tools"]] == ["get_weather"]


async def test_a_looping_agent_is_stopped_with_a_final_message(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 3}, "on_stop": "message"}})
    h.fake.default = Reply(body=response_body("", calls=[("get_weather", '{"city":"Oslo"}', "c1")]))
    result = await Runner.run(agent(h, "sdk-4"), "Weather?", run_config=CONFIG, max_turns=10)
    assert "tollgate stopped this run (llm_call_cap)" in result.final_output
    assert len(h.fake.seen) == 3
    run = await h.run("sdk-4")
    assert (run["status"], run["stop_reason"], run["reserved_tokens"]) == ("stopped", "llm_call_cap", 0)
