"""`limits.max_answer_bytes` through a running gateway, with the official SDKs: an upstream answer that
tollgate reads whole (a non-streamed model answer, a forwarded call's error body, a model list) and is
larger than the cap is a 502 `upstream_unavailable` in the caller's wire format; the step is charged
as any failure after the request was sent (at its reservation, none left dangling); its span is an
error; no task, connection or file descriptor is left behind (the harness of test_faults.py).
Forwarded 2xx bodies stream through a chunk at a time and are not capped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory
from tests.fakes.upstream import FakeProvider, Reply, anthropic_message, openai_completion, openai_stream
from tests.gateway.test_faults import (
    CHAT,
    MESSAGES,
    PRICING,
    TIMEOUTS,
    USER,
    Env,
    RawUpstream,
    assert_nothing_left,
    assert_released,
    assert_span_error,
    body_for,
    call,
    fault_case,
    frozen_heap,  # noqa: F401 - a fixture `env` uses
    warm,
)

CAP = 64 * 1024
BIG = "x" * (CAP + 1)  # one answer's text alone is over the cap
WIRES = pytest.mark.parametrize("path", [CHAT, MESSAGES], ids=["openai", "anthropic"])


class Endless:
    """A loopback upstream whose every answer is a 200 with a body that never ends: 4 MiB of chunks (or
    of bytes delimited by a close that never comes), then nothing until the gateway goes away (bounded,
    so that a gateway without a cap times out instead of filling the test machine's memory)."""

    def __init__(self) -> None:
        self.chunked = True
        self.open = 0
        self.ended = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.ended.clear()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.partition(b":")[2]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + framing + b"\r\n")
            piece = b"x" * 4096
            for _ in range(1024):
                writer.write(b"1000\r\n" + piece + b"\r\n" if self.chunked else piece)
                await writer.drain()
            await reader.read()  # until the gateway closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.transport.abort()
            self.open -= 1
            self.ended.set()


@pytest.fixture
async def endless() -> AsyncIterator[Endless]:
    server = Endless()
    yield server
    await server.close()


@pytest.fixture
async def env(frozen_heap: None, gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str],  # noqa: F811
              endless: Endless) -> AsyncIterator[Env]:
    """test_faults' environment with a small answer cap, plus an endless upstream (`end-*` models)."""
    raw = RawUpstream()
    await raw.start()
    end_url = await endless.start()
    fake_url = fake[1]
    providers = {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai", "timeouts": TIMEOUTS},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-provider", "timeouts": TIMEOUTS},
        "endoa": {"type": "openai", "base_url": f"{end_url}/v1", "api_key": "sk-end", "timeouts": TIMEOUTS},
        "endan": {"type": "anthropic", "base_url": end_url, "api_key": "sk-end", "timeouts": TIMEOUTS},
    }
    h = await gateway_factory(
        providers=providers,
        models={"gpt-*": "openai", "claude-*": "anthropic", "end-gpt-*": "endoa", "end-claude-*": "endan"},
        pricing={**PRICING, "end-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0}},
        agents={"default": {"budget": {"usd": 50.0, "tokens": 10_000_000}}},
        limits={"max_answer_bytes": CAP},
    )
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        yield Env(h, raw, exporter, telemetry, client)
    finally:
        await client.close()
        await raw.close()
        telemetry.shutdown()


def oversized(path: str) -> dict[str, Any]:
    return openai_completion(BIG) if path == CHAT else anthropic_message(BIG)


async def sdk_call(env: Env, path: str, run_id: str, model: str | None = None) -> Exception:
    """The model call through the official SDK of `path`'s wire; the error it raised."""
    headers = {"x-tollgate-run-id": run_id}
    if path == CHAT:
        async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0,
                                      default_headers=headers) as oa:
            with pytest.raises(openai.InternalServerError) as caught:
                await oa.chat.completions.create(model=model or "gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
            assert caught.value.status_code == 502
            assert caught.value.code == "upstream_unavailable"
            assert caught.value.type == "server_error"
            assert "max_answer_bytes" in caught.value.message
            return caught.value
    async with anthropic.AsyncAnthropic(base_url=env.h.url, api_key="k", max_retries=0,
                                        default_headers=headers) as an:
        with pytest.raises(anthropic.InternalServerError) as acaught:
            await an.messages.create(model=model or "claude-3-5-haiku-latest", max_tokens=64, messages=USER)  # type: ignore[arg-type]
        assert acaught.value.status_code == 502
        body = acaught.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        assert body["error"]["type"] == "api_error" and body["error"]["code"] == "upstream_unavailable", body
        assert "max_answer_bytes" in body["error"]["message"]
        return acaught.value


async def assert_charged(env: Env, run_id: str) -> None:
    """Settled as every failure after the request was sent: at the reservation (the upstream may bill
    the answer it produced), nothing left reserved."""
    run = await assert_released(env, run_id)
    assert run["spent_usd"] > 0, run
    assert run["steps"][-1]["status"] == 502, run["steps"][-1]


@WIRES
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_oversized_answer_is_a_502_to_the_sdk(env: Env, path: str, framing: str) -> None:
    answer = orjson.dumps(oversized(path))
    if framing == "content-length":
        env.fake.queue(Reply(body=answer))
    else:
        env.fake.queue(Reply(chunks=[answer[i:i + 8192] for i in range(0, len(answer), 8192)]))
    base = await warm(env)
    run_id = env.run_id()
    await sdk_call(env, path, run_id)
    await assert_charged(env, run_id)
    assert_span_error(env, run_id, "upstream_unavailable")
    await assert_nothing_left(env, base)


@WIRES
async def test_an_oversized_answer_has_the_wire_error_shape(env: Env, path: str) -> None:
    env.fake.queue(Reply(body=orjson.dumps(oversized(path))))
    await fault_case(env, path, body_for(path), status=502, code="upstream_unavailable")


@WIRES
async def test_an_answer_of_exactly_the_cap_passes(env: Env, path: str) -> None:
    answer = orjson.dumps(oversized(path))
    text = BIG[: len(BIG) - (len(answer) - CAP)]
    exact = orjson.dumps(openai_completion(text) if path == CHAT else anthropic_message(text))
    assert len(exact) == CAP
    env.fake.queue(Reply(body=exact))
    status, raw = await call(env, path, body_for(path), env.run_id())
    assert status == 200 and raw == exact


@WIRES
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "close-delimited"])
async def test_an_endless_answer_is_cut_at_the_cap(env: Env, endless: Endless, path: str, chunked: bool) -> None:
    """A body that never ends: the connection is closed at the cap, the upstream sees it go."""
    endless.chunked = chunked
    base = await warm(env)
    run_id = env.run_id()
    await sdk_call(env, path, run_id, model="end-gpt-4o" if path == CHAT else "end-claude-3-5-haiku")
    await asyncio.wait_for(endless.ended.wait(), 5)
    assert endless.open == 0
    await assert_charged(env, run_id)
    assert_span_error(env, run_id, "upstream_unavailable")
    await assert_nothing_left(env, base)


# -- forwarded /v1/... paths ---------------------------------------------------------------------------


async def test_a_forwarded_oversized_error_body_is_a_502_in_the_callers_format(env: Env) -> None:
    """A forwarded call's 4xx/5xx body is read whole (to scrub the provider key): capped."""
    error = {"error": {"message": BIG, "type": "invalid_request_error", "param": None, "code": None}}
    env.fake.queue(Reply(status=400, body=error))
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0) as oa:
        with pytest.raises(openai.InternalServerError) as caught:
            await oa.embeddings.create(model="gpt-embedding", input="hi")
    assert caught.value.status_code == 502 and caught.value.code == "upstream_unavailable"
    env.fake.queue(Reply(status=400, body={"type": "error", "error": {"type": "invalid_request_error",
                                                                      "message": BIG}}))
    async with anthropic.AsyncAnthropic(base_url=env.h.url, api_key="k", max_retries=0) as an:
        with pytest.raises(anthropic.InternalServerError) as acaught:
            await an.messages.count_tokens(model="claude-3-5-haiku-latest", messages=USER)  # type: ignore[arg-type]
    body = acaught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["code"] == "upstream_unavailable"
    assert env.h.gateway.upstream.busy_connections() == 0


async def test_a_forwarded_2xx_body_streams_through_uncapped(env: Env) -> None:
    data = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5] * (CAP // 2)}],
            "model": "text-embedding-3-small", "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    assert len(orjson.dumps(data)) > CAP
    env.fake.queue(Reply(body=data))
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0) as oa:
        result = await oa.embeddings.create(model="gpt-embedding", input="hi", encoding_format="float")
    assert len(result.data[0].embedding) == CAP // 2


async def test_an_oversized_model_list_is_not_merged(env: Env) -> None:
    env.fake.models = [{"id": f"model-{i}-{'x' * 100}", "object": "model", "owned_by": "fake"} for i in range(1000)]
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0) as oa:
        with pytest.raises(openai.InternalServerError) as caught:
            await oa.models.list()
    assert caught.value.status_code == 502 and caught.value.code == "upstream_unavailable"
    env.fake.models = env.fake.models[:3]
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0) as oa:
        # both providers' lists, the same three models (the fake serves both): each listed once
        assert len((await oa.models.list()).data) == 3



async def test_a_stream_longer_than_the_cap_ends_with_an_error_event(env: Env) -> None:
    """The reader keeps the streamed text: a stream is bounded as a whole too, ending with the error
    event of its wire once it passes the cap, settled at the reservation."""
    env.h.fake.queue(Reply(chunks=openai_stream(["y" * 1024] * 100)))
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0,
                                  default_headers={"x-tollgate-run-id": "long-stream"}) as oa:
        stream = await oa.chat.completions.create(model="gpt-4o-mini", messages=USER, stream=True)  # type: ignore[arg-type]
        with pytest.raises(openai.APIError, match="max_answer_bytes"):
            async for _ in stream:
                pass
    run = await assert_released(env, "long-stream")
    assert run["spent_usd"] > 0, run


async def test_a_buffered_stream_longer_than_the_cap_is_a_502(env: Env) -> None:
    """Several choices under an output grammar (the stream held whole until it validates) past the cap:
    a 502 before anything is relayed."""
    env.h.fake.queue(Reply(chunks=openai_stream(["y" * 1024] * 100)))
    headers = {"x-tollgate-run-id": "long-held", "x-tollgate-grammar": "regex:y+"}
    async with openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="k", max_retries=0,
                                  default_headers=headers) as oa:
        with pytest.raises(openai.InternalServerError, match="max_answer_bytes"):
            stream = await oa.chat.completions.create(model="gpt-4o-mini", messages=USER, n=2,  # type: ignore[arg-type]
                                                      stream=True)
            async for _ in stream:
                pass
    await assert_released(env, "long-held")
