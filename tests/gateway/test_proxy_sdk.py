"""The official SDKs against a running gateway get exactly what the fake upstream sent."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from tests.conftest import Harness
from tests.fakes.upstream import Reply, anthropic_message, anthropic_stream, openai_completion, openai_stream


def oa(h: Harness, **kw: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="agent-key", max_retries=0, **kw)  # type: ignore[arg-type]


async def test_openai_non_stream(gw: Harness) -> None:
    gw.fake.queue(Reply(body=openai_completion("Bonjour")))
    async with oa(gw) as client:
        result = await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert result.choices[0].message.content == "Bonjour"
    seen = gw.fake.seen[-1]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["Authorization"] == "Bearer sk-provider-openai"
    assert "agent-key" not in str(seen.headers)


async def test_openai_stream_none_is_a_plain_answer(gw: Harness) -> None:
    """`stream=None` is in the SDK's signature; it sends `"stream": null`, which is not streaming."""
    gw.fake.queue(Reply(body=openai_completion("plain")))
    async with oa(gw) as client:
        result = await client.chat.completions.create(model="gpt-4o-mini", stream=None,
                                                      messages=[{"role": "user", "content": "hi"}])
    assert result.choices[0].message.content == "plain"
    assert b'"stream":null' in gw.fake.seen[-1].body.replace(b" ", b"")


async def test_openai_stream_chunks_identical(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=openai_stream(["Hel", "lo", " wor", "ld"])))
    async with oa(gw) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert parts == ["Hel", "lo", " wor", "ld"]
    sent = gw.fake.seen[-1].json
    assert sent["stream_options"] == {"include_usage": True}



async def test_openai_sync_client_in_thread(gw: Harness) -> None:
    gw.fake.queue(Reply(body=openai_completion("sync ok")))

    def call() -> str | None:
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
            return client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}]).choices[0].message.content

    assert await asyncio.to_thread(call) == "sync ok"


async def test_anthropic_non_stream_and_stream(gw: Harness) -> None:
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="agent-key", max_retries=0) as client:
        await _anthropic_both(gw, client)


async def _anthropic_both(gw: Harness, client: anthropic.AsyncAnthropic) -> None:
    gw.fake.queue(Reply(body=anthropic_message("Salut")))
    msg = await client.messages.create(model="claude-3-5-haiku-latest", max_tokens=100,
                                       messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "Salut"  # type: ignore[union-attr]
    assert gw.fake.seen[-1].headers["x-api-key"] == "sk-ant-provider"
    gw.fake.queue(Reply(chunks=anthropic_stream(["a", "b", "c"])))
    async with client.messages.stream(model="claude-3-5-haiku-latest", max_tokens=100,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        texts = [t async for t in stream.text_stream]
    assert texts == ["a", "b", "c"]


@pytest.mark.parametrize("status", [400, 429, 500])
async def test_upstream_errors_pass_through(gw: Harness, status: int) -> None:
    gw.fake.queue(Reply(status=status, body={"error": {"message": "upstream says no", "type": "x", "code": "y"}}))
    with pytest.raises(openai.APIStatusError) as info:
        async with oa(gw) as client:
            await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == status
    assert info.value.body["message"] == "upstream says no"  # type: ignore[index]


async def test_other_anthropic_paths_get_the_provider_key_as_x_api_key(gw: Harness) -> None:
    gw.fake.queue(Reply(body={"input_tokens": 3}))
    async with gw.session.post(f"{gw.url}/v1/messages/count_tokens", headers={"x-api-key": "agent-key"},
                               json={"model": "claude-3-5-haiku-latest", "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
    seen = gw.fake.seen[-1]
    assert seen.path == "/v1/messages/count_tokens"
    assert seen.headers["x-api-key"] == "sk-ant-provider" and "Authorization" not in seen.headers
