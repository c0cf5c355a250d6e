"""Session 13 review, second pass: defects left in the refusal and Redis settle changes (each test fails
because of one)."""

from __future__ import annotations

import uuid

import aiohttp
import openai
import orjson
import pytest
from redis.asyncio import Redis

from gateway.store.base import Reservation
from gateway.store.redis import RedisRunStore
from tests.conftest import GatewayFactory
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import Reply, openai_completion
from tests.gateway.test_session13_review import CALL, NOW, REFUSAL, SCHEMA, client, raw  # noqa: F401  (fixture)
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

TEXT_FORMAT = {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": False}}
MSG = [{"role": "user", "content": "2+2?"}]
RF = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


# -- refusals -------------------------------------------------------------------------------------------


async def test_an_empty_responses_refusal_part_is_not_a_refusal(gateway_factory: GatewayFactory) -> None:
    """Chat Completions: `refusal: ""` is no refusal (`openai_chat._refuses` wants a non-empty string), so
    an empty answer is judged (422 with no retries; the first half of this test holds). The Responses API's
    `answer_from` takes any part of `type: refusal` as a refusal, empty or not, so a response with no
    text and an empty refusal part is exempt from `text.format` and relayed as a 200."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    chat = openai_completion("")
    chat["choices"][0]["message"] = {"role": "assistant", "content": None, "refusal": ""}
    h.fake.queue(Reply(body=chat))
    async with client(h.url, "empty-refusal-chat") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.chat.completions.create(model="gpt-4o-mini", messages=MSG, response_format=RF)  # type: ignore[arg-type]

    body = {**response_body(""), "output": [
        {"type": "message", "id": "msg_r", "status": "completed", "role": "assistant",
         "content": [{"type": "refusal", "refusal": ""}]},
    ]}
    h.fake.queue(Reply(body=body))
    async with client(h.url, "empty-refusal-resp") as c:
        with pytest.raises(openai.UnprocessableEntityError):
            await c.responses.create(model="gpt-4o-mini", input="2+2?", text=TEXT_FORMAT)  # type: ignore[arg-type]


async def test_streamed_text_is_judged_when_the_final_response_shows_only_a_refusal(
    gateway_factory: GatewayFactory,
) -> None:
    """Responses streaming: `output_text` deltas carry `{"answer": "x"}` (JSON, so never cut while
    streaming; the schema judges it once complete) and `response.completed` lists only a refusal part.
    The text that reached the agent breaks the schema; `ResponsesStreamReader._finish` only checks the
    final text against the streamed one when the final has text, and `answer_from` marks the answer
    refused (no final text), so `held_to_text` skips the streamed text: the stream ends as a success.
    A final whose text differs from what streamed is an upstream fault by the reader's own contract."""
    h = await gateway_factory(agents={"default": {"output": {"retries": 0}}})
    events = response_stream(['{"answer": ', '"x"}'])
    last = orjson.loads(events[-1].split(b"data: ", 1)[1])
    assert last["type"] == "response.completed"
    last["response"]["output"] = [
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "refusal", "refusal": REFUSAL}]},
    ]
    events[-1] = b"event: response.completed\ndata: " + orjson.dumps(last) + b"\n\n"
    h.fake.queue(Reply(chunks=events))
    async with aiohttp.ClientSession() as session, session.post(
        f"{h.url}/v1/responses", headers={"authorization": "Bearer k", "x-tollgate-run-id": "resp-stream-refusal"},
        json={"model": "gpt-4o-mini", "input": "2+2?", "stream": True, "text": TEXT_FORMAT},
    ) as resp:
        text = await resp.text()
    assert 'delta":"\\"x' in text  # the schema-breaking text streamed to the agent
    assert "output_nonconforming" in text or "differs" in text or resp.status != 200, text[-600:]


# -- Redis: an expired reservation's late settle --------------------------------------------------------


async def test_a_settle_after_the_tombstone_window_of_its_expiry_is_not_charged_again(
    redis_server: RedisServer, raw: Redis  # noqa: F811
) -> None:
    """README: "A live call older than the lease is charged its reservation, never less"; `logic.settle`
    (memory, SQLite) drops a settle of a reservation `logic.expire` charged. The Redis `_RESERVE` expiry
    path charges it in full and remembers its id in `released:<run>` only for the tombstone window, while
    the call itself may go on for any time; once another settle prunes the id (`bury`), the call's own
    settle reaches `charge_lost` (no `o:` field, agent set) and charges its usage a second time."""
    store = RedisRunStore.open(redis_server.url, prefix=f"t-{uuid.uuid4().hex}:", lease_s=1)  # tombstone 930 s
    try:
        old = await store.reserve("r", "bot", CALL, NOW)
        assert isinstance(old, Reservation)
        other = await store.reserve("r", "bot", CALL, NOW + 10)  # past old's lease: old charged in full
        assert isinstance(other, Reservation)
        charged = (await store.get("r")).used  # type: ignore[union-attr]
        full = CALL.claims[0].fixed + 250 * CALL.claims[0].per_unit
        assert charged["usd"] == pytest.approx(full) and charged["llm_calls"] == 1.0
        await store.settle(other, {"usd": 0.0002, "llm_calls": 1.0}, NOW + 2000)  # prunes old ids
        await store.settle(old, {"usd": 0.0001, "llm_calls": 1.0}, NOW + 2001)  # the long call ends
        state = await store.get("r")
        assert state is not None
        assert state.used == pytest.approx({"usd": full + 0.0002, "llm_calls": 2.0})
    finally:
        await store.close()
