"""Fault handling through a running gateway (issue 7): every upstream and client fault, for the OpenAI
and the Anthropic wire, streaming and not.

test_errors.py and test_streaming.py already pin the status codes and error shapes of several faults.
Here every fault is also checked for what it leaves behind:

* the caller gets a clear error in its wire format (or a final error event in the stream);
* the step's reservation is settled or released (`reserved_usd == 0`, `reserved_tokens == 0`, under a
  USD and a token budget);
* the step's span is exported with status ERROR and the `error.type` of the fault;
* no task, no upstream connection and no file descriptor is left behind (bounded poll back to the
  baseline taken before the request).
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.raw_http import read_request
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
USER = [{"role": "user", "content": "hi"}]
WIRES = pytest.mark.parametrize("path", [CHAT, MESSAGES], ids=["openai", "anthropic"])
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
ANTHROPIC_TYPE = {502: "api_error", 504: "timeout_error"}
# Long enough that a pause of the test process (a full GC late in the suite) cannot pass for an
# upstream timeout in the cases that do not test one (a disconnect mid-stream); the fakes that do
# stall for 3 s.
TIMEOUTS = {"connect": 2, "first_byte": 1.2, "idle": 1.2}


# -- a raw upstream that resets or truncates connections ------------------------------------------------


class RawUpstream:
    """A loopback HTTP/1.1 server that reads one request per connection, then misbehaves as scripted:

    * `reset`: send `head` (maybe nothing) and `body_part`, then an RST (SO_LINGER 0, abort);
    * `close`: the same, then a plain FIN (a body shorter than its Content-Length).
    """

    def __init__(self) -> None:
        self.action = "reset"
        self.head = b""
        self.body_part = b""
        self.requests: list[bytes] = []
        self.open = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def script(self, action: str, head: bytes = b"", body_part: bytes = b"") -> None:
        self.action, self.head, self.body_part = action, head, body_part

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            self.requests.append(await read_request(reader))
            if self.head or self.body_part:
                writer.write(self.head + self.body_part)
                await writer.drain()
                await asyncio.sleep(0.05)  # the gateway has read the bytes before the connection dies
            if self.action == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
                await writer.wait_closed()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()
        finally:
            self.open -= 1


def http_head(content_type: bytes, length: int | None = None) -> bytes:
    framing = b"Content-Length: %d\r\n" % length if length is not None else b"Transfer-Encoding: chunked\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n" + framing + b"\r\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


# -- the environment: gateway + fake + raw upstream + in-memory spans -------------------------------------


PRICING = {
    "gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
    "claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
    "raw-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
}


@dataclass
class Env:
    h: Harness
    raw: RawUpstream
    exporter: InMemorySpanExporter
    telemetry: Any
    client: aiohttp.ClientSession
    counter: list[int] = field(default_factory=lambda: [0])
    answered_in: float = 0.0  # seconds the last faulty call took to be answered (fault_case)

    @property
    def fake(self) -> FakeProvider:
        return self.h.fake

    def run_id(self) -> str:
        self.counter[0] += 1
        return f"fault-{self.counter[0]}"

    async def run(self, run_id: str) -> dict[str, Any]:
        """The run from the admin API, on a connection that closes after the answer."""
        async with self.client.get(f"{self.h.admin_url}/admin/runs/{run_id}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()  # type: ignore[no-any-return]

    def spans(self) -> list[ReadableSpan]:
        assert self.telemetry.force_flush()
        return [s for s in self.exporter.get_finished_spans() if (s.attributes or {}).get("gen_ai.operation.name") == "chat"]


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """What the suite allocated before this test is out of `gc.collect()`'s reach while it runs: the
    leak checks collect in a loop, and late in the suite (torch, hypothesis) each full collection of
    that heap took about a second. Objects the test creates are collected as usual (the garbage the
    suite left is frozen too, and collected after `unfreeze`)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
async def env(frozen_heap: None, gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]) -> AsyncIterator[Env]:
    raw = RawUpstream()
    raw_url = await raw.start()
    fake_url = fake[1]
    providers = {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai", "timeouts": TIMEOUTS},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-provider", "timeouts": TIMEOUTS},
        "rawoa": {"type": "openai", "base_url": f"{raw_url}/v1", "api_key": "sk-raw", "timeouts": TIMEOUTS},
        "rawan": {"type": "anthropic", "base_url": raw_url, "api_key": "sk-raw", "timeouts": TIMEOUTS},
    }
    h = await gateway_factory(
        providers=providers,
        models={"gpt-*": "openai", "claude-*": "anthropic", "raw-gpt-*": "rawoa", "raw-claude-*": "rawan"},
        pricing=PRICING,
        agents={"default": {"budget": {"usd": 50.0, "tokens": 10_000_000}}},
    )
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry  # the record stage looks it up per step
    # every request on its own connection: a finished request leaves no server-side handler task
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    try:
        yield Env(h, raw, exporter, telemetry, client)
    finally:
        await client.close()
        await raw.close()
        telemetry.shutdown()


def body_for(path: str, *, stream: bool = False, model: str | None = None) -> dict[str, Any]:
    if path == CHAT:
        return {"model": model or "gpt-4o-mini", "messages": USER, "stream": stream}
    return {"model": model or "claude-3-5-haiku-latest", "max_tokens": 64, "messages": USER, "stream": stream}


def raw_model(path: str) -> str:
    return "raw-gpt-4o" if path == CHAT else "raw-claude-3-5-haiku"


# -- nothing left behind ------------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Baseline:
    tasks: set[asyncio.Task[Any]]
    fds: int
    connections: int


async def warm(env: Env) -> Baseline:
    """One good call of each wire (pool, ledger, spans warmed up), then the baseline. The replies a
    test queued for its faulty call wait."""
    queued, env.fake.replies = env.fake.replies, []
    for path in (CHAT, MESSAGES):
        async with env.client.post(f"{env.h.url}{path}", json=body_for(path)) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    env.fake.replies = queued
    await env.h.gateway.services["ledger"].flush()
    await asyncio.sleep(0.05)
    gc.collect()
    return Baseline(set(asyncio.all_tasks()), open_fds(), env.h.gateway.upstream.open_connections())


async def assert_nothing_left(env: Env, base: Baseline, timeout: float = 5.0) -> None:
    upstream = env.h.gateway.upstream
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t not in base.tasks and t is not me and not t.done()]
        state = {
            "tasks": [t.get_coro() for t in tasks],
            "busy_connections": upstream.busy_connections(),
            "open_connections": upstream.open_connections(),
            "fds": open_fds(),
            "fake_in_flight": env.fake.in_flight,
            "raw_open": env.raw.open,
        }
        clean = (
            not tasks
            and state["busy_connections"] == 0
            and state["open_connections"] <= base.connections
            and state["fds"] <= base.fds
            and state["fake_in_flight"] == 0
            and state["raw_open"] == 0
        )
        if clean:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind (baseline fds={base.fds} conns={base.connections}): {state}")
        await asyncio.sleep(0.02)


async def assert_released(env: Env, run_id: str, *, llm_calls: int = 1) -> dict[str, Any]:
    run = await env.run(run_id)
    assert run["reserved_usd"] == 0, run
    assert run["reserved_tokens"] == 0, run
    assert run["llm_calls"] == llm_calls, run
    return run


def assert_span_error(env: Env, run_id: str, error_type: str) -> None:
    spans = [s for s in env.spans() if (s.attributes or {}).get("tollgate.run_id", run_id) == run_id]
    assert spans, "the step exported no span"
    span = spans[-1]
    attrs = dict(span.attributes or {})
    assert span.status.status_code is StatusCode.ERROR, (span.name, span.status, attrs)
    assert attrs.get("error.type") == error_type, attrs


def assert_wire_error(path: str, raw: bytes, status: int, code: str) -> None:
    data = orjson.loads(raw)
    if path == MESSAGES:
        assert data["type"] == "error", data
        assert set(data["error"]) == {"type", "message", "code"}, data
        assert data["error"]["type"] == ANTHROPIC_TYPE[status], data
    else:
        assert set(data) == {"error"}, data
        assert set(data["error"]) == {"message", "type", "param", "code"}, data
    assert data["error"]["code"] == code, data
    assert data["error"]["message"], data


def assert_error_event(path: str, raw: bytes, code: str) -> None:
    """The stream ends with one error event in the provider's stream format."""
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    name, data = None, b""
    for line in last.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
    event = orjson.loads(data)
    if path == MESSAGES:
        assert name == b"error", last
        assert event["type"] == "error" and set(event["error"]) == {"type", "message", "code"}, event
    else:
        assert name is None, last
        assert set(event) == {"error"} and set(event["error"]) == {"message", "type", "param", "code"}, event
    assert event["error"]["code"] == code, event
    assert event["error"]["message"], event


async def call(env: Env, path: str, body: dict[str, Any], run_id: str) -> tuple[int, bytes]:
    headers = {"x-tollgate-run-id": run_id}
    async with env.client.post(f"{env.h.url}{path}", json=body, headers=headers) as resp:
        assert resp.headers["x-tollgate-run-id"] == run_id
        return resp.status, await resp.read()


async def fault_case(env: Env, path: str, body: dict[str, Any], *, status: int, code: str,
                     error_type: str | None = None, in_stream: bool = False) -> bytes:
    """After a baseline, make the faulty call and check the four promises."""
    base = await warm(env)
    run_id = env.run_id()
    started = time.monotonic()
    got, raw = await call(env, path, body, run_id)
    env.answered_in = time.monotonic() - started
    assert got == status, raw[:300]
    if in_stream:
        assert_error_event(path, raw, code)
    else:
        assert_wire_error(path, raw, status, code)
    await assert_released(env, run_id)
    assert_span_error(env, run_id, error_type or code)
    await assert_nothing_left(env, base)
    return raw


def stream_of(path: str, parts: list[str]) -> list[bytes]:
    return openai_stream(parts) if path == CHAT else anthropic_stream(parts)


def answer_of(path: str) -> dict[str, Any]:
    return openai_completion() if path == CHAT else anthropic_message()


# -- upstream timeouts ---------------------------------------------------------------------------------


@WIRES
@STREAMS
async def test_timeout_before_headers(env: Env, path: str, stream: bool) -> None:
    env.fake.queue(Reply(delay=3.0, body=answer_of(path)))
    await fault_case(env, path, body_for(path, stream=stream), status=504, code="upstream_timeout")
    # answered at the 1.2 s first-byte timeout, not after the fake's 3 s (the checks after it, which
    # collect garbage until nothing is left, take longer the more the suite has loaded)
    assert env.answered_in < 2.5
    assert env.fake.disconnects == 0  # the fake was still sleeping: its handler was cancelled, not written to


@WIRES
async def test_timeout_between_stream_chunks(env: Env, path: str) -> None:
    chunks = stream_of(path, ["never", "finished"])
    env.fake.queue(Reply(chunks=chunks, chunk_delay=3.0))
    raw = await fault_case(env, path, body_for(path, stream=True), status=200, code="upstream_timeout", in_stream=True)
    assert raw.startswith(chunks[0])


@WIRES
async def test_timeout_while_reading_a_json_body(env: Env, path: str) -> None:
    """Headers arrive, then the body stalls: the idle timeout applies to non-streamed bodies too."""
    answer = orjson.dumps(answer_of(path))
    env.fake.queue(Reply(chunks=[answer[:20], answer[20:]], chunk_delay=3.0))
    await fault_case(env, path, body_for(path), status=504, code="upstream_timeout")


# -- connection reset, before and after the headers; truncated bodies -------------------------------------


@WIRES
@STREAMS
async def test_connection_reset_before_headers(env: Env, path: str, stream: bool) -> None:
    env.raw.script("reset")
    await fault_case(env, path, body_for(path, stream=stream, model=raw_model(path)), status=502,
                     code="upstream_unavailable")
    assert len(env.raw.requests) == 1


@WIRES
@STREAMS
async def test_connection_closed_before_headers(env: Env, path: str, stream: bool) -> None:
    env.raw.script("close")
    await fault_case(env, path, body_for(path, stream=stream, model=raw_model(path)), status=502,
                     code="upstream_unavailable")


@WIRES
async def test_connection_reset_after_headers_json(env: Env, path: str) -> None:
    answer = orjson.dumps(answer_of(path))
    env.raw.script("reset", http_head(b"application/json", len(answer)), answer[:15])
    await fault_case(env, path, body_for(path, model=raw_model(path)), status=502, code="upstream_unavailable")


@WIRES
async def test_connection_reset_mid_stream(env: Env, path: str) -> None:
    first = stream_of(path, ["partial"])[:2]
    env.raw.script("reset", http_head(b"text/event-stream"), b"".join(chunked(c) for c in first))
    raw = await fault_case(env, path, body_for(path, stream=True, model=raw_model(path)), status=200,
                           code="upstream_unavailable", in_stream=True)
    assert raw.startswith(first[0])


@WIRES
async def test_truncated_json_body(env: Env, path: str) -> None:
    """Fewer bytes than the Content-Length, then a clean close."""
    answer = orjson.dumps(answer_of(path))
    env.raw.script("close", http_head(b"application/json", len(answer)), answer[:-5])
    await fault_case(env, path, body_for(path, model=raw_model(path)), status=502, code="upstream_unavailable")


@WIRES
@pytest.mark.parametrize("cut", [1, 3])
async def test_truncated_stream(env: Env, path: str, cut: int) -> None:
    chunks = stream_of(path, ["one", "two", "three"])
    env.fake.queue(Reply(chunks=chunks, cut_after=cut))
    raw = await fault_case(env, path, body_for(path, stream=True), status=200, code="upstream_unavailable",
                           in_stream=True)
    assert raw.startswith(b"".join(chunks[:cut]))


@WIRES
async def test_stream_ends_cleanly_but_incomplete(env: Env, path: str) -> None:
    """The upstream finishes its chunked body properly, but the answer never completed."""
    chunks = openai_stream(["a"], done=False)[:2] if path == CHAT else anthropic_stream(["a"], complete=False)
    env.fake.queue(Reply(chunks=chunks))
    await fault_case(env, path, body_for(path, stream=True), status=200, code="upstream_unavailable", in_stream=True)


# -- upstream 5xx ------------------------------------------------------------------------------------


@WIRES
@STREAMS
@pytest.mark.parametrize("status", [500, 503, 529])
async def test_upstream_5xx_passed_through_and_released(env: Env, path: str, stream: bool, status: int) -> None:
    if path == MESSAGES:
        upstream = {"type": "error", "error": {"type": "overloaded_error", "message": "upstream overloaded"}}
    else:
        upstream = {"error": {"message": "upstream failed", "type": "server_error", "param": None, "code": None}}
    env.fake.queue(Reply(status=status, body=upstream))
    base = await warm(env)
    run_id = env.run_id()
    got, raw = await call(env, path, body_for(path, stream=stream), run_id)
    assert got == status
    assert orjson.loads(raw) == upstream  # the provider's own error, in its own wire format, unchanged
    # an upstream error is not charged, and one the SDKs retry (any 5xx) is no model call of the run
    run = await assert_released(env, run_id, llm_calls=0)
    assert run["spent_usd"] == 0
    assert_span_error(env, run_id, str(status))
    await assert_nothing_left(env, base)


# -- malformed upstream answers ------------------------------------------------------------------------


@WIRES
@pytest.mark.parametrize("payload", [b"<html>oops</html>", b'{"id": "x", "choices": [', b"", b"[1, 2]", b'"text"'],
                         ids=["html", "truncated-json", "empty", "array", "string"])
async def test_malformed_json_answer(env: Env, path: str, payload: bytes) -> None:
    env.fake.queue(Reply(body=payload))
    await fault_case(env, path, body_for(path), status=502, code="upstream_unavailable")


# Valid JSON of the wrong shape. The first ones make the adapter's parse_answer raise (today: a 500 from
# aiohttp, not in the caller's format); the last of each wire are accepted and relayed as they are.
WRONG_SHAPES = {
    CHAT: [
        {"choices": [1]},
        {"choices": [{"message": "text"}]},
        {"choices": [{"message": {"content": "x", "tool_calls": ["call"]}}]},
        {"choices": [{"message": {"content": "x", "tool_calls": [{"function": "f"}]}}]},
        {"choices": {"0": {}}},
        {"choices": [], "usage": "lots"},
    ],
    MESSAGES: [
        {"content": [1]},
        {"content": "text"},
        {"content": [{"type": "tool_use", "input": "not an object"}]},
        {"type": "message", "content": None, "usage": [1]},
        {"content": [{"type": "text", "text": 7}]},
    ],
}
CRASHING_SHAPES = {CHAT: 5, MESSAGES: 2}  # how many of the first shapes make parse_answer raise
SHAPE_CASES = [(path, i) for path in (CHAT, MESSAGES) for i in range(len(WRONG_SHAPES[path]))]
SHAPE_IDS = [f"{'openai' if p == CHAT else 'anthropic'}-{i}" for p, i in SHAPE_CASES]

async def hygiene_case(env: Env, path: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
    """After a baseline, make the faulty call and check only what it leaves behind."""
    base = await warm(env)
    run_id = env.run_id()
    async with env.client.post(f"{env.h.url}{path}", json=body, headers={"x-tollgate-run-id": run_id}) as resp:
        status, parts = resp.status, []
        try:
            while chunk := await resp.content.readany():
                parts.append(chunk)
        except aiohttp.ClientPayloadError:
            parts.append(b"<cut>")  # the response ended without its terminating chunk
        raw = b"".join(parts)
    await assert_released(env, run_id)
    await assert_nothing_left(env, base)
    return status, raw, run_id


@pytest.mark.parametrize(("path", "index"), SHAPE_CASES, ids=SHAPE_IDS)
async def test_wrong_shaped_json_answer_leaves_nothing(env: Env, path: str, index: int) -> None:
    env.fake.queue(Reply(body=WRONG_SHAPES[path][index]))
    status, raw, _ = await hygiene_case(env, path, body_for(path))
    if index >= CRASHING_SHAPES[path]:  # accepted: relayed unchanged, the step settled from what it said
        assert status == 200 and orjson.loads(raw) == WRONG_SHAPES[path][index]


@pytest.mark.parametrize(("path", "index"), [(p, i)
                                             for p, i in SHAPE_CASES if i < CRASHING_SHAPES[p]],
                         ids=[n for (p, i), n in zip(SHAPE_CASES, SHAPE_IDS, strict=True) if i < CRASHING_SHAPES[p]])
async def test_wrong_shaped_json_answer_is_a_502(env: Env, path: str, index: int) -> None:
    """Valid JSON that cannot be read as an answer can be neither judged nor settled from: 502."""
    env.fake.queue(Reply(body=WRONG_SHAPES[path][index]))
    await fault_case(env, path, body_for(path), status=502, code="upstream_unavailable")


def malformed_sse(path: str) -> list[bytes]:
    good = stream_of(path, ["ok", "then"])
    bad = b"data: {\"choices\": [{\"delta\": {\"content\": \"bro\n\n" if path == CHAT else (
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "delta": {\n\n')
    return [*good[:2], bad, *good[2:]]


WRONG_SSE = {
    CHAT: b'data: {"id": "c", "choices": [1]}\n\n',
    MESSAGES: b'event: content_block_start\ndata: {"type": "content_block_start", "index": 1, "content_block": "x"}\n\n',
}


def wrong_sse(path: str) -> list[bytes]:
    good = stream_of(path, ["ok"])
    return [*good[:2], WRONG_SSE[path], *good[2:]]


@WIRES
@pytest.mark.parametrize("make", [malformed_sse, wrong_sse], ids=["undecodable", "wrong-shape"])
async def test_malformed_sse_leaves_nothing(env: Env, path: str, make: Callable[[str], list[bytes]]) -> None:
    chunks = make(path)
    env.fake.queue(Reply(chunks=chunks))
    status, raw, _ = await hygiene_case(env, path, body_for(path, stream=True))
    assert status == 200
    assert raw.startswith(b"".join(chunks[:2]))


@WIRES
async def test_malformed_sse_json_ends_with_an_error_event(env: Env, path: str) -> None:
    chunks = malformed_sse(path)
    env.fake.queue(Reply(chunks=chunks))
    raw = await fault_case(env, path, body_for(path, stream=True), status=200, code="upstream_unavailable",
                           in_stream=True)
    assert raw.startswith(b"".join(chunks[:2]))
    assert chunks[2] not in raw  # the event that cannot be judged never reaches the agent


@WIRES
async def test_wrong_shaped_sse_event_ends_with_an_error_event(env: Env, path: str) -> None:
    await_chunks = wrong_sse(path)
    env.fake.queue(Reply(chunks=await_chunks))
    await fault_case(env, path, body_for(path, stream=True), status=200, code="upstream_unavailable", in_stream=True)


# -- slow client: backpressure, not buffering --------------------------------------------------------------


def small_receive_buffer(addr_info: Any) -> socket.socket:
    """A client socket with a fixed 64 KiB receive buffer (no autotuning): a slow reader's window stays small."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return sock


@WIRES
async def test_slow_client_is_backpressured_not_buffered(env: Env, path: str) -> None:
    """A client that stops reading: the gateway's writes wait (aiohttp drains at its high-water mark),
    so it stops reading the upstream, whose writes then block too. What is held meanwhile is bounded by
    socket buffers, not by the length of the stream, and the gateway's heap does not grow with it; when
    the client reads again the stream completes, byte for byte, and nothing is left."""
    part = "x" * 8000
    chunks = stream_of(path, [part] * 4000)  # ~32 MB of events
    total = sum(len(c) for c in chunks)
    sent = [0]

    class Counted(list[bytes]):
        def __iter__(self) -> Any:
            for chunk in super().__iter__():
                sent[0] += len(chunk)
                yield chunk

    env.fake.queue(Reply(chunks=Counted(chunks)))
    base = await warm(env)
    run_id = env.run_id()
    connector = aiohttp.TCPConnector(force_close=True, socket_factory=small_receive_buffer)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 14) as slow:
        tracemalloc.start()
        try:
            resp = await slow.post(f"{env.h.url}{path}", json=body_for(path, stream=True),
                                   headers={"x-tollgate-run-id": run_id})
            try:
                assert resp.status == 200
                received = bytearray(await resp.content.readany())
                heap_before = tracemalloc.get_traced_memory()[0]
                # stop reading until the upstream makes no more progress
                last, still = -1, 0
                while still < 5:
                    await asyncio.sleep(0.05)
                    still = still + 1 if sent[0] == last else 0
                    last = sent[0]
                stalled_at = sent[0]
                # the stream reader keeps the answer's text for judging it (about a quarter of the bytes
                # sent here): everything beyond that is what buffering would cost
                held = tracemalloc.get_traced_memory()[0] - heap_before - stalled_at // 3
                assert stalled_at < total / 2, f"{stalled_at} of {total} bytes left the upstream for a stalled client"
                assert held < 8 * 1024 * 1024, f"{held} bytes held for a stalled client"
                assert env.fake.in_flight == 1  # the upstream is blocked by backpressure, not finished
                assert env.h.gateway.upstream.busy_connections() == 1
                while True:  # a slow reader: bounded reads
                    chunk = await resp.content.read(1 << 20)
                    if not chunk:
                        break
                    received += chunk
            finally:
                resp.release()
        finally:
            tracemalloc.stop()
    # unchanged, minus the usage chunk tollgate asked for on the agent's behalf (OpenAI)
    assert bytes(received) == b"".join(c for c in chunks if path == MESSAGES or b'"usage"' not in c)
    assert sent[0] == total
    run = await env.run(run_id)
    assert run["reserved_usd"] == 0 and run["reserved_tokens"] == 0
    assert run["steps"][-1]["status"] == 200
    await assert_nothing_left(env, base)


# -- client disconnect mid-stream ---------------------------------------------------------------------


async def disconnect_case(env: Env, path: str, holding: bool) -> str:
    if holding:  # the relay holds tool-call events: nothing is written to the client when it leaves
        tool = {"id": "call_1", "type": "function", "function": {"name": "t", "arguments": "{}"}}
        chunks = openai_stream(["a"], tool_calls=[tool]) if path == CHAT else anthropic_stream(
            ["a"], tool_uses=[{"id": "tu_1", "name": "t", "input": {}}])
        stall = chunks[: 4 if path == CHAT else 6] + [b": keepalive\n\n"] * 80
    else:
        stall = stream_of(path, ["p"] * 80)
    env.fake.queue(Reply(chunks=stall, chunk_delay=0.05))
    base = await warm(env)
    run_id = env.run_id()
    resp = await env.client.post(f"{env.h.url}{path}", json=body_for(path, stream=True),
                                 headers={"x-tollgate-run-id": run_id})
    try:
        assert resp.status == 200
        assert await resp.content.readany()
        await asyncio.sleep(0.15)
    finally:
        resp.close()  # drop the connection mid-stream
    await assert_nothing_left(env, base)
    assert env.fake.disconnects == 1, "the upstream kept streaming to nobody"
    run = await assert_released(env, run_id)
    assert run["spent_usd"] > 0  # the upstream did work: the reservation is charged, not released
    return run_id


@WIRES
@pytest.mark.parametrize("holding", [False, True], ids=["text", "tool-call-held"])
async def test_client_disconnect_mid_stream(env: Env, path: str, holding: bool) -> None:
    """The agent goes away mid-stream: the upstream is closed at once, the reservation settled (the
    upstream did work), and nothing is left."""
    await disconnect_case(env, path, holding)


@WIRES
async def test_client_disconnect_marks_the_span(env: Env, path: str) -> None:
    run_id = await disconnect_case(env, path, holding=False)
    assert_span_error(env, run_id, "client_disconnected")
