"""Acceptance: upstream and client faults, written from the contract (DESIGN sections 2-4, README "Runs,
identity, decisions", "How budgets are held", `providers.<name>.timeouts`, `limits.*`).

The promise under test: each of these faults, for OpenAI Chat Completions and Anthropic Messages, streamed
and not, "gives a clear error in the caller's wire format, settles or releases its reservation, marks its
span as an error, and leaves no task, connection or file handle behind":

1. upstream timeout before headers (`timeouts.first_byte`)
2. timeout between chunks (`timeouts.idle`)
3. connection reset by the upstream (before headers; mid-body / mid-stream)
4. truncated answer (the upstream closes before the final event / before Content-Length)
5. upstream 5xx (passed through unchanged, DESIGN 4; charged nothing, README)
6. malformed JSON from the upstream
7. a slow client reading a long stream slowly (back-pressure: no whole-stream buffering)
8. the client disconnecting mid-stream

The upstream is a scripted raw asyncio server on loopback (`RawUpstream`) so it can stall, reset (RST
through SO_LINGER 0), truncate and flood precisely. The gateway is the repo's `gateway_factory` (in-process,
on loopback), with `create_apps` given an in-memory span exporter, so spans, asyncio tasks, file
descriptors and the gateway's sockets to the upstream (matched through /proc/net/tcp) are all observable
from this process. Each fault is preceded by a successful warm-up call of the same kind; the baseline is
taken once the gateway is idle after it, and the same counts must come back after the fault.

Reservations: the upstream holds each faulted request until the test has read the run's `reserved_usd`
(must be > 0), so the settlement can be checked exactly: README "How budgets are held": a call the upstream
may already have received when it failed (no answer within `first_byte`, a broken connection), a stream
that broke, or one the agent left, is settled at the full reservation ("never at $0"); an upstream error
answer is charged nothing. Either way `reserved_usd`/`reserved_tokens` return to 0.

Faults 1-6 hit a keep-alive connection the gateway pooled (realistic providers keep connections open), and
a follow-up call checks the broken connection did not go back to the pool; faults 7-8 and the sanity test
use fresh `Connection: close` connections. Also passed with `BOTH_LOOPS = True` (uvloop, as `tollgate
serve` runs); left off to keep the file near 30 s. Compared with tests/gateway/test_faults.py afterwards:
a raw-wire "error event is final" test duplicated its `assert_error_event` checks and was dropped; what
stays adds the official SDKs, pooled-connection faults, byte-exact 5xx pass-through, spend equal to the
observed reservation, a client pause longer than `idle`, a reset (RST) disconnect, and socket counts read
from /proc rather than the gateway's own pool counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import tests.conftest as repo_conftest
from gateway.app import create_apps
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Seen, anthropic_message, anthropic_stream, openai_completion, openai_stream

RUN_HEADER = "x-tollgate-run-id"
MSG = [{"role": "user", "content": "hello"}]
# first_byte above idle: the upstream holds each faulted request while the test reads its reservation
TIMEOUTS = {"connect": 1, "first_byte": 1.0, "idle": 0.5}
WARM = {"openai": "gpt-warm", "anthropic": "claude-warm"}
FAULTY = {"openai": "gpt-fault", "anthropic": "claude-fault"}
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
# upstream 5xx bodies as the providers send them (OpenAI's are pretty-printed): passed through byte for byte
FIVE_XX = {
    "openai": (500, (b'{\n    "error": {\n        "message": "The server had an error while processing your '
                     b'request. Sorry about that!",\n        "type": "server_error",\n        "param": null,\n'
                     b'        "code": null,\n        "x_fake_marker": 17\n    }\n}\n')),
    "anthropic": (529, (b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},'
                        b'"request_id":"req_fake_529"}')),
}


# -- the scripted raw upstream ----------------------------------------------------------------------------


async def _read_request(reader: asyncio.StreamReader) -> Seen | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        body = b"".join(parts)
    else:
        body = b""
    return Seen(method, path, headers, body)


def _head(status: int, ctype: str, length: int | None = None, keep: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}", f"Content-Type: {ctype}"]
    if not keep:
        lines.append("Connection: close")
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER on, 0 s), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class RawUpstream:
    """One fake provider for both wires (the path decides). By default each connection serves one request
    and closes (`Connection: close`), so after any call no healthy connection needs to stay open: every
    live connection is one the gateway left behind. With `keepalive`, successful answers keep their
    connection open for the next request (as real providers do); faults still end theirs."""

    def __init__(self) -> None:
        self.fault: str = "ok"
        self.hold = False
        self.received = asyncio.Event()
        self.release = asyncio.Event()
        self.go = asyncio.Event()  # set by the test once the client has seen stream bytes
        self.peer_gone = asyncio.Event()  # the gateway closed a connection we were still writing to
        self.live = 0
        self.keepalive = False
        self.served_on: list[int] = []  # per request: how many requests its connection had served before
        self.requests: list[Seen] = []
        self.sent = 0  # bytes of the long stream written (drained to the kernel)
        self.total = 0  # bytes of the long stream in all
        self.long_events = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self._writers):
            w.transport.abort()
        await self.server.wait_closed()

    def arm(self, fault: str, *, hold: bool = True) -> None:
        self.fault, self.hold = fault, hold
        self.received, self.release, self.go, self.peer_gone = (asyncio.Event() for _ in range(4))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.live += 1
        self._writers.add(writer)
        try:
            for index in range(1000):
                req = await _read_request(reader)
                if req is None:
                    return
                self.requests.append(req)
                self.served_on.append(index)
                fault = self.fault
                self.fault = "ok"  # one faulted request per arm()
                if fault != "ok" and self.hold:
                    self.received.set()
                    await asyncio.wait_for(self.release.wait(), 5)
                await self._respond(fault, req, reader, writer)
                if not (fault == "ok" and self.keepalive):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            self.peer_gone.set()
        finally:
            self._writers.discard(writer)
            if not writer.is_closing():
                writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self.live -= 1

    async def _until_eof(self, reader: asyncio.StreamReader, limit: float = 10.0) -> None:
        """Stall: send nothing until the gateway closes the connection (bounded)."""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(limit):
                while await reader.read(65536):
                    pass
        self.peer_gone.set()

    async def _wait_go(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.go.wait(), 3)

    async def _respond(self, fault: str, req: Seen, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        api = "anthropic" if req.path.rstrip("/").endswith("/messages") else "openai"
        body = req.json
        model, stream = body["model"], bool(body.get("stream"))
        if api == "openai":
            events = openai_stream(["Hel", "lo"], model=model, usage=(10, 5))
            prefix = 2  # role chunk + first text delta
            whole = orjson.dumps(openai_completion(model=model))
            bad_event = b'data: {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [{"ind\n\n'
        else:
            events = anthropic_stream(["Hel", "lo"], model=model, usage=(10, 5))
            prefix = 3  # message_start, content_block_start, first text delta
            whole = orjson.dumps(anthropic_message(model=model))
            bad_event = b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "del\n\n'

        async def send(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        if fault == "ok":
            keep = self.keepalive
            if stream:
                await send(_head(200, "text/event-stream", keep=keep) + b"".join(_chunk(e) for e in events)
                           + b"0\r\n\r\n")
            else:
                await send(_head(200, "application/json", len(whole), keep=keep) + whole)
            return
        if fault == "first_byte":
            await self._until_eof(reader)
            return
        if fault == "reset_before_headers":
            _rst(writer)
            return
        if fault == "5xx":
            status, payload = FIVE_XX[api]
            await send(_head(status, "application/json", len(payload)) + payload)
            return
        if fault == "long":
            await self._long_stream(api, model, send, reader, writer)
            return
        if fault == "endless":
            await self._endless(events[:prefix], events[prefix - 1], send)
            return
        if not stream:
            half = whole[: len(whole) // 2]
            if fault == "malformed":
                await send(_head(200, "application/json", len(half)) + half)  # framing fine, JSON broken
                return
            await send(_head(200, "application/json", len(whole)) + half)
            if fault == "idle":
                await self._until_eof(reader)
            elif fault == "reset_mid":
                _rst(writer)
            elif fault == "truncated":
                writer.close()  # FIN before Content-Length bytes
            else:
                raise AssertionError(fault)
            return
        await send(_head(200, "text/event-stream") + b"".join(_chunk(e) for e in events[:prefix]))
        await self._wait_go()
        if fault == "idle":
            await self._until_eof(reader)
        elif fault == "reset_mid":
            _rst(writer)
        elif fault == "truncated":
            await send(b"0\r\n\r\n")  # a clean end of the body, but no final event
        elif fault == "truncated_fin":
            writer.close()  # FIN in the middle of the chunked body
        elif fault == "malformed":
            await send(_chunk(bad_event) + b"".join(_chunk(e) for e in events[prefix:]) + b"0\r\n\r\n")
        else:
            raise AssertionError(fault)

    async def _endless(self, prefix: list[bytes], delta: bytes, send: Any) -> None:
        """A long generation: a text delta every 20 ms for up to 10 s, until the gateway hangs up."""
        await send(_head(200, "text/event-stream") + b"".join(_chunk(e) for e in prefix))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            await send(_chunk(delta))  # raises ConnectionError once the gateway closed: peer_gone

    async def _long_stream(self, api: str, model: str, send: Any, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        writer.transport.set_write_buffer_limits(high=65536)
        text = "x" * 16384
        if api == "openai":
            events = openai_stream([text], model=model, usage=(10, 5))
            head, delta, tail = events[:1], events[1], events[2:]
        else:
            events = anthropic_stream([text], model=model, usage=(10, 5))
            head, delta, tail = events[:2], events[2], events[3:]
        framed = _chunk(delta)
        end = b"".join(_chunk(e) for e in tail) + b"0\r\n\r\n"
        start = _head(200, "text/event-stream") + b"".join(_chunk(e) for e in head)
        self.total = len(start) + framed.__len__() * self.long_events + len(end)
        self.sent = 0
        await send(start)
        self.sent += len(start)
        for _ in range(self.long_events):
            await send(framed)
            self.sent += len(framed)
        await send(end)
        self.sent += len(end)
        await self._until_eof(reader)


# -- observing the process --------------------------------------------------------------------------------


def _socket_inodes_to(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as fh:
            next(fh)
            for line in fh:
                cols = line.split()
                if int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] != "0":
                    inodes.add(cols[9])
    return inodes


@dataclass(frozen=True)
class Snapshot:
    tasks: int
    fds: int
    gw_upstream_sockets: int  # fds of this process connected to the fake upstream's port
    upstream_live: int  # connections the fake upstream still has open

    def describe(self) -> str:
        return (f"tasks={self.tasks} fds={self.fds} gateway->upstream sockets={self.gw_upstream_sockets} "
                f"upstream live connections={self.upstream_live}")


def snapshot(up: RawUpstream) -> Snapshot:
    fds = os.listdir("/proc/self/fd")
    inodes = _socket_inodes_to(up.port)
    to_up = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                to_up += 1
    return Snapshot(len(asyncio.all_tasks()), len(fds), to_up, up.live)


async def quiet(up: RawUpstream, timeout: float = 3.0, pooled: int = 0) -> Snapshot:
    """The counts once nothing changes for 5 polls in a row (the gateway idle), with at most `pooled`
    connections to the upstream open."""
    deadline = time.monotonic() + timeout
    last, same = snapshot(up), 0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        now = snapshot(up)
        same = same + 1 if now == last else 0
        last = now
        if same >= 3 and now.upstream_live <= pooled and now.gw_upstream_sockets <= pooled:
            break
    return last


def task_names() -> list[str]:
    return sorted(f"{t.get_name()}:{t.get_coro()}" for t in asyncio.all_tasks())


async def back_to(up: RawUpstream, base: Snapshot, timeout: float = 3.0, pooled: int = 0) -> Snapshot:
    deadline = time.monotonic() + timeout
    while True:
        now = snapshot(up)
        if (now.tasks <= base.tasks and now.fds <= base.fds and now.gw_upstream_sockets <= pooled
                and now.upstream_live <= pooled):
            return now
        if time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.02)


def assert_no_leftovers(base: Snapshot, after: Snapshot, names_before: list[str], pooled: int = 0) -> None:
    extra = sorted(set(task_names()) - set(names_before))
    assert after.gw_upstream_sockets <= pooled, f"gateway socket(s) to the upstream left open: {after.describe()}"
    assert after.upstream_live <= pooled, f"upstream connection(s) never closed by the gateway: {after.describe()}"
    assert after.tasks <= base.tasks, f"tasks left behind: before {base.describe()}, after {after.describe()}: {extra}"
    assert after.fds <= base.fds, f"file descriptors left behind: before {base.describe()}, after {after.describe()}"


# -- fixtures ---------------------------------------------------------------------------------------------


@dataclass
class Env:
    h: Harness
    up: RawUpstream
    exporter: InMemorySpanExporter
    telemetry: Telemetry
    results: dict[str, Any] = field(default_factory=dict)

    async def spans(self, name: str) -> list[ReadableSpan]:
        assert await asyncio.to_thread(self.telemetry.force_flush)
        return [s for s in self.exporter.get_finished_spans() if s.name == name]

    async def run(self, run_id: str) -> dict[str, Any]:
        return await self.h.run(run_id)

    async def released(self, run_id: str, timeout: float = 3.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = await self.run(run_id)
            if not view["reserved_usd"] and not view["reserved_tokens"]:
                return view
            if time.monotonic() > deadline:
                return view
            await asyncio.sleep(0.02)


@pytest.fixture
async def env(gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    up = RawUpstream()
    await up.start()
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    # the repo's gateway_factory, with the apps given an in-memory span exporter
    monkeypatch.setattr(repo_conftest, "create_apps", lambda config: create_apps(config, telemetry=telemetry))
    h = await gateway_factory(
        providers={
            "openai": {"type": "openai", "base_url": f"{up.url}/v1", "api_key": "sk-provider-openai",
                       "timeouts": TIMEOUTS},
            "anthropic": {"type": "anthropic", "base_url": up.url, "api_key": "sk-ant-provider",
                          "timeouts": TIMEOUTS},
        },
        pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0},
                 "claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 4.0}},
        agents={"default": {"budget": {"usd": 1.0}}},
        limits={"max_answer_bytes": 512 * 1024 * 1024},
    )
    try:
        yield Env(h, up, exporter, telemetry)
    finally:
        await up.close()
        telemetry.shutdown()


# -- clients ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: int | None = None  # HTTP status of the response
    error: BaseException | None = None
    started: bool = False  # stream items reached the client before the error
    items: list[Any] = field(default_factory=list)


async def sdk_call(env: Env, api: str, stream: bool, model: str, run_id: str) -> Outcome:
    out = Outcome()
    headers = {RUN_HEADER: run_id}
    if api == "openai":
        client: Any = openai.AsyncOpenAI(base_url=f"{env.h.url}/v1", api_key="sk-agent", max_retries=0,
                                         timeout=10)
        make = lambda: client.chat.completions.create(
            model=model, messages=MSG, max_tokens=64, stream=stream, extra_headers=headers)
    else:
        client = anthropic.AsyncAnthropic(base_url=env.h.url, api_key="sk-agent", max_retries=0, timeout=10)
        make = lambda: client.messages.create(
            model=model, messages=MSG, max_tokens=64, stream=stream, extra_headers=headers)
    try:
        try:
            result = await make()
        except (openai.APIStatusError, anthropic.APIStatusError) as exc:
            out.status, out.error = exc.status_code, exc
            return out
        except (openai.APIError, anthropic.APIError) as exc:  # a connection error, ...: no clear error
            out.error = exc
            return out
        if not stream:
            out.status = 200
            out.items.append(result)
            return out
        out.status = result.response.status_code
        try:
            async for item in result:
                out.items.append(item)
                out.started = True
                env.up.go.set()
        except (openai.APIError, anthropic.APIError) as exc:  # the stream's error event
            out.error = exc
        return out
    finally:
        await client.close()


def check_status_error(api: str, out: Outcome, status: int, code: str) -> None:
    """DESIGN 4: the status and the error body of the API called."""
    assert out.status == status, f"expected HTTP {status} {code}, got {out.status}: {out.error!r} {out.items!r}"
    exc = out.error
    assert isinstance(exc, (openai.APIStatusError, anthropic.APIStatusError)), repr(exc)
    body = exc.response.json()
    if api == "openai":
        assert set(body) == {"error"}, body
        err = body["error"]
        assert {"message", "type", "param", "code"} <= set(err), body
        assert err["param"] is None and err["code"] == code, body
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
    else:
        assert body.get("type") == "error" and isinstance(body.get("error"), dict), body
        err = body["error"]
        assert err.get("code") == code, body
        assert isinstance(err.get("type"), str) and err["type"], body
        assert isinstance(err.get("message"), str) and err["message"], body


def check_stream_error(api: str, out: Outcome, code: str) -> None:
    """DESIGN 4: a stream already started ends with a final error event in the provider's stream format
    (the SDK raises it as an APIError while iterating)."""
    assert out.status == 200, f"stream should have started (200), got {out.status}: {out.error!r}"
    assert out.started, f"no stream item reached the client before the fault: {out.error!r}"
    exc = out.error
    assert exc is not None, f"the stream ended without any error event after {len(out.items)} item(s): {out.items!r}"
    if api == "openai":
        assert isinstance(exc, openai.APIError), repr(exc)
        err = exc.body
        assert isinstance(err, dict), f"not an OpenAI error event: {exc!r}"
        assert err.get("code") == code, err
        assert {"message", "type", "param", "code"} <= set(err), err
    else:
        assert isinstance(exc, anthropic.APIStatusError), f"not an Anthropic `event: error`: {exc!r}"
        body = exc.body
        assert isinstance(body, dict) and body.get("type") == "error", body
        assert body["error"].get("code") == code, body
        assert isinstance(body["error"].get("type"), str), body


async def check_span(env: Env, model: str, code: str | None) -> ReadableSpan:
    spans = await env.spans(f"chat {model}")
    assert spans, f"no `chat {model}` span finished; names: {[s.name for s in env.exporter.get_finished_spans()]}"
    span = spans[-1]
    assert span.status.status_code == StatusCode.ERROR, (
        f"span not marked as an error: status={span.status.status_code} attrs={dict(span.attributes or {})}")
    error_type = (span.attributes or {}).get("error.type")
    if code is None:
        assert error_type, f"span has no error.type: {dict(span.attributes or {})}"
    else:
        assert error_type == code, f"error.type {error_type!r}, expected {code!r}"
    return span


def check_answer(api: str, stream: bool, out: Outcome) -> None:
    """A successful call's content reached the client whole (no answer of another request)."""
    assert out.status == 200 and out.error is None, f"call failed: {out.status} {out.error!r}"
    if not stream:
        text = out.items[0].choices[0].message.content if api == "openai" else out.items[0].content[0].text
        assert text == "Hello!", out.items
    elif api == "openai":
        assert "".join(c.choices[0].delta.content or "" for c in out.items if c.choices) == "Hello", out.items
    else:
        deltas = [e.delta.text for e in out.items if e.type == "content_block_delta"]
        assert "".join(deltas) == "Hello" and out.items[-1].type == "message_stop", out.items


async def warm_up(env: Env, api: str, stream: bool, pooled: int = 0) -> tuple[Snapshot, list[str]]:
    env.up.arm("ok", hold=False)
    warm_run = f"warm-{uuid.uuid4().hex[:8]}"
    out = await sdk_call(env, api, stream, WARM[api], warm_run)
    check_answer(api, stream, out)
    await env.run(warm_run)  # the harness's keep-alive admin connection is part of the baseline
    base = await quiet(env.up, pooled=pooled)
    assert base.upstream_live <= pooled and base.gw_upstream_sockets <= pooled, base.describe()
    return base, task_names()


async def faulted(env: Env, api: str, stream: bool, fault: str) -> tuple[Outcome, float, str]:
    """Run one faulted call; returns its outcome, the reservation seen while the upstream held the
    request, and the run id."""
    run_id = f"fault-{fault}-{uuid.uuid4().hex[:8]}"
    env.up.arm(fault)
    task = asyncio.create_task(sdk_call(env, api, stream, FAULTY[api], run_id))
    await asyncio.wait_for(env.up.received.wait(), 5)
    view = await env.run(run_id)
    reserved = view["reserved_usd"]
    env.up.release.set()
    out = await asyncio.wait_for(task, 15)
    assert reserved > 0, f"no reservation was held while the call was upstream: {view}"
    return out, reserved, run_id


# -- 1-6: upstream faults through the official SDKs -------------------------------------------------------

# (fault, streamed) -> ("status", http status, code) | ("event", None, code) | ("passthrough", ...)
EXPECT: dict[tuple[str, bool], tuple[str, int | None, str | None]] = {
    ("first_byte", False): ("status", 504, "upstream_timeout"),
    ("first_byte", True): ("status", 504, "upstream_timeout"),
    ("idle", False): ("status", 504, "upstream_timeout"),
    ("idle", True): ("event", None, "upstream_timeout"),
    ("reset_before_headers", False): ("status", 502, "upstream_unavailable"),
    ("reset_before_headers", True): ("status", 502, "upstream_unavailable"),
    ("reset_mid", False): ("status", 502, "upstream_unavailable"),
    ("reset_mid", True): ("event", None, "upstream_unavailable"),
    ("truncated", False): ("status", 502, "upstream_unavailable"),
    ("truncated", True): ("event", None, "upstream_unavailable"),
    ("truncated_fin", True): ("event", None, "upstream_unavailable"),
    ("5xx", False): ("passthrough", None, None),
    ("5xx", True): ("passthrough", None, None),
    ("malformed", False): ("status", 502, "upstream_unavailable"),
    ("malformed", True): ("event", None, "upstream_unavailable"),
}


def check_outcome(api: str, fault: str, stream: bool, out: Outcome, run_id: str) -> None:
    kind, status, code = EXPECT[(fault, stream)]
    if kind == "status":
        assert status is not None and code is not None
        check_status_error(api, out, status, code)
    elif kind == "event":
        assert code is not None
        check_stream_error(api, out, code)
    else:
        up_status, up_body = FIVE_XX[api]
        assert out.status == up_status, f"upstream {up_status} not passed through: {out.status} {out.error!r}"
        exc = out.error
        assert isinstance(exc, (openai.APIStatusError, anthropic.APIStatusError)), repr(exc)
        assert exc.response.content == up_body, f"5xx body changed: {exc.response.content!r}"
        assert exc.response.headers.get("content-type", "").startswith("application/json")
    if isinstance(out.error, (openai.APIStatusError, anthropic.APIStatusError)) and kind != "event":
        # DESIGN 3: every response echoes the run id, errors included
        assert out.error.response.headers.get(RUN_HEADER) == run_id, dict(out.error.response.headers)


CASES = [pytest.param(api, fault, stream, id=f"{api}-{fault}-{'stream' if stream else 'plain'}")
         for api in ("openai", "anthropic") for (fault, stream) in EXPECT]


@pytest.mark.parametrize(("api", "fault", "stream"), CASES)
async def test_upstream_fault(env: Env, api: str, fault: str, stream: bool) -> None:
    """Faults 1-6, against a keep-alive upstream (as real providers are), so the fault hits the connection
    the gateway pooled from the warm-up call: a clear error in the caller's wire format (504
    `upstream_timeout` / 502 `upstream_unavailable`; a final error event once a stream has started; an
    upstream 5xx passed through unchanged), the run id echoed, the reservation settled (the full reservation
    when the upstream may have received the call, $0 for an upstream error answer) with nothing left
    reserved, the `chat {model}` span ERROR with `error.type`, the broken connection not returned to the
    pool (the next call gets its own answer), and, once the gateway is idle, no task or fd more than before
    and at most the one healthy pooled connection open."""
    env.up.keepalive = True
    base, names = await warm_up(env, api, stream, pooled=1)
    out, reserved, run_id = await faulted(env, api, stream, fault)
    reused = env.up.served_on[-1] > 0
    kind, _status, code = EXPECT[(fault, stream)]

    # 1. the error the caller sees
    check_outcome(api, fault, stream, out, run_id)

    # 2. the reservation: nothing left reserved; charged in full unless the upstream answered an error
    view = await env.released(run_id)
    assert view["reserved_usd"] == 0 and view["reserved_tokens"] == 0, f"reservation not released: {view}"
    if kind == "passthrough":
        assert view["spent_usd"] == 0, f"an upstream error answer is charged nothing: {view}"
    else:
        assert view["spent_usd"] == pytest.approx(reserved), f"expected the full reservation {reserved}: {view}"

    # 3. the span
    span = await check_span(env, FAULTY[api], code)

    # 4. the pool is healthy: the next call gets its own answer
    env.up.arm("ok", hold=False)
    follow = await sdk_call(env, api, stream, WARM[api], f"next-{uuid.uuid4().hex[:8]}")
    check_answer(api, stream, follow)

    # 5. no leftovers
    after = await back_to(env.up, base, pooled=1)
    print(f"\n[{api} {fault} stream={stream}] on pooled conn={reused} status={out.status} "
          f"error={type(out.error).__name__} error.type={(span.attributes or {}).get('error.type')} "
          f"reserved={reserved:.6f} spent={view['spent_usd']:.6f} before: {base.describe()} after: {after.describe()}")
    assert_no_leftovers(base, after, names, pooled=1)


# -- raw HTTP client (slow reader, disconnect) ------------------------------------------------------------


class RawClient:
    """A plain socket HTTP/1.1 client: reads exactly when told to (small receive buffer)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.received = 0
        self.status = 0
        self.headers: dict[str, str] = {}
        self.tail = b""
        self.saw_error = False
        self.eof = False

    @classmethod
    async def post(cls, env: Env, api: str, model: str, run_id: str, rcvbuf: int = 65536) -> RawClient:
        host, port = env.h.url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=65536)
        body = orjson.dumps({"model": model, "messages": MSG, "max_tokens": 64, "stream": True})
        extra = "anthropic-version: 2023-06-01\r\n" if api == "anthropic" else ""
        writer.write((f"POST {PATHS[api]} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n{RUN_HEADER}: {run_id}\r\n{extra}"
                      "Authorization: Bearer sk-agent\r\nConnection: close\r\n\r\n").encode() + body)
        await writer.drain()
        client = cls(reader, writer)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode("latin-1").split("\r\n")
        client.status = int(lines[0].split(" ")[1])
        client.headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        return client

    async def read(self, n: int = 65536) -> bytes:
        data = await self.reader.read(n)
        if not data:
            self.eof = True
        self.received += len(data)
        window = self.tail[-64:] + data
        if b'"error"' in window or b"event: error" in window:
            self.saw_error = True
        self.tail = (self.tail + data)[-65536:]
        return data

    def close(self, rst: bool = False) -> None:
        if rst:
            _rst(self.writer)
        else:
            self.writer.close()


# -- 7: slow client, back-pressure ------------------------------------------------------------------------

LONG_EVENTS = 4096  # ~16.5 KB each: a ~68 MB stream
IN_FLIGHT_LIMIT = 24 * 1024 * 1024  # what kernel buffers and a bounded relay may hold between the two ends


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_slow_client_gets_backpressure(env: Env, api: str) -> None:
    """Fault 7: a client reading a long stream slowly. The gateway must not buffer the whole stream: while
    the client does not read, the upstream's writes must block with at most IN_FLIGHT_LIMIT bytes between
    what the upstream wrote and what the client read; a pause of 3x `timeouts.idle` in the *client* is not
    upstream silence (the upstream was never silent). Then the stream completes normally, the step is
    settled from its usage (nothing left reserved), its span is not an error, and nothing is left behind."""
    base, names = await warm_up(env, api, True)
    env.up.long_events = LONG_EVENTS
    run_id = f"slow-{uuid.uuid4().hex[:8]}"
    env.up.arm("long", hold=False)
    client = await RawClient.post(env, api, FAULTY[api], run_id)
    assert client.status == 200, client.status
    await client.read(4096)
    # phase 1: the client stops reading for 1.5 s (3x idle)
    samples = []
    t_end = time.monotonic() + 1.5
    while time.monotonic() < t_end:
        await asyncio.sleep(0.05)
        samples.append(env.up.sent)
    # on a loaded machine the buffers between the two ends fill more slowly: a few seconds more to settle
    t_end += 5.0
    while samples[-1] != samples[-5] and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
        samples.append(env.up.sent)
    paused_gap = env.up.sent - client.received
    env.results["paused"] = (env.up.sent, client.received, env.up.total)
    assert env.up.sent < env.up.total, (
        f"the upstream wrote the whole {env.up.total} B stream while the client had read {client.received} B: "
        "the gateway buffered it")
    assert samples[-1] == samples[-5], f"the upstream was never held back: {samples[-5:]}"
    assert paused_gap <= IN_FLIGHT_LIMIT, f"{paused_gap} B in flight between upstream and a paused client"
    # phase 2: read slowly; the gap stays bounded
    max_gap = 0
    for _ in range(40):
        await client.read(65536)
        await asyncio.sleep(0.005)
        max_gap = max(max_gap, env.up.sent - client.received)
    assert max_gap <= IN_FLIGHT_LIMIT, f"{max_gap} B in flight while the client read slowly"
    # phase 3: read the rest
    async with asyncio.timeout(20):
        while await client.read(1 << 20):
            pass
    client.close()
    env.results["read"] = client.received
    assert not client.saw_error, f"the stream carried an error event: {client.tail[-600:]!r}"
    final = b"data: [DONE]" if api == "openai" else b"event: message_stop"
    assert final in client.tail, f"the stream did not end with its final event: {client.tail[-600:]!r}"
    assert client.received >= env.up.long_events * 16384, client.received

    view = await env.released(run_id)
    assert view["reserved_usd"] == 0 and view["reserved_tokens"] == 0, view
    assert view["spent_usd"] > 0, view
    print(f"\n[{api} slow] paused (sent, read, total)={env.results['paused']} max_gap={max_gap} "
          f"read={client.received} spent={view['spent_usd']}")
    spans = await env.spans(f"chat {FAULTY[api]}")
    assert spans and spans[-1].status.status_code != StatusCode.ERROR, spans and dict(spans[-1].attributes or {})
    after = await back_to(env.up, base)
    assert_no_leftovers(base, after, names)


# -- 8: the client disconnects mid-stream -----------------------------------------------------------------


@pytest.mark.parametrize("how", ["fin", "rst"])
@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_client_disconnect_mid_stream(env: Env, api: str, how: str) -> None:
    """Fault 8: the client goes away mid-stream (a clean close or a reset). The gateway must close its
    upstream connection promptly (the upstream sees its writes fail within 2 s), settle the step at its
    full reservation ("when the agent went away before the answer — never at $0") with nothing left
    reserved, mark the span as an error, and leave no task, connection or fd behind."""
    base, names = await warm_up(env, api, True)
    run_id = f"gone-{uuid.uuid4().hex[:8]}"
    env.up.arm("endless")
    client_task = asyncio.create_task(RawClient.post(env, api, FAULTY[api], run_id))
    await asyncio.wait_for(env.up.received.wait(), 5)
    reserved = (await env.run(run_id))["reserved_usd"]
    env.up.release.set()
    client = await asyncio.wait_for(client_task, 5)
    assert client.status == 200
    async with asyncio.timeout(5):
        while client.received < 200 or b"Hel" not in client.tail:
            assert await client.read(), "stream ended early"
    assert reserved > 0
    client.close(rst=(how == "rst"))
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(env.up.peer_gone.wait(), 2)
    except TimeoutError:
        raise AssertionError("the gateway kept the upstream stream open 2 s after the client left") from None
    env.results["upstream_closed_after_s"] = time.monotonic() - t0

    view = await env.released(run_id)
    assert view["reserved_usd"] == 0 and view["reserved_tokens"] == 0, f"reservation not released: {view}"
    assert view["spent_usd"] == pytest.approx(reserved), f"expected the full reservation {reserved}: {view}"
    span = await check_span(env, FAULTY[api], None)
    after = await back_to(env.up, base)
    print(f"\n[{api} disconnect {how}] upstream closed after {env.results['upstream_closed_after_s']:.3f}s "
          f"reserved={reserved:.6f} spent={view['spent_usd']:.6f} error.type={(span.attributes or {}).get('error.type')} "
          f"before: {base.describe()} after: {after.describe()}")
    assert_no_leftovers(base, after, names)


# the fixture's gateway must really be ours: a sanity test that the fake upstream and spans are wired
async def test_harness_sees_upstream_spans_and_sockets(env: Env) -> None:
    """Sanity of the measuring tools (so the tests above can fail for the right reason): a stalled upstream
    call is visible as a gateway socket to the upstream and a live upstream connection while in flight."""
    env.up.arm("first_byte")
    task = asyncio.create_task(sdk_call(env, "openai", False, FAULTY["openai"], "sanity"))
    await asyncio.wait_for(env.up.received.wait(), 5)
    during = snapshot(env.up)
    env.up.release.set()
    await task
    assert during.gw_upstream_sockets == 1 and during.upstream_live == 1, during.describe()
    assert await env.spans(f"chat {FAULTY['openai']}")
