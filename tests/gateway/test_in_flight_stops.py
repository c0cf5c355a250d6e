"""A run stopped while some of its steps are in flight: the answers of steps admitted before the stop
are judged on the limits (as a serial order of the steps would judge them), not withheld for the stop.

A parallel agent (several model calls of one run at once) that hits `caps.llm_calls` with one call too
many used to lose every answer in flight: they had been admitted and paid for, and the agent got none.
Now each one that fits the limits is delivered; one that breaches a limit is still withheld, with the
run's own stop reason, and the caps hold exactly (`RunStore.apply(..., in_flight=True)`).

A step in flight while its run is reset counts in no run: neither the tool calls it proposes nor the
ones the provider ran itself (Responses `web_search_call` items) land in the fresh run.

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

from gateway.call import Answer
from guards.base import Decision, StepContext
from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import message_item, response_body
from tests.fakes.upstream import openai_completion, openai_stream, serving, sse_response, tool_call
from tests.redis_fixture import memory_or_redis, redis_server  # noqa: F401  (fixtures, by name)

GPT = "gpt-4o-mini"


class HeldUpstream:
    """Answers a chat completion whose user message is `name` with `calls[name]` tool calls (a Responses
    call: that many `web_search_call` items, which the provider ran itself); a name in `held` waits for
    `release(name)` first. `arrived` counts the requests in."""

    def __init__(self, calls: dict[str, int], held: set[str], *, same: bool = False,
                 again: dict[str, int] | None = None) -> None:
        self.calls = calls
        self.again = again or {}  # the calls of a name's later requests (a re-ask), when not `calls`
        self.same = same  # every call proposes search({"q": "same"}): a loop
        self.held = {name: asyncio.Event() for name in held}
        self.arrivals: list[str] = []
        self._changed = asyncio.Condition()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        name = body["messages"][-1]["content"] if "messages" in body else first_input(body["input"])
        async with self._changed:
            self.arrivals.append(name)
            self._changed.notify_all()
        if name in self.held:
            await self.held[name].wait()
        calls = [tool_call("search", orjson.dumps({"q": "same" if self.same else f"{name}{i}"}).decode(), f"{name}{i}")
                 for i in range(self.calls[name])]
        if "input" in body:
            count = self.again.get(name, self.calls[name]) if self.arrivals.count(name) > 1 else self.calls[name]
            answer = response_body("", usage=(10, 5))
            answer["output"] = [*({"id": f"ws_{name}{i}", "type": "web_search_call", "status": "completed",
                                   "action": {"type": "search", "query": name}} for i in range(count)),
                                message_item("searched")]
            return web.json_response(answer)
        if body.get("stream"):
            return await sse_response(request, openai_stream([""], tool_calls=calls))
        return web.json_response(openai_completion("", tool_calls=calls))

    def release(self, *names: str) -> None:
        for name in names or self.held:
            self.held[name].set()

    async def arrived(self, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.arrivals) >= count)


def first_input(given: str | list[Any]) -> str:
    """A Responses call's first user text (a re-ask sends it again, as an item, before its correction)."""
    if isinstance(given, str):
        return given
    content = next(item["content"] for item in given if item.get("role") == "user")
    return content if isinstance(content, str) else str(content[0]["text"])


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


@pytest.fixture
def state(memory_or_redis: dict[str, Any]) -> dict[str, Any]:  # noqa: F811  (the fixture, by name)
    return memory_or_redis


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


async def test_an_answer_in_flight_that_repeats_a_call_is_withheld_with_the_runs_own_reason(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """`loop: {window: 3, max_distinct: 1}` lets two `search({"q": "same"})` reach the agent. Three steps
    in flight each propose it; a fourth step stops the run (`caps.llm_calls: 3`). The third answer is the
    loop: withheld, with the reason the run is stopped with (it answered `loop_detected` before)."""
    upstream = HeldUpstream({"a": 1, "b": 1, "c": 1, "d": 1}, held={"a", "b", "c"}, same=True)
    run = f"par-loop-{state['backend']}"
    async with serving(upstream.handle) as url:
        h = await gateway_factory(
            providers={"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai"}},
            models={"gpt-*": "openai"}, state=state,
            agents={"bot": {"caps": {"llm_calls": 3}, "loop": {"window": 3, "max_distinct": 1}}})
        async with client(h, run) as sdk:
            steps = {name: asyncio.ensure_future(ask(sdk, name, stream=name == "b")) for name in "abc"}
            await upstream.arrived(3)
            with pytest.raises(openai.PermissionDeniedError) as stopped:
                await ask(sdk, "d")
            assert stopped.value.code == "llm_call_cap"
            for name in "ab":
                upstream.release(name)
                assert await steps[name] == [f"{name}0"]
            upstream.release("c")
            with pytest.raises(openai.PermissionDeniedError) as withheld:
                await steps["c"]
            assert withheld.value.code == "llm_call_cap"
            view = await h.settled(run, steps=4)
            assert (view["stop_reason"], view["tool_calls"], view["reserved_usd"]) == ("llm_call_cap", 2, 0)


async def test_calls_the_provider_ran_in_a_step_in_flight_across_a_reset_count_in_no_run(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """`caps.tool_calls: 4`. A Responses step admitted before the reset comes back with 3 web searches the
    provider ran; the fresh run has 2 tool calls by then. Counted there (5 > 4), they stopped the fresh
    run with `tool_call_cap`; the step counts in no run."""
    upstream = HeldUpstream({"old": 3, "new": 2}, held={"old"})
    run = f"reset-hosted-{state['backend']}"
    async with gateway(gateway_factory, upstream, state, {"tool_calls": 4}) as h, client(h, run) as sdk:
        old = asyncio.ensure_future(sdk.responses.create(model=GPT, input="old", tools=[{"type": "web_search"}]))
        await upstream.arrived(1)
        async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as reset:
            assert reset.status == 200
        assert await ask(sdk, "new") == ["new0", "new1"]
        upstream.release("old")
        assert (await old).output_text == "searched"  # its answer is delivered: it breaches nothing
        view = await h.settled(run, steps=1)
        assert (view["status"], view["tool_calls"], view["reserved_usd"]) == ("active", 2, 0)
        assert await ask(sdk, "new") == ["new0", "new1"]  # the fresh run goes on: 4 of its 4 tool calls


@pytest.mark.parametrize("retries", [0, 1])
async def test_calls_the_provider_ran_in_an_unjudged_step_across_a_reset_count_in_no_run(
    gateway_factory: GatewayFactory, state: dict[str, Any], retries: int
) -> None:
    """As above, for a step that ends before its answer is judged (still not matching the output grammar
    after its re-asks), whose calls the provider ran are counted at its end: the 3 searches of the attempt
    before the reset count in no run, the 1 of a re-ask (admitted in the fresh run) counts there."""
    upstream = HeldUpstream({"old": 3, "new": 2}, held={"old"}, again={"old": 1})
    run = f"reset-unjudged-{retries}-{state['backend']}"
    async with serving(upstream.handle) as url:
        h = await gateway_factory(
            providers={"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai"}},
            models={"gpt-*": "openai"}, state=state,
            agents={"bot": {"caps": {"tool_calls": 4}, "output": {"grammar": "regex:[0-9]+", "retries": retries}}})
        async with client(h, run) as sdk:
            old = asyncio.ensure_future(sdk.responses.create(model=GPT, input="old", tools=[{"type": "web_search"}]))
            await upstream.arrived(1)
            async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as reset:
                assert reset.status == 200
            async with h.session.post(f"{h.url}/v1/chat/completions", headers={"x-tollgate-run-id": run},
                                      json={"model": GPT, "messages": [{"role": "user", "content": "new"}],
                                            "tools": [{"type": "function", "function": {"name": "search"}}]}) as r:
                assert r.status == 200  # a tool-call answer is not held to the grammar
            upstream.release("old")
            with pytest.raises(openai.APIStatusError):  # nonconforming after its re-asks
                await old
            assert upstream.arrivals.count("old") == 1 + retries
            view = await h.settled(run, steps=1)
            assert (view["status"], view["stop_reason"], view["tool_calls"], view["reserved_usd"]) == (
                "active", None, 2 + retries, 0)


class RejectSearched:
    """A custom guard: an answer whose text says "searched" is refused (a reject: the run goes on)."""

    name = "reject_searched"

    def before(self, ctx: StepContext) -> Decision:
        return Decision.allow(self.name)

    def after(self, ctx: StepContext, answer: Answer) -> Decision:
        if "searched" in answer.text:
            return Decision.reject(self.name, "forbidden_text", "the answer says a forbidden word")
        return Decision.allow(self.name)


async def test_a_guards_reject_still_withholds_an_answer_in_flight_across_a_reset(
    gateway_factory: GatewayFactory,
) -> None:
    """What a reset leaves out is what the answer would change in the run (counts, a stop); the answer is
    still judged, and a guard's reject withholds it."""
    upstream = HeldUpstream({"old": 1}, held={"old"})
    run = "reset-reject"
    async with serving(upstream.handle) as url:
        h = await gateway_factory(
            providers={"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai"}},
            models={"gpt-*": "openai"},
            agents={"bot": {"guards": [{"use": f"{__name__}:RejectSearched"}]}})
        async with client(h, run) as sdk:
            old = asyncio.ensure_future(sdk.responses.create(model=GPT, input="old", tools=[{"type": "web_search"}]))
            await upstream.arrived(1)
            async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as reset:
                assert reset.status == 200
            upstream.release("old")
            with pytest.raises(openai.BadRequestError) as refused:
                await old
            assert "forbidden word" in str(refused.value)
