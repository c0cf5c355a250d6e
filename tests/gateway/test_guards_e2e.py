"""Run guards through a running gateway with the official SDKs and raw concurrent clients."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from guards.budget import IMAGE_TOKENS
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import (
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)

PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
           "claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
MSG = [{"role": "user", "content": "hello"}]


def agent(**policy: Any) -> dict[str, Any]:
    return {"bot": policy}


def state(backend: str, name: str) -> dict[str, str]:
    """A run store: memory, or an SQLite file `name`.db in the test's directory (concurrent steps of one
    run share its reservation writes, gateway/store/sqlite.py)."""
    return {"backend": "memory"} if backend == "memory" else {"backend": "sqlite", "path": f"{name}.db"}


async def post(h: Harness, body: dict[str, Any], run: str, path: str = "/v1/chat/completions",
               agent_name: str = "bot") -> tuple[int, dict[str, str], bytes]:
    headers = {"x-tollgate-run-id": run, "x-tollgate-agent": agent_name, "content-type": "application/json"}
    async with h.session.post(h.url + path, data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_usd_budget_stops_exactly_at_the_crossing_step(gateway_factory: GatewayFactory) -> None:
    budget = 0.001
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": budget}))
    h.fake.default = Reply(body=openai_completion(prompt_tokens=10, completion_tokens=5))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "r1"}) as client:
        ok = 0
        with pytest.raises(openai.PermissionDeniedError) as info:
            for _ in range(200):
                await client.chat.completions.create(model="gpt-4o-mini", messages=MSG, max_tokens=50)
                ok += 1
    assert info.value.body["code"] == "budget_exhausted"  # type: ignore[index]
    assert info.value.response.headers["x-tollgate-stop-reason"] == "budget_exhausted"
    assert len(h.fake.seen) == ok  # the crossing request never reached the upstream
    size = len(h.fake.seen[0].body)
    step_cost = (10 * 1.0 + 5 * 2.0) / 1e6
    smallest = (size * 1.0 + 16 * 2.0) / 1e6  # worst case at the minimal output (16 tokens)
    # exactly: every granted step fitted its worst case (max_tokens clamped near the end),
    # the refused one could not fit even a minimal call
    assert ok * step_cost + smallest > budget >= (ok - 1) * step_cost + smallest
    run = await h.run("r1")
    assert run["status"] == "stopped" and run["stop_reason"] == "budget_exhausted"
    assert run["spent_usd"] == pytest.approx(ok * step_cost)
    assert run["spent_usd"] <= budget and run["reserved_usd"] == 0
    # sticky until reset
    status, headers, _ = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 1}, "r1")
    assert status == 403 and headers["x-tollgate-stop-reason"] == "budget_exhausted"
    async with h.session.post(f"{h.admin_url}/admin/runs/r1/reset") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "active"
    status, _, _ = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 5}, "r1")
    assert status == 200


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_concurrent_budget_never_overspends(gateway_factory: GatewayFactory, backend: str) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"tokens": 1}), state=state(backend, "h"))
    body = {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 20}
    per_call = len(orjson.dumps(body)) + 20
    h2 = await gateway_factory(pricing=PRICING, agents=agent(budget={"tokens": per_call * 10}),
                               state=state(backend, "h2"))
    h2.fake.default = Reply(body=openai_completion(prompt_tokens=per_call - 20, completion_tokens=20), delay=0.05)
    results = await asyncio.gather(*(post(h2, body, "conc") for _ in range(200)))
    assert h is not None
    statuses = [s for s, _, _ in results]
    assert statuses.count(200) <= 10
    assert len(h2.fake.seen) == statuses.count(200)
    assert set(statuses) <= {200, 403}
    run = await h2.run("conc")
    assert run["input_tokens"] + run["output_tokens"] <= per_call * 10
    assert run["reserved_tokens"] == 0


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_concurrent_llm_call_cap(gateway_factory: GatewayFactory, backend: str) -> None:
    h = await gateway_factory(agents=agent(caps={"llm_calls": 10}), state=state(backend, "cap"))
    h.fake.default = Reply(body=openai_completion(), delay=0.02)
    results = await asyncio.gather(
        *(post(h, {"model": "gpt-4o-mini", "messages": MSG}, "cap") for _ in range(200))
    )
    statuses = [s for s, _, _ in results]
    assert statuses.count(200) == 10 and len(h.fake.seen) == 10
    codes = {orjson.loads(b)["error"]["code"] for s, _, b in results if s == 403}
    assert codes == {"llm_call_cap"}
    assert (await h.run("cap"))["llm_calls"] == 10


async def test_concurrent_steps_of_one_run_hold_the_cap_on_file_through_the_sdk(
    gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    """Official SDK, SQLite store: overlapping steps of one run reserve in shared writes; the cap holds,
    every refusal is the SDK's 403, and the file ends with the 10 calls settled and nothing open."""
    h = await gateway_factory(agents=agent(caps={"llm_calls": 10}), state=state("sqlite", "sdk"))
    h.fake.default = Reply(body=openai_completion(), delay=0.02)
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "sdk"}) as client:
        calls = [client.chat.completions.create(model="gpt-4o-mini", messages=MSG)  # type: ignore[arg-type]
                 for _ in range(40)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    answered = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(answered) == 10 and len(h.fake.seen) == 10
    assert all(isinstance(r, openai.PermissionDeniedError) and r.code == "llm_call_cap" for r in refused)
    run = await h.run("sdk")  # reading the run writes what was still buffered
    assert run["llm_calls"] == 10
    with closing(sqlite3.connect(tmp_path / "sdk.db")) as conn:
        [(blob,)] = conn.execute("SELECT state FROM runs WHERE run_id = 'sdk'").fetchall()
    on_file = orjson.loads(blob)
    assert on_file["open"] == {} and on_file["used"]["llm_calls"] == 10


async def test_max_tokens_clamped_and_reported(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.01}))
    status, headers, _ = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 10_000_000}, "clamp")
    assert status == 200
    granted = int(headers["x-tollgate-max-tokens"])
    assert granted < 10_000_000
    assert h.fake.seen[-1].json["max_tokens"] == granted
    status, headers, _ = await post(h, {"model": "gpt-4o-mini", "messages": MSG}, "clamp2")
    assert status == 200 and "x-tollgate-max-tokens" in headers
    assert h.fake.seen[-1].json["max_completion_tokens"] == int(headers["x-tollgate-max-tokens"])


async def test_unknown_price_with_usd_budget_is_clear(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(models={"mystery-*": "openai"}, agents=agent(budget={"usd": 1.0}))
    status, _, body = await post(h, {"model": "mystery-model", "messages": MSG}, "price")
    assert status == 400  # a request/config error, not a stop: the run is not stopped
    assert "no known price" in orjson.loads(body)["error"]["message"]
    assert h.fake.seen == []
    run = await h.run("price")
    assert run["status"] == "active" and run["reserved_usd"] == 0


@pytest.mark.parametrize("usage", [None, (10, 5)])
async def test_stream_missing_usage_or_cut_settles_above_zero(gateway_factory: GatewayFactory,
                                                              usage: tuple[int, int] | None) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    chunks = openai_stream(["x" * 40] * 5, usage=usage)
    reply = Reply(chunks=chunks) if usage is None else Reply(chunks=chunks, cut_after=3)
    h.fake.queue(reply)
    status, _, _ = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True, "max_tokens": 100}, "s")
    assert status == 200
    run = await h.run("s")
    assert run["spent_usd"] > 0
    assert run["output_tokens"] >= 100  # settled at the reservation: never below what was relayed
    assert run["reserved_usd"] == 0


async def test_anthropic_stream_settles_to_reported_usage(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    h.fake.queue(Reply(chunks=anthropic_stream(["hi"], usage=(12, 7))))
    status, _, _ = await post(h, {"model": "claude-3-5-haiku-latest", "max_tokens": 64, "messages": MSG,
                                  "stream": True}, "as", path="/v1/messages")
    assert status == 200
    run = await h.run("as")
    assert (run["input_tokens"], run["output_tokens"]) == (12, 7)
    assert run["spent_usd"] == pytest.approx((12 * 1.0 + 7 * 2.0) / 1e6)


async def test_loop_detection_withholds_the_repeat(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agent(loop={"window": 4, "max_distinct": 1}))
    h.fake.default = Reply(body=openai_completion("", tool_calls=[tool_call("search", '{"q": "same"}')]))
    messages: list[dict[str, Any]] = list(MSG)
    statuses = []
    for i in range(5):
        status, headers, body = await post(h, {"model": "gpt-4o-mini", "messages": messages}, "loop")
        statuses.append(status)
        if status != 200:
            assert headers["x-tollgate-stop-reason"] == "loop_detected"
            break
        messages = messages + [{"role": "assistant", "content": None, "tool_calls": [tool_call("search", '{"q":"same"}', f"c{i}")]},
                               {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"}]
    assert statuses == [200, 200, 200, 403]
    run = await h.run("loop")
    assert run["tool_calls"] == 3  # the withheld repeat did not count as returned


async def test_no_progress_on_same_results(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agent(loop={"window": 10, "max_distinct": 1, "stall_steps": 2}))
    messages: list[dict[str, Any]] = list(MSG)
    statuses = []
    for i in range(6):
        h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("lookup", f'{{"id": {i}}}', f"c{i}")])))
        status, headers, _ = await post(h, {"model": "gpt-4o-mini", "messages": messages}, "np")
        statuses.append(status)
        if status != 200:
            assert headers["x-tollgate-stop-reason"] == "no_progress"
            break
        messages = messages + [{"role": "assistant", "content": None, "tool_calls": [tool_call("lookup", f'{{"id": {i}}}', f"c{i}")]},
                               {"role": "tool", "tool_call_id": f"c{i}", "content": "nothing found"}]
    # step 1: new request; step 2: first result (new); steps 3 and 4 bring the same result again
    assert statuses == [200, 200, 200, 403]
    run = await h.run("np")  # the stopped step counts no call and holds nothing
    assert (run["llm_calls"], run["reserved_tokens"], run["reserved_usd"]) == (3, 0, 0)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@pytest.mark.parametrize(
    "usage",
    [{"prompt_tokens": 1, "completion_tokens": 1e300}, {"prompt_tokens": 10**30, "completion_tokens": 1},
     {"prompt_tokens": -100000, "completion_tokens": -5}],
)
async def test_usage_no_provider_reports_is_settled_at_the_reservation(
        gateway_factory: GatewayFactory, backend: str, usage: dict[str, Any]) -> None:
    """Huge or negative counts are not believed: the agent gets its answer, the run is charged the
    whole reservation (never credited), and the run state stays readable."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}), state=state(backend, "u"))
    h.fake.queue(Reply(body=json.dumps({**openai_completion("fine"), "usage": usage}).encode()))  # any int size
    status, _, raw = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 50}, "u")
    assert status == 200 and orjson.loads(raw)["choices"][0]["message"]["content"] == "fine"
    run = await h.run("u")
    input_bound = len(orjson.dumps({"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 50}))
    assert run["spent_usd"] == pytest.approx((input_bound * 1.0 + 50 * 2.0) / 1e6)
    assert (run["input_tokens"], run["output_tokens"], run["reserved_usd"]) == (input_bound, 50, 0)
    async with h.session.get(f"{h.admin_url}/admin/runs") as resp:
        assert resp.status == 200


async def test_a_budget_held_by_a_step_in_flight_refuses_without_stopping(gateway_factory: GatewayFactory) -> None:
    """No max_tokens: the first step reserves all the budget can pay for. A concurrent second step is
    refused (403 budget_exhausted, saying it is held), but the run is not stopped: the first settles at
    its real usage, and the next step goes through."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.01}))
    h.fake.default = Reply(body=openai_completion(prompt_tokens=10, completion_tokens=5), delay=0.3)
    body = {"model": "gpt-4o-mini", "messages": MSG}
    first, second = await asyncio.gather(post(h, body, "held"), post(h, body, "held"))
    statuses = sorted([first[0], second[0]])
    assert statuses == [200, 403]
    refused = orjson.loads((first if first[0] == 403 else second)[2])["error"]
    assert refused["code"] == "budget_exhausted" and "held by 1 step(s) in flight" in refused["message"]
    run = await h.run("held")
    assert (run["status"], run["reserved_usd"]) == ("active", 0)
    assert (await post(h, body, "held"))[0] == 200
    assert len(h.fake.seen) == 2


async def test_a_held_refusal_is_not_a_step_and_never_a_final_message(gateway_factory: GatewayFactory) -> None:
    """Refused while the budget is held: the guards' effects are not applied (retrying as told cannot
    trip no_progress), and with `on_stop: message` it is still a 403, since nothing stopped."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.01}, loop={"stall_steps": 2},
                                                            on_stop="message"))
    body = {"model": "gpt-4o-mini", "messages": MSG}
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=10, completion_tokens=5), delay=0.4))
    slow = asyncio.create_task(post(h, body, "hr"))
    await asyncio.wait_for(h.fake.wait_seen(1), 10)
    for _ in range(2):
        status, headers, raw = await post(h, body, "hr")
        assert status == 403 and "x-tollgate-stop-reason" not in headers
        assert orjson.loads(raw)["error"]["code"] == "budget_exhausted"
    assert (await slow)[0] == 200
    status, _, _ = await post(h, body, "hr")
    assert status == 200
    assert (await h.run("hr"))["status"] == "active"


async def test_both_output_limit_fields_are_reserved_and_clamped(gateway_factory: GatewayFactory) -> None:
    """`max_tokens` and `max_completion_tokens` together: the larger is reserved, and both are held to
    the grant (an upstream that honours only `max_tokens` cannot run past the budget); the one the
    agent set lower stays as it was."""
    h = await gateway_factory(agents=agent(budget={"tokens": 3000}))
    body = {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 1_000_000, "max_completion_tokens": 10}
    status, headers, _ = await post(h, body, "both")
    assert status == 200
    granted = 3000 - len(orjson.dumps(body))
    assert int(headers["x-tollgate-max-tokens"]) == granted
    sent = h.fake.seen[-1].json
    assert (sent["max_tokens"], sent["max_completion_tokens"]) == (granted, 10)


@pytest.mark.parametrize("n", [1, 4])
async def test_n_choices_share_the_token_budget(gateway_factory: GatewayFactory, n: int) -> None:
    """OpenAI bills every choice: with `n` choices, the output limit written upstream is what the
    budget pays for `n` times over."""
    h = await gateway_factory(agents=agent(budget={"tokens": 3000}))
    body = {"model": "gpt-4o-mini", "messages": MSG, "n": n}
    status, headers, _ = await post(h, body, f"n{n}")
    assert status == 200
    granted = int(headers["x-tollgate-max-tokens"])
    sent = h.fake.seen[-1].json
    assert granted == (3000 - len(orjson.dumps(body))) // n  # the input bound is the agent's body size
    assert sent["n"] == n and granted in (sent.get("max_completion_tokens"), sent.get("max_tokens"))


@pytest.mark.parametrize(
    ("path", "body"),
    [(p, {"model": "gpt-4o-mini", "messages": MSG})
     for p in ("/v1/chat/completions/", "/v1//chat/completions", "/v1/chat/completions%2F",
               "/v1/chat%2Fcompletions", "/v1/Chat/Completions", "/v1/chat/completions;", "/v1/chat/completions%20",
               "/v1/chat/completions%00")]
    + [(p, {"model": "claude-3-5-haiku-latest", "max_tokens": 8, "messages": MSG})
       for p in ("/v1/messages/", "/v1//messages", "/v1/messages%2F")],
)
async def test_spellings_of_a_guarded_path_are_guarded(gateway_factory: GatewayFactory, path: str,
                                                       body: dict[str, Any]) -> None:
    """A doubled, trailing or encoded slash is the same model call (upstreams often normalise paths):
    the stopped run stays stopped, and nothing more reaches the upstream."""
    h = await gateway_factory(agents=agent(caps={"llm_calls": 1}))
    assert (await post(h, body, "pv", path=path))[0] == 200  # the variant is a counted model call
    status, headers, _ = await post(h, body, "pv", path="/v1/chat/completions" if "gpt" in body["model"]
                                      else "/v1/messages")
    assert status == 403 and headers["x-tollgate-stop-reason"] == "llm_call_cap"
    assert (await post(h, body, "pv", path=path))[0] == 403
    assert len(h.fake.seen) == 1


async def test_a_stopped_run_reaches_no_upstream_path(gateway_factory: GatewayFactory) -> None:
    """Other /v1 paths pass through, but not for a stopped run; and a guarded path takes POST (or GET)."""
    h = await gateway_factory(agents=agent(caps={"llm_calls": 1}))
    body = {"model": "gpt-4o-mini", "input": "hi"}
    assert (await post(h, body, "ps", path="/v1/embeddings"))[0] == 200  # passes through while active
    for method in ("PUT", "PATCH"):
        async with h.session.request(method, f"{h.url}/v1/chat/completions", json=body,
                                     headers={"x-tollgate-run-id": "ps", "x-tollgate-agent": "bot"}) as resp:
            assert resp.status == 400
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, "ps"))[0] == 200
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, "ps"))[0] == 403  # the cap stops it
    seen = len(h.fake.seen)
    status, headers, raw = await post(h, body, "ps", path="/v1/embeddings")
    assert status == 403 and headers["x-tollgate-stop-reason"] == "llm_call_cap"
    assert orjson.loads(raw)["error"]["code"] == "llm_call_cap"
    assert len(h.fake.seen) == seen


async def test_on_stop_message_answers_200(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agent(caps={"llm_calls": 1}, on_stop="message"))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "m"}) as client:
        await client.chat.completions.create(model="gpt-4o-mini", messages=MSG)
        raw = await client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=MSG)
        assert raw.headers["x-tollgate-stop-reason"] == "llm_call_cap"
        message = raw.parse().choices[0]
        assert message.finish_reason == "stop" and "llm_call_cap" in (message.message.content or "")
        stream = await client.chat.completions.create(model="gpt-4o-mini", messages=MSG, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert "llm_call_cap" in text
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "m"}) as ac:
        msg = await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG)
        assert "llm_call_cap" in msg.content[0].text  # type: ignore[union-attr]


async def test_anthropic_stream_stop_after_a_held_tool_use_is_readable_by_the_sdk_stream_helper(
        gateway_factory: GatewayFactory) -> None:
    """Text block 0 reaches the agent, the tool_use block is held, the loop guard stops: the stop's
    message continues at block 1, which `client.messages.stream()` accumulates without an IndexError."""
    h = await gateway_factory(agents=agent(loop={"window": 2, "max_distinct": 1}, on_stop="message"))
    uses = [{"id": "toolu_1", "name": "search", "input": {"q": 1}}]
    h.fake.queue(Reply(chunks=anthropic_stream(["thinking"], tool_uses=uses)),
                 Reply(chunks=anthropic_stream(["again"], tool_uses=uses)))
    headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "hs"}
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0, default_headers=headers) as ac:
        async with ac.messages.stream(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG) as stream:
            first = await stream.get_final_message()
        assert [b.type for b in first.content] == ["text", "tool_use"]
        async with ac.messages.stream(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG) as stream:
            final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "text"]  # the held tool_use never reached the agent
    assert final.content[0].text == "again"  # type: ignore[union-attr]
    assert "loop_detected" in final.content[1].text  # type: ignore[union-attr]


async def test_anthropic_stop_raises_permission_error(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agent(caps={"llm_calls": 1}))
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "a"}) as ac:
        h.fake.queue(Reply(body=anthropic_message()))
        await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG)
        with pytest.raises(anthropic.PermissionDeniedError) as info:
            await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG)
    assert info.value.body["error"]["code"] == "llm_call_cap"  # type: ignore[index]


async def test_stream_loop_stop_after_text_ends_with_error_event(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents=agent(loop={"window": 2, "max_distinct": 1}))
    calls = [tool_call("search", '{"q":1}', "a")]
    h.fake.queue(Reply(chunks=openai_stream(["thinking"], tool_calls=calls)),
                 Reply(chunks=openai_stream(["again"], tool_calls=calls)))
    await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, "sl")
    status, _, body = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, "sl")
    assert status == 200
    assert b"again" in body and b'"search"' not in body  # the held tool call never reached the agent
    assert b'"loop_detected"' in body


async def test_admin_runs_and_cli_table(gateway_factory: GatewayFactory) -> None:
    from gateway.cli import format_runs

    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    await post(h, {"model": "gpt-4o-mini", "messages": MSG}, "t1")
    async with h.session.get(f"{h.admin_url}/admin/runs") as resp:
        runs = (await resp.json())["runs"]
    assert [r["run_id"] for r in runs] == ["t1"]
    assert runs[0]["steps"][0]["status"] == 200
    table = format_runs(runs)
    assert table.splitlines()[0].split()[:3] == ["RUN", "ID", "AGENT"] and "t1" in table


@pytest.mark.parametrize("mode", ["fail_closed", "fail_open"])
async def test_state_store_down_fails_closed_unless_configured(gateway_factory: GatewayFactory, mode: str) -> None:
    from gateway.errors import StateUnavailable

    h = await gateway_factory(agents=agent(budget={"tokens": 10_000}, state_failure=mode))

    async def down(*args: Any, **kwargs: Any) -> Any:
        raise StateUnavailable("state store error: connection refused")

    store = h.gateway.store
    for name in ("get", "reserve", "settle", "apply", "record_step"):
        setattr(store, name, down)
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers={"x-tollgate-agent": "bot"}) as ac:
        if mode == "fail_closed":
            with pytest.raises(anthropic.APIStatusError) as info:
                await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG)
            assert info.value.status_code == 503
            assert info.value.body["error"]["code"] == "state_unavailable"  # type: ignore[index]
            assert h.fake.seen == []
        else:
            msg = await ac.messages.create(model="claude-3-5-haiku-latest", max_tokens=10, messages=MSG)
            assert msg.content[0].text == "Hello!"  # type: ignore[union-attr]


async def test_tollgate_runs_prints_the_table(gateway_factory: GatewayFactory) -> None:
    import sys

    h = await gateway_factory(agents=agent(caps={"llm_calls": 1}))
    await post(h, {"model": "gpt-4o-mini", "messages": MSG}, "cli-run")
    await post(h, {"model": "gpt-4o-mini", "messages": MSG}, "cli-run")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "runs", "--admin", h.admin_url,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    header, row = out.decode().splitlines()
    assert header.split() == ["RUN", "ID", "AGENT", "STATUS", "STOP", "REASON", "SPENT", "USD", "TOKENS", "LLM",
                              "CALLS", "TOOL", "CALLS"]
    assert row.split()[:4] == ["cli-run", "bot", "stopped", "llm_call_cap"]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "runs", "--admin",
                                                "http://127.0.0.1:9", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 1 and b"cannot read" in err


async def test_images_are_reserved_by_their_own_bound(gateway_factory: GatewayFactory) -> None:
    """A URL is a few bytes, an image ~1-2k tokens: each image part is reserved apart, so the output
    the budget still pays for is what is left after them."""
    h = await gateway_factory(agents=agent(budget={"tokens": 20_000}))
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": [image, image]}]}
    status, headers, _ = await post(h, body, "img")
    assert status == 200
    sent = h.fake.seen[-1].json
    granted = sent.get("max_completion_tokens") or sent["max_tokens"]
    assert granted == int(headers["x-tollgate-max-tokens"]) < 20_000 - 2 * IMAGE_TOKENS
    status, _, _ = await post(h, {**body, "messages": [{"role": "user", "content": [image] * 3}]}, "img2")
    assert status == 403  # three images alone are more than the whole budget
    status, _, _ = await post(h, {**body, "model": "gpt-4o-mini", "messages": [{"role": "user", "content": [image]}]},
                              "img3")
    assert status == 403  # one image on gpt-4o-mini can bill 48,169 tokens


async def test_documents_named_not_sent_are_400_under_a_budget(gateway_factory: GatewayFactory) -> None:
    """A file id or URL stands for a document of any size: with a budget it is refused, not unbounded."""
    h = await gateway_factory(agents={"default": {"budget": {"tokens": 100_000}}})
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": [
                {"type": "file", "file": {"file_id": "file-abc"}}]}])  # type: ignore[list-item]
    assert caught.value.code == "invalid_request" and "document" in caught.value.message
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0) as aclient:
        with pytest.raises(anthropic.BadRequestError):
            await aclient.messages.create(model="claude-3-5-haiku-latest", max_tokens=16, messages=[
                {"role": "user", "content": [{"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}]}])  # type: ignore[list-item]
    assert h.fake.seen == []


class NoBackoffOpenAI(openai.AsyncOpenAI):
    """The SDK's own retries, without its waits between them."""

    def _calculate_retry_timeout(self, *args: Any, **kwargs: Any) -> float:
        return 0.0


class NoBackoffAnthropic(anthropic.AsyncAnthropic):
    def _calculate_retry_timeout(self, *args: Any, **kwargs: Any) -> float:
        return 0.0


SERVER_ERROR = {"error": {"message": "The server had an error", "type": "server_error", "param": None, "code": None}}
OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_the_sdks_own_retries_of_provider_errors_stop_nothing(gateway_factory: GatewayFactory, wire: str) -> None:
    """A provider 5xx (Anthropic's 529 overload) is retried by the agent's SDK with the same bytes: the
    retry is that step again, not a step without progress, and an error answer is no model call. Two
    errors in a row used to stop a healthy run with `no_progress` (stall_steps 2), and each counted
    toward `caps.llm_calls` (a cap of 3 was spent by one answer and its retries)."""
    h = await gateway_factory(agents=agent(loop={"stall_steps": 2}, caps={"llm_calls": 3}))
    run = {"x-tollgate-run-id": f"retried-{wire}", "x-tollgate-agent": "bot"}
    if wire == "openai":
        h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("search", '{"q": "a"}', "c1")])),
                     Reply(status=500, body=SERVER_ERROR), Reply(status=500, body=SERVER_ERROR),
                     Reply(body=openai_completion("found it")))
        client = NoBackoffOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=2, default_headers=run)
        tools: list[Any] = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
        messages: list[Any] = [{"role": "user", "content": "find a"}]
        async with client:
            first = await client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools)
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": "c1", "content": "result a"}]
            second = await client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools)
        assert second.choices[0].message.content == "found it"
    else:
        h.fake.queue(Reply(body=anthropic_message("", tool_uses=[{"id": "t1", "name": "search", "input": {"q": "a"}}])),
                     Reply(status=529, body=OVERLOADED), Reply(status=529, body=OVERLOADED),
                     Reply(body=anthropic_message("found it")))
        aclient = NoBackoffAnthropic(base_url=h.url, api_key="k", max_retries=2, default_headers=run)
        atools: list[Any] = [{"name": "search", "input_schema": {"type": "object"}}]
        amessages: list[Any] = [{"role": "user", "content": "find a"}]
        async with aclient:
            turn = await aclient.messages.create(model="claude-3-5-haiku-latest", max_tokens=64, messages=amessages,
                                                 tools=atools)
            amessages += [{"role": "assistant", "content": [b.model_dump() for b in turn.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]}]
            answer = await aclient.messages.create(model="claude-3-5-haiku-latest", max_tokens=64,
                                                   messages=amessages, tools=atools)
        assert [b.text for b in answer.content if b.type == "text"] == ["found it"]
    assert len(h.fake.seen) == 4
    state = await h.run(f"retried-{wire}")
    assert (state["status"], state["llm_calls"]) == ("active", 2)
    # the identical request after an answer is a repeat again: the second in a row stops the run
    for expected in (200, 403):
        h.fake.queue(Reply(body=openai_completion("again")) if wire == "openai" else Reply(body=anthropic_message("x")))
        body = ({"model": "gpt-4o-mini", "messages": messages, "tools": tools} if wire == "openai" else
                {"model": "claude-3-5-haiku-latest", "max_tokens": 64, "messages": amessages, "tools": atools})
        path = "/v1/chat/completions" if wire == "openai" else "/v1/messages"
        status, _, _ = await post(h, body, f"retried-{wire}", path)
        assert status == expected


async def test_on_stop_message_answers_a_step_held_to_a_schema_with_the_message_too(
    gateway_factory: GatewayFactory,
) -> None:
    """The contract (DESIGN section 3): `on_stop: message` answers every stop with a final assistant message
    and `x-tollgate-stop-reason`, a step with `response_format` included; the README tells agents that
    parse structured output to use `on_stop: error` instead."""
    h = await gateway_factory(agents=agent(caps={"llm_calls": 1}, on_stop="message"))
    h.fake.queue(Reply(body=openai_completion('{"a": 1}')))
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    c = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                           default_headers={"x-tollgate-run-id": "structured-stop", "x-tollgate-agent": "bot"})
    async with c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=schema)  # type: ignore[arg-type]
        raw = await c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=MSG,
                                                                 response_format=schema)  # type: ignore[arg-type]
    assert raw.headers["x-tollgate-stop-reason"] == "llm_call_cap"
    assert "llm_call_cap" in (raw.parse().choices[0].message.content or "")


async def test_an_agent_resending_a_failing_request_forever_is_counted_again(gateway_factory: GatewayFactory) -> None:
    """The provider's SDK-retried errors are forgiven per request (`guards.loop.FORGIVEN_RETRIES`): past
    them, an agent looping on the same failing request counts toward `caps.llm_calls` again, and stops."""
    h = await gateway_factory(agents=agent(caps={"llm_calls": 3}))
    h.fake.default = Reply(status=500, body=SERVER_ERROR)
    body = {"model": "gpt-4o-mini", "messages": MSG}
    statuses = [(await post(h, body, "failing-forever"))[0] for _ in range(9)]
    assert statuses == [500] * 8 + [403]  # 5 forgiven, 3 counted, then the cap
    assert (await h.run("failing-forever"))["stop_reason"] == "llm_call_cap"


async def test_tollgate_s_own_502_after_a_charged_answer_is_no_forgiven_retry(gateway_factory: GatewayFactory) -> None:
    """Only the provider's own error answer is forgiven: a 502 for an answer over `limits.max_answer_bytes`
    is charged, and its identical resends are repeats (they used to be marked too: 8 paid calls, never
    stopped)."""
    h = await gateway_factory(agents=agent(loop={"stall_steps": 2}), limits={"max_answer_bytes": 2000})
    h.fake.default = Reply(body=openai_completion("x" * 5000))
    body = {"model": "gpt-4o-mini", "messages": MSG}
    statuses = [(await post(h, body, "oversized"))[0] for _ in range(4)]
    assert statuses == [502, 502, 403, 403] and len(h.fake.seen) == 2
    assert (await h.run("oversized"))["stop_reason"] == "no_progress"
