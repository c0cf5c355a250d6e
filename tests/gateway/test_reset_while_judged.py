"""A reset that lands between a guard's judgement and its write (README: "a step in flight while its run
is reset does not stop the fresh run, and counts in no run"). The judgement reads the run, then the stop
or the effects are written: the store checks, atomically with the write, that the epoch judged is still
the run's. Without that check a reset landing in between had the fresh run stopped, or counted, by the
run it ended.

`ResetFirst` wraps the gateway's store and resets the run right before the chosen write reaches it: the
race made deterministic, on every backend (no sleeps)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from gateway.pipeline import RESET_RETRIES
from gateway.store.base import RunStore
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, openai_completion, openai_stream, tool_call
from tests.redis_fixture import redis_server  # noqa: F401  (fixture, by name)

GPT = "gpt-4o-mini"
MSG = [{"role": "user", "content": "hello"}]


class ResetFirst:
    """The store, but the next `times` calls of `operation` (`stop` or `apply`) first reset their run."""

    def __init__(self, inner: RunStore, operation: str, times: int = 1) -> None:
        self._inner, self._operation, self._times, self.resets = inner, operation, times, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if name != self._operation or self.resets >= self._times:
            return method

        async def reset_then(run_id: str, *args: Any, **kwargs: Any) -> Any:
            self.resets += 1
            assert await self._inner.reset(run_id, time.time()) is not None
            return await method(run_id, *args, **kwargs)

        return reset_then


def state_config(backend: str, request: pytest.FixtureRequest, tmp: Any) -> dict[str, Any]:
    if backend == "redis":
        return {"backend": "redis", "url": request.getfixturevalue("redis_server").url}
    return {"backend": backend, "path": str(tmp / "state.db")} if backend == "sqlite" else {"backend": "memory"}


async def post(h: Harness, body: dict[str, Any], run: str) -> tuple[int, str | None, dict[str, Any]]:
    hdrs = {"x-tollgate-run-id": run, "x-tollgate-agent": "bot", "content-type": "application/json"}
    async with h.session.post(h.url + "/v1/chat/completions", data=orjson.dumps(body), headers=hdrs) as resp:
        return resp.status, resp.headers.get("x-tollgate-stop-reason"), orjson.loads(await resp.read())


def wrap(h: Harness, operation: str, times: int = 1) -> ResetFirst:
    store = h.gateway.store = ResetFirst(h.gateway.store, operation, times)  # type: ignore[assignment]
    return store


@pytest.fixture(params=["memory", "sqlite", "redis"])
def state(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    return state_config(request.param, request, tmp_path)


async def test_a_stop_judged_before_a_reset_is_judged_again_on_the_fresh_run(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """`stall_steps: 1`: the same request twice is a step without progress, stopped before it goes
    upstream. The run is reset between that judgement and the stop: the step is judged again on the fresh
    run, where it is the first request, and goes on; the fresh run is not stopped."""
    h = await gateway_factory(agents={"bot": {"loop": {"stall_steps": 1}}}, state=state)
    body = {"model": GPT, "messages": MSG}
    assert (await post(h, body, "again"))[0] == 200
    store = wrap(h, "stop")
    status, reason, answer = await post(h, body, "again")
    assert store.resets == 1
    assert (status, reason) == (200, None), answer
    view = await h.settled("again")
    assert (view["status"], view["stop_reason"], view["llm_calls"]) == ("active", None, 1)
    assert (await post(h, body, "again"))[:2] == (403, "no_progress")  # judged on the fresh run's history


async def test_a_step_whose_every_judgement_a_reset_interrupts_is_refused_503(gateway_factory: GatewayFactory) -> None:
    """Judged again after each reset, at most `RESET_RETRIES` times: then 503 `state_unavailable` (the
    SDKs retry it), nothing reserved, nothing sent upstream, the run not stopped."""
    h = await gateway_factory(agents={"bot": {"loop": {"stall_steps": 1}}})  # its effects: a history push
    assert (await post(h, {"model": GPT, "messages": MSG}, "storm"))[0] == 200
    store = wrap(h, "apply", times=RESET_RETRIES)
    status, _, answer = await post(h, {"model": GPT, "messages": [*MSG, *MSG]}, "storm")
    assert store.resets == RESET_RETRIES
    assert (status, answer["error"]["code"]) == (503, "state_unavailable"), answer
    view = await h.run("storm")
    assert (view["status"], view["reserved_usd"], view["llm_calls"], len(h.fake.seen)) == ("active", 0, 0, 1)


async def test_an_answer_judged_before_a_reset_stops_nothing_and_counts_in_no_run(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """`loop: {window: 2, max_distinct: 1}`: the second `search` call in a row is a loop. The run is reset
    between the answer's judgement and the stop: the answer is delivered (it was admitted before the reset,
    as a step in flight is), and the fresh run is neither stopped nor counted."""
    h = await gateway_factory(agents={"bot": {"loop": {"window": 2, "max_distinct": 1}}}, state=state)
    calls = Reply(body=openai_completion(tool_calls=[tool_call("search", '{"q": "x"}')]))
    h.fake.queue(calls, calls)
    assert (await post(h, {"model": GPT, "messages": MSG}, "loop"))[0] == 200
    store = wrap(h, "stop")
    status, reason, answer = await post(h, {"model": GPT, "messages": [*MSG, {"role": "user", "content": "on"}]},
                                        "loop")
    assert store.resets == 1
    assert (status, reason) == (200, None), answer
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "search"
    view = await h.run("loop")
    assert (view["status"], view["stop_reason"], view["tool_calls"]) == ("active", None, 0)


async def test_effects_judged_before_a_reset_are_not_counted_in_the_fresh_run(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """`caps.tool_calls: 1`: an answer's tool call counts once its answer is judged. The run is reset
    between that judgement and the count: the answer is delivered and the fresh run counts none of it, so
    its own first tool call is still allowed."""
    h = await gateway_factory(agents={"bot": {"caps": {"tool_calls": 1}}}, state=state)
    h.fake.default = Reply(body=openai_completion(tool_calls=[tool_call("search", '{"q": "x"}')]))
    store = wrap(h, "apply")
    status, _, answer = await post(h, {"model": GPT, "messages": MSG}, "count")
    assert store.resets == 1
    assert status == 200, answer
    view = await h.run("count")
    assert (view["status"], view["tool_calls"]) == ("active", 0)
    assert (await post(h, {"model": GPT, "messages": MSG}, "count"))[0] == 200  # the fresh run's own call
    view = await h.run("count")
    assert (view["status"], view["tool_calls"]) == ("active", 1)


async def test_a_step_judged_again_after_a_reset_sends_the_fresh_run_s_output_limit(
    gateway_factory: GatewayFactory, state: dict[str, Any]
) -> None:
    """The first judgement clamped `max_tokens` to what the old run's token budget had left; the reset
    landed before its effects. Judged again, the fresh run pays the agent's own 600: the upstream gets
    600, not the old run's clamp, and no `x-tollgate-max-tokens` says otherwise."""
    h = await gateway_factory(agents={"bot": {"budget": {"tokens": 3000}, "loop": {"stall_steps": 5}}}, state=state)
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=2000, completion_tokens=500)))
    assert (await post(h, {"model": GPT, "messages": MSG, "max_tokens": 600}, "limit"))[0] == 200
    h.fake.queue(Reply(chunks=openai_stream(["hi"], usage=(10, 5))))  # a stream: its body is written anew
    store = wrap(h, "apply")
    hdrs = {"x-tollgate-run-id": "limit", "x-tollgate-agent": "bot"}
    body = {"model": GPT, "messages": [*MSG, *MSG], "max_tokens": 600, "stream": True}
    async with h.session.post(h.url + "/v1/chat/completions", json=body, headers=hdrs) as resp:
        assert resp.status == 200, await resp.text()
        assert "x-tollgate-max-tokens" not in resp.headers
        await resp.read()
    assert store.resets == 1
    assert orjson.loads(h.fake.seen[-1].body)["max_tokens"] == 600
