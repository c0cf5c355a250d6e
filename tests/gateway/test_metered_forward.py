"""Metered forwarded paths end to end with the official OpenAI SDK: `POST /v1/embeddings`,
`/v1/completions` (streamed and not) and `/v1/responses/compact` are reserved before they go upstream
and settled to their usage after, like model calls (README "Runs, identity, decisions"). Loopback fakes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import (
    Reply,
    openai_compaction,
    openai_embedding,
    openai_text_completion,
    openai_text_stream,
)

IN, OUT = 1.0, 2.0  # USD per million tokens
PRICING = {"gpt-*": {"input_per_mtok": IN, "output_per_mtok": OUT},
           "text-embedding-*": {"input_per_mtok": IN, "output_per_mtok": 0.0}}
MODELS = {"gpt-*": "openai", "text-embedding-*": "openai", "claude-*": "anthropic"}
EMBED, INSTRUCT, GPT = "text-embedding-3-small", "gpt-3.5-turbo-instruct", "gpt-4o-mini"
COMPACT_INPUT: list[Any] = [{"role": "user", "content": "hi"}]


def usd(input_tokens: int, output_tokens: int = 0) -> float:
    return (input_tokens * IN + output_tokens * OUT) / 1e6


async def make(factory: GatewayFactory, **policy: Any) -> Harness:
    return await factory(pricing=PRICING, models=MODELS, agents={"bot": policy})


def client(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="agent-key", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


async def until(h: Harness, run: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The admin view of `run` once `ok` holds: a streamed step is recorded after the stream's end has
    left, which no client can await."""
    deadline = time.monotonic() + 5
    while True:
        view = await h.run(run)
        if ok(view) or time.monotonic() > deadline:
            return view
        await asyncio.sleep(0.01)


async def test_embeddings_are_charged_their_input_tokens(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(body=openai_embedding(2, prompt_tokens=8)))
    async with client(h, "emb") as oa:
        result = await oa.embeddings.create(model=EMBED, input=["hello", "world"], encoding_format="float")
    assert [len(d.embedding) for d in result.data] == [3, 3]
    run = await h.run("emb")
    assert run["spent_usd"] == pytest.approx(usd(8)) and run["reserved_usd"] == 0
    assert (run["input_tokens"], run["output_tokens"], run["llm_calls"]) == (8, 0, 0)
    [step] = run["steps"]
    assert (step["operation"], step["model"], step["status"]) == ("embeddings", EMBED, 200)
    assert step["cost_usd"] == pytest.approx(usd(8))
    seen = h.fake.seen[-1]
    assert (seen.path, seen.headers["Authorization"]) == ("/v1/embeddings", "Bearer sk-provider-openai")
    assert seen.json == {"model": EMBED, "input": ["hello", "world"], "encoding_format": "float"}


async def test_completions_are_charged_their_usage_and_count_as_llm_calls(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(body=openai_text_completion("Paris.", prompt_tokens=12, completion_tokens=3)))
    async with client(h, "cmp") as oa:
        result = await oa.completions.create(model=INSTRUCT, prompt="The capital of France is", max_tokens=50)
    assert result.choices[0].text == "Paris."
    run = await h.run("cmp")
    assert run["spent_usd"] == pytest.approx(usd(12, 3)) and run["reserved_usd"] == 0
    assert (run["input_tokens"], run["output_tokens"], run["llm_calls"]) == (12, 3, 1)
    assert run["steps"][-1]["operation"] == "text_completion"
    assert h.fake.seen[-1].json["max_tokens"] == 50  # the budget pays for it: sent as it came


async def test_a_streamed_completion_streams_and_is_charged_its_usage(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(chunks=openai_text_stream(["Par", "is."], usage=(12, 3))))
    async with client(h, "cs") as oa:
        stream = await oa.completions.create(model=INSTRUCT, prompt="The capital of France is", stream=True)
        chunks = [chunk async for chunk in stream]
    # tollgate asked for the usage chunk; the agent did not, so it never sees it
    assert all(chunk.choices for chunk in chunks) and all(chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].text for c in chunks) == "Paris."
    assert h.fake.seen[-1].json["stream_options"] == {"include_usage": True}
    run = await until(h, "cs", lambda r: bool(r["steps"]))
    assert run["spent_usd"] == pytest.approx(usd(12, 3)) and run["reserved_usd"] == 0
    assert run["steps"][-1]["stream"] is True


async def test_a_usage_chunk_the_agent_asked_for_reaches_it(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(chunks=openai_text_stream(["ok"], usage=(7, 1))))
    async with client(h, "cu") as oa:
        stream = await oa.completions.create(model=INSTRUCT, prompt="x", stream=True, max_tokens=5,
                                             stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 7
    assert (await h.run("cu"))["spent_usd"] == pytest.approx(usd(7, 1))


async def test_compact_is_charged_its_usage_and_is_no_llm_call(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0}, caps={"llm_calls": 1})
    h.fake.queue(Reply(body=openai_compaction(input_tokens=40, output_tokens=12)))
    async with client(h, "cpt") as oa:
        result = await oa.responses.compact(model=GPT, input=COMPACT_INPUT)
    assert result.object == "response.compaction" and result.usage.output_tokens == 12
    run = await h.run("cpt")
    assert run["spent_usd"] == pytest.approx(usd(40, 12)) and run["reserved_usd"] == 0
    assert (run["input_tokens"], run["output_tokens"], run["llm_calls"]) == (40, 12, 0)
    assert h.fake.seen[-1].path == "/v1/responses/compact"


async def test_only_legacy_completions_count_toward_the_llm_call_cap(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, caps={"llm_calls": 1})
    h.fake.queue(Reply(body=openai_embedding()), Reply(body=openai_compaction()),
                 Reply(body=openai_text_completion()))
    async with client(h, "cap") as oa:
        await oa.embeddings.create(model=EMBED, input="x")
        await oa.responses.compact(model=GPT, input=COMPACT_INPUT)
        await oa.completions.create(model=INSTRUCT, prompt="x")
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await oa.chat.completions.create(model=GPT, messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "llm_call_cap"
    assert (await h.run("cap"))["llm_calls"] == 1


@pytest.mark.parametrize("kind", ["embeddings", "completions"])
async def test_concurrent_calls_never_overspend_and_leave_nothing_reserved(
        gateway_factory: GatewayFactory, kind: str) -> None:
    prompt = "word " * 200  # ~1,000 bytes: each call reserves ~1,100 tokens of input
    bound = usd(len(prompt) + 100, 16 if kind == "completions" else 0)
    budget = 5.5 * bound
    h = await make(gateway_factory, budget={"usd": budget})
    if kind == "embeddings":
        h.fake.default = Reply(body=openai_embedding(prompt_tokens=len(prompt)), delay=0.05)
    else:
        h.fake.default = Reply(body=openai_text_completion(prompt_tokens=len(prompt), completion_tokens=16),
                               delay=0.05)

    async def one(oa: openai.AsyncOpenAI) -> str:
        try:
            if kind == "embeddings":
                await oa.embeddings.create(model=EMBED, input=prompt)
            else:
                await oa.completions.create(model=INSTRUCT, prompt=prompt)
        except openai.PermissionDeniedError as exc:
            assert exc.code in ("budget_exhausted", "token_budget_exhausted"), exc.body
            return "refused"
        return "ok"

    async with client(h, "conc") as oa:
        outcomes = await asyncio.gather(*(one(oa) for _ in range(50)))
    run = await h.run("conc")
    ok = outcomes.count("ok")
    assert 1 <= ok < 50 and len(h.fake.seen) == ok
    cost = usd(len(prompt), 16 if kind == "completions" else 0)
    assert run["spent_usd"] == pytest.approx(ok * cost) and run["spent_usd"] <= budget
    assert run["reserved_usd"] == 0 and run["reserved_tokens"] == 0
    assert len(run["steps"]) == 50  # the refused ones are steps too


async def test_a_bound_the_budget_cannot_pay_stops_the_run_on_every_path(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"tokens": 100})
    async with client(h, "stop") as oa:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await oa.embeddings.create(model=EMBED, input="x" * 200)
        assert caught.value.code == "token_budget_exhausted"
        assert caught.value.response.headers["x-tollgate-stop-reason"] == "token_budget_exhausted"
        calls: list[Callable[[], Any]] = [
            lambda: oa.embeddings.create(model=EMBED, input="x"),
            lambda: oa.completions.create(model=INSTRUCT, prompt="x", max_tokens=1),
            lambda: oa.completions.create(model=INSTRUCT, prompt="x", max_tokens=1, stream=True),
            lambda: oa.responses.compact(model=GPT, input=COMPACT_INPUT),
            lambda: oa.chat.completions.create(model=GPT, messages=[{"role": "user", "content": "x"}], max_tokens=1),
        ]
        for call in calls:  # sticky: each is refused with the run's reason, nothing goes upstream
            with pytest.raises(openai.PermissionDeniedError) as caught:
                await call()
            assert caught.value.code == "token_budget_exhausted"
            assert caught.value.response.headers["x-tollgate-stop-reason"] == "token_budget_exhausted"
    assert h.fake.seen == []
    run = await h.run("stop")
    assert (run["status"], run["stop_reason"], run["reserved_tokens"]) == ("stopped", "token_budget_exhausted", 0)
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = [r for r in ledger.rows() if r["run_id"] == "stop"]
    assert [r["operation"] for r in rows[:2]] == ["embeddings", "embeddings"]
    assert {r["decision"] for r in rows} == {"stop"}


async def test_a_stop_by_a_model_call_refuses_metered_calls(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, caps={"llm_calls": 1})
    async with client(h, "mstop") as oa:
        await oa.chat.completions.create(model=GPT, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.PermissionDeniedError):
            await oa.chat.completions.create(model=GPT, messages=[{"role": "user", "content": "x"}])
        for call in (lambda: oa.embeddings.create(model=EMBED, input="x"),
                     lambda: oa.embeddings.create(model="no-provider-serves-it", input="x"),
                     lambda: oa.responses.compact(model=GPT, input=COMPACT_INPUT)):
            with pytest.raises(openai.PermissionDeniedError) as caught:  # the run's reason, on every path
                await call()
            assert caught.value.code == "llm_call_cap"
    assert len(h.fake.seen) == 1


async def test_a_max_tokens_the_budget_cannot_pay_is_lowered(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"tokens": 1000})
    h.fake.queue(Reply(body=openai_text_completion(prompt_tokens=5, completion_tokens=5)))
    async with client(h, "low") as oa:
        raw = await oa.completions.with_raw_response.create(model=INSTRUCT, prompt="x", max_tokens=5000)
    sent = h.fake.seen[-1].json["max_tokens"]
    assert 16 <= sent < 1000 and raw.headers["x-tollgate-max-tokens"] == str(sent)
    assert (await h.run("low"))["reserved_tokens"] == 0


async def test_an_upstream_error_is_charged_nothing(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    h.fake.queue(Reply(status=500, body=error), Reply(status=500, body=error), Reply(status=500, body=error))
    async with client(h, "err") as oa:
        for call in (lambda: oa.embeddings.create(model=EMBED, input="x"),
                     lambda: oa.completions.create(model=INSTRUCT, prompt="x", stream=True),
                     lambda: oa.responses.compact(model=GPT, input=COMPACT_INPUT)):
            with pytest.raises(openai.InternalServerError):
                await call()
    run = await h.run("err")
    assert (run["spent_usd"], run["reserved_usd"], run["input_tokens"], run["output_tokens"]) == (0, 0, 0, 0)
    assert [s["status"] for s in run["steps"]] == [500, 500, 500]


async def test_a_stream_cut_midway_is_charged_its_reservation(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(chunks=openai_text_stream(["a", "b", "c"], usage=(3, 3)), cut_after=2))
    async with client(h, "cut") as oa:
        with pytest.raises(openai.APIError):
            stream = await oa.completions.create(model=INSTRUCT, prompt="x", max_tokens=40, stream=True)
            async for _ in stream:
                pass
    run = await until(h, "cut", lambda r: bool(r["steps"]))
    assert run["reserved_usd"] == 0 and run["output_tokens"] == 40  # the whole output it reserved
    assert run["input_tokens"] > 0
    assert run["spent_usd"] == pytest.approx(usd(run["input_tokens"], 40))


async def test_a_body_cut_midway_is_charged_its_reservation_and_not_ended(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    body = orjson.dumps(openai_embedding(prompt_tokens=1))
    h.fake.queue(Reply(chunks=[body[:20], body[20:]], cut_after=1, headers={"Content-Type": "application/json"}))
    async with client(h, "bcut") as oa:
        with pytest.raises(openai.APIError):
            await oa.embeddings.create(model=EMBED, input="x" * 100)
    run = await until(h, "bcut", lambda r: bool(r["steps"]))
    assert run["reserved_usd"] == 0 and run["output_tokens"] == 0
    assert run["input_tokens"] >= 100 and run["spent_usd"] == pytest.approx(usd(run["input_tokens"]))


async def test_an_unpriced_model_under_a_usd_budget_is_refused_as_a_model_call_is(
        gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(models={"*": "openai"}, agents={"bot": {"budget": {"usd": 1.0}}})
    async with client(h, "unpriced") as oa:
        with pytest.raises(openai.BadRequestError) as chat:
            await oa.chat.completions.create(model="my-model", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as emb:
            await oa.embeddings.create(model="my-model", input="x")
    assert emb.value.code == chat.value.code == "invalid_request"
    assert "no known price" in emb.value.message and "no known price" in chat.value.message
    assert h.fake.seen == []


async def test_an_embedding_model_genai_prices_lists_by_input_alone_is_priced_from_it(
        gateway_factory: GatewayFactory) -> None:
    """genai-prices gives embedding models an input price only: enough for a call that bills no output."""
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 1.0}}})
    h.fake.queue(Reply(body=openai_embedding(1, prompt_tokens=1_000)))
    async with client(h, "gp") as oa:
        await oa.embeddings.create(model=EMBED, input="hello")
    run = await h.run("gp")
    assert run["spent_usd"] == pytest.approx(1_000 * 0.02 / 1e6) and run["reserved_usd"] == 0


async def test_what_cannot_be_bounded_is_a_400_and_holds_nothing(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(body=openai_embedding()))
    async with client(h, "bad") as oa:
        await oa.embeddings.create(model=EMBED, input="x")
        with pytest.raises(openai.BadRequestError):
            await oa.responses.compact(model=GPT, previous_response_id="resp_1")
        with pytest.raises(openai.BadRequestError):
            await oa.post("/embeddings", body={"model": EMBED}, cast_to=object)
        with pytest.raises(openai.BadRequestError):
            await oa.post("/completions", body={"model": INSTRUCT, "prompt": "x", "max_tokens": -1}, cast_to=object)
    run = await h.run("bad")
    assert run["reserved_usd"] == 0 and len(h.fake.seen) == 1


async def test_a_spelling_of_a_metered_path_is_metered(gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"tokens": 100})
    body = orjson.dumps({"model": EMBED, "input": "x" * 200})
    async with h.session.post(f"{h.url}/v1//Embeddings/", data=body,
                              headers={"content-type": "application/json", "x-tollgate-run-id": "sp",
                                       "x-tollgate-agent": "bot"}) as resp:
        assert resp.status == 403 and resp.headers["x-tollgate-stop-reason"] == "token_budget_exhausted"
    assert h.fake.seen == []


async def test_an_unchanged_body_travels_as_its_original_bytes_and_no_usage_is_charged_in_full(
        gateway_factory: GatewayFactory) -> None:
    h = await make(gateway_factory, budget={"usd": 1.0})
    h.fake.queue(Reply(body=b'{"object": "list", "data": []}'))
    exact = b'{"model":"text-embedding-3-small",   "input":["a","b"]}'
    async with h.session.post(f"{h.url}/v1/embeddings", data=exact,
                              headers={"content-type": "application/json", "x-tollgate-run-id": "raw",
                                       "x-tollgate-agent": "bot"}) as resp:
        assert resp.status == 200
        assert await resp.read() == b'{"object": "list", "data": []}'
    assert h.fake.seen[-1].body == exact
    run = await h.run("raw")
    assert (run["input_tokens"], run["output_tokens"], run["reserved_usd"]) == (len(exact), 0, 0)
    assert run["spent_usd"] == pytest.approx(usd(len(exact)))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_span_has_each_choice_s_finish_reason(gateway_factory: GatewayFactory,
                                                                 stream: bool) -> None:
    """semconv `gen_ai.response.finish_reasons` (one per choice, in choice order) on the span of a legacy
    completion, streamed or not, as a chat completion's."""
    h = await make(gateway_factory)
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry
    if stream:
        h.fake.queue(Reply(chunks=openai_text_stream(["Par", "is."])))
    else:
        answer = openai_text_completion("Paris.")
        answer["choices"].append({"index": 1, "text": "Lyon", "finish_reason": "length", "logprobs": None})
        h.fake.queue(Reply(body=answer))
    async with client(h, "why") as oa:
        if stream:
            async for _ in await oa.completions.create(model=INSTRUCT, prompt="x", stream=True):
                pass
        else:
            await oa.completions.create(model=INSTRUCT, prompt="x", n=2)
    await until(h, "why", lambda r: bool(r["steps"]))
    assert telemetry.force_flush()
    [span] = [s for s in exporter.get_finished_spans() if s.name == f"text_completion {INSTRUCT}"]
    reasons = dict(span.attributes or {})["gen_ai.response.finish_reasons"]
    assert reasons == (("stop",) if stream else ("stop", "length"))
    telemetry.shutdown()


async def test_a_compact_refused_for_its_whole_bound_names_what_the_budget_pays(gateway_factory: GatewayFactory) -> None:
    """A compaction reserves the model's whole output limit (128,000 for gpt-5) or is refused alone; the
    refusal said the budget left pays the provider's output-limit clamp (32768) whenever it paid more."""
    h = await make(gateway_factory, budget={"usd": 0.1})  # pays ~50,000 output tokens at $2 per million
    async with client(h, "cpt-refused") as oa:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await oa.responses.compact(model="gpt-5", input=COMPACT_INPUT)
    paid = int(re.search(r"the budget left pays (\d+)", caught.value.message).group(1))  # type: ignore[union-attr]
    run = await h.run("cpt-refused")
    assert run["status"] == "active" and run["reserved_usd"] == 0 and h.fake.seen == []
    assert 32768 < paid and usd(0, paid) <= 0.1  # what $0.1 pays at the output price, not the clamp
