"""A run stopped while some of its steps are in flight: the answers of steps admitted before the stop
are judged on the limits (as a serial order of the steps would judge them), not withheld for the stop.

A parallel agent (several model calls of one run at once) that hits `caps.llm_calls` with one call too
many used to lose every answer in flight: they had been admitted and paid for, and the agent got none.
Now each one that fits the limits is delivered; one that breaches a limit is still withheld, with the
run's own stop reason, and the caps hold exactly (`RunStore.apply(..., in_flight=True)`).

Driven by the official `openai` SDK against a running gateway; the upstream holds its answers until the
test releases them, so the stop lands while they are in flight (no sleeps). Memory and Redis state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import orjson
import pytest
from aiohttp import web

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import openai_completion, openai_stream, serving, sse_response, tool_call
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture, by name)

GPT = "gpt-4o-mini"


class HeldUpstream:
    """Answers a chat completion whose user message is `name` with `calls[name]` tool calls; a name in
    `held` waits for `release(name)` first. `arrived` counts the requests in."""

    def __init__(self, calls: dict[str, int], held: set[str]) -> None:
        self.calls = calls
        self.held = {name: asyncio.Event() for name in held}
        self.arrivals: list[str] = []
        self._changed = asyncio.Condition()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        name = body["messages"][-1]["content"]
        async with self._changed:
            self.arrivals.append(name)
            self._changed.notify_all()
        if name in self.held:
            await self.held[name].wait()
        calls = [tool_call("search", orjson.dumps({"q": f"{name}{i}"}).decode(), f"{name}{i}")
                 for i in range(self.calls[name])]
        if body.get("stream"):
            return await sse_response(request, openai_stream([""], tool_calls=calls))
        return web.json_response(openai_completion("", tool_calls=calls))

    def release(self, *names: str) -> None:
        for name in names or self.held:
            self.held[name].set()

    async def arrived(self, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.arrivals) >= count)


@asynccontextmanager
async def gateway(factory: GatewayFactory, upstream: HeldUpstream, state: dict[str, Any],
                  caps: dict[str, int]) -> AsyncIterator[Harness]:
    async with serving(upstream.handle) as url:
        providers = {"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai"}}
        yield await factory(providers=providers, models={"gpt-*": "openai"}, state=state,
                            agents={"bot": {"caps": caps}})


def client(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


async def ask(sdk: openai.AsyncOpenAI, name: str, *, stream: bool = False) -> list[str]:
    """The tool call ids the agent received."""
    messages: Any = [{"role": "user", "content": name}]
    if not stream:
        answer = await sdk.chat.completions.create(model=GPT, messages=messages)
        return [c.id for c in answer.choices[0].message.tool_calls or []]
    ids: list[str] = []
    async with await sdk.chat.completions.create(model=GPT, messages=messages, stream=True) as chunks:
        async for chunk in chunks:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if delta.id:
                    ids.append(delta.id)
    return ids


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "memory":
        return {"backend": "memory"}
    server: RedisServer = request.getfixturevalue("redis_server")
    return {"backend": "redis", "url": server.url}


async def test_answers_in_flight_when_the_llm_call_cap_stops_the_run_are_delivered(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    upstream = HeldUpstream({"a": 1, "b": 2, "c": 1, "d": 1}, held={"a", "b", "c"})
    async with gateway(gateway_factory, upstream, state, {"llm_calls": 3}) as h, \
            client(h, f"par-llm-{state['backend']}") as sdk:
        in_flight = [asyncio.ensure_future(ask(sdk, "a")), asyncio.ensure_future(ask(sdk, "b")),
                     asyncio.ensure_future(ask(sdk, "c", stream=True))]
        await upstream.arrived(3)
        with pytest.raises(openai.PermissionDeniedError) as refused:  # the fourth: over the cap, the run stops
            await ask(sdk, "d")
        assert refused.value.code == "llm_call_cap"
        upstream.release()
        assert await asyncio.gather(*in_flight) == [["a0"], ["b0", "b1"], ["c0"]]  # all three, as admitted
        view = await h.settled(f"par-llm-{state['backend']}", steps=4)
        assert (view["status"], view["stop_reason"]) == ("stopped", "llm_call_cap")
        assert (view["llm_calls"], view["tool_calls"], view["reserved_usd"]) == (3, 4, 0)
        assert upstream.arrivals.count("d") == 0
        with pytest.raises(openai.PermissionDeniedError) as sticky:  # a new step after the stop: refused
            await ask(sdk, "a")
        assert sticky.value.code == "llm_call_cap"


async def test_an_answer_in_flight_that_breaches_the_tool_call_cap_is_still_withheld(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """`caps.tool_calls: 3`: `c` proposes 4 calls and stops the run; of the two in flight, `a` (1 call)
    answers first and fits, so it is delivered; `b` (3 more) would then breach the cap and is withheld
    with the run's reason."""
    upstream = HeldUpstream({"a": 1, "b": 3, "c": 4}, held={"a", "b"})
    run = f"par-tools-{state['backend']}"
    async with gateway(gateway_factory, upstream, state, {"tool_calls": 3}) as h, client(h, run) as sdk:
        a = asyncio.ensure_future(ask(sdk, "a", stream=True))
        b = asyncio.ensure_future(ask(sdk, "b"))
        await upstream.arrived(2)
        with pytest.raises(openai.PermissionDeniedError) as stopped:
            await ask(sdk, "c")
        assert stopped.value.code == "tool_call_cap"
        upstream.release("a")
        assert await a == ["a0"]
        upstream.release("b")
        with pytest.raises(openai.PermissionDeniedError) as withheld:
            await b
        assert withheld.value.code == "tool_call_cap"
        view = await h.settled(run, steps=3)
        assert (view["status"], view["stop_reason"], view["tool_calls"]) == ("stopped", "tool_call_cap", 1)
        assert view["reserved_usd"] == 0
