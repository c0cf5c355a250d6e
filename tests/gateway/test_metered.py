"""`gateway.metered`: how each metered path is read, bounded, settled and guarded (pure tables)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.call import Usage
from gateway.config import Limits
from gateway.errors import InvalidRequest
from gateway.forward import GUARDED_PATHS, canonical_path
from gateway.metered import (
    COMPLETION_DEFAULT_TOKENS,
    METERS,
    CompletionStreamReader,
    MeteredAdapter,
    MeteredBudget,
    MeteredCaps,
    answer_of,
    guards_for,
    output_bound,
    output_free_claims,
    prompt_count,
)
from gateway.pricing import ModelPrice, Rate
from gateway.providers.sse import SseParser
from gateway.store import logic
from gateway.store.base import Claim, Denial, Reservation, ReserveRequest
from guards.bounds import MIN_OUTPUT_TOKENS
from tests.fakes.upstream import (
    openai_compaction,
    openai_embedding,
    openai_text_completion,
    openai_text_stream,
)
from tests.guards.support import NOW, PRICE, ctx, policy, run

EMBED, COMPLETE, COMPACT = (METERS[p] for p in ("/v1/embeddings", "/v1/completions", "/v1/responses/compact"))
LIMITS = Limits()


def parse(path: str, body: dict[str, Any]) -> Any:
    raw = orjson.dumps(body)
    return METERS[path].parse(body, raw, LIMITS)


def test_the_registry_is_keyed_by_canonical_paths_apart_from_the_model_calls() -> None:
    assert all(canonical_path(path) == path for path in METERS)
    assert not set(METERS) & set(GUARDED_PATHS)
    assert {(m.operation, m.upstream_path, m.output, m.llm_call) for m in METERS.values()} == {
        ("embeddings", "/embeddings", "none", False),
        ("text_completion", "/completions", "max_tokens", True),
        ("chat", "/responses/compact", "model_limit", False),
    }


@pytest.mark.parametrize(("path", "body", "fields"), [
    ("/v1/embeddings", {"model": "e", "input": "hi"}, {"operation": "embeddings", "max_tokens": None}),
    ("/v1/embeddings", {"model": "e", "input": [[1, 2, 3]], "dimensions": 8}, {"stream": False}),
    ("/v1/completions", {"model": "i", "prompt": "x"},
     {"max_tokens": COMPLETION_DEFAULT_TOKENS, "stream": False, "choices": 1, "operation": "text_completion"}),
    ("/v1/completions", {"model": "i", "prompt": "x", "max_tokens": 0, "echo": True}, {"max_tokens": 0}),
    ("/v1/completions", {"model": "i", "prompt": ["a", "b", "c"], "n": 2, "stream": True},
     {"choices": 6, "stream": True}),
    ("/v1/completions", {"model": "i", "prompt": [1, 2, 3], "n": 2, "best_of": 5}, {"choices": 5}),
    ("/v1/completions", {"model": "i", "prompt": [[1, 2], [3]], "max_tokens": 7}, {"choices": 2, "max_tokens": 7}),
    ("/v1/responses/compact", {"model": "g", "input": "hi", "instructions": "be brief"},
     {"operation": "chat", "max_tokens": None, "protocol": "openai_responses"}),
    ("/v1/responses/compact", {"model": "g", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, {"images": 1}),
])
def test_a_body_is_read_into_a_call_bounded_by_its_size(path: str, body: dict[str, Any],
                                                        fields: dict[str, Any]) -> None:
    call = parse(path, body)
    assert call.input_bytes == len(orjson.dumps(body)) and call.request_hash
    seen = {"operation": call.operation, "max_tokens": call.max_tokens, "stream": call.stream,
            "choices": call.params.choice_count or 1, "protocol": call.protocol, "images": call.input_images}
    assert {key: seen[key] for key in fields} == fields


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"input": "x"}, "model"),
    ("/v1/embeddings", {"model": "e"}, "input"),
    ("/v1/embeddings", {"model": "e", "input": []}, "input"),
    ("/v1/embeddings", {"model": "e", "input": "x", "stream": True}, "stream"),
    ("/v1/completions", {"model": "i"}, "prompt"),
    ("/v1/completions", {"model": "i", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "i", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "i", "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": "i", "prompt": "x", "n": 129}, "n"),  # every choice is reserved
    ("/v1/completions", {"model": "i", "prompt": "x", "best_of": 21}, "best_of"),
    ("/v1/completions", {"model": "i", "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/responses/compact", {"model": "g", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("/v1/responses/compact", {"model": "g", "input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ("/v1/responses/compact", {"model": "g", "input": "x", "stream": True}, "stream"),
])
def test_what_cannot_be_bounded_or_read_is_a_400(path: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(path, body)
    assert caught.value.param == param


@pytest.mark.parametrize(("prompt", "count"), [("x", 1), ([1, 2, 3], 1), (["a", "b"], 2), ([[1], [2], [3]], 3)])
def test_each_prompt_gets_its_own_choices(prompt: Any, count: int) -> None:
    assert prompt_count(prompt) == count


@pytest.mark.parametrize(("meter", "body", "bound"), [
    (EMBED, {"model": "e", "input": "x"}, (0, 0)),
    (COMPLETE, {"model": "i", "prompt": "x"}, None),  # the request's max_tokens, lowered like a model call's
    (COMPLETE, {"model": "i", "prompt": "x", "max_tokens": 0}, (0, 0)),
    # no output limit to send: the model's, whole (or the step is refused); only a budget that cannot pay
    # the smallest answer stops the run, as for a model call
    (COMPACT, {"model": "g", "input": "x"}, (MIN_OUTPUT_TOKENS, 4096)),
])
def test_output_bounds(meter: Any, body: dict[str, Any], bound: tuple[int, int] | None) -> None:
    assert output_bound(meter, meter.parse(body, orjson.dumps(body), LIMITS), 4096) == bound


@pytest.mark.parametrize(("meter", "body", "usage"), [
    (EMBED, openai_embedding(prompt_tokens=8), Usage(input_tokens=8)),
    (EMBED, {**openai_embedding(), "usage": {"total_tokens": 8}}, None),  # no input count: no report
    (EMBED, {**openai_embedding(), "usage": {"prompt_tokens": -1}}, None),
    (EMBED, {"data": []}, None),
    (COMPLETE, openai_text_completion(prompt_tokens=12, completion_tokens=3), Usage(12, 3)),
    (COMPLETE, {**openai_text_completion(), "usage": {}}, None),
    (COMPACT, openai_compaction(input_tokens=40, output_tokens=12), Usage(40, 12)),
    (COMPACT, {**openai_compaction(), "usage": None}, None),
])
def test_usage_is_read_where_each_answer_reports_it(meter: Any, body: dict[str, Any], usage: Usage | None) -> None:
    assert answer_of(meter, orjson.dumps(body)).usage == usage


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b'{"usage": "many"}'])
def test_an_answer_that_is_no_json_object_reports_no_usage(data: bytes) -> None:
    assert answer_of(EMBED, data).usage is None


def test_a_completion_answer_keeps_its_text() -> None:
    assert answer_of(COMPLETE, orjson.dumps(openai_text_completion("Paris."))).text == "Paris."


@pytest.mark.parametrize(("reasons", "expected"), [
    (["stop"], ("stop",)),
    (["length", "stop", "stop"], ("length", "stop", "stop")),  # one per choice, in choice order
    (["stop", None], ("stop", "error")),  # a choice without one keeps the others' places
    ([None], ()),  # none known at all
])
def test_a_completion_answer_has_each_choice_s_finish_reason(reasons: list[str | None],
                                                             expected: tuple[str, ...]) -> None:
    """semconv `gen_ai.response.finish_reasons`, one per choice, as the streamed completion's reader and
    the chat adapter (`aligned_reasons`) give them."""
    body = openai_text_completion("Paris.")
    body["choices"] = [{"index": i, "text": "x", "finish_reason": r, "logprobs": None} for i, r in enumerate(reasons)]
    assert answer_of(COMPLETE, orjson.dumps(body)).finish_reasons == expected


@pytest.mark.parametrize("choices", [None, "many", [1, "x"], []])
def test_an_answer_without_choices_has_no_finish_reasons(choices: Any) -> None:
    body = {**openai_text_completion(), "choices": choices}
    assert answer_of(COMPLETE, orjson.dumps(body)).finish_reasons == ()
    assert answer_of(EMBED, orjson.dumps(openai_embedding())).finish_reasons == ()


def feed(reader: CompletionStreamReader, chunks: list[bytes]) -> bytes:
    parser = SseParser()
    return b"".join(reader.feed(event).out for chunk in chunks for event in parser.feed(chunk))


@pytest.mark.parametrize("hide", [True, False])
def test_a_streamed_completion_is_read_for_its_usage_and_text(hide: bool) -> None:
    chunks = openai_text_stream(["Par", "is."], usage=(12, 3))
    reader = CompletionStreamReader(hide, 1)
    out = feed(reader, chunks)
    usage_chunk = chunks[-2]
    assert out == b"".join(c for c in chunks if not (hide and c == usage_chunk))
    answer = reader.answer()
    assert (answer.text, answer.usage, reader.output_chars, reader.complete) == ("Paris.", Usage(12, 3), 6, True)


def test_a_cut_stream_is_incomplete_and_counts_what_it_relayed() -> None:
    reader = CompletionStreamReader(True, 1)
    feed(reader, openai_text_stream(["abcd", "ef"])[:2])
    assert (reader.complete, reader.output_chars, reader.answer().usage) == (False, 6, None)


@pytest.mark.parametrize(("body", "value", "sent"), [
    ({"max_tokens": 500}, 100, 100),
    ({"max_tokens": 50}, 100, 50),  # one the agent set lower stays lower
    ({}, 100, 100),  # the legacy field, whatever the provider's dialect
])
def test_a_lowered_limit_is_written_in_max_tokens(body: dict[str, Any], value: int, sent: int) -> None:
    MeteredAdapter(COMPLETE).set_max_tokens(body, value, prefer_completion_field=True)
    assert body == {"max_tokens": sent}


def test_the_adapter_speaks_openai_on_the_meters_path() -> None:
    adapter = MeteredAdapter(COMPACT)
    assert (adapter.operation, adapter.upstream_path, adapter.protocol) == ("chat", "/responses/compact", "openai")
    error = orjson.loads(adapter.error_body(InvalidRequest("bad")))
    assert error["error"]["code"] == "invalid_request"


@pytest.mark.parametrize(("counts", "claims"), [(True, ("llm_calls",)), (False, ())])
def test_only_a_path_that_counts_claims_an_llm_call(counts: bool, claims: tuple[str, ...]) -> None:
    decision = MeteredCaps(counts).before(ctx(p=policy(caps={"llm_calls": 3})))
    assert decision.action == "allow" and tuple(c.counter for c in decision.claims) == claims


@pytest.mark.parametrize("counts", [True, False])
def test_the_time_cap_stops_either(counts: bool) -> None:
    decision = MeteredCaps(counts).before(ctx(p=policy(caps={"seconds": 10}), state=run(started_at=NOW - 60)))
    assert (decision.action, decision.reason) == ("stop", "time_cap")


FREE_OUTPUT = ModelPrice(Rate(1e-6), Rate(0.0))


@pytest.mark.parametrize(("price", "free", "per_unit"), [
    (FREE_OUTPUT, True, {"tokens": 1.0, "usd": 1.0}),  # a fixed-only claim gets a part per unit
    (FREE_OUTPUT, False, {"tokens": 1.0, "usd": 0.0}),
    (PRICE, True, {"tokens": 1.0, "usd": 4e-6}),  # one with a part per unit keeps it
])
def test_budget_claims_of_a_call_without_output(price: ModelPrice, free: bool, per_unit: dict[str, float]) -> None:
    decision = MeteredBudget(free).before(ctx(p=policy(budget={"usd": 1, "tokens": 1000}), price=price))
    assert {c.counter: c.per_unit for c in decision.claims} == per_unit
    assert {c.counter: c.fixed for c in decision.claims} == {"tokens": 1000.0, "usd": pytest.approx(1000e-6)}


def test_an_unpriced_model_under_a_usd_budget_is_rejected_as_for_a_model_call() -> None:
    decision = MeteredBudget(True).before(ctx(p=policy(budget={"usd": 1}), price=None))
    assert (decision.action, decision.reason) == ("reject", "price_unknown")


def test_a_call_without_output_held_by_steps_in_flight_is_refused_alone() -> None:
    """With zero units granted, a claim's part per unit holds nothing, but lets the store tell a budget
    held by steps in flight (refused alone, `held`) from one spent (the run stops)."""
    claims = output_free_claims((Claim("usd", 0.4, 0.0, 1.0, "budget_exhausted"),))
    state = run()

    def reserve() -> Reservation | Denial:
        return logic.reserve(state, ReserveRequest(claims, 0, 0), NOW, f"r{len(state.open)}")

    first, second = reserve(), reserve()
    assert isinstance(first, Reservation) and isinstance(second, Reservation) and first.amounts == {"usd": 0.4}
    third = reserve()
    assert isinstance(third, Denial) and third.held and not state.stopped
    logic.settle(state, first, {"usd": 0.4}, NOW)
    logic.settle(state, second, {"usd": 0.4}, NOW)
    spent = reserve()
    assert isinstance(spent, Denial) and not spent.held and state.stopped


def test_the_guards_of_a_metered_step() -> None:
    names = [(guard.name, on_error) for guard, on_error in guards_for(EMBED, (0, 0))]
    assert names == [("caps", "fail_closed"), ("budget", "fail_closed")]
