"""Session 13 review: defects in today's change (each test fails because of one)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from redis.asyncio import Redis

from gateway.store.base import Claim, Reservation, ReserveRequest
from gateway.store.redis import RedisRunStore
from gateway.store.redis_index import run_key, steps_key
from tests.conftest import GatewayFactory
from tests.fakes.responses import response_body
from tests.fakes.upstream import Reply, openai_completion
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
RF = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
MSG = [{"role": "user", "content": "2+2?"}]
REFUSAL = "I can't help with that."


def client(url: str, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run})


def chunk(choices: list[dict[str, Any]]) -> bytes:
    data = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1700000000, "model": "gpt-4o-mini",
            "choices": choices}
    return b"data: " + orjson.dumps(data) + b"\n\n"


# -- refusals: only a refusal is exempt, never the text next to it -------------------------------------


async def test_a_refusing_first_choice_does_not_exempt_the_other_choices(gateway_factory: GatewayFactory) -> None:
    """README: "Every choice is held to the constraints (OpenAI's `n`)". With `n: 2`, choice 0 refuses
    and choice 1 writes prose under a JSON schema: choice 1 must still be judged (422 with no retries).
    `Answer.refused` (choice 0) makes `held_to_text` skip every choice: the prose is relayed as a 200."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    body = openai_completion("")
    body["choices"] = [
        {"index": 0, "message": {"role": "assistant", "content": None, "refusal": REFUSAL},
         "finish_reason": "stop", "logprobs": None},
        {"index": 1, "message": {"role": "assistant", "content": "four, definitely not JSON"},
         "finish_reason": "stop", "logprobs": None},
    ]
    h.fake.queue(Reply(body=body))
    async with client(h.url, "refuse-n") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF, n=2)  # type: ignore[arg-type]


async def test_a_streamed_refusal_delta_does_not_exempt_streamed_content(gateway_factory: GatewayFactory) -> None:
    """Non-streamed, a message holding content as well as `refusal` is an answer and is judged
    (`openai_chat._refuses(message) and not text`). Streamed (`stream_check: buffer`), one `refusal`
    delta next to schema-breaking content marks the whole answer refused (`OpenAIStreamReader._refused`
    is set whatever content came), so `{"answer": "x"}` is relayed as a success, never re-asked."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0, "stream_check": "buffer"}}})
    events = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {"content": '{"answer": "x"}'}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {"refusal": "."}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
              b"data: [DONE]\n\n"]
    h.fake.queue(Reply(chunks=events))
    async with client(h.url, "refuse-stream") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                            stream=True)


async def test_an_incremental_stream_ending_in_a_refusal_delta_is_still_judged_whole(
    gateway_factory: GatewayFactory,
) -> None:
    """Incremental streaming: content that never breaks JSON syntax but breaks the schema
    (`{"answer": "x"}`), then a one-character `refusal` delta. The README: "the stream's end waits for
    the final verdict, so an SDK sees the error". The refusal delta skips the final verdict."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    events = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {"content": '{"answer": "x"}'}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {"refusal": "."}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
              b"data: [DONE]\n\n"]
    h.fake.queue(Reply(chunks=events))
    async with client(h.url, "refuse-incr") as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                                 stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


async def test_a_refusal_message_does_not_exempt_another_message_of_the_response(
    gateway_factory: GatewayFactory,
) -> None:
    """Responses API: one message item holding only a refusal part and a second message item whose
    text breaks the `text.format` schema. `answer_from` sets `refused` for the whole answer when any
    message is a refusal, so the second message's prose reaches the agent as a success."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    body = {**response_body(""), "output": [
        {"type": "message", "id": "msg_r", "status": "completed", "role": "assistant",
         "content": [{"type": "refusal", "refusal": REFUSAL}]},
        {"type": "message", "id": "msg_t", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "four, not JSON", "annotations": []}]},
    ]}
    h.fake.queue(Reply(body=body))
    async with client(h.url, "refuse-resp") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.responses.create(model="gpt-4o-mini", input="2+2?",
                                     text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}})



async def test_a_refusal_delta_of_another_choice_does_not_exempt_its_streamed_content(
    gateway_factory: GatewayFactory,
) -> None:
    """`n: 2` streamed (held whole, as the README says for several choices): choice 1 streams prose
    under the JSON schema, plus a one-character `refusal` delta. `OpenAIStreamReader.answer` drops every
    choice in `_refusing` from `other_texts`, content and all, so the prose is never judged; the same
    choice non-streamed (content next to `refusal`) is judged. README: "Every choice is held to the
    constraints (OpenAI's `n`)"."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    events = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
                     {"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {"content": '{"answer": 4}'}, "finish_reason": None}]),
              chunk([{"index": 1, "delta": {"content": "four, not JSON"}, "finish_reason": None}]),
              chunk([{"index": 1, "delta": {"refusal": "."}, "finish_reason": None}]),
              chunk([{"index": 0, "delta": {}, "finish_reason": "stop"},
                     {"index": 1, "delta": {}, "finish_reason": "stop"}]),
              b"data: [DONE]\n\n"]
    h.fake.queue(Reply(chunks=events))
    async with client(h.url, "refuse-n-stream") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF,  # type: ignore[arg-type]
                                            stream=True, n=2)


# -- Redis: a run Redis lost while steps were in flight -------------------------------------------------

NOW = 1_000.0
CALL = ReserveRequest((Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted"), Claim("llm_calls", 1.0)), 16, 250)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[Redis]:  # noqa: F811
    conn = Redis.from_url(redis_server.url)
    yield conn
    await conn.aclose()


async def grant(store: RedisRunStore, run_id: str = "r") -> Reservation:
    result = await store.reserve(run_id, "bot", CALL, NOW)
    assert isinstance(result, Reservation), result
    return result


async def test_a_lost_run_charges_every_step_that_was_in_flight(redis_server: RedisServer, raw: Redis) -> None:  # noqa: F811
    """README: "If Redis loses a run while one of its steps is in flight (FLUSHALL, a restart without its
    data), that step's usage is charged to the run created afresh." Two steps in flight (an agent's
    parallel calls): the first settle recreates the run (epoch 1, no reservations); the second finds the
    run, its epoch matching and its reservation gone, and `_SETTLE` answers 0: its usage is dropped."""
    store = RedisRunStore.open(redis_server.url, prefix=f"t-{uuid.uuid4().hex}:")
    try:
        first, second = await grant(store), await grant(store)
        await raw.delete(run_key(store._prefix, "r"), steps_key(store._prefix, "r"))  # FLUSHALL, a restart without its data
        await store.settle(first, {"usd": 0.0005, "llm_calls": 1.0}, NOW + 1)
        await store.settle(second, {"usd": 0.0007, "llm_calls": 1.0}, NOW + 2)
        state = await store.get("r")
        assert state is not None
        assert state.used == pytest.approx({"usd": 0.0012, "llm_calls": 2.0})
    finally:
        await store.close()


async def test_a_lost_run_recreated_by_a_new_step_still_charges_the_step_in_flight(
    redis_server: RedisServer, raw: Redis  # noqa: F811
) -> None:
    """The same contract when the run is recreated by the run's next reserve (the agent's next step, or
    another sidecar's) before the in-flight step settles: that settle finds an epoch-1 run without its
    reservation and charges nothing, so the provider's bill for it is never counted."""
    store = RedisRunStore.open(redis_server.url, prefix=f"t-{uuid.uuid4().hex}:")
    try:
        in_flight = await grant(store)
        await raw.delete(run_key(store._prefix, "r"), steps_key(store._prefix, "r"))
        later = await grant(store)  # recreates the run
        await store.settle(later, {"usd": 0.0001, "llm_calls": 1.0}, NOW + 1)
        await store.settle(in_flight, {"usd": 0.0005, "llm_calls": 1.0}, NOW + 2)
        state = await store.get("r")
        assert state is not None
        assert state.used == pytest.approx({"usd": 0.0006, "llm_calls": 2.0})
    finally:
        await store.close()
