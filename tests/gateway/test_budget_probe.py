"""Hostile probes of the budget and cap guarantees (README "How budgets are held", DESIGN sections 4-5).

Every request reserves its worst case before it goes upstream and settles it after; no budget is ever
overspent, no reservation is left dangling, stops are sticky until reset, and every refusal is in the
wire format of the API that was called. Fakes on loopback only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import orjson
import pytest

from gateway.http1 import Http1Pool
from gateway.upstream import Upstream
from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import (
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
)

PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
           "claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
MSG = [{"role": "user", "content": "hello"}]
GPT = "gpt-4o-mini"
CLAUDE = "claude-3-5-haiku-latest"
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


def agent(**policy: Any) -> dict[str, Any]:
    return {"bot": policy}


def headers(run: str) -> dict[str, str]:
    return {"x-tollgate-run-id": run, "x-tollgate-agent": "bot"}


async def post(h: Harness, body: dict[str, Any], run: str, path: str = CHAT,
               extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    hdrs = {**headers(run), "content-type": "application/json", **(extra or {})}
    async with h.session.post(h.url + path, data=orjson.dumps(body), headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def until(h: Harness, run: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict[str, Any]:
    """Poll the admin view of `run` until `ok` holds (the gateway finishes a step after the client left,
    which no client can await)."""
    deadline = time.monotonic() + timeout
    while True:
        async with h.session.get(f"{h.admin_url}/admin/runs/{run}") as resp:
            view = await resp.json() if resp.status == 200 else {}
        if view and ok(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run} never reached the expected state: {view}")
        await asyncio.sleep(0.02)


def body_for(path: str, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        return {"model": GPT, "messages": MSG, "stream": stream, **extra}
    if path == MESSAGES:
        return {"model": CLAUDE, "messages": MSG, "max_tokens": 64, "stream": stream, **extra}
    return {"model": GPT, "input": "hello", "stream": stream, **extra}


def reply_for(path: str, *, stream: bool, usage: tuple[int, int] = (10, 5), delay: float = 0.0,
              chunk_delay: float = 0.0, parts: list[str] | None = None) -> Reply:
    parts = parts or ["hel", "lo"]
    if path == CHAT:
        if stream:
            return Reply(chunks=openai_stream(parts, usage=usage), delay=delay, chunk_delay=chunk_delay)
        return Reply(body=openai_completion(prompt_tokens=usage[0], completion_tokens=usage[1]), delay=delay)
    if path == MESSAGES:
        if stream:
            return Reply(chunks=anthropic_stream(parts, usage=usage), delay=delay, chunk_delay=chunk_delay)
        return Reply(body=anthropic_message(input_tokens=usage[0], output_tokens=usage[1]), delay=delay)
    if stream:
        return Reply(chunks=response_stream(parts, usage=usage), delay=delay, chunk_delay=chunk_delay)
    return Reply(body=response_body(usage=usage), delay=delay)


# -- max_tokens clamp: the model's output limit ------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_unpayable_max_tokens_is_capped_by_the_model_output_limit(gateway_factory: GatewayFactory,
                                                                        path: str) -> None:
    """README: a request with a max_tokens the budget cannot pay 'gets the most the remaining budget can
    pay for, capped by the model's output limit (... else the provider's max_output_tokens, default
    32768)'. A 10M-token ask under a 200k-token budget must be granted at most 32768."""
    h = await gateway_factory(agents=agent(budget={"tokens": 200_000}))
    field = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    h.fake.queue(reply_for(path, stream=False))
    body = body_for(path, **{field: 10_000_000})
    status, hdrs, raw = await post(h, body, "cap-" + path.rsplit("/", 1)[-1], path)
    assert status == 200, raw
    granted = int(hdrs["x-tollgate-max-tokens"])
    assert granted <= 32768, f"granted {granted} output tokens, above the model's output limit"
    assert h.fake.seen[-1].json[field] == granted


# -- a request the upstream received is never settled at $0 ----------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_client_gone_before_the_answer_headers_is_charged_not_free(gateway_factory: GatewayFactory,
                                                                         path: str) -> None:
    """The agent gives up (its own timeout) while the upstream is still working on a request it has
    fully received. The provider bills that call; the step must be settled at its reservation (README:
    '... settled at the full reservation — never at $0'), else an agent that times out keeps spending
    money the budget never sees."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    h.fake.queue(reply_for(path, stream=False, delay=1.0))
    run = "gone-" + path.rsplit("/", 1)[-1]
    body = body_for(path, **({"max_output_tokens": 64} if path == RESPONSES else {"max_tokens": 64}))
    task = asyncio.create_task(post(h, body, run, path))
    await asyncio.wait_for(h.fake.wait_seen(1), 5)  # the upstream has the whole request
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    view = await until(h, run, lambda v: v["llm_calls"] == 1 and v["reserved_usd"] == 0 and v["steps"])
    assert view["reserved_tokens"] == 0
    assert view["spent_usd"] > 0, "a call the upstream received and billed was settled at $0"
    assert view["output_tokens"] >= 64


async def test_client_gone_while_queued_for_an_upstream_connection_is_free(gateway_factory: GatewayFactory) -> None:
    """The counterpart: an agent that leaves while its call still waits for a free upstream connection
    sent the provider nothing, so nothing is billed; its reservation is released, not charged."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    spare, h.gateway.upstream = h.gateway.upstream, Upstream(Http1Pool(asyncio.get_running_loop(), limit=1))
    await spare.close()
    h.fake.queue(reply_for(CHAT, stream=False, delay=0.5))  # holds the only connection
    first = asyncio.create_task(post(h, body_for(CHAT, max_tokens=64), "holder"))
    await asyncio.wait_for(h.fake.wait_seen(1), 5)
    queued = asyncio.create_task(post(h, body_for(CHAT, max_tokens=64), "queued"))
    await until(h, "queued", lambda v: v["reserved_usd"] > 0)  # reserved, waiting for the connection
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    view = await until(h, "queued", lambda v: v["reserved_usd"] == 0 and v["steps"])
    assert (view["spent_usd"], view["output_tokens"], view["reserved_tokens"]) == (0, 0, 0), view
    status, _, raw = await first
    assert status == 200, raw
    assert len(h.fake.seen) == 1  # the queued call never reached the upstream
    await h.gateway.upstream.close()


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_first_byte_timeout_after_the_request_was_sent_is_charged(gateway_factory: GatewayFactory,
                                                                        fake: Any, path: str) -> None:
    """504 upstream_timeout: the upstream received the whole request and may be generating (and
    billing) it; the step is not free."""
    _, fake_url = fake
    timeouts = {"first_byte": 0.3}
    providers = {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "k", "timeouts": timeouts},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "k", "timeouts": timeouts},
    }
    h = await gateway_factory(providers=providers, pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    h.fake.queue(reply_for(path, stream=False, delay=1.5))
    run = "fb-" + path.rsplit("/", 1)[-1]
    body = body_for(path, **({"max_output_tokens": 64} if path == RESPONSES else {"max_tokens": 64}))
    status, _, raw = await post(h, body, run, path)
    assert status == 504, raw
    assert len(h.fake.seen) == 1
    view = await h.run(run)
    assert (view["reserved_usd"], view["reserved_tokens"], view["llm_calls"]) == (0, 0, 1)
    assert view["spent_usd"] > 0, "a request the upstream received was settled at $0 after a timeout"


# -- streams whose usage is missing or partial are settled at the reservation ----------------------


def _without_final_usage(chunks: list[bytes]) -> list[bytes]:
    """An Anthropic-wire stream whose message_delta carries no usage (some compatible upstreams)."""
    out = []
    for chunk in chunks:
        if b"message_delta" in chunk:
            data = json.loads(chunk.split(b"data: ", 1)[1])
            data.pop("usage", None)
            chunk = b"event: message_delta\ndata: " + orjson.dumps(data) + b"\n\n"
        out.append(chunk)
    return out


async def test_anthropic_stream_without_final_usage_is_not_settled_at_the_placeholder(
        gateway_factory: GatewayFactory) -> None:
    """message_start's `output_tokens: 1` is a placeholder; the real count comes in message_delta. A
    stream whose message_delta has no usage carried no output count: settled at the reservation (and
    never below what was relayed), not at 1 output token."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    text = ["word " * 50] * 8  # 2000 characters relayed
    h.fake.queue(Reply(chunks=_without_final_usage(anthropic_stream(text, usage=(10, 600)))))
    body = {"model": CLAUDE, "max_tokens": 1000, "messages": MSG, "stream": True}
    status, _, raw = await post(h, body, "anth-nousage", MESSAGES)
    assert status == 200 and raw.count(b"text_delta") == len(text)  # relayed (an SDK's accumulator
    # would choke on the missing usage: the raw events are what an agent got)
    view = await h.run("anth-nousage")
    assert view["reserved_usd"] == 0
    assert view["output_tokens"] >= 1000, f"settled at {view['output_tokens']} output tokens after 2000 chars"


def _continuous_usage_stream(parts: list[str]) -> list[bytes]:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far."""
    out = []
    for index, part in enumerate(parts, start=1):
        data = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": GPT,
                "choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}],
                "usage": {"prompt_tokens": 10, "completion_tokens": index, "total_tokens": 10 + index}}
        out.append(b"data: " + orjson.dumps(data) + b"\n\n")
    return out


async def test_openai_stream_that_broke_after_a_running_usage_chunk_is_settled_at_the_reservation(
        gateway_factory: GatewayFactory) -> None:
    """README: 'a stream without a usage chunk, or one that broke, is settled at the full reservation'.
    A stream cut before its end, whose chunks carried running usage (vLLM continuous usage stats),
    must not be settled at the partial count of the last chunk that happened to arrive."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    h.fake.queue(Reply(chunks=_continuous_usage_stream(["tok "] * 20), cut_after=5))
    body = {"model": GPT, "messages": MSG, "stream": True, "max_tokens": 500,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, _, raw = await post(h, body, "cont", CHAT)
    assert status == 200 and b"upstream_unavailable" in raw  # the stream ends with an error event
    view = await h.run("cont")
    assert view["reserved_usd"] == 0
    assert view["output_tokens"] >= 500, f"a broken stream settled at {view['output_tokens']} output tokens"


# -- the input bound covers what goes upstream ----------------------------------------------------------


async def test_native_output_schema_tollgate_adds_is_inside_the_input_bound(gateway_factory: GatewayFactory) -> None:
    """The agent's `output.grammar` is sent upstream natively (`response_format` with the whole schema,
    which the provider bills as input). The reservation's input bound is the size of the agent's own
    body, without the schema tollgate adds: a 12 KB schema on a tiny request is reserved as ~100 bytes,
    and a token budget of 2000 is overspent on the first call."""
    schema = {"type": "object", "description": "field notes " * 1000, "additionalProperties": False,
              "properties": {"a": {"type": "string"}}, "required": ["a"]}
    budget = 2000
    h = await gateway_factory(agents=agent(budget={"tokens": budget},
                                           output={"grammar": "json_schema:" + json.dumps(schema)}))

    def answer(path: str) -> Reply:  # the upstream bills ~1 token per 3 bytes of what it received
        received = len(h.fake.seen[-1].body)
        return Reply(body=openai_completion('{"a": "x"}', prompt_tokens=received // 3, completion_tokens=5))

    h.fake._next = answer  # type: ignore[method-assign]
    sent = {"model": GPT, "messages": MSG, "max_tokens": 100}
    status, hdrs, raw = await post(h, sent, "schema-bound")
    view = await h.run("schema-bound")
    assert view["reserved_tokens"] == 0
    if status == 200:
        forwarded = h.fake.seen[-1]
        assert "response_format" in forwarded.json
        size = len(forwarded.body)
        assert size + int(hdrs.get("x-tollgate-max-tokens", 100)) <= budget, (
            f"{size} bytes went upstream under a {budget}-token budget (reserved as {len(orjson.dumps(sent))} + 100)")
        assert view["input_tokens"] + view["output_tokens"] <= budget
    else:
        assert status == 403 and orjson.loads(raw)["error"]["code"] == "token_budget_exhausted"
        assert h.fake.seen == []


async def test_native_schema_is_bounded_once_in_a_reask_of_a_tool_filtered_request(
        gateway_factory: GatewayFactory) -> None:
    """A request whose tools the allow-list filtered is re-asked from the filtered body; the schema
    tollgate adds natively must be in that body's input bound once, not twice (the grant of the re-ask
    would shrink by the schema's size for nothing)."""
    schema = {"type": "object", "description": "notes " * 500, "properties": {"a": {"type": "string"}},
              "required": ["a"]}
    budget = 20_000
    h = await gateway_factory(agents=agent(budget={"tokens": budget}, tools={"allow": ["search"]},
                                           output={"grammar": "json_schema:" + json.dumps(schema)}))
    h.fake.queue(Reply(body=openai_completion("prose", prompt_tokens=10, completion_tokens=5)),
                 Reply(body=openai_completion('{"a": "x"}', prompt_tokens=10, completion_tokens=5)))
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("search", "rm")]
    status, _, raw = await post(h, {"model": GPT, "messages": MSG, "tools": tools}, "filtered-reask")
    assert status == 200, raw
    first, second = h.fake.seen
    assert [t["function"]["name"] for t in second.json["tools"]] == ["search"]
    assert "response_format" in first.json and "response_format" in second.json
    # the grant is what the budget leaves after the first attempt (15 tokens) and the re-ask's input
    # bound, which is at most the size of the body sent (that body also carries max_tokens itself)
    granted = second.json["max_completion_tokens"]
    assert granted >= budget - 15 - len(second.body), (granted, len(second.body))


# -- concurrency across the three wire formats --------------------------------------------------------


def _by_path(stream_of: Callable[[str], bool], usage: tuple[int, int], delay: float) -> Callable[[str], Reply]:
    def next_reply(path: str) -> Reply:
        kind = MESSAGES if path.endswith("/messages") else RESPONSES if path.endswith("/responses") else CHAT
        return reply_for(kind, stream=stream_of(path), usage=usage, delay=delay, chunk_delay=0.002)
    return next_reply


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_mixed_concurrent_steps_never_overspend_and_release_every_reservation(
        gateway_factory: GatewayFactory, backend: str) -> None:
    """120 concurrent steps of one run, chat / messages / responses, streamed and not, under a USD budget
    that pays for a handful: every answer is 200 or a 403 budget refusal in the caller's format, the
    upstream saw only the granted ones, the settled spend is within the budget and nothing stays held."""
    state = {"backend": "memory"} if backend == "memory" else {"backend": "sqlite", "path": "mixed.db"}
    budget = 0.004
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": budget}), state=state)
    jobs = []
    for i in range(120):
        path = (CHAT, MESSAGES, RESPONSES)[i % 3]
        stream = bool(i % 2)
        field = "max_output_tokens" if path == RESPONSES else "max_tokens"
        body = body_for(path, stream=stream, **{field: 200})
        jobs.append((path, stream, body))

    async def one(path: str, stream: bool, body: dict[str, Any]) -> tuple[str, int, bytes]:
        status, _, raw = await post(h, body, "mixed", path)
        return path, status, raw

    # the fake answers by path; whether it streams follows what the request asked
    def next_reply(path: str) -> Reply:
        body = h.fake.seen[-1].json
        return _by_path(lambda _: bool(body.get("stream")), (40, 30), 0.03)(path)

    h.fake._next = next_reply  # type: ignore[method-assign]
    results = await asyncio.gather(*(one(*job) for job in jobs))
    ok = [r for r in results if r[1] == 200]
    refused = [r for r in results if r[1] != 200]
    assert ok and refused
    assert len(h.fake.seen) == len(ok)
    for path, status, raw in refused:
        assert status == 403, raw
        error = orjson.loads(raw)
        if path == MESSAGES:
            assert error["type"] == "error" and error["error"]["code"] == "budget_exhausted"
        else:
            assert error["error"]["code"] == "budget_exhausted"
    for path, _, raw in ok:
        assert b"upstream_unavailable" not in raw and b"budget_exhausted" not in raw
    view = await h.run("mixed")
    assert view["spent_usd"] <= budget + 1e-12
    assert (view["reserved_usd"], view["reserved_tokens"]) == (0, 0)
    assert view["llm_calls"] == len(ok)
    assert view["spent_usd"] == pytest.approx(len(ok) * (40 * 1.0 + 30 * 2.0) / 1e6)


# -- streams the client abandons --------------------------------------------------------------------


def _sdk_openai(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, default_headers=headers(run))


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_stream_abandoned_by_the_sdk_releases_and_charges_the_reservation(gateway_factory: GatewayFactory,
                                                                                path: str) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}, caps={"llm_calls": 5}))
    h.fake.queue(reply_for(path, stream=True, parts=["tok "] * 200, chunk_delay=0.01))
    run = "abandon-" + path.rsplit("/", 1)[-1]
    if path == MESSAGES:
        async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                            default_headers=headers(run)) as client:
            stream = await client.messages.create(model=CLAUDE, max_tokens=300, messages=MSG,  # type: ignore[arg-type]
                                                  stream=True)
            async for event in stream:
                if event.type == "content_block_delta":
                    break
            await stream.close()
    else:
        async with _sdk_openai(h, run) as client:
            if path == CHAT:
                chat = await client.chat.completions.create(model=GPT, messages=MSG, max_tokens=300,  # type: ignore[arg-type]
                                                            stream=True)
                async for chunk in chat:
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                await chat.close()
            else:
                resp = await client.responses.create(model=GPT, input="hi", max_output_tokens=300, stream=True)
                async for event in resp:
                    if event.type == "response.output_text.delta":
                        break
                await resp.close()
    view = await until(h, run, lambda v: v["steps"] and v["reserved_usd"] == 0)
    assert view["reserved_tokens"] == 0 and view["llm_calls"] == 1
    assert view["output_tokens"] >= 300  # no usage ever arrived: charged the reservation
    assert view["spent_usd"] > 0 and view["status"] == "active"


# -- an upstream that bills beyond the reservation ---------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
@pytest.mark.parametrize("stream", [False, True])
async def test_usage_beyond_the_reservation_is_billed_honestly_and_stops_the_run(
        gateway_factory: GatewayFactory, path: str, stream: bool) -> None:
    """An upstream that ignored max_tokens reports 5000 output tokens against a 50-token grant: the run
    is charged what the provider billed (not the reservation), and the next step is refused with
    budget_exhausted (sticky) without reaching the upstream."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.005}))
    h.fake.queue(reply_for(path, stream=stream, usage=(20, 5000)))
    run = f"over-{path.rsplit('/', 1)[-1]}-{stream}"
    field = "max_output_tokens" if path == RESPONSES else "max_tokens"
    status, _, raw = await post(h, body_for(path, stream=stream, **{field: 50}), run, path)
    assert status == 200, raw
    view = await h.run(run)
    assert (view["input_tokens"], view["output_tokens"]) == (20, 5000)
    assert view["spent_usd"] == pytest.approx((20 * 1.0 + 5000 * 2.0) / 1e6)
    assert (view["reserved_usd"], view["reserved_tokens"]) == (0, 0)
    for _ in range(2):
        status, hdrs, raw = await post(h, body_for(path, **{field: 16}), run, path)
        assert status == 403 and hdrs["x-tollgate-stop-reason"] == "budget_exhausted"
        error = orjson.loads(raw)
        assert error["error"]["code"] == "budget_exhausted"
        assert (error.get("type") == "error") == (path == MESSAGES)
    assert len(h.fake.seen) == 1
    view = await h.run(run)
    assert view["status"] == "stopped" and view["stop_reason"] == "budget_exhausted"


# -- grammar re-asks are reserved, charged and counted -------------------------------------------------


@pytest.mark.parametrize("stream_check", ["incremental", "buffer"])
async def test_reasks_count_against_llm_calls_and_the_budget(gateway_factory: GatewayFactory,
                                                             stream_check: str) -> None:
    """output: {grammar, retries: 5} with caps.llm_calls 3: an answer that never conforms is re-asked,
    each attempt reserved and counted; the third attempt is the last the cap allows, the fourth is a
    stop (llm_call_cap), and only three requests ever reached the upstream."""
    h = await gateway_factory(pricing=PRICING, agents=agent(
        budget={"usd": 1.0}, caps={"llm_calls": 3},
        output={"grammar": "regex:[0-9]+", "retries": 5, "stream_check": stream_check}))
    h.fake.default = Reply(body=openai_completion("not a number", prompt_tokens=30, completion_tokens=7))
    stream = stream_check == "buffer"
    if stream:
        h.fake.default = Reply(chunks=openai_stream(["not a number"], usage=(30, 7)))
    status, hdrs, raw = await post(h, {"model": GPT, "messages": MSG, "max_tokens": 40, "stream": stream}, "reask")
    assert status == 403, raw
    assert hdrs["x-tollgate-stop-reason"] == "llm_call_cap"
    assert orjson.loads(raw)["error"]["code"] == "llm_call_cap"
    assert len(h.fake.seen) == 3
    view = await h.run("reask")
    assert view["llm_calls"] == 3 and (view["reserved_usd"], view["reserved_tokens"]) == (0, 0)
    assert (view["input_tokens"], view["output_tokens"]) == (90, 21)
    assert view["spent_usd"] == pytest.approx(3 * (30 * 1.0 + 7 * 2.0) / 1e6)
    assert view["status"] == "stopped"


async def test_reask_that_the_budget_cannot_pay_ends_the_step_and_leaves_nothing_held(
    gateway_factory: GatewayFactory,
) -> None:
    """Each re-ask carries the original request plus the bad answer and an instruction: a bigger input
    bound. When the budget cannot pay for it, the step ends with the answer's 422 output_nonconforming
    (the run is not stopped: the agent's own next request is smaller); what the earlier attempts cost
    stays charged."""
    h = await gateway_factory(agents=agent(budget={"tokens": 900},
                                           output={"grammar": "regex:[0-9]+", "retries": 3}))
    h.fake.default = Reply(body=openai_completion("x" * 400, prompt_tokens=100, completion_tokens=100))
    status, hdrs, raw = await post(h, {"model": GPT, "messages": MSG, "max_tokens": 100}, "reask-budget")
    assert status == 422, raw
    assert orjson.loads(raw)["error"]["code"] == "output_nonconforming" and "x-tollgate-stop-reason" not in hdrs
    view = await h.run("reask-budget")
    assert (view["status"], view["stop_reason"]) == ("active", None)
    assert (view["reserved_usd"], view["reserved_tokens"]) == (0, 0)
    assert view["input_tokens"] + view["output_tokens"] == 200 * len(h.fake.seen)
    assert view["input_tokens"] + view["output_tokens"] <= 900
    assert view["llm_calls"] == len(h.fake.seen) >= 1


# -- output-limit fields: edge values -----------------------------------------------------------------


FIELDS = [(CHAT, "max_tokens"), (CHAT, "max_completion_tokens"), (MESSAGES, "max_tokens"),
          (RESPONSES, "max_output_tokens")]


@pytest.mark.parametrize(("path", "field"), FIELDS)
@pytest.mark.parametrize("value", [0, -1, 1.5, "100", True, [100], -(2**63)])
@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_output_limits_are_400_in_the_callers_format(gateway_factory: GatewayFactory, path: str,
                                                                     field: str, value: Any, stream: bool) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.01}))
    body = body_for(path, stream=stream)
    body[field] = value
    status, hdrs, raw = await post(h, body, "edge", path)
    assert status == 400, raw
    error = orjson.loads(raw)
    if path == MESSAGES:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == "invalid_request"
    assert "x-tollgate-stop-reason" not in hdrs
    assert h.fake.seen == []
    async with h.session.get(f"{h.admin_url}/admin/runs/edge") as resp:
        if resp.status == 200:  # a refused request may leave no run at all
            view = await resp.json()
            assert view["status"] == "active" and (view["reserved_usd"], view["reserved_tokens"]) == (0, 0)
            assert view["llm_calls"] == 0


@pytest.mark.parametrize(("path", "field"), FIELDS)
@pytest.mark.parametrize("value", [None, 2**63 - 1, 2**64 - 1, 10**20])
async def test_absent_or_huge_output_limits_are_clamped_never_an_error(gateway_factory: GatewayFactory, path: str,
                                                                       field: str, value: Any) -> None:
    """DESIGN 5: 'max_tokens too large, or absent, under a budget: clamped to what the budget can pay
    (and the model's output limit), reported in x-tollgate-max-tokens; never an error'. JSON has no
    integer size limit: 10**20 is as much an integer as 2**63 - 1."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.01}))
    h.fake.queue(reply_for(path, stream=False))
    body = body_for(path)
    body[field] = value
    raw_body = json.dumps(body).encode()  # Python's JSON writes any integer exactly
    async with h.session.post(h.url + path, data=raw_body,
                              headers={**headers("huge"), "content-type": "application/json"}) as resp:
        status, hdrs, raw = resp.status, dict(resp.headers), await resp.read()
    assert status == 200, raw
    granted = int(hdrs["x-tollgate-max-tokens"])
    budget_pays = int((0.01 - len(raw_body) * 1e-6) / 2e-6)
    assert 16 <= granted <= min(budget_pays, 32768)
    sent = h.fake.seen[-1].json
    assert sent.get(field) == granted or (path == CHAT and granted in (sent.get("max_tokens"),
                                                                       sent.get("max_completion_tokens")))
    view = await h.run("huge")
    assert (view["reserved_usd"], view["reserved_tokens"], view["status"]) == (0, 0, "active")


async def test_a_huge_max_tokens_beside_a_step_in_flight_leaves_nothing_reserved(
        gateway_factory: GatewayFactory) -> None:
    """No budget (caps only), so nothing clamps the ask: one step asks for max_tokens 2**64 - 1 while
    another step of the run (max_tokens 3000) is in flight. Both finish; `reserved_tokens` and
    `reserved_usd` must be back to 0 (the huge reservation must not swallow the small one's amounts
    in rounding, leaving a remainder held forever)."""
    h = await gateway_factory(pricing=PRICING, agents=agent(caps={"llm_calls": 100}))
    h.fake.queue(Reply(body=openai_completion(), delay=0.4), Reply(body=openai_completion()))
    slow = asyncio.create_task(post(h, {"model": GPT, "messages": MSG, "max_tokens": 3000}, "float"))
    await asyncio.wait_for(h.fake.wait_seen(1), 5)
    status, _, raw = await post(h, {"model": GPT, "messages": MSG, "max_tokens": 2**64 - 1}, "float")
    assert status == 200, raw
    assert (await slow)[0] == 200
    view = await h.run("float")
    assert view["llm_calls"] == 2 and (view["input_tokens"], view["output_tokens"]) == (20, 10)
    assert view["reserved_tokens"] == 0, f"{view['reserved_tokens']} tokens stay reserved with nothing in flight"
    assert view["reserved_usd"] == 0


# -- n choices -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_without_usage_are_charged_for_every_choice(gateway_factory: GatewayFactory,
                                                                    stream: bool) -> None:
    """n=3 under a token budget: the grant is what the budget pays three times over; an answer without
    usage is settled at the whole reservation (3 x the grant), never as if one choice was asked."""
    budget = 3000
    h = await gateway_factory(agents=agent(budget={"tokens": budget}))
    if stream:
        h.fake.queue(Reply(chunks=openai_stream(["a", "b"], usage=None)))
    else:
        h.fake.queue(Reply(body={**openai_completion(), "usage": None}))
    body = {"model": GPT, "messages": MSG, "n": 3, "stream": stream}
    status, hdrs, raw = await post(h, body, f"n3-{stream}")
    assert status == 200, raw
    granted = int(hdrs["x-tollgate-max-tokens"])
    assert granted == (budget - len(orjson.dumps(body))) // 3
    view = await h.run(f"n3-{stream}")
    assert view["output_tokens"] == 3 * granted
    assert view["input_tokens"] + view["output_tokens"] <= budget
    assert view["reserved_tokens"] == 0
    # what is left cannot pay even 16 tokens for 3 choices: refused, and the upstream never sees it
    status, hdrs, raw = await post(h, body, f"n3-{stream}")
    assert status == 403 and orjson.loads(raw)["error"]["code"] == "token_budget_exhausted"
    assert len(h.fake.seen) == 1


# -- reset while a step is in flight ---------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_reset_while_a_step_is_in_flight(gateway_factory: GatewayFactory, path: str) -> None:
    """A stopped run with a step still in flight is reset. The fresh run holds nothing once the old step
    finishes, is active, and pays its own full budget again."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.002}, caps={"llm_calls": 2}))
    run = "reset-" + path.rsplit("/", 1)[-1]
    field = "max_output_tokens" if path == RESPONSES else "max_tokens"
    h.fake.queue(reply_for(path, stream=True, delay=0.3), reply_for(path, stream=False))
    slow = asyncio.create_task(post(h, body_for(path, stream=True, **{field: 100}), run, path))
    await asyncio.wait_for(h.fake.wait_seen(1), 5)
    assert (await post(h, body_for(path, **{field: 100}), run, path))[0] == 200
    status, hdrs, _ = await post(h, body_for(path, **{field: 100}), run, path)  # third: over the cap
    assert status == 403 and hdrs["x-tollgate-stop-reason"] == "llm_call_cap"
    async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as resp:
        assert resp.status == 200
    status, _, raw = await slow
    assert status == 200 and b"error" not in raw
    view = await h.run(run)
    assert view["status"] == "active" and view["stop_reason"] is None
    assert (view["reserved_usd"], view["reserved_tokens"], view["spent_usd"], view["llm_calls"]) == (0, 0, 0, 0)
    h.fake.queue(reply_for(path, stream=False), reply_for(path, stream=False))
    for _ in range(2):
        assert (await post(h, body_for(path, **{field: 100}), run, path))[0] == 200
    view = await h.run(run)
    assert view["llm_calls"] == 2 and view["reserved_usd"] == 0


# -- time cap ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_time_cap_is_a_sticky_stop_until_reset(gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway_factory(agents=agent(caps={"seconds": 0.2}))
    run = "time-" + path.rsplit("/", 1)[-1]
    h.fake.queue(reply_for(path, stream=False, delay=0.35))  # the first step outlasts the cap
    assert (await post(h, body_for(path), run, path))[0] == 200
    for stream in (False, True):
        status, hdrs, raw = await post(h, body_for(path, stream=stream), run, path)
        assert status == 403, raw
        assert hdrs["x-tollgate-stop-reason"] == "time_cap"
        error = orjson.loads(raw)
        assert error["error"]["code"] == "time_cap"
        assert (error.get("type") == "error") == (path == MESSAGES)
    assert len(h.fake.seen) == 1
    view = await h.run(run)
    assert (view["status"], view["stop_reason"], view["reserved_tokens"]) == ("stopped", "time_cap", 0)
    async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as resp:
        assert resp.status == 200
    h.fake.queue(reply_for(path, stream=False))
    assert (await post(h, body_for(path), run, path))[0] == 200  # the clock starts again


# -- on_stop: message, streaming -----------------------------------------------------------------------------


async def test_on_stop_message_while_streaming_reads_as_a_final_answer_in_every_sdk(
        gateway_factory: GatewayFactory) -> None:
    """A budget stop with `on_stop: message` on a streamed call: 200, one final assistant message that
    says why, the stream's end, `x-tollgate-stop-reason`; every SDK reads it as a normal stream."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.0001}, on_stop="message"))
    big = "x" * 400  # more input than the budget can ever pay: stopped before anything goes upstream
    async with _sdk_openai(h, "osm") as client:
        chat = await client.chat.completions.with_raw_response.create(
            model=GPT, messages=[{"role": "user", "content": big}], stream=True)
        assert chat.headers["x-tollgate-stop-reason"] == "budget_exhausted"
        chunks = [c async for c in chat.parse()]  # type: ignore[union-attr]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "budget_exhausted" in text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        async with client.responses.stream(model=GPT, input=big) as stream:
            final = await stream.get_final_response()
        assert "budget_exhausted" in final.output_text and final.status == "completed"
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                        default_headers=headers("osm")) as claude:
        async with claude.messages.stream(model=CLAUDE, max_tokens=50,
                                          messages=[{"role": "user", "content": big}]) as astream:
            message = await astream.get_final_message()
        assert "budget_exhausted" in message.content[0].text  # type: ignore[union-attr]
        assert message.stop_reason == "end_turn"
    assert h.fake.seen == []
    view = await h.run("osm")
    assert (view["status"], view["stop_reason"], view["reserved_usd"]) == ("stopped", "budget_exhausted", 0)


async def test_on_stop_message_after_streamed_bytes_ends_with_a_final_message(gateway_factory: GatewayFactory) -> None:
    """The stop comes after text was streamed (the tool-call cap trips on the answer): the stream is
    closed with one final assistant chunk saying why, then its end; the SDK reads it without error."""
    h = await gateway_factory(pricing=PRICING, agents=agent(caps={"tool_calls": 1}, on_stop="message"))
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": f'{{"q": {i}}}'}}
             for i in range(2)]
    h.fake.queue(Reply(chunks=openai_stream(["let me look"], tool_calls=calls)))
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    async with _sdk_openai(h, "osm2") as client:
        stream = await client.chat.completions.create(model=GPT, messages=MSG, tools=tools,  # type: ignore[arg-type]
                                                      stream=True)
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("let me look") and "tool_call_cap" in text
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)  # the held calls never left
    view = await h.run("osm2")
    assert (view["status"], view["stop_reason"], view["reserved_usd"]) == ("stopped", "tool_call_cap", 0)


# -- agent keys, budgets of one kind, unpriced models ----------------------------------------------------


async def test_anthropic_x_api_key_agent_budget_applies_and_stays_per_agent(gateway_factory: GatewayFactory) -> None:
    """Agent keys through Anthropic's `x-api-key`: the key names the agent whose budget applies; the
    provider key replaces it upstream; an unknown key is a 401 in Anthropic's format."""
    h = await gateway_factory(pricing=PRICING, agents={
        "small": {"keys": ["key-small"], "budget": {"tokens": 500}},
        "large": {"keys": ["key-large"], "budget": {"tokens": 100_000}},
    })
    h.fake.default = Reply(body=anthropic_message(input_tokens=100, output_tokens=100))
    runs = {"x-tollgate-run-id": "keyed"}
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="key-small", max_retries=0,
                                        default_headers=runs) as small:
        raw = await small.messages.with_raw_response.create(model=CLAUDE, max_tokens=10_000, messages=MSG)  # type: ignore[arg-type]
        assert 16 <= int(raw.headers["x-tollgate-max-tokens"]) < 500
        assert h.fake.seen[-1].headers["x-api-key"] == "sk-ant-provider"
        with pytest.raises(anthropic.PermissionDeniedError) as refused:
            for _ in range(5):
                await small.messages.create(model=CLAUDE, max_tokens=200, messages=MSG)  # type: ignore[arg-type]
        assert refused.value.body["error"]["code"] == "token_budget_exhausted"  # type: ignore[index]
    async with anthropic.AsyncAnthropic(base_url=h.url, api_key="nobody", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as unknown:
            await stranger.messages.create(model=CLAUDE, max_tokens=10, messages=MSG)  # type: ignore[arg-type]
        assert unknown.value.body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    view = await h.run("keyed")
    assert view["agent"] == "small" and view["input_tokens"] + view["output_tokens"] <= 500
    assert view["reserved_tokens"] == 0


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_unpriced_model_under_a_token_budget_is_guarded_and_under_a_usd_budget_refused(
        gateway_factory: GatewayFactory, path: str) -> None:
    unpriced = "gpt-unknown-xyz" if path != MESSAGES else "claude-unknown-xyz"
    h = await gateway_factory(agents={"toks": {"budget": {"tokens": 400}}, "usd": {"budget": {"usd": 1.0}}})
    h.fake.default = reply_for(path, stream=False, usage=(100, 100))
    body = {**body_for(path), "model": unpriced}
    for _ in range(3):
        hdrs = {"x-tollgate-agent": "toks"}
        async with h.session.post(h.url + path, json=body, headers={**hdrs, "x-tollgate-run-id": "tk"}) as resp:
            last = resp.status, await resp.read()
    assert last[0] == 403 and orjson.loads(last[1])["error"]["code"] == "token_budget_exhausted"
    view = await h.run("tk")
    assert view["input_tokens"] + view["output_tokens"] <= 400 and view["reserved_tokens"] == 0
    seen = len(h.fake.seen)
    async with h.session.post(h.url + path, json=body,
                              headers={"x-tollgate-agent": "usd", "x-tollgate-run-id": "ud"}) as resp:
        status, raw = resp.status, await resp.read()
    assert status == 400 and "no known price" in orjson.loads(raw)["error"]["message"]
    assert len(h.fake.seen) == seen
    view = await h.run("ud")
    assert view["status"] == "active" and (view["reserved_usd"], view["llm_calls"]) == (0, 0)


# -- a stop is sticky on every API and path; a held refusal is not a stop ----------------------------------


async def test_a_budget_stop_on_one_api_holds_on_the_others(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"tokens": 300}))
    status, hdrs, raw = await post(h, {"model": GPT, "messages": [{"role": "user", "content": "x" * 400}]}, "sticky")
    assert status == 403 and hdrs["x-tollgate-stop-reason"] == "token_budget_exhausted"
    for path in (MESSAGES, RESPONSES, CHAT):
        for stream in (False, True):
            status, hdrs, raw = await post(h, body_for(path, stream=stream, max_tokens=16)
                                           if path != RESPONSES else body_for(path, stream=stream), "sticky", path)
            assert status == 403 and hdrs["x-tollgate-stop-reason"] == "token_budget_exhausted", raw
            error = orjson.loads(raw)
            assert error["error"]["code"] == "token_budget_exhausted"
            if path == MESSAGES:
                assert error["type"] == "error" and error["error"]["type"] == "permission_error"
            else:
                assert error["error"]["type"] == "permission_error"
    async with h.session.post(h.url + "/v1/embeddings", json={"model": GPT, "input": "x"},
                              headers=headers("sticky")) as resp:
        assert resp.status == 403
    assert h.fake.seen == []


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
async def test_held_refusal_on_streams_is_a_403_in_the_callers_format_and_the_run_goes_on(
        gateway_factory: GatewayFactory, path: str) -> None:
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 0.01}, on_stop="message"))
    h.fake.queue(reply_for(path, stream=True, delay=0.3), reply_for(path, stream=True))
    body = {**body_for(path, stream=True)}
    body.pop("max_tokens", None)
    if path == MESSAGES:
        body["max_tokens"] = 100_000  # asks for more than the budget pays: gets all of it
    slow = asyncio.create_task(post(h, body, "held", path))
    await asyncio.wait_for(h.fake.wait_seen(1), 5)
    status, hdrs, raw = await post(h, body, "held", path)
    assert status == 403 and "x-tollgate-stop-reason" not in hdrs, raw
    error = orjson.loads(raw)
    assert error["error"]["code"] == "budget_exhausted"
    assert (error.get("type") == "error") == (path == MESSAGES)
    assert (await slow)[0] == 200
    status, _, raw = await post(h, body, "held", path)
    assert status == 200 and b"budget_exhausted" not in raw
    view = await h.run("held")
    assert (view["status"], view["reserved_usd"], view["llm_calls"]) == ("active", 0, 2)


async def test_a_failed_responses_stream_is_relayed_and_billed_from_its_usage(gateway_factory: GatewayFactory) -> None:
    """README: 'a response.failed is relayed as it came and billed from its usage'."""
    h = await gateway_factory(pricing=PRICING, agents=agent(budget={"usd": 1.0}))
    chunks = response_stream(["partial"], usage=(11, 40), complete=False)
    failed = response_body("partial", usage=(11, 40), status="failed")
    chunks.append(b"event: response.failed\ndata: " + orjson.dumps(
        {"type": "response.failed", "sequence_number": len(chunks), "response": failed}) + b"\n\n")
    h.fake.queue(Reply(chunks=chunks))
    status, _, raw = await post(h, {"model": GPT, "input": "hi", "stream": True, "max_output_tokens": 300},
                                "failed", RESPONSES)
    assert status == 200 and b"response.failed" in raw
    view = await h.run("failed")
    assert (view["input_tokens"], view["output_tokens"], view["reserved_usd"]) == (11, 40, 0)
    assert view["spent_usd"] == pytest.approx((11 * 1.0 + 40 * 2.0) / 1e6)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_pdf_openai_reads_inline_is_bounded_by_its_pages(gateway_factory: GatewayFactory, api: str) -> None:
    """OpenAI bills a PDF sent as a data URL per page (its text and an image of each page), not by its
    bytes: 100 pages in a few KB cannot pass a 50,000-token budget."""
    from tests.gateway.providers.test_common import pdf_of

    h = await gateway_factory(agents={"default": {"budget": {"tokens": 50_000}}})
    url = "data:application/pdf;base64," + base64.b64encode(pdf_of(100)).decode()
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-tollgate-run-id": f"pdf-{api}"}) as client:
        with pytest.raises(openai.PermissionDeniedError) as stopped:
            if api == "chat":
                await client.chat.completions.create(model="gpt-4o-mini", max_tokens=16, messages=[
                    {"role": "user", "content": [{"type": "file", "file": {"filename": "a.pdf", "file_data": url}},
                                                 {"type": "text", "text": "summarise"}]}])
            else:
                await client.responses.create(model="gpt-4o-mini", max_output_tokens=16, input=[
                    {"role": "user", "content": [{"type": "input_file", "filename": "a.pdf", "file_data": url},
                                                 {"type": "input_text", "text": "summarise"}]}])
    assert stopped.value.code == "token_budget_exhausted" and h.fake.seen == []
