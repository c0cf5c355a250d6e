"""Streaming relay, upstream hygiene and forwarding (DESIGN sections 2, 3, 5; issue 2 "Show").

SSE is relayed chunk by chunk as it arrives, a client that goes away closes the upstream, idle and
truncated upstream streams end with an error event in the provider's format, the upstream sees
tollgate's key and no hop-by-hop headers, unchanged bodies travel as the original bytes, and the
other `/v1/...` routes are forwarded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import (
    FakeProvider,
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
OA_MODEL = "gpt-4o-mini"
AN_MODEL = "claude-3-5-haiku-latest"
USER = [{"role": "user", "content": "hi"}]
BOTH = pytest.mark.parametrize("path", [CHAT, MESSAGES])


class Tracked(list[bytes]):
    """Stream chunks that record when the fake upstream takes each one to send it."""

    def __init__(self, chunks: list[bytes]) -> None:
        super().__init__(chunks)
        self.sent_at: list[float] = []

    def __iter__(self) -> Iterator[bytes]:
        for chunk in super().__iter__():
            self.sent_at.append(time.monotonic())
            yield chunk

    @property
    def sent(self) -> int:
        return len(self.sent_at)


def stream_chunks(path: str, parts: list[str]) -> list[bytes]:
    return openai_stream(parts) if path == CHAT else anthropic_stream(parts)


def stream_body(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        # include_usage asked by the agent: nothing is hidden, so the relay must be byte-identical
        return {"model": OA_MODEL, "messages": USER, "stream": True, "stream_options": {"include_usage": True}, **extra}
    return {"model": AN_MODEL, "max_tokens": 64, "messages": USER, "stream": True, **extra}


async def wait_for(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    """Bounded poll of a condition on shared state (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the time limit")
        await asyncio.sleep(0.01)


async def events(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Complete SSE events (with their blank line) as they arrive on the client side."""
    buf = b""
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, _, buf = buf.partition(b"\n\n")
            yield event + b"\n\n"
    if buf:
        yield buf


def last_event_json(raw: bytes) -> tuple[str | None, dict[str, Any]]:
    event = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    name: str | None = None
    data = b""
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
    return name, orjson.loads(data)


def assert_error_event(path: str, raw: bytes, code: str) -> None:
    name, data = last_event_json(raw)
    if path == CHAT:
        assert name is None
        assert set(data) == {"error"}
        err = data["error"]
        assert set(err) == {"message", "type", "param", "code"}
    else:
        assert name == "error"
        assert data["type"] == "error"
        err = data["error"]
        assert set(err) == {"type", "message", "code"}
        assert err["type"] in ("api_error", "timeout_error", "overloaded_error")
    assert err["code"] == code
    assert err["message"]


# -- relayed chunk by chunk as it arrives ------------------------------------------------------------


@BOTH
async def test_sse_relayed_chunk_by_chunk(gw: Harness, path: str) -> None:
    chunks = Tracked(stream_chunks(path, ["Hel", "lo", " wor", "ld"]))
    gw.fake.queue(Reply(chunks=chunks, chunk_delay=0.08))
    received: list[bytes] = []
    async with gw.session.post(f"{gw.url}{path}", json=stream_body(path)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for event in events(resp):
            index = len(received)
            received.append(event)
            if index < len(chunks) - 1:
                # event i reaches the client before the upstream has sent chunk i+2: nothing is buffered
                assert chunks.sent <= index + 2, (index, chunks.sent)
                assert gw.fake.in_flight == 1
    assert b"".join(received) == b"".join(chunks)
    assert len(received) == len(chunks)


async def test_openai_sdk_stream_first_chunk_before_upstream_finishes(gw: Harness) -> None:
    chunks = Tracked(openai_stream(["a", "b", "c", "d", "e"]))
    gw.fake.queue(Reply(chunks=chunks, chunk_delay=0.08))
    first_at: float | None = None
    parts: list[str] = []
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(model=OA_MODEL, messages=USER, stream=True)  # type: ignore[arg-type]
        async for chunk in stream:
            if first_at is None:
                first_at = time.monotonic()
                assert chunks.sent < len(chunks)
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
    assert parts == ["a", "b", "c", "d", "e"]
    assert first_at is not None and first_at < chunks.sent_at[-1]


async def test_anthropic_sdk_stream_first_text_before_upstream_finishes(gw: Harness) -> None:
    chunks = Tracked(anthropic_stream(["x", "y", "z"]))
    gw.fake.queue(Reply(chunks=chunks, chunk_delay=0.08))
    texts: list[str] = []
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as client:
        async with client.messages.stream(model=AN_MODEL, max_tokens=64, messages=USER) as stream:  # type: ignore[arg-type]
            async for text in stream.text_stream:
                if not texts:
                    assert chunks.sent < len(chunks)
                texts.append(text)
    assert texts == ["x", "y", "z"]


async def test_sync_openai_sdk_stream(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=openai_stream(["sync ", "stream"])))

    def call() -> list[str]:
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
            stream = client.chat.completions.create(model=OA_MODEL, messages=USER, stream=True)  # type: ignore[arg-type]
            return [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]

    assert await asyncio.to_thread(call) == ["sync ", "stream"]


async def test_usage_chunk_tollgate_asked_for_is_hidden(gw: Harness) -> None:
    """tollgate adds include_usage to settle budgets; an agent that did not ask never sees the chunk."""
    chunks = openai_stream(["a"])
    gw.fake.queue(Reply(chunks=chunks))
    body = {"model": OA_MODEL, "messages": USER, "stream": True}
    async with gw.session.post(f"{gw.url}{CHAT}", json=body) as resp:
        raw = await resp.read()
    assert gw.fake.seen[-1].json["stream_options"] == {"include_usage": True}
    usage_chunk = chunks[-2]
    assert b'"usage"' in usage_chunk
    assert raw == b"".join(c for c in chunks if c != usage_chunk)


# -- client disconnect closes the upstream ----------------------------------------------------------


@BOTH
async def test_client_disconnect_closes_upstream(gw: Harness, path: str) -> None:
    chunks = Tracked(stream_chunks(path, ["p"] * 60))
    gw.fake.queue(Reply(chunks=chunks, chunk_delay=0.05))
    resp = await gw.session.post(f"{gw.url}{path}", json=stream_body(path))
    try:
        assert resp.status == 200
        first = await resp.content.readany()
        assert first
    finally:
        resp.close()  # drops the connection mid-stream
    await wait_for(lambda: gw.fake.disconnects == 1 and gw.fake.in_flight == 0)
    assert chunks.sent < len(chunks), "the upstream kept streaming to nobody"


# -- idle timeout and truncated upstream streams -------------------------------------------------------


def idle_providers(fake_url: str, idle: float) -> dict[str, Any]:
    timeouts = {"idle": idle}
    return {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "k", "timeouts": timeouts},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "k", "timeouts": timeouts},
    }


@BOTH
async def test_idle_gap_ends_stream_with_error_event(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], path: str
) -> None:
    h = await gateway_factory(providers=idle_providers(fake[1], 0.25))
    chunks = stream_chunks(path, ["never", "finished"])
    h.fake.queue(Reply(chunks=chunks, chunk_delay=2.0))
    started = time.monotonic()
    async with h.session.post(f"{h.url}{path}", json=stream_body(path)) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert time.monotonic() - started < 1.5
    assert raw.startswith(chunks[0])
    assert chunks[1] not in raw
    assert_error_event(path, raw, "upstream_timeout")
    await wait_for(lambda: h.fake.in_flight == 0)


@BOTH
async def test_idle_gap_is_measured_between_chunks_not_in_total(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], path: str
) -> None:
    """No total timeout: a stream longer than `idle` whose chunks keep coming completes."""
    h = await gateway_factory(providers=idle_providers(fake[1], 0.3))
    chunks = stream_chunks(path, ["a", "b", "c", "d", "e", "f"])
    h.fake.queue(Reply(chunks=chunks, chunk_delay=0.06))  # ~0.6s in total, each gap well under idle
    async with h.session.post(f"{h.url}{path}", json=stream_body(path)) as resp:
        raw = await resp.read()
    assert raw == b"".join(chunks)


@BOTH
@pytest.mark.parametrize("cut", [1, 3])
async def test_truncated_stream_ends_with_error_event(gw: Harness, path: str, cut: int) -> None:
    chunks = stream_chunks(path, ["one", "two", "three"])
    gw.fake.queue(Reply(chunks=chunks, cut_after=cut))
    async with gw.session.post(f"{gw.url}{path}", json=stream_body(path)) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert raw.startswith(b"".join(chunks[:cut]))
    assert_error_event(path, raw, "upstream_unavailable")


async def test_sdks_raise_on_stream_error_event(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=openai_stream(["a", "b"]), cut_after=2))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(model=OA_MODEL, messages=USER, stream=True)  # type: ignore[arg-type]
        with pytest.raises(openai.APIError) as oe:
            async for _ in stream:
                pass
    assert oe.value.code == "upstream_unavailable"
    gw.fake.queue(Reply(chunks=anthropic_stream(["a", "b"]), cut_after=3))
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as aclient:
        with pytest.raises(anthropic.APIStatusError) as ae:
            async with aclient.messages.stream(model=AN_MODEL, max_tokens=8, messages=USER) as stream2:  # type: ignore[arg-type]
                async for _ in stream2.text_stream:
                    pass
    assert ae.value.body["error"]["code"] == "upstream_unavailable"  # type: ignore[index]


# -- credentials and hop-by-hop headers ---------------------------------------------------------------

AGENT_HEADERS = {
    "Authorization": "Bearer agent-own-key",
    "x-api-key": "agent-own-anthropic-key",
    "Connection": "keep-alive, X-Drop-Me",
    "X-Drop-Me": "named in Connection",
    "Keep-Alive": "timeout=5, max=100",
    "TE": "trailers",
    "Trailer": "X-Checksum",
    "Upgrade": "h2c",
    "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0",
    "Proxy-Connection": "keep-alive",
    "x-tollgate-run-id": "run-hop",
    "x-tollgate-agent": "hopper",
    "X-Custom-Trace": "keep-me",
    "anthropic-beta": "tools-2024-05-16",
}
HOP = {"keep-alive", "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection", "x-drop-me"}


@BOTH
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_gets_provider_key_and_no_hop_by_hop(gw: Harness, path: str, stream: bool) -> None:
    body = stream_body(path) if stream else {**stream_body(path), "stream": False}
    if stream:
        gw.fake.queue(Reply(chunks=stream_chunks(path, ["ok"])))
    async with gw.session.post(f"{gw.url}{path}", json=body, headers=AGENT_HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-tollgate-run-id"] == "run-hop"
        await resp.read()
    seen = {k.lower(): v for k, v in gw.fake.seen[-1].headers.items()}
    if path == CHAT:
        assert seen["authorization"] == "Bearer sk-provider-openai"
        assert "x-api-key" not in seen
    else:
        assert seen["x-api-key"] == "sk-ant-provider"
        assert "authorization" not in seen
        assert seen["anthropic-version"] == "2023-06-01"
    assert "agent-own" not in repr(seen)
    assert not HOP & set(seen), HOP & set(seen)
    assert "x-drop-me" not in seen.get("connection", "").lower()
    assert not [k for k in seen if k.startswith("x-tollgate-")]
    assert seen["x-custom-trace"] == "keep-me"
    assert seen["anthropic-beta"] == "tools-2024-05-16"


async def test_upstream_hop_by_hop_response_headers_are_stripped(gw: Harness) -> None:
    gw.fake.queue(Reply(body=openai_completion(), headers={
        "Keep-Alive": "timeout=99", "Proxy-Authenticate": "Basic", "Trailer": "X-Sum",
        "X-Upstream-Id": "up-1", "openai-processing-ms": "12",
    }))
    async with gw.session.post(f"{gw.url}{CHAT}", json={"model": OA_MODEL, "messages": USER}) as resp:
        assert resp.status == 200
        headers = {k.lower(): v for k, v in resp.headers.items()}
        await resp.read()
    assert headers["x-upstream-id"] == "up-1"
    assert headers["openai-processing-ms"] == "12"
    assert headers.get("keep-alive") != "timeout=99"
    assert "proxy-authenticate" not in headers and "trailer" not in headers


async def test_passthrough_auth_forwards_the_agents_key(gateway_factory: GatewayFactory, fake: tuple[Any, str]) -> None:
    providers = {"openai": {"type": "openai", "base_url": f"{fake[1]}/v1", "passthrough_auth": True}}
    h = await gateway_factory(providers=providers, models={"gpt-*": "openai"})
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="agent-own-key", max_retries=0) as client:
        await client.chat.completions.create(model=OA_MODEL, messages=USER)  # type: ignore[arg-type]
    assert h.fake.seen[-1].headers["Authorization"] == "Bearer agent-own-key"


# -- unchanged bodies travel as the original bytes -----------------------------------------------------

ODD_OPENAI = (
    b'{\n  "messages" :[ {"content":"hi \\u00e9",   "role":"user"} ],\n\t"temperature": 0.50,'
    b'"model":"gpt-4o-mini" , "x_extra": {"b": 1, "a": [1.0, 2e3]}\n}\n'
)
ODD_OPENAI_STREAM = (
    b'{ "stream":true,"stream_options":{"include_usage":true},  "messages":[{"role":"user","content":"hi"}],'
    b'"model":"gpt-4o-mini"}'
)
ODD_ANTHROPIC = (
    b'{"max_tokens": 100,\r\n "messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],'
    b'   "model":"claude-3-5-haiku-latest","metadata":{"user_id":"u1"}}'
)
ODD_ANTHROPIC_STREAM = (
    b'{"stream": true, "max_tokens": 100, "messages":[{"role":"user","content":"hi"}],'
    b'"model" :"claude-3-5-haiku-latest"}'
)


@pytest.mark.parametrize(
    ("path", "raw"),
    [(CHAT, ODD_OPENAI), (CHAT, ODD_OPENAI_STREAM), (MESSAGES, ODD_ANTHROPIC), (MESSAGES, ODD_ANTHROPIC_STREAM)],
    ids=["openai", "openai-stream", "anthropic", "anthropic-stream"],
)
async def test_unchanged_body_forwarded_as_original_bytes(gw: Harness, path: str, raw: bytes) -> None:
    if b'"stream":true' in raw or b'"stream": true' in raw:
        gw.fake.queue(Reply(chunks=stream_chunks(path, ["ok"])))
    async with gw.session.post(f"{gw.url}{path}", data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    assert gw.fake.seen[-1].body == raw


@BOTH
async def test_answer_bytes_relayed_unchanged(gw: Harness, path: str) -> None:
    answer = openai_completion("odd") if path == CHAT else anthropic_message("odd")
    upstream = orjson.dumps(answer, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    gw.fake.queue(Reply(body=upstream))
    body = {**stream_body(path), "stream": False}
    body.pop("stream_options", None)
    async with gw.session.post(f"{gw.url}{path}", json=body) as resp:
        assert resp.status == 200
        assert await resp.read() == upstream


# -- routing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "model", "upstream_model"),
    [
        (CHAT, "openai/gpt-4o-mini", "gpt-4o-mini"),
        (CHAT, "openai/my-finetune:v2", "my-finetune:v2"),  # matches no glob: the prefix alone routes it
        (CHAT, "openai/org/model-x", "org/model-x"),  # only the first segment is the provider
        (MESSAGES, "anthropic/claude-3-5-haiku-latest", "claude-3-5-haiku-latest"),
    ],
)
async def test_provider_prefix_routes_and_is_stripped(gw: Harness, path: str, model: str, upstream_model: str) -> None:
    body = {**stream_body(path), "stream": False, "model": model, "temperature": 0.3}
    body.pop("stream_options", None)
    async with gw.session.post(f"{gw.url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    seen = gw.fake.seen[-1]
    assert seen.path == ("/v1/chat/completions" if path == CHAT else "/v1/messages")
    assert seen.json == {**body, "model": upstream_model}


async def test_prefix_routing_with_streaming_sdk(gw: Harness) -> None:
    gw.fake.queue(Reply(chunks=openai_stream(["pre", "fixed"])))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(model="openai/gpt-4o-mini", messages=USER, stream=True)  # type: ignore[arg-type]
        parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert parts == ["pre", "fixed"]
    assert gw.fake.seen[-1].json["model"] == "gpt-4o-mini"


async def test_exact_model_names_win_over_globs(gateway_factory: GatewayFactory, fake: tuple[Any, str]) -> None:
    second = FakeProvider()
    server = TestServer(second.app(), host="127.0.0.1")
    await server.start_server()
    try:
        second_url = str(server.make_url("")).rstrip("/")
        providers = {
            "openai": {"type": "openai", "base_url": f"{fake[1]}/v1", "api_key": "sk-provider-openai"},
            "local": {"type": "openai", "base_url": f"{second_url}/v1"},
        }
        h = await gateway_factory(providers=providers, models={"gpt-*": "openai", "gpt-local": "local"})
        for model in ("gpt-local", "gpt-4o"):
            async with h.session.post(f"{h.url}{CHAT}", json={"model": model, "messages": USER}) as resp:
                assert resp.status == 200
        assert [s.json["model"] for s in second.seen] == ["gpt-local"]
        assert [s.json["model"] for s in h.fake.seen] == ["gpt-4o"]
        assert "authorization" not in {k.lower() for k in second.seen[0].headers}  # local has no key
    finally:
        await server.close()


# -- GET /v1/models and other /v1 paths ---------------------------------------------------------------


async def test_models_merges_every_provider(gateway_factory: GatewayFactory, fake: tuple[Any, str]) -> None:
    second = FakeProvider()
    second.models = [{"id": "claude-3-5-haiku-latest", "type": "model", "display_name": "Claude Haiku"}]
    server = TestServer(second.app(), host="127.0.0.1")
    await server.start_server()
    try:
        second_url = str(server.make_url("")).rstrip("/")
        providers = {
            "openai": {"type": "openai", "base_url": f"{fake[1]}/v1", "api_key": "sk-provider-openai"},
            "anthropic": {"type": "anthropic", "base_url": second_url, "api_key": "sk-ant-provider"},
        }
        h = await gateway_factory(providers=providers)
        async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="agent-key", max_retries=0) as client:
            page = await client.models.list()
            models = {m.id: m for m in page.data}
        assert set(models) == {"gpt-4o-mini", "claude-3-5-haiku-latest"}
        assert models["gpt-4o-mini"].owned_by == "fake"
        assert models["claude-3-5-haiku-latest"].owned_by == "anthropic"
        oa_seen, an_seen = h.fake.seen[-1], second.seen[-1]
        assert (oa_seen.method, oa_seen.path) == ("GET", "/v1/models")
        assert oa_seen.headers["Authorization"] == "Bearer sk-provider-openai"
        assert (an_seen.method, an_seen.path) == ("GET", "/v1/models")
        assert an_seen.headers["x-api-key"] == "sk-ant-provider"
        assert "agent-key" not in repr(oa_seen.headers) + repr(an_seen.headers)
        # one provider down: the others still answer
        await server.close()
        async with h.session.get(f"{h.url}/v1/models") as resp:
            assert resp.status == 200
            ids = [m["id"] for m in (await resp.json())["data"]]
        assert ids == ["gpt-4o-mini"]
    finally:
        await server.close()


async def test_embeddings_forwarded(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(models={"gpt-*": "openai", "claude-*": "anthropic", "text-embedding-*": "openai"})
    reply = {"object": "list", "model": "text-embedding-3-small",
             "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
             "usage": {"prompt_tokens": 2, "total_tokens": 2}}
    h.fake.queue(Reply(body=reply))
    async with openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="agent-key", max_retries=0) as client:
        result = await client.embeddings.create(model="text-embedding-3-small", input="hello", encoding_format="float")
    assert result.data[0].embedding == [0.25, -0.5]
    seen = h.fake.seen[-1]
    assert (seen.method, seen.path) == ("POST", "/v1/embeddings")
    assert seen.headers["Authorization"] == "Bearer sk-provider-openai"
    assert "agent-key" not in repr(seen.headers)
    assert seen.json["input"] == "hello"


async def test_other_v1_paths_forward_bytes_query_and_status(gw: Harness) -> None:
    raw = b'{ "input" : "x",  "model":"openai/text-embedding-3-small"}'
    gw.fake.queue(Reply(body=b'{"data" : []}'))
    async with gw.session.post(f"{gw.url}/v1/embeddings", data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
        assert await resp.read() == b'{"data" : []}'
    assert gw.fake.seen[-1].json == {"input": "x", "model": "text-embedding-3-small"}  # prefix stripped
    # no body: the first OpenAI provider; query string kept; upstream status and body unchanged
    gw.fake.queue(Reply(status=404, body=b'{"error": {"message": "no such file"}}'))
    async with gw.session.get(f"{gw.url}/v1/files/file-1?purpose=batch&limit=2",
                              headers={"Authorization": "Bearer agent-key"}) as resp:
        assert resp.status == 404
        assert await resp.read() == b'{"error": {"message": "no such file"}}'
        assert resp.headers["x-tollgate-run-id"] == "default:default"
    seen = gw.fake.seen[-1]
    assert (seen.method, seen.path) == ("GET", "/v1/files/file-1")
    assert seen.headers["Authorization"] == "Bearer sk-provider-openai"
    # unchanged JSON bodies on other paths travel as the original bytes too
    exact = b'{"model":"gpt-4o-mini",   "input":["a","b"]}'
    async with gw.session.post(f"{gw.url}/v1/embeddings", data=exact, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
    assert gw.fake.seen[-1].body == exact
