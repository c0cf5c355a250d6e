"""`gateway.batches`: provider URLs in batch objects moved to the gateway; plus OpenAI's batch creation
through a running gateway with the official SDK (refused for a guarded agent, `gateway.unguarded`)."""

from __future__ import annotations

import openai
import orjson
import pytest

from gateway.batches import rewrites_urls, with_gateway_urls
from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply

BASE, GW = "https://api.anthropic.com", "http://127.0.0.1:8080"


@pytest.mark.parametrize(("path", "rewrites"), [
    ("/v1/messages/batches", True), ("/v1/messages/batches/msgbatch_1", True),
    ("/v1/messages/batches/msgbatch_1/cancel", True), ("/v1/batches", False), ("/v1/messages", False),
])
def test_which_answers_may_carry_provider_urls(path: str, rewrites: bool) -> None:
    assert rewrites_urls(path) is rewrites


def test_results_urls_on_the_provider_move_to_the_gateway_and_nothing_else_changes() -> None:
    one = {"id": "b1", "results_url": f"{BASE}/v1/messages/batches/b1/results"}
    moved = orjson.loads(with_gateway_urls(orjson.dumps(one), BASE, GW))
    assert moved == {"id": "b1", "results_url": f"{GW}/v1/messages/batches/b1/results"}
    page = {"data": [one, {"id": "b2", "results_url": None}], "has_more": False}
    assert orjson.loads(with_gateway_urls(orjson.dumps(page), BASE + "/", GW + "/"))["data"][0] == moved
    for data in (orjson.dumps({"id": "b2", "results_url": None}), b"not json", b"[1]",
                 orjson.dumps({"results_url": "https://elsewhere.example/x"})):
        assert with_gateway_urls(data, BASE, GW) is data  # unchanged bytes, never re-serialized
    # the provider's canonical origin behind a relay configured as base_url: the batch's results path is kept
    elsewhere = orjson.dumps({"results_url": "https://api.anthropic.com:443/v1/messages/batches/b1/results?x=1"})
    assert orjson.loads(with_gateway_urls(elsewhere, "https://relay.example/anthropic", GW)) == {
        "results_url": f"{GW}/v1/messages/batches/b1/results?x=1"}


async def test_openai_batch_creation_is_refused_for_a_budgeted_agent_and_forwarded_for_others(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory(agents={"capped": {"keys": ["k-capped"], "budget": {"usd": 1.0}},
                                      "free": {"keys": ["k-free"]}})
    batch = {"id": "batch_1", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "file-1",
             "completion_window": "24h", "status": "validating", "created_at": 1}
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k-capped", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.create(input_file_id="file-1", endpoint="/v1/chat/completions",
                                        completion_window="24h")
    assert "budget" in refused.value.message and h.fake.seen == []
    h.fake.queue(Reply(body=batch))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k-free", max_retries=0) as client:
        created = await client.batches.create(input_file_id="file-1", endpoint="/v1/chat/completions",
                                              completion_window="24h")
    assert created.id == "batch_1" and h.fake.seen[-1].path == "/v1/batches"
