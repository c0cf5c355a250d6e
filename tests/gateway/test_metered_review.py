"""Review of commit e013900 (embeddings, legacy completions and `/v1/responses/compact` metered like model
calls). Each test here fails on that commit because of a defect its docstring names; the official OpenAI
SDK drives a running gateway against the loopback fake provider."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, openai_embedding, openai_text_completion

IN, OUT = 1.0, 2.0  # USD per million tokens
PRICING = {"gpt-*": {"input_per_mtok": IN, "output_per_mtok": OUT},
           "text-embedding-*": {"input_per_mtok": IN, "output_per_mtok": 0.0}}
MODELS = {"gpt-*": "openai", "text-embedding-*": "openai", "claude-*": "anthropic"}
EMBED, INSTRUCT, GPT = "text-embedding-3-small", "gpt-3.5-turbo-instruct", "gpt-4o-mini"
COMPACT_INPUT: list[Any] = [{"role": "user", "content": "hi"}]


async def make(factory: GatewayFactory, **policy: Any) -> Harness:
    return await factory(pricing=PRICING, models=MODELS, agents={"bot": policy})


def client(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="agent-key", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


@pytest.mark.parametrize("field", ["n", "best_of"])
async def test_a_wild_choice_count_is_a_400_not_a_sticky_budget_stop(
        gateway_factory: GatewayFactory, field: str) -> None:
    """Every choice of a legacy completion is reserved (`n` per prompt, or `best_of`), so a wild count
    multiplies the worst case by itself. Model calls bound `n` (`MAX_CHOICES` = 128 in
    `gateway/providers/openai_chat.py`, "a wild `n` is a 400, not a stop"); `parse_completions` takes any
    integer >= 1, so `n: 1000000` under a $1 budget is reserved as $32, refused as `budget_exhausted` and
    STOPS the run (sticky) although nothing was spent and OpenAI itself would answer 400 (n <= 128,
    best_of <= 20). Correct: a 400 `invalid_request` in OpenAI's format, the run still active."""
    h = await make(gateway_factory, budget={"usd": 1.0})
    async with client(h, f"wild-{field}") as oa:
        with pytest.raises(openai.BadRequestError) as caught:
            await oa.completions.create(model=INSTRUCT, prompt="x", max_tokens=16, **{field: 10**6})
        assert caught.value.code == "invalid_request"
        assert h.fake.seen == []
        h.fake.queue(Reply(body=openai_text_completion("ok")))
        await oa.completions.create(model=INSTRUCT, prompt="x", max_tokens=16)  # the run goes on
    run = await h.run(f"wild-{field}")
    assert (run["status"], run["stop_reason"]) == ("active", None)


async def test_a_compaction_the_budget_cannot_hold_whole_does_not_stop_a_run_with_budget_left(
        gateway_factory: GatewayFactory) -> None:
    """Compaction reserves the model's whole output limit, "granted whole or refused" (README). Here the
    run has spent nothing and its $0.01 budget pays chat calls, but not 32,768 output tokens ($0.066).
    The store is asked for `min_units == max_units == model limit` (`gateway/metered.py` `output_bound`),
    so `logic.reserve` treats the unpaid bound as a spent budget and stops the run for good with
    `budget_exhausted`: one context-housekeeping call, which the Agents SDK may trigger by itself, kills
    a run that has 100% of its budget left, and every later model call is refused. Correct: that
    compaction alone is refused (a 4xx), the run stays active and the next chat call goes through."""
    h = await make(gateway_factory, budget={"usd": 0.01})
    async with client(h, "cpt-stop") as oa:
        with pytest.raises(openai.APIStatusError) as caught:
            await oa.responses.compact(model=GPT, input=COMPACT_INPUT)
        assert 400 <= caught.value.status_code < 500
        run = await h.run("cpt-stop")
        assert run["spent_usd"] == 0
        assert (run["status"], run["stop_reason"]) == ("active", None)
        answer = await oa.chat.completions.create(model=GPT, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=5)
        assert answer.choices[0].message.content


@pytest.mark.parametrize("sent", ["absent", "null"])
async def test_a_budgeted_completion_tells_the_upstream_the_limit_it_reserved(
        gateway_factory: GatewayFactory, sent: str) -> None:
    """A legacy completion without `max_tokens` (or with `max_tokens: null`) is reserved 16 output tokens,
    "as upstream", but the body goes upstream without a limit: `guard_before` writes the grant only when
    `grant.units != call.max_tokens`, and `parse_completions` sets `call.max_tokens = 16` itself, so the
    grant (16) is never written. 16 is OpenAI's default only: an OpenAI-wire server tollgate routes to
    (`type: openai`, e.g. llama.cpp, whose `/v1/completions` generates until EOS or the context is full
    without a limit; vLLM reads an explicit `null` as "up to the context") generates far more, and the
    settlement believes its usage: the budget is overspent. Chat calls write the granted limit whenever
    the budget claims output. Correct: a budgeted completion goes upstream with `max_tokens` = the grant,
    so an upstream that honours `max_tokens` cannot bill more than was reserved.

    The fake upstream here behaves like llama.cpp: it honours `max_tokens` when sent, else generates 1000."""
    h = await make(gateway_factory, budget={"tokens": 300})
    fake = h.fake

    def like_llama_cpp(path: str) -> Reply:
        limit = fake.seen[-1].json.get("max_tokens")
        generated = 1000 if limit is None else min(limit, 1000)
        return Reply(body=openai_text_completion("x" * generated, prompt_tokens=2, completion_tokens=generated))

    fake._next = like_llama_cpp  # type: ignore[method-assign]  # the request is in `seen` before a reply is picked
    extra: dict[str, Any] = {} if sent == "absent" else {"extra_body": {"max_tokens": None}}
    async with client(h, f"limit-{sent}") as oa:
        await oa.completions.create(model=INSTRUCT, prompt="x", **extra)
    assert fake.seen[-1].json.get("max_tokens") == 16
    run = await h.run(f"limit-{sent}")
    assert run["input_tokens"] + run["output_tokens"] <= 300  # the run's token budget


async def test_metered_spans_do_not_claim_the_chat_completions_api(gateway_factory: GatewayFactory) -> None:
    """`openai.api.type` names the OpenAI API of an inference span; semconv defines `chat_completions`
    and `responses` only. The metered embeddings and legacy-completion steps are built as
    `Call(protocol="openai")` (`gateway/metered.py` `parse_embeddings` / `parse_completions`), and
    `otel/attributes.py` `_API_TYPES` maps protocol "openai" to `chat_completions`, so their spans say they
    are Chat Completions calls: a backend grouping by API type mixes embeddings into chat traffic.
    Correct: no `openai.api.type` (or never `chat_completions`) on `embeddings` / `text_completion` spans."""
    h = await make(gateway_factory, budget={"usd": 1.0})
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry
    h.fake.queue(Reply(body=openai_embedding(1, prompt_tokens=7)),
                 Reply(body=openai_text_completion(prompt_tokens=3, completion_tokens=2)))
    try:
        async with client(h, "spans") as oa:
            await oa.embeddings.create(model=EMBED, input="hello")
            await oa.completions.create(model=INSTRUCT, prompt="x", max_tokens=5)
        assert telemetry.force_flush()
        spans = {s.name: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
        for name in (f"embeddings {EMBED}", f"text_completion {INSTRUCT}"):
            assert name in spans
            assert spans[name].get("openai.api.type") != "chat_completions", (name, spans[name])
    finally:
        telemetry.shutdown()
