"""LangChain / LangGraph, driven as a user would, pointed at tollgate: `ChatOpenAI` on Chat Completions and
on the Responses API, `ChatAnthropic`, `with_structured_output`, and `langchain.agents.create_agent` tool
loops under tollgate's guards, with the fake provider upstream.

The first test showed a defect (`stream_check: buffer` ignored for a stream that only offers tools, so a
streamed structured output with bad arguments was not re-asked); the others show the main LangChain
flows working through tollgate."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import langchain_anthropic._client_utils as anthropic_clients
import langchain_anthropic.chat_models
import langchain_openai.chat_models._client_utils as openai_clients
import langchain_openai.chat_models.base
import openai
import pytest
from langchain.agents import create_agent
from langchain_anthropic import ChatAnthropic
from langchain_core.exceptions import ModelPermissionDeniedError
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import (
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)

# LangChain's packages warn about their own deprecations and beta features on import and use
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning",
                                        "ignore::UserWarning")

KEY = "lc-agent-key"
GPT = "gpt-4o-mini"
CLAUDE = "claude-sonnet-4-5"
PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
           "claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 5.0}}
CITIES = ["Oslo", "Rome", "Paris", "Lima", "Cairo", "Quito", "Delhi", "Tokyo", "Accra", "Minsk"]
RAN: list[str] = []


async def gateway(factory: GatewayFactory, **policy: Any) -> Harness:
    return await factory(pricing=PRICING, agents={"bot": {"keys": [KEY], **policy}})


def oa(h: Harness, run: str, **kw: Any) -> ChatOpenAI:
    kw.setdefault("max_retries", 0)
    return ChatOpenAI(model=GPT, base_url=f"{h.url}/v1", api_key=KEY,  # type: ignore[arg-type]
                      default_headers={"x-tollgate-run-id": run}, **kw)


def an(h: Harness, run: str, **kw: Any) -> ChatAnthropic:
    kw.setdefault("max_retries", 0)
    return ChatAnthropic(model=CLAUDE, base_url=h.url, api_key=KEY,  # type: ignore[arg-type,call-arg]
                         default_headers={"x-tollgate-run-id": run}, **kw)


OPENED: list[Any] = []  # the httpx clients this module's models used


def counting(paths: list[str]) -> httpx.AsyncClient:
    """An httpx client for ChatOpenAI that records every request the SDK sends (retries included)."""
    async def hook(request: httpx.Request) -> None:
        paths.append(request.url.path)
    client = httpx.AsyncClient(event_hooks={"request": [hook]})
    OPENED.append(client)
    return client


@pytest.fixture(autouse=True)
async def closed_clients(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """LangChain caches one default httpx client per base URL for the life of the process (each test's
    gateway has its own port) and never closes it: its sockets would be left to the garbage collector,
    an unraisable ResourceWarning in some later test. Each test's models get clients closed after it."""
    def tracked(build: Callable[..., Any]) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Any:
            client = build(*args, **kwargs)  # not the cached one: one per model, closed below
            OPENED.append(client)
            return client
        return make

    builders = {  # what each package's default-client function builds, past its cache
        langchain_openai.chat_models.base: (openai_clients._build_sync_httpx_client,
                                             openai_clients._build_async_httpx_client),
        langchain_anthropic.chat_models: (anthropic_clients._get_default_httpx_client.__wrapped__,
                                          anthropic_clients._get_default_async_httpx_client.__wrapped__),
    }
    for module, (sync, async_) in builders.items():
        monkeypatch.setattr(module, "_get_default_httpx_client", tracked(sync))
        monkeypatch.setattr(module, "_get_default_async_httpx_client", tracked(async_))
    yield
    while OPENED:
        client = OPENED.pop()
        if hasattr(client, "aclose"):  # httpx's or httpx2's (the anthropic SDK's), async or not
            await client.aclose()
        else:
            client.close()


def chat_turn(i: int, text: str = "", calls: list[dict[str, Any]] | None = None,
              usage: tuple[int, int] = (100, 50)) -> Reply:
    """A Chat Completions answer with an id of its own (LangGraph merges messages that share an id)."""
    body = openai_completion(text, tool_calls=calls, prompt_tokens=usage[0], completion_tokens=usage[1])
    body["id"] = f"chatcmpl-{i}"
    return Reply(body=body)


def claude_turn(i: int, text: str = "", uses: list[dict[str, Any]] | None = None,
                usage: tuple[int, int] = (100, 50)) -> Reply:
    body = anthropic_message(text, model=CLAUDE, tool_uses=uses, input_tokens=usage[0], output_tokens=usage[1])
    body["id"] = f"msg_{i}"
    return Reply(body=body)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    RAN.append(f"get_weather:{city}")
    return f"sunny in {city}"


@tool
def delete_all() -> str:
    """Delete everything."""
    RAN.append("delete_all")
    return "deleted"


class Weather(BaseModel):
    city: str
    temp_c: int


BAD = '{"city":"Oslo","temp_c":"warm"}'
GOOD = '{"city":"Oslo","temp_c":5}'


@pytest.fixture(autouse=True)
def _clear() -> None:
    RAN.clear()


# ------------------------------------------------------------------------------------------- defects


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
async def test_stream_check_buffer_reasks_streamed_tool_arguments(gateway_factory: GatewayFactory, api: str) -> None:
    """Defect: `output: {stream_check: buffer, retries: 1}` should hold a streamed answer until it
    validates "so it can be re-asked too" (README, Structured outputs), and tool arguments that break
    their tool's parameter schema are "re-asked the same way" as a nonconforming answer. LangChain's
    default `with_structured_output` (method `function_calling`, the only one for ChatAnthropic's
    default) streams a forced tool call. With no text grammar in the request, tollgate ignores the
    buffer setting and relays the stream incrementally (`gateway/proxy.py`: `incremental = plan is None
    or ...`), so the bad arguments end the stream with `output_nonconforming` instead of being re-asked:
    the agent gets an error where a non-streamed call (and the same stream with a response_format) gets
    the valid second answer."""
    h = await gateway(gateway_factory, budget={"usd": 1.0}, output={"retries": 1, "stream_check": "buffer"})
    for args in (BAD, GOOD):
        if api == "chat":
            h.fake.queue(Reply(chunks=openai_stream([], tool_calls=[tool_call("Weather", args)])))
        elif api == "responses":
            h.fake.queue(Reply(chunks=response_stream([], calls=[("Weather", args, "c1")])))
        else:
            h.fake.queue(Reply(chunks=anthropic_stream([], model=CLAUDE, tool_uses=[
                {"id": "t1", "name": "Weather", "input": json.loads(args)}])))
    llm = an(h, "buf-tools") if api == "anthropic" else oa(h, "buf-tools", use_responses_api=api == "responses")
    outs = [o async for o in llm.with_structured_output(Weather, method="function_calling").astream("Oslo?")]
    assert outs[-1] == Weather(city="Oslo", temp_c=5)
    assert len(h.fake.seen) == 2  # the bad answer was re-asked once
    view = await h.settled("buf-tools", 1)
    assert (view["status"], view["reserved_usd"]) == ("active", 0)


# ------------------------------------------------------------------------------ LangChain flows that work


async def test_chat_openai_invoke_batch_and_stream_with_usage(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(body=openai_completion("Bonjour", prompt_tokens=11, completion_tokens=3)),
                 Reply(body=openai_completion("a", prompt_tokens=5, completion_tokens=1)),
                 Reply(body=openai_completion("a", prompt_tokens=5, completion_tokens=1)),
                 Reply(chunks=openai_stream(["Hel", "lo"], usage=(12, 2))))
    llm = oa(h, "lc-basic", stream_usage=True)
    msg = await llm.ainvoke("hi")
    assert msg.content == "Bonjour" and msg.usage_metadata and msg.usage_metadata["input_tokens"] == 11
    assert [m.content for m in await llm.abatch(["x", "y"])] == ["a", "a"]
    parts = [c async for c in llm.astream("hi")]
    assert "".join(str(c.content) for c in parts) == "Hello"
    assert [c.usage_metadata["input_tokens"] for c in parts if c.usage_metadata] == [12]
    assert h.fake.seen[-1].json["stream_options"] == {"include_usage": True}
    assert all(s.headers["Authorization"] == "Bearer sk-provider-openai" for s in h.fake.seen)
    view = await h.settled("lc-basic", 4)
    assert (view["llm_calls"], view["input_tokens"], view["output_tokens"], view["reserved_usd"]) == (4, 33, 7, 0)


async def test_responses_api_and_anthropic_invoke_and_stream(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(body=response_body("Bonjour")), Reply(chunks=response_stream(["Hel", "lo"])),
                 Reply(body=anthropic_message("Salut", model=CLAUDE)),
                 Reply(chunks=anthropic_stream(["a", "b"], model=CLAUDE)))
    responses = oa(h, "lc-two", use_responses_api=True)
    assert (await responses.ainvoke("hi")).text == "Bonjour"
    assert "".join([c.text async for c in responses.astream("hi")]) == "Hello"
    claude = an(h, "lc-two")
    assert (await claude.ainvoke("hi")).text == "Salut"
    assert "".join([c.text async for c in claude.astream("hi")]) == "ab"
    assert h.fake.seen[2].headers["x-api-key"] == "sk-ant-provider"
    view = await h.settled("lc-two", 4)
    assert (view["llm_calls"], view["reserved_usd"]) == (4, 0)


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
async def test_bind_tools_offers_only_allowed_tools(gateway_factory: GatewayFactory, api: str) -> None:
    h = await gateway(gateway_factory, budget={"usd": 1.0}, tools={"allow": ["get_weather"]})
    if api == "chat":
        h.fake.queue(Reply(chunks=openai_stream([], tool_calls=[tool_call("get_weather", '{"city":"Rome"}')])))
        llm = oa(h, "lc-tools", streaming=True)
    elif api == "responses":
        h.fake.queue(Reply(chunks=response_stream([], calls=[("get_weather", '{"city":"Rome"}', "c1")])))
        llm = oa(h, "lc-tools", streaming=True, use_responses_api=True)
    else:
        h.fake.queue(Reply(chunks=anthropic_stream([], model=CLAUDE, tool_uses=[
            {"id": "c1", "name": "get_weather", "input": {"city": "Rome"}}])))
        llm = an(h, "lc-tools", streaming=True)
    msg = await llm.bind_tools([get_weather, delete_all]).ainvoke("weather in Rome?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Rome"})]
    offered = h.fake.seen[-1].json["tools"]
    assert [t.get("name") or t["function"]["name"] for t in offered] == ["get_weather"]
    view = await h.settled("lc-tools", 1)
    assert (view["tool_calls"], view["reserved_usd"]) == (1, 0)


@pytest.mark.parametrize(("api", "method"), [("chat", "json_schema"), ("chat", "function_calling"),
                                             ("chat", "json_mode"), ("responses", "json_schema"),
                                             ("anthropic", "function_calling")])
async def test_with_structured_output_is_reasked_until_it_conforms(gateway_factory: GatewayFactory, api: str,
                                                                   method: str) -> None:
    h = await gateway(gateway_factory, budget={"usd": 1.0}, output={"retries": 1})
    # json_object asks for JSON, not for the schema: its bad answer is one that is not JSON at all
    for text in (("Sure: " + GOOD) if method == "json_mode" else BAD, GOOD):
        if api == "chat" and method == "function_calling":
            h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("Weather", text)])))
        elif api == "chat":
            h.fake.queue(Reply(body=openai_completion(text)))
        elif api == "responses":
            h.fake.queue(Reply(body=response_body(text)))
        else:
            h.fake.queue(claude_turn(0, uses=[{"id": "t1", "name": "Weather", "input": json.loads(text)}]))
    llm = an(h, "lc-so") if api == "anthropic" else oa(h, "lc-so", use_responses_api=api == "responses")
    out = await llm.with_structured_output(Weather, method=method).ainvoke("Weather in Oslo, as JSON")
    assert (out, len(h.fake.seen)) == (Weather(city="Oslo", temp_c=5), 2)
    view = await h.settled("lc-so", 1)
    assert view["reserved_usd"] == 0


async def test_structured_output_still_nonconforming_is_a_422_langchain_raises(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, budget={"usd": 1.0}, output={"retries": 1})
    h.fake.default = Reply(body=openai_completion(BAD))
    paths: list[str] = []
    llm = oa(h, "lc-422", max_retries=2, http_async_client=counting(paths))
    with pytest.raises(openai.UnprocessableEntityError) as info:
        await llm.with_structured_output(Weather, method="json_schema").ainvoke("Weather in Oslo")
    assert info.value.status_code == 422
    assert info.value.body["code"] == "output_nonconforming"  # type: ignore[index]
    assert (len(paths), len(h.fake.seen)) == (1, 2)  # LangChain does not retry; tollgate re-asked once
    view = await h.settled("lc-422", 1)
    assert (view["status"], view["llm_calls"], view["reserved_usd"]) == ("active", 2, 0)


@pytest.mark.parametrize("api", ["chat", "anthropic"])
async def test_agent_loop_is_stopped_by_its_budget(gateway_factory: GatewayFactory, api: str) -> None:
    """A create_agent tool loop that would go on for ever stops on a catchable 403 `budget_exhausted`
    that LangChain maps to ModelPermissionDeniedError and does not retry; spend stays within budget."""
    h = await gateway(gateway_factory, budget={"usd": 0.002})
    run = f"lc-budget-{api}"
    paths: list[str] = []
    if api == "chat":
        h.fake.queue(*[chat_turn(i, calls=[tool_call("get_weather", json.dumps({"city": c}), f"c{i}")])
                       for i, c in enumerate(CITIES)])
        llm: Any = oa(h, run, max_retries=2, http_async_client=counting(paths))
    else:
        h.fake.queue(*[claude_turn(i, uses=[{"id": f"t{i}", "name": "get_weather", "input": {"city": c}}])
                       for i, c in enumerate(CITIES)])
        llm = an(h, run, max_retries=2, max_tokens=1000)
    agent = create_agent(llm, tools=[get_weather])
    with pytest.raises(ModelPermissionDeniedError) as info:
        await agent.ainvoke({"messages": [HumanMessage("Weather everywhere, one city at a time")]})
    err: Any = info.value
    body = err.body if api == "chat" else err.body["error"]
    assert (err.status_code, body["code"]) == (403, "budget_exhausted")
    assert 2 <= len(RAN) < len(CITIES)
    if api == "chat":
        assert len(paths) == len(h.fake.seen) + 1  # the refusal was sent once, never retried
    view = await h.run(run)
    assert (view["status"], view["stop_reason"]) == ("stopped", "budget_exhausted")
    assert 0 < view["spent_usd"] <= 0.002 and view["reserved_usd"] == 0


@pytest.mark.parametrize("guard", ["llm_calls", "loop", "allow"])
async def test_agent_guards_stop_a_langgraph_loop(gateway_factory: GatewayFactory, guard: str) -> None:
    policy: dict[str, Any] = {"budget": {"usd": 1.0}, "caps": {"llm_calls": 3},
                              "loop": {"window": 3, "max_distinct": 1}, "tools": {"allow": ["get_weather"]}}
    code = {"llm_calls": "llm_call_cap", "loop": "loop_detected", "allow": "tool_not_allowed"}[guard]
    h = await gateway(gateway_factory, **policy)
    if guard == "allow":
        h.fake.queue(chat_turn(0, calls=[tool_call("get_weather", '{"city":"Oslo"}', "c0")]),
                     chat_turn(1, calls=[tool_call("delete_all", "{}", "c1")]))
    h.fake.queue(*[chat_turn(i, calls=[tool_call("get_weather", json.dumps(
        {"city": "Oslo" if guard == "loop" else c}), f"c{i + 2}")]) for i, c in enumerate(CITIES, start=2)])
    agent = create_agent(oa(h, f"lc-{guard}"), tools=[get_weather, delete_all])
    with pytest.raises(openai.PermissionDeniedError) as info:
        await agent.ainvoke({"messages": [HumanMessage("Weather")]})
    assert info.value.body["code"] == code  # type: ignore[index]
    assert "delete_all" not in RAN
    view = await h.run(f"lc-{guard}")
    assert (view["status"], view["stop_reason"], view["reserved_usd"]) == ("stopped", code, 0)


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
async def test_on_stop_message_ends_a_streamed_agent_loop_gracefully(gateway_factory: GatewayFactory,
                                                                     api: str) -> None:
    h = await gateway(gateway_factory, budget={"usd": 1.0}, caps={"llm_calls": 1}, on_stop="message")
    if api == "chat":
        h.fake.queue(Reply(chunks=openai_stream([], tool_calls=[tool_call("get_weather", '{"city":"Oslo"}')])))
        llm: Any = oa(h, f"lc-msg-{api}", streaming=True)
    elif api == "responses":
        h.fake.queue(Reply(chunks=response_stream([], calls=[("get_weather", '{"city":"Oslo"}', "c1")])))
        llm = oa(h, f"lc-msg-{api}", streaming=True, use_responses_api=True)
    else:
        h.fake.queue(Reply(chunks=anthropic_stream([], model=CLAUDE, tool_uses=[
            {"id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}])))
        llm = an(h, f"lc-msg-{api}", streaming=True)
    out = await create_agent(llm, tools=[get_weather]).ainvoke({"messages": [HumanMessage("Weather")]})
    assert RAN == ["get_weather:Oslo"]
    assert "llm_call_cap" in out["messages"][-1].text
    view = await h.settled(f"lc-msg-{api}", 1)
    assert (view["stop_reason"], view["llm_calls"], view["reserved_usd"]) == ("llm_call_cap", 1, 0)
