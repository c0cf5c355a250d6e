"""Hostile probes of usage and price accounting (README "How budgets are held", DESIGN section 5).

Each test sends one answer whose usage it chose through the fake upstream, then checks what the run was
charged (`spent_usd`, `input_tokens`, `output_tokens` of `GET /admin/runs/{id}`, DESIGN section 2)
against an oracle: the config's `pricing:` table computed by hand, or genai-prices itself
(`extract_usage` + `calc_price`) for models tollgate prices from genai-prices. Loopback fakes only.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply, anthropic_message, openai_completion, openai_stream

GPT = "gpt-4o-mini"
CLAUDE = "claude-3-5-haiku-latest"
MSG = [{"role": "user", "content": "hello"}]
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
REL = 1e-9  # float vs Decimal rounding


def agents(**budget: Any) -> dict[str, Any]:
    return {"bot": {"budget": budget or {"usd": 100.0}}}


def headers(run: str) -> dict[str, str]:
    return {"x-tollgate-run-id": run, "x-tollgate-agent": "bot"}


async def post(h: Harness, body: dict[str, Any], run: str, path: str = CHAT) -> tuple[int, dict[str, str], bytes]:
    hdrs = {**headers(run), "content-type": "application/json"}
    async with h.session.post(h.url + path, data=orjson.dumps(body), headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def settled(h: Harness, run: str, steps: int = 1, timeout: float = 5.0) -> dict[str, Any]:
    """The run once `steps` steps are recorded (a streamed step is recorded after its last byte, which no
    client can await: poll the admin API)."""
    deadline = time.monotonic() + timeout
    ok: Callable[[dict[str, Any]], bool] = lambda v: len(v.get("steps") or []) >= steps
    while True:
        view = await h.run(run)
        if ok(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run} never recorded {steps} step(s): {view}")
        await asyncio.sleep(0.02)


def genai_cost(body: dict[str, Any], provider: str, flavor: str | None = None) -> float:
    """What genai-prices charges for an answer body (its own usage extraction and price table)."""
    from genai_prices import extract_usage

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"api_flavor": flavor} if flavor else {}
        extracted = extract_usage(body, provider_id=provider, **kwargs)
        return float(extracted.calc_price().total_price)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL + 1e-9 * max(abs(a), abs(b))


def ant_ev(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def anthropic_stream_usage(text: str, start_usage: dict[str, Any], delta_usage: dict[str, Any] | None,
                           model: str = CLAUDE) -> list[bytes]:
    """A streamed message with the usage objects given verbatim in message_start and message_delta."""
    out = [ant_ev("message_start", {"message": {
        "id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})]
    out.append(ant_ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
    out.append(ant_ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}))
    out.append(ant_ev("content_block_stop", {"index": 0}))
    delta: dict[str, Any] = {"delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    if delta_usage is not None:
        delta["usage"] = delta_usage
    out.append(ant_ev("message_delta", delta))
    out.append(ant_ev("message_stop", {}))
    return out


def chat_chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: Any = None,
               model: str = GPT) -> bytes:
    data: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000,
                            "model": model, "choices": [] if delta is None else
                            [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        data["usage"] = usage
    return b"data: " + orjson.dumps(data) + b"\n\n"


def oa(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0, default_headers=headers(run))


def an(h: Harness, run: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0, default_headers=headers(run))


PROBE_PRICE = {"input_per_mtok": 3.0, "output_per_mtok": 7.0}
CACHE_USAGE_CHAT = {"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500,
                    "prompt_tokens_details": {"cached_tokens": 600, "audio_tokens": 0},
                    "completion_tokens_details": {"reasoning_tokens": 300, "audio_tokens": 0}}


# -- OpenAI Chat Completions: cached and reasoning tokens ------------------------------------------------


async def test_chat_cached_tokens_priced_at_cache_rate_reasoning_counted_once(gateway_factory: GatewayFactory) -> None:
    """README: 'After the answer the reservation is settled to the provider's usage ... Prices come from
    `genai-prices`'. 600 of 1000 prompt tokens were cached (gpt-4o-mini cached read is half the input
    rate) and 300 of 500 completion tokens were reasoning (already inside completion_tokens): genai-prices
    charges that, and the run counts 500 output tokens, not 800."""
    h = await gateway_factory(agents=agents())
    body = {**openai_completion(), "usage": CACHE_USAGE_CHAT}
    h.fake.queue(Reply(body=body))
    async with oa(h, "chat-cache") as client:
        await client.chat.completions.create(model=GPT, messages=MSG, max_tokens=600)  # type: ignore[arg-type]
    view = await h.run("chat-cache")
    assert view["input_tokens"] == 1000 and view["output_tokens"] == 500, view
    want = genai_cost(body, "openai", "chat")
    assert close(view["spent_usd"], want), f"spent {view['spent_usd']}, genai-prices says {want}"


async def test_chat_stream_usage_settles_like_the_same_answer_unstreamed(gateway_factory: GatewayFactory) -> None:
    """README: 'After the answer the reservation is settled to the provider's usage'. One answer, once
    streamed (usage chunk with cache/reasoning details) and once not: the two runs are charged alike."""
    h = await gateway_factory(agents=agents())
    h.fake.queue(Reply(body={**openai_completion("Hello!"), "usage": CACHE_USAGE_CHAT}))
    chunks = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "Hello!"}),
              chat_chunk({}, "stop"), chat_chunk(None, usage=CACHE_USAGE_CHAT), b"data: [DONE]\n\n"]
    h.fake.queue(Reply(chunks=chunks))
    async with oa(h, "chat-ns") as client:
        await client.chat.completions.create(model=GPT, messages=MSG, max_tokens=600)  # type: ignore[arg-type]
    async with oa(h, "chat-s") as client:
        stream = await client.chat.completions.create(model=GPT, messages=MSG, max_tokens=600,  # type: ignore[arg-type]
                                                      stream=True)
        async for _ in stream:
            pass
    a, b = await settled(h, "chat-ns"), await settled(h, "chat-s")
    assert (a["input_tokens"], a["output_tokens"]) == (b["input_tokens"], b["output_tokens"]) == (1000, 500)
    assert close(a["spent_usd"], b["spent_usd"]), (a["spent_usd"], b["spent_usd"])


async def test_chat_config_price_by_hand(gateway_factory: GatewayFactory) -> None:
    """DESIGN 5: `pricing:` is 'USD per million tokens; overrides genai-prices'. gpt-4o-mini priced at
    3/7 per Mtok in the config: 1000 in + 500 out = 0.003 + 0.0035 (no cache rate configured, so the
    600 cached tokens cost the input rate); genai-prices' own 0.15/0.6 must not be used."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE})
    h.fake.queue(Reply(body={**openai_completion(), "usage": CACHE_USAGE_CHAT}))
    status, _, raw = await post(h, {"model": GPT, "messages": MSG, "max_tokens": 600}, "cfg")
    assert status == 200, raw
    view = await h.run("cfg")
    assert close(view["spent_usd"], 1000 * 3e-6 + 500 * 7e-6), view["spent_usd"]


async def test_provider_prefixed_model_priced_by_the_bare_name_entry(gateway_factory: GatewayFactory) -> None:
    """DESIGN 5: 'Pricing and `models:` globs match the model name the agent sent, without a
    `provider/` prefix'. `openai/gpt-4o-mini` must be priced by the `gpt-4o-mini` entry."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE})
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=100, completion_tokens=10)))
    status, _, raw = await post(h, {"model": f"openai/{GPT}", "messages": MSG, "max_tokens": 50}, "prefix")
    assert status == 200, raw
    view = await h.run("prefix")
    assert close(view["spent_usd"], 100 * 3e-6 + 10 * 7e-6), view["spent_usd"]


async def test_dated_model_glob_entry_beats_genai_prices(gateway_factory: GatewayFactory) -> None:
    """DESIGN 5: `pricing:` globs 'override genai-prices'. A glob `gpt-4o-mini*` covers the dated
    snapshot `gpt-4o-mini-2024-07-18` (which genai-prices also knows, at other rates)."""
    h = await gateway_factory(agents=agents(), pricing={"gpt-4o-mini*": PROBE_PRICE})
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=100, completion_tokens=10)))
    body = {"model": "gpt-4o-mini-2024-07-18", "messages": MSG, "max_tokens": 50}
    status, _, raw = await post(h, body, "dated")
    assert status == 200, raw
    view = await h.run("dated")
    assert close(view["spent_usd"], 100 * 3e-6 + 10 * 7e-6), view["spent_usd"]


# -- Responses API ---------------------------------------------------------------------------------------


async def test_responses_details_priced_like_genai_prices(gateway_factory: GatewayFactory) -> None:
    """README: 'Prices come from `genai-prices`' and the reservation 'is settled to the provider's
    usage'. Responses usage with `input_tokens_details.cached_tokens` and
    `output_tokens_details.reasoning_tokens`, streamed and not: both as genai-prices prices it."""
    h = await gateway_factory(agents=agents())
    usage = {"input_tokens": 1000, "output_tokens": 500, "total_tokens": 1500,
             "input_tokens_details": {"cached_tokens": 600}, "output_tokens_details": {"reasoning_tokens": 300}}
    body = {**response_body("Hi"), "usage": usage}
    h.fake.queue(Reply(body=body))
    stream = response_stream(["Hi"])
    final = orjson.loads(stream[-1].split(b"data: ", 1)[1])
    final["response"]["usage"] = usage
    stream[-1] = b"event: response.completed\ndata: " + orjson.dumps(final) + b"\n\n"
    h.fake.queue(Reply(chunks=stream))
    async with oa(h, "resp-ns") as client:
        await client.responses.create(model=GPT, input="hello", max_output_tokens=600)
    async with oa(h, "resp-s") as client:
        events = await client.responses.create(model=GPT, input="hello", max_output_tokens=600, stream=True)
        async for _ in events:
            pass
    want = genai_cost(body, "openai", "responses")
    for run in ("resp-ns", "resp-s"):
        view = await settled(h, run)
        assert view["input_tokens"] == 1000 and view["output_tokens"] == 500, view
        assert close(view["spent_usd"], want), f"{run}: spent {view['spent_usd']}, genai-prices says {want}"


# -- Anthropic: cache reads and writes ------------------------------------------------------------------

ANT_CACHE_5M = {"input_tokens": 100, "output_tokens": 50, "cache_read_input_tokens": 1000,
                "cache_creation_input_tokens": 2000,
                "cache_creation": {"ephemeral_5m_input_tokens": 2000, "ephemeral_1h_input_tokens": 0}}


async def test_anthropic_cache_read_and_write_priced_at_their_rates(gateway_factory: GatewayFactory) -> None:
    """README: 'Prices come from `genai-prices`'; DESIGN 5: tokens = input + output. Anthropic reports
    input without the cache: the run counts 100 + 1000 + 2000 input tokens, and the cache read/write
    tokens cost their own rates, as genai-prices computes."""
    h = await gateway_factory(agents=agents())
    body = {**anthropic_message(), "usage": ANT_CACHE_5M}
    h.fake.queue(Reply(body=body))
    async with an(h, "ant-cache") as client:
        await client.messages.create(model=CLAUDE, max_tokens=64, messages=MSG)  # type: ignore[arg-type]
    view = await h.run("ant-cache")
    assert view["input_tokens"] == 3100 and view["output_tokens"] == 50, view
    want = genai_cost(body, "anthropic")
    assert close(view["spent_usd"], want), f"spent {view['spent_usd']}, genai-prices says {want}"


async def test_anthropic_1h_cache_write_priced_at_the_1h_rate(gateway_factory: GatewayFactory) -> None:
    """README: 'Prices come from `genai-prices`'. Anthropic bills a 1-hour cache write at 2x input
    (genai-prices: `cache_write_1h_mtok` 1.6 for Haiku 3.5, vs 1.0 for the 5-minute write), reported in
    `usage.cache_creation.ephemeral_1h_input_tokens`. 2000 tokens written for 1h cost 0.0032, not 0.002."""
    h = await gateway_factory(agents=agents())
    usage = {**ANT_CACHE_5M, "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 2000}}
    body = {**anthropic_message(), "usage": usage}
    h.fake.queue(Reply(body=body))
    async with an(h, "ant-1h") as client:
        await client.messages.create(model=CLAUDE, max_tokens=64, messages=MSG)  # type: ignore[arg-type]
    view = await h.run("ant-1h")
    want = genai_cost(body, "anthropic")
    assert close(view["spent_usd"], want), f"spent {view['spent_usd']}, genai-prices says {want}"


async def test_anthropic_1h_cache_write_streamed(gateway_factory: GatewayFactory) -> None:
    """README: 'Prices come from `genai-prices`', and a stream 'is settled to the provider's usage'.
    The same 1h cache write as above, reported in a stream's message_start: charged at the 1h rate."""
    h = await gateway_factory(agents=agents())
    start = {"input_tokens": 100, "output_tokens": 1, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 2000,
             "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 2000}}
    h.fake.queue(Reply(chunks=anthropic_stream_usage("Hello!", start, {"output_tokens": 50})))
    async with an(h, "ant-1h-s") as client:
        async with client.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG) as s:  # type: ignore[arg-type]
            await s.get_final_message()
    view = await settled(h, "ant-1h-s")
    body = {**anthropic_message(), "usage": {**start, "output_tokens": 50}}
    want = genai_cost(body, "anthropic")
    assert close(view["spent_usd"], want), f"spent {view['spent_usd']}, genai-prices says {want}"


async def test_anthropic_web_search_requests_are_charged(gateway_factory: GatewayFactory) -> None:
    """README: 'Prices come from `genai-prices`'; server tools 'run upstream before any answer comes
    back'. Anthropic bills $10 per 1000 web searches (`usage.server_tool_use.web_search_requests`,
    genai-prices `web_searches_kcount`): 5 searches add $0.05 the run must be charged."""
    h = await gateway_factory(agents=agents())
    usage = {"input_tokens": 100, "output_tokens": 50, "server_tool_use": {"web_search_requests": 5}}
    body = {**anthropic_message(), "usage": usage}
    h.fake.queue(Reply(body=body))
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    status, _, raw = await post(h, {"model": CLAUDE, "max_tokens": 64, "messages": MSG, "tools": tools},
                                "ant-ws", MESSAGES)
    assert status == 200, raw
    view = await h.run("ant-ws")
    want = genai_cost(body, "anthropic")
    assert close(view["spent_usd"], want), f"spent {view['spent_usd']}, genai-prices says {want}"


async def test_anthropic_stream_with_cache_equals_unstreamed(gateway_factory: GatewayFactory) -> None:
    """README: 'After the answer the reservation is settled to the provider's usage'. The cache counts
    come in message_start, the final output (and, as the API now does, cumulative input counts) in
    message_delta: the stream is charged as the same answer unstreamed."""
    h = await gateway_factory(agents=agents())
    h.fake.queue(Reply(body={**anthropic_message(), "usage": ANT_CACHE_5M}))
    start = {**ANT_CACHE_5M, "output_tokens": 1}
    delta = {k: v for k, v in ANT_CACHE_5M.items() if k != "cache_creation"}
    h.fake.queue(Reply(chunks=anthropic_stream_usage("Hello!", start, delta)))
    async with an(h, "ant-ns") as client:
        await client.messages.create(model=CLAUDE, max_tokens=64, messages=MSG)  # type: ignore[arg-type]
    async with an(h, "ant-s") as client:
        async with client.messages.stream(model=CLAUDE, max_tokens=64, messages=MSG) as s:  # type: ignore[arg-type]
            await s.get_final_message()
    a, b = await settled(h, "ant-ns"), await settled(h, "ant-s")
    assert (a["input_tokens"], a["output_tokens"]) == (b["input_tokens"], b["output_tokens"]) == (3100, 50)
    assert close(a["spent_usd"], b["spent_usd"]), (a["spent_usd"], b["spent_usd"])


async def test_tiered_price_picks_the_long_context_tier(gateway_factory: GatewayFactory) -> None:
    """README: 'Prices come from `genai-prices`'. claude-sonnet-4-5 costs double past 200k input tokens
    (all token kinds, chosen by total input incl. cache): 150k plain + 100k cache read = 250k input."""
    h = await gateway_factory(agents=agents())
    model = "claude-sonnet-4-5"
    usage = {"input_tokens": 150_000, "output_tokens": 50, "cache_read_input_tokens": 100_000,
             "cache_creation_input_tokens": 0}
    body = {**anthropic_message(model=model), "usage": usage}
    h.fake.queue(Reply(body=body))
    status, _, raw = await post(h, {"model": model, "max_tokens": 64, "messages": MSG}, "tier", MESSAGES)
    assert status == 200, raw
    view = await h.run("tier")
    want = genai_cost(body, "anthropic")
    assert close(view["spent_usd"], want), f"spent {view['spent_usd']}, genai-prices says {want}"


# -- usage a buggy upstream reports: never believed, never a credit --------------------------------------


async def reserved_then_spent(h: Harness, run: str, path: str, body: dict[str, Any], reply: Reply,
                              stream: bool = False) -> tuple[float, dict[str, Any]]:
    """Reserved USD while the call is upstream (read once the fake holds it), then the settled run."""
    reply.delay = max(reply.delay, 0.3)
    h.fake.queue(reply)
    seen = len(h.fake.seen)
    task = asyncio.create_task(post(h, {**body, "stream": stream}, run, path))
    await asyncio.wait_for(h.fake.wait_seen(seen + 1), 5)
    reserved = (await h.run(run))["reserved_usd"]
    status, _, raw = await task
    assert status == 200, raw
    return reserved, await settled(h, run)


BAD_COUNTS = [-5, "12", 1.5, 2**60]


@pytest.mark.parametrize("bad", BAD_COUNTS, ids=["negative", "string", "fraction", "huge"])
async def test_chat_absurd_usage_settles_at_the_reservation(gateway_factory: GatewayFactory, bad: Any) -> None:
    """README: usage that cannot be believed is treated like missing usage: the step 'is settled at the
    full reservation ... never at $0'. A completion_tokens of {bad} must neither credit the budget back
    nor be charged as 0."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE})
    reply = Reply(body={**openai_completion(), "usage": {"prompt_tokens": 10, "completion_tokens": bad}})
    reserved, view = await reserved_then_spent(h, f"bad-chat-{bad}", CHAT,
                                               {"model": GPT, "messages": MSG, "max_tokens": 100}, reply)
    assert reserved > 0
    assert close(view["spent_usd"], reserved), f"reserved {reserved}, spent {view['spent_usd']}"


@pytest.mark.parametrize("bad", [-5, None, "12"], ids=["negative", "null", "string"])
async def test_anthropic_stream_absurd_final_output_settles_at_the_reservation(gateway_factory: GatewayFactory,
                                                                              bad: Any) -> None:
    """README: 'a stream without a usage chunk ... is settled at the full reservation'. The
    message_delta that carries a stream's real output count says {bad}: the output count is unknown, so
    the step is charged its reservation, not message_start's 1-token placeholder."""
    h = await gateway_factory(agents=agents(), pricing={"claude-*": PROBE_PRICE})
    chunks = anthropic_stream_usage("x" * 400, {"input_tokens": 10, "output_tokens": 1}, {"output_tokens": bad})
    body = {"model": CLAUDE, "max_tokens": 100, "messages": MSG}
    reserved, view = await reserved_then_spent(h, f"bad-ant-{bad}", MESSAGES, body, Reply(chunks=chunks),
                                               stream=True)
    assert close(view["spent_usd"], reserved), (
        f"reserved {reserved}, spent {view['spent_usd']} (output tokens charged {view['output_tokens']})")


async def test_chat_stream_garbage_final_usage_does_not_keep_running_usage(gateway_factory: GatewayFactory) -> None:
    """README: a stream 'that broke (whatever running usage it reported), is settled at the full
    reservation', and unbelievable usage is no usage. An upstream with running usage per chunk (vLLM
    continuous_usage_stats) whose final usage chunk is garbage: the step must not settle at the first
    chunk's running count (1 output token)."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE})
    running = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
    chunks = [chat_chunk({"role": "assistant", "content": "x" * 400}, usage=running), chat_chunk({}, "stop"),
              chat_chunk(None, usage={"prompt_tokens": 10, "completion_tokens": -1, "total_tokens": 9}),
              b"data: [DONE]\n\n"]
    body = {"model": GPT, "messages": MSG, "max_tokens": 100, "stream_options": {"include_usage": True}}
    reserved, view = await reserved_then_spent(h, "bad-chat-stream", CHAT, body, Reply(chunks=chunks), stream=True)
    assert close(view["spent_usd"], reserved), (
        f"reserved {reserved}, spent {view['spent_usd']} (output tokens charged {view['output_tokens']})")


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_empty_usage_object_is_not_free(gateway_factory: GatewayFactory, path: str) -> None:
    """README: 'a stream without a usage chunk ... is settled at the full reservation ... never at $0'.
    An answer whose `usage` is an empty object reports no counts at all: it is usage missing, not a
    call that used 0 tokens, so the run must not be charged $0 for an answer it received."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE, "claude-*": PROBE_PRICE})
    if path == CHAT:
        body, reply = ({"model": GPT, "messages": MSG, "max_tokens": 100},
                       Reply(body={**openai_completion("x" * 400), "usage": {}}))
    elif path == MESSAGES:
        body, reply = ({"model": CLAUDE, "messages": MSG, "max_tokens": 100},
                       Reply(body={**anthropic_message("x" * 400), "usage": {}}))
    else:
        body, reply = ({"model": GPT, "input": "hello", "max_output_tokens": 100},
                       Reply(body={**response_body("x" * 400), "usage": {}}))
    reserved, view = await reserved_then_spent(h, "empty-" + path.rsplit("/", 1)[-1], path, body, reply)
    assert view["spent_usd"] > 0, f"a received answer with usage {{}} was charged $0 (reserved {reserved})"
    assert close(view["spent_usd"], reserved), f"reserved {reserved}, spent {view['spent_usd']}"


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_missing_usage_charged_the_reservation(gateway_factory: GatewayFactory, path: str) -> None:
    """README: 'a stream without a usage chunk ... is settled at the full reservation'. Non-streamed
    answers without any `usage` field: same rule (never at $0)."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE, "claude-*": PROBE_PRICE})
    if path == CHAT:
        answer = openai_completion()
        body = {"model": GPT, "messages": MSG, "max_tokens": 100}
    elif path == MESSAGES:
        answer = anthropic_message()
        body = {"model": CLAUDE, "messages": MSG, "max_tokens": 100}
    else:
        answer = response_body()
        body = {"model": GPT, "input": "hello", "max_output_tokens": 100}
    answer.pop("usage")
    reserved, view = await reserved_then_spent(h, "nousage-" + path.rsplit("/", 1)[-1], path, body,
                                               Reply(body=answer))
    assert reserved > 0 and close(view["spent_usd"], reserved), f"reserved {reserved}, spent {view['spent_usd']}"


async def test_chat_stream_without_usage_chunk_charged_the_reservation(gateway_factory: GatewayFactory) -> None:
    """README: 'a stream without a usage chunk ... is settled at the full reservation'."""
    h = await gateway_factory(agents=agents(), pricing={GPT: PROBE_PRICE})
    chunks = openai_stream(["Hel", "lo"], usage=None)
    reserved, view = await reserved_then_spent(h, "nousage-stream", CHAT,
                                               {"model": GPT, "messages": MSG, "max_tokens": 100},
                                               Reply(chunks=chunks), stream=True)
    assert close(view["spent_usd"], reserved), f"reserved {reserved}, spent {view['spent_usd']}"


# -- the reservation covers the settlement ----------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
async def test_settled_never_above_reserved_for_a_worst_case_answer(gateway_factory: GatewayFactory,
                                                                     path: str) -> None:
    """README: 'the budget guard reserves the worst case ... an upper bound of the input tokens (the UTF-8
    size of the request body) ... plus the output limit'. An answer using exactly that many input tokens
    and all of max_tokens, priced by genai-prices (cache reads/writes included): settled <= reserved,
    and the reservation equals bytes x worst input rate + max_tokens x worst output rate."""
    h = await gateway_factory(agents=agents())
    if path == CHAT:
        body = {"model": GPT, "messages": MSG, "max_tokens": 100}
        n = len(orjson.dumps({**body, "stream": False}))
        reply = Reply(body=openai_completion(prompt_tokens=n, completion_tokens=100))
        rates = (0.15e-6, 0.6e-6)
    elif path == MESSAGES:
        # the request lets Anthropic write its cache (a top-level `cache_control`): the worst input is a write
        body = {"model": CLAUDE, "messages": MSG, "max_tokens": 100, "cache_control": {"type": "ephemeral"}}
        n = len(orjson.dumps({**body, "stream": False}))
        usage = {"input_tokens": 0, "cache_creation_input_tokens": n, "output_tokens": 100}
        reply = Reply(body={**anthropic_message(), "usage": usage})
        rates = (1.0e-6, 4e-6)  # worst input of Haiku 3.5 is its (5m) cache write
    else:
        body = {"model": GPT, "input": "hello", "max_output_tokens": 100}
        n = len(orjson.dumps({**body, "stream": False}))
        reply = Reply(body=response_body(usage=(n, 100)))
        rates = (0.15e-6, 0.6e-6)
    reserved, view = await reserved_then_spent(h, "worst-" + path.rsplit("/", 1)[-1], path, body, reply)
    assert view["spent_usd"] <= reserved + 1e-12, f"settled {view['spent_usd']} above reserved {reserved}"
    assert float(Decimal(reserved)) >= n * rates[0] + 100 * rates[1] - 1e-12, reserved


async def test_reservation_covers_a_1h_cache_write_at_its_rate(gateway_factory: GatewayFactory) -> None:
    """README: 'the budget guard reserves the worst case' of the input bound; pricing.py's own
    `worst_input` says 'a cache write can cost more than plain input'. A request that asks for a 1-hour
    cache (`cache_control.ttl: 1h`) may be billed every input token at the 1h write rate (Haiku 3.5:
    $1.6/Mtok in genai-prices), so the reservation must be at least bytes x 1.6e-6 + max_tokens x 4e-6."""
    h = await gateway_factory(agents=agents())
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello " * 50,
                                               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]
    body = {"model": CLAUDE, "messages": messages, "max_tokens": 100}
    n = len(orjson.dumps({**body, "stream": False}))
    usage = {"input_tokens": 0, "cache_creation_input_tokens": n, "output_tokens": 100,
             "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": n}}
    reply = Reply(body={**anthropic_message(), "usage": usage})
    reserved, view = await reserved_then_spent(h, "worst-1h", MESSAGES, body, reply)
    assert reserved >= n * 1.6e-6 + 100 * 4e-6 - 1e-12, f"reserved {reserved} < 1h worst case {n * 1.6e-6 + 4e-4}"
    assert view["spent_usd"] <= reserved + 1e-12
