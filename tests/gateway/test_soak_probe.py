"""Soak probe: one gateway under sustained mixed traffic, then what a production gateway must guarantee.

The traffic (bounded in count and time, loopback only) mixes, on Chat Completions, Responses and
Messages, streamed and not: good answers, upstream faults (5xx, an RST mid-stream, a stream that ends
before its final event, headers slower than a short `first_byte`), clients that leave mid-stream, before
the response headers, in the loop turn the upstream's headers arrive (`race`: a raw socket shut down
by the fake upstream as it writes them) and at a random point of the pipeline (`random`, on runs of
their own since they may leave before a step exists), stops (USD and token budget, a disallowed tool, a
loop), grammar re-asks, and admin resets of runs while their calls are in flight. In-process tests run on
asyncio's loop and on uvloop; the `tollgate serve` test once (its gateway runs uvloop in a subprocess).

Afterwards: every run's reservations are back to 0 and its spend within its budget, no asyncio task and
no busy upstream connection is left, file descriptors are back near the baseline, RSS growth after
warm-up is bounded (a real `tollgate serve`), the ledger chain verifies and has one row per step,
Prometheus counters agree with what the fake upstream saw, and the gateway still answers correctly.
Also: 200 streams held open whose clients all vanish at once are released within a few seconds.

The fake upstream is scripted per request by the headers `x-soak-scenario` and `x-soak-id`, which the
gateway forwards as it forwards any agent header, and counts request heads as their bytes arrive.
Each test collects every broken guarantee and fails once with all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import socket
import sqlite3
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import RawTestServer, get_port_socket
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_runner import ServerRunner
from prometheus_client.parser import text_string_to_metric_families

import gateway.proxy
from gateway.call import digest
from gateway.http1_wire import Sending
from gateway.ledger_chain import verify
from tests.conftest import GatewayFactory, Harness
from tests.fakes.ports import free_port
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import (
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)

BOTH_LOOPS = True  # asyncio and uvloop (the loop `tollgate serve` runs)

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
APIS = (CHAT, MESSAGES, RESPONSES)
MODEL = {CHAT: "gpt-4o-mini", RESPONSES: "gpt-4o-mini", MESSAGES: "claude-3-5-haiku-latest"}
DONE_MARK = {CHAT: b"[DONE]", MESSAGES: b"message_stop", RESPONSES: b"response.completed"}

FIRST_BYTE_S = 0.8  # the providers' first_byte timeout
SLOW_S = 1.6  # the fake's delay before headers for `slow_first` and `hold`
TIMEOUTS = {"connect": 2, "first_byte": FIRST_BYTE_S, "idle": 5}
TOOL_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
SHAPED_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                 "additionalProperties": False}
GOOD_TEXT = "Hello soak"

BUDGETS = {
    "std": {"usd": 50.0, "tokens": 50_000_000},
    "tight": {"usd": 0.001, "tokens": 1000},
    "tools": {"usd": 1.0, "tokens": 10_000_000},
    "loopy": {"usd": 1.0, "tokens": 10_000_000},
    "shaped": {"usd": 1.0, "tokens": 10_000_000},
}
AGENTS: dict[str, Any] = {
    "std": {"budget": BUDGETS["std"]},
    "tight": {"budget": BUDGETS["tight"]},
    "tools": {"budget": BUDGETS["tools"], "tools": {"allow": ["search"], "on_violation": "reject"}},
    "loopy": {"budget": BUDGETS["loopy"], "loop": {"window": 3, "max_distinct": 1}},
    "shaped": {"budget": BUDGETS["shaped"],
               "output": {"grammar": "json_schema:" + orjson.dumps(SHAPED_SCHEMA).decode(), "retries": 1,
                          "stream_check": "buffer"}},
}
RUNS = {"std": 6, "tight": 3, "tools": 3, "loopy": 3, "shaped": 2}
STOPPABLE = ("tight", "tools", "loopy")


def providers(fake_url: str) -> dict[str, Any]:
    return {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai",
                   "timeouts": TIMEOUTS},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-provider",
                      "timeouts": TIMEOUTS},
    }


# -- the scripted fake upstream ---------------------------------------------------------------------


def _rst(transport: Any) -> None:
    """Close with an RST (SO_LINGER 0), as a crashed upstream or a middlebox does."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if transport is not None:
        transport.abort()


def _calls(scenario: str, sid: str) -> list[tuple[str, str]]:
    if scenario in ("tool_ok", "tool_slow"):
        return [("search", orjson.dumps({"q": sid}).decode())]
    if scenario == "tool_bad":
        return [("rm_rf", '{"q": "/"}')]
    if scenario == "loop":
        return [("search", '{"q": "same"}')]
    return []


def _answer(api: str, text: str, calls: list[tuple[str, str]]) -> dict[str, Any]:
    if api == CHAT:
        tcs = [tool_call(n, a, f"call_{i}") for i, (n, a) in enumerate(calls)] or None
        return openai_completion(text, tool_calls=tcs)
    if api == MESSAGES:
        uses = [{"id": f"toolu_{i}", "name": n, "input": orjson.loads(a)} for i, (n, a) in enumerate(calls)]
        return anthropic_message(text, tool_uses=uses or None)
    return response_body(text, calls=[(n, a, f"call_{i}") for i, (n, a) in enumerate(calls)])


def _stream(api: str, parts: list[str], calls: list[tuple[str, str]], *, complete: bool) -> list[bytes]:
    if api == CHAT:
        tcs = [tool_call(n, a, f"call_{i}") for i, (n, a) in enumerate(calls)] or None
        if not complete:  # no finish chunk, no usage, no [DONE]: the stream just ends
            return openai_stream(parts, tool_calls=tcs, usage=None, done=False)[:-1]
        return openai_stream(parts, tool_calls=tcs)
    if api == MESSAGES:
        uses = [{"id": f"toolu_{i}", "name": n, "input": orjson.loads(a)} for i, (n, a) in enumerate(calls)]
        return anthropic_stream(parts, tool_uses=uses or None, complete=complete)
    return response_stream(parts, calls=[(n, a, f"call_{i}") for i, (n, a) in enumerate(calls)], complete=complete)


def _error_body(api: str) -> dict[str, Any]:
    if api == MESSAGES:
        return {"type": "error", "error": {"type": "api_error", "message": "upstream boom"}}
    return {"error": {"message": "upstream boom", "type": "server_error", "param": None, "code": None}}


def shut_now(writer: asyncio.StreamWriter) -> None:
    """Send the FIN of `writer`'s socket at once (close() sends it on the loop's next turn). Through a
    duplicate of the fd: uvloop's transport sockets refuse shutdown(); a shutdown acts on the socket."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(sock.fileno())) as dup:
        dup.shutdown(socket.SHUT_RDWR)


class SoakUpstream:
    """One fake upstream for the three APIs; each request's reply follows its `x-soak-scenario`."""

    def __init__(self) -> None:
        self.seen = 0  # requests its handler began to serve
        self.heads = 0  # request heads that arrived on the wire (a handler cancelled before it ran included)
        self.by_scenario: Counter[str] = Counter()
        self.in_flight = 0
        self.disconnects = 0
        self.reask_extra = 0  # second (re-asked) attempts of `reask` requests
        self.attempts: dict[str, int] = {}
        self.waiters: dict[str, tuple[int, asyncio.Future[None]]] = {}
        self.hooks: dict[str, tuple[asyncio.StreamWriter, asyncio.Future[None]]] = {}
        self.port = 0
        self.listener: socket.socket | None = None

    def server(self) -> RawTestServer:
        """A loopback server that counts request heads as their bytes arrive: a request the gateway
        sent and then aborted (its client left) may never reach a handler, yet it was sent."""
        upstream = self

        class CountingHandler(RequestHandler):
            def data_received(self, data: bytes) -> None:
                upstream.heads += data.count(b"POST /")
                super().data_received(data)

        class CountingServer(web.Server):
            def __call__(self) -> RequestHandler:
                return CountingHandler(self, loop=self._loop, **self._kwargs)

        class CountingTestServer(RawTestServer):
            async def _make_runner(self, debug: bool = True, **kwargs: Any) -> ServerRunner:
                srv = CountingServer(self._handler, loop=self._loop, debug=debug, **kwargs)
                return ServerRunner(srv, debug=debug, **kwargs)

        def listening(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
            sock = upstream.listener = get_port_socket(host, port, family)
            return sock

        return CountingTestServer(self.handle, host="127.0.0.1", socket_factory=listening)

    def expect(self, sid: str, attempt: int = 1) -> asyncio.Future[None]:
        """A future done when attempt `attempt` of the request `sid` arrives here."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters[sid] = (attempt, fut)
        return fut

    def on_headers(self, sid: str, writer: asyncio.StreamWriter) -> asyncio.Future[None]:
        """Shut the client's socket (`writer`) down as soon as the response headers of `sid` are written."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.hooks[sid] = (writer, fut)
        return fut

    def _arrived(self, sid: str, attempt: int) -> None:
        waiter = self.waiters.get(sid)
        if waiter is not None and waiter[0] == attempt:
            del self.waiters[sid]
            if not waiter[1].done():
                waiter[1].set_result(None)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.seen += 1
        raw = await request.read()
        sid = request.headers.get("x-soak-id", "")
        scenario = request.headers.get("x-soak-scenario", "ok")
        self.by_scenario[scenario] += 1
        attempt = self.attempts[sid] = self.attempts.get(sid, 0) + 1
        if scenario in ("reask", "reask_hold") and attempt > 1:
            self.reask_extra += 1
        self._arrived(sid, attempt)
        path = request.path
        api = MESSAGES if path.endswith("/messages") else RESPONSES if path.endswith("/responses") else CHAT
        stream = bool(orjson.loads(raw).get("stream")) if raw else False
        self.in_flight += 1
        try:
            return await self._reply(request, api, scenario, stream, attempt, sid)
        except ConnectionResetError:  # the gateway let go of the connection (its client left)
            self.disconnects += 1
            return web.Response(status=499)
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.in_flight -= 1

    async def _reply(self, request: web.BaseRequest, api: str, scenario: str, stream: bool, attempt: int,
                     sid: str) -> web.StreamResponse:
        if scenario in ("slow_first", "hold") or (scenario == "reask_hold" and attempt > 1):
            await asyncio.sleep(SLOW_S)  # past first_byte, or the client leaves first
        if scenario == "e500":
            return web.Response(status=500, body=orjson.dumps(_error_body(api)), content_type="application/json")
        text = GOOD_TEXT
        if scenario in ("reask", "reask_hold"):
            text = "not json at all" if attempt == 1 else '{"answer": "ok"}'
        elif scenario == "shaped_ok":
            text = '{"answer": "ok"}'
        calls = _calls(scenario, sid)
        if calls and scenario != "tool_slow":
            text = ""
        if not stream:
            return web.Response(body=orjson.dumps(_answer(api, text, calls)), content_type="application/json")
        delay = 0.0
        if scenario == "slow_stream":
            parts, delay = ["p"] * 40, 0.02
        elif scenario == "race":
            parts, delay = ["p"] * 10, 0.02
        elif scenario == "tool_slow":
            parts, delay = ["p"] * 20, 0.02
        elif scenario == "long":
            parts, delay = ["p"] * 100, 0.2
        else:
            parts = [text[: len(text) // 2], text[len(text) // 2:]] if text else []
        chunks = _stream(api, parts, calls, complete=scenario != "truncated")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if scenario == "race":  # the client leaves as the headers leave the upstream, in the same loop turn
            hook = self.hooks.pop(sid, None)
            if hook is not None:
                shut_now(hook[0])
                if not hook[1].done():
                    hook[1].set_result(None)
        cut = max(1, len(chunks) // 2) if scenario == "reset_mid" else None
        for index, chunk in enumerate(chunks):
            if index == cut:
                _rst(request.transport)
                return resp
            await resp.write(chunk)
            if delay:
                await asyncio.sleep(delay)
        await resp.write_eof()
        return resp


@pytest.fixture
async def fake() -> AsyncIterator[tuple[SoakUpstream, str]]:
    """Overrides conftest's `fake` (so `gateway_factory` runs against this upstream)."""
    upstream = SoakUpstream()
    server = upstream.server()
    await server.start_server()
    # aiohttp's test server listens with a backlog of 128: the 200 streams opened at once overflowed
    # it, and a connection whose SYN was dropped is retried a second later, past the providers'
    # first_byte (which includes connecting): 504s that were the fake's, not tollgate's
    assert upstream.listener is not None
    upstream.listener.listen(1024)
    upstream.port = int(server.port or 0)
    try:
        yield upstream, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


# -- traffic ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    agent: str
    run: str
    api: str
    stream: bool
    scenario: str
    # read | mid (leave after the first bytes) | early (leave before the headers, once the upstream has the
    # request) | raw (a raw socket shut down as the upstream's headers are written: the relay's first write)
    # | random (leave 0-15 ms after sending: at any await of the pipeline, maybe before a step)
    client: str = "read"


# (weight, agent, scenario, stream: True/False/None = either, client)
MIX: tuple[tuple[int, str, str, bool | None, str], ...] = (
    (36, "std", "ok", None, "read"),
    (5, "std", "e500", None, "read"),
    (5, "std", "reset_mid", True, "read"),
    (5, "std", "truncated", True, "read"),
    (3, "std", "slow_first", None, "read"),
    (6, "std", "slow_stream", True, "mid"),
    (4, "std", "hold", None, "early"),
    (4, "std", "race", True, "raw"),
    (9, "tight", "ok", None, "read"),
    (2, "tight", "hold", None, "early"),
    (3, "tools", "tool_slow", True, "mid"),
    (3, "shaped", "reask_hold", None, "early"),
    (3, "std", "ok", None, "random"),
    (3, "tight", "ok", None, "random"),
    (6, "tools", "tool_ok", None, "read"),
    (2, "tools", "tool_bad", None, "read"),
    (6, "loopy", "loop", None, "read"),
    (6, "shaped", "reask", None, "read"),
    (3, "shaped", "shaped_ok", None, "read"),
)


def run_ids(prefix: str) -> dict[str, list[str]]:
    """Run ids by agent; `rand-<agent>` runs take only the `random` clients (which may or may not
    become steps), so every other run's ledger rows can be counted exactly."""
    ids = {agent: [f"{prefix}-{agent}-{k}" for k in range(n)] for agent, n in RUNS.items()}
    for agent in ("std", "tight"):
        ids[f"rand-{agent}"] = [f"{prefix}-rand-{agent}-{k}" for k in range(2)]
    return ids


def make_specs(count: int, prefix: str, seed: int, mix: tuple[tuple[int, str, str, bool | None, str], ...] = MIX,
               ) -> list[Spec]:
    rng = random.Random(seed)
    runs = run_ids(prefix)
    weights = [m[0] for m in mix]
    out: list[Spec] = []
    for _ in range(count):
        _, agent, scenario, stream, client = rng.choices(mix, weights)[0]
        pool = runs[f"rand-{agent}"] if client == "random" else runs[agent]
        out.append(Spec(agent, rng.choice(pool), rng.choice(APIS),
                        rng.random() < 0.5 if stream is None else stream, scenario, client))
    return out


def request_body(spec: Spec, index: int, tag: object = "") -> dict[str, Any]:
    """The request of `spec`; `tag`-`index` makes it (and its ledger input hash) unique in the soak."""
    text = f"soak request {tag}-{index}"
    model = MODEL[spec.api]
    tools = spec.agent in ("tools", "loopy")
    if spec.api == CHAT:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 64}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": "search", "parameters": TOOL_SCHEMA}}]
    elif spec.api == MESSAGES:
        body = {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": text}]}
        if tools:
            body["tools"] = [{"name": "search", "input_schema": TOOL_SCHEMA}]
    else:
        body = {"model": model, "input": text, "max_output_tokens": 64}
        if tools:
            body["tools"] = [{"type": "function", "name": "search", "parameters": TOOL_SCHEMA}]
    if spec.stream:
        body["stream"] = True
    return body


@dataclass
class Stats:
    sent: int = 0  # requests that reached the gateway's model handler (one step each), `random` ones aside
    random_sent: int = 0
    outcomes: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    anomalies: list[str] = field(default_factory=list)
    resets: int = 0
    left_mid: int = 0
    left_early: int = 0
    left: dict[str, str] = field(default_factory=dict)  # ledger input hash -> scenario, of clients that left

    def anomaly(self, text: str) -> None:
        if len(self.anomalies) < 40:
            self.anomalies.append(text)


def judge(spec: Spec, status: int, data: bytes) -> str | None:
    """What is wrong with the answer the client got, or None."""
    s = spec.scenario
    done = DONE_MARK[spec.api]

    def good() -> bool:
        if status != 200 or b'"error"' in data:
            return False
        if spec.stream:
            return done in data and b"Hello" in data and b" soak" in data
        return GOOD_TEXT.encode() in data

    def refused(*codes: str) -> bool:
        return status == 403 and any(c.encode() in data for c in codes)

    def stream_stop(*codes: str) -> bool:
        return spec.stream and status == 200 and any(c.encode() in data for c in codes)

    if s == "ok" and spec.agent == "std":
        ok = good()
    elif s == "ok":  # tight budget
        ok = good() or refused("budget_exhausted", "token_budget_exhausted")
    elif s == "e500":
        ok = status == 500 and b"upstream boom" in data
    elif s in ("reset_mid", "truncated"):
        ok = status in (200, 502) and b"upstream_unavailable" in data
    elif s == "slow_first":
        ok = status == 504 and b"upstream_timeout" in data
    elif s == "tool_ok":
        # a concurrent step may stop the run (tool_not_allowed) while this answer is judged
        ok = (status == 200 and b"search" in data and b'"error"' not in data) or refused("tool_not_allowed") \
            or stream_stop("tool_not_allowed")
    elif s == "tool_bad":
        if b"rm_rf" in data and b"tool_not_allowed" not in data:
            return "a disallowed tool call reached the agent"
        ok = refused("tool_not_allowed") or stream_stop("tool_not_allowed")
    elif s == "loop":
        ok = (status == 200 and b"search" in data and b'"error"' not in data) or refused("loop_detected") \
            or stream_stop("loop_detected")
    elif s in ("reask", "shaped_ok"):
        ok = status == 200 and b"answer" in data and b"not json" not in data and b'"error"' not in data
    else:
        ok = True
    return None if ok else f"{spec.agent}/{s} {spec.api} stream={spec.stream}: {status} {data[-300:]!r}"


async def one(session: aiohttp.ClientSession, url: str, fake: SoakUpstream, spec: Spec, index: int,
              prefix: str, tag: int, stats: Stats) -> None:
    sid = f"{prefix}-{tag}-{index}"
    headers = {"x-tollgate-agent": spec.agent, "x-tollgate-run-id": spec.run, "x-soak-id": sid,
               "x-soak-scenario": spec.scenario}
    body = orjson.dumps(request_body(spec, index, tag))
    target = f"{url}{spec.api}"
    headers["content-type"] = "application/json"
    if spec.client in ("mid", "early", "raw"):
        stats.left[digest(body)] = spec.scenario
    if spec.client == "raw":
        stats.sent += 1
        stats.left_early += 1
        stats.outcomes[(spec.scenario, "left", 0)] += 1
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        fired = fake.on_headers(sid, writer)
        lines = [f"POST {spec.api} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}",
                 "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        answered = asyncio.ensure_future(reader.read())
        try:
            done, _ = await asyncio.wait({fired, answered}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            if fired not in done:
                stats.anomaly(f"raw {sid}: the client was not shut down at the upstream's headers "
                              f"({answered.result()[:200] if answered.done() else 'no answer'!r})")
        finally:
            answered.cancel()
            fake.hooks.pop(sid, None)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        return
    if spec.client == "random":
        stats.random_sent += 1

        async def post_random() -> tuple[int, bytes]:
            async with session.post(target, data=body, headers=headers) as resp:
                return resp.status, await resp.read()

        task = asyncio.create_task(post_random())
        # not a wait for something: the moment the client leaves is drawn (0-15 ms)
        await asyncio.wait({task}, timeout=(index * 7919 % 16) / 1000)
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            status, data = await task
            stats.outcomes[(spec.scenario + "/random", spec.api, status)] += 1
        return
    stats.sent += 1
    if spec.client == "early":
        # leave once the upstream has the request (its re-ask for `reask_hold`), before any header came
        arrived = fake.expect(sid, 2 if spec.scenario == "reask_hold" else 1)

        async def post() -> tuple[int, bytes]:
            async with session.post(target, data=body, headers=headers) as resp:
                return resp.status, await resp.read()

        task = asyncio.create_task(post())
        done, _ = await asyncio.wait({task, arrived}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        fake.waiters.pop(sid, None)
        if task in done and arrived not in done:  # answered without going upstream (a stopped run)
            stats.left.pop(digest(body), None)
            status, data = task.result()
            stats.outcomes[(spec.scenario, spec.api, status)] += 1
            if not (status == 403 and spec.agent in STOPPABLE):
                stats.anomaly(f"early {sid}: answered {status} before reaching the upstream: {data[-200:]!r}")
            return
        if not done:
            stats.anomaly(f"early {sid}: the request never reached the upstream")
        task.cancel()  # the client goes away before the response headers
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task
        stats.left_early += 1
        stats.outcomes[(spec.scenario, "left", 0)] += 1
        return
    try:
        async with session.post(target, data=body, headers=headers) as resp:
            if spec.client == "mid":
                if resp.status != 200:
                    data = await resp.read()
                    stats.left.pop(digest(body), None)
                    stats.outcomes[(spec.scenario, spec.api, resp.status)] += 1
                    if not (resp.status == 403 and spec.agent in STOPPABLE):
                        stats.anomaly(f"mid {sid}: status {resp.status} {data[-200:]!r}")
                    return
                await resp.content.readany()
                resp.close()  # the client goes away mid-stream
                stats.left_mid += 1
                stats.outcomes[(spec.scenario, "left", resp.status)] += 1
                return
            data = await resp.read()
            status = resp.status
            if resp.headers.get("x-tollgate-run-id") != spec.run:
                stats.anomaly(f"{sid}: run id not echoed ({resp.headers.get('x-tollgate-run-id')})")
    except (aiohttp.ClientError, TimeoutError) as exc:
        stats.anomaly(f"{spec.agent}/{spec.scenario} {spec.api} stream={spec.stream}: client error {exc!r}")
        return
    stats.outcomes[(spec.scenario, spec.api, status)] += 1
    problem = judge(spec, status, data)
    if problem is not None:
        stats.anomaly(problem)


async def drive(url: str, admin_url: str, fake: SoakUpstream, specs: list[Spec], *, prefix: str,
                concurrency: int, stats: Stats, resets: bool, seed: int) -> None:
    """Send `specs` with `concurrency` workers; meanwhile (with `resets`) reset runs through the admin API."""
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=20)
    rng = random.Random(seed)
    runs = run_ids(prefix)
    stoppable = [r for agent in STOPPABLE for r in runs[agent]]
    others = [r for agent in runs if agent not in STOPPABLE for r in runs[agent]]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        queue = iter(enumerate(specs))
        finished = asyncio.Event()

        async def worker() -> None:
            for index, spec in queue:
                await one(session, url, fake, spec, index, prefix, seed, stats)

        async def resetter() -> None:
            while not finished.is_set():
                run = rng.choice(stoppable) if rng.random() < 0.8 else rng.choice(others)
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.post(f"{admin_url}/admin/runs/{run}/reset") as resp:
                        await resp.read()
                        if resp.status == 200:
                            stats.resets += 1
                        elif resp.status != 404:
                            stats.anomaly(f"reset {run}: {resp.status}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), 0.03)  # pace, ends at once when traffic ends

        reset_task = asyncio.create_task(resetter()) if resets else None
        try:
            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 120)
        finally:
            finished.set()
            if reset_task is not None:
                await reset_task


# -- checks -----------------------------------------------------------------------------------------


async def until(check: Callable[[], Awaitable[Any]], timeout: float) -> tuple[bool, Any]:
    """Poll `check` (returns (ok, state)) until ok or the deadline; nothing here can be awaited instead."""
    deadline = time.monotonic() + timeout
    while True:
        ok, state = await check()
        if ok or time.monotonic() > deadline:
            return ok, state
        await asyncio.sleep(0.05)


async def admin_get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if resp.content_type == "application/json" else raw.decode())


async def check_runs(session: aiohttp.ClientSession, admin_url: str, prefix: str, problems: list[str],
                     timeout: float = 5.0) -> dict[str, dict[str, Any]]:
    """Every run: reservations back to 0, spend within its budget, `std` runs never stopped."""
    all_runs = [(agent, r) for agent, ids in run_ids(prefix).items() for r in ids]

    async def read() -> tuple[bool, dict[str, dict[str, Any]]]:
        views: dict[str, dict[str, Any]] = {}
        for agent, run in all_runs:
            status, view = await admin_get(session, f"{admin_url}/admin/runs/{run}")
            if status == 200:
                views[run] = view
        held = {r: v for r, v in views.items() if v["reserved_usd"] != 0 or v["reserved_tokens"] != 0}
        return not held, views

    _ok, views = await until(read, timeout)
    for run, view in views.items():
        agent = view["agent"]
        if view["reserved_usd"] != 0 or view["reserved_tokens"] != 0:
            problems.append(f"run {run}: reservation left after {timeout}s: reserved_usd={view['reserved_usd']} "
                            f"reserved_tokens={view['reserved_tokens']} (llm_calls={view['llm_calls']}, "
                            f"status={view['status']})")
        budget = BUDGETS[agent]
        tokens = view["input_tokens"] + view["output_tokens"]
        if view["spent_usd"] > budget["usd"] + 1e-9 or tokens > budget["tokens"]:
            problems.append(f"run {run}: spend over budget: usd {view['spent_usd']} / {budget['usd']}, "
                            f"tokens {tokens} / {budget['tokens']}")
        if agent == "std" and view["status"] != "active":
            problems.append(f"run {run}: a std run stopped: {view['stop_reason']}: {view.get('stop_detail')}")
    return views


def metric_sums(text: str) -> dict[str, Any]:
    sums: Counter[str] = Counter()
    by_status: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] += sample.value
            if sample.name == "tollgate_upstream_requests_total":
                by_status[sample.labels.get("status", "")] += int(sample.value)
    return {**sums, "by_status": dict(by_status)}


async def check_metrics(session: aiohttp.ClientSession, admin_url: str, fake: SoakUpstream, problems: list[str],
                        timeout: float = 2.5) -> dict[str, Any]:
    """Counters agree with the fake: upstream requests = requests it saw, re-asks = second attempts."""

    async def read() -> tuple[bool, dict[str, float]]:
        status, text = await admin_get(session, f"{admin_url}/metrics")
        assert status == 200, text
        sums = metric_sums(text)
        ok = (sums.get("tollgate_upstream_requests_total", 0) == fake.heads
              and sums.get("tollgate_budget_reserved_usd", 0) == 0)
        return ok, sums

    _, sums = await until(read, timeout)
    if sums.get("tollgate_upstream_requests_total", 0) != fake.heads:
        problems.append(f"metrics: tollgate_upstream_requests_total={sums.get('tollgate_upstream_requests_total')} "
                        f"but {fake.heads} requests reached the upstream ({fake.seen} reached its handler); "
                        f"by status {sums.get('by_status')}")
    if sums.get("tollgate_reasks_total", 0) != fake.reask_extra:
        problems.append(f"metrics: tollgate_reasks_total={sums.get('tollgate_reasks_total')} but the upstream saw "
                        f"{fake.reask_extra} re-asked attempts")
    if sums.get("tollgate_budget_reserved_usd", 0) != 0:
        problems.append(f"metrics: tollgate_budget_reserved_usd={sums.get('tollgate_budget_reserved_usd')} "
                        "with nothing in flight")
    return sums


def ledger_counts(path: Path) -> tuple[int, int, int]:
    """(rows, rows of steps the client left, rows of the `rand-` runs), the first two without the latter."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        total = conn.execute("SELECT count(*) FROM ledger WHERE run_id NOT LIKE '%-rand-%'").fetchone()[0]
        left = conn.execute("SELECT count(*) FROM ledger WHERE reason = 'client_disconnected'"
                            " AND run_id NOT LIKE '%-rand-%'").fetchone()[0]
        rand = conn.execute("SELECT count(*) FROM ledger WHERE run_id LIKE '%-rand-%'").fetchone()[0]
        return int(total), int(left), int(rand)
    finally:
        conn.close()


def ledger_decisions(path: Path, hashes: dict[str, str]) -> Counter[tuple[str, str, str | None]]:
    """(scenario, decision, reason) of the ledger rows of the given input hashes."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT input_hash, decision, reason FROM ledger").fetchall()
    finally:
        conn.close()
    return Counter((hashes[h], d, r) for h, d, r in rows if h in hashes)


async def check_ledger(path: Path, steps: int, left: int, problems: list[str], timeout: float = 5.0,
                       random_sent: int = 0, left_hashes: dict[str, str] | None = None) -> int:
    """Rows of the exactly counted runs = steps; returns all rows."""
    async def read() -> tuple[bool, tuple[int, int, int]]:
        counts = await asyncio.to_thread(ledger_counts, path)
        return counts[0] >= steps, counts

    _, (rows, disconnected, rand) = await until(read, timeout)
    if rows != steps:
        problems.append(f"ledger: {rows} rows for {steps} steps")
    if rand > random_sent:
        problems.append(f"ledger: {rand} rows for {random_sent} requests of clients that left at random")
    if disconnected != left:
        odd = ""
        if left_hashes:
            found = await asyncio.to_thread(ledger_decisions, path, left_hashes)
            odd = f"; rows of the steps whose client left, by (scenario, decision, reason): " \
                  f"{ {k: v for k, v in found.items() if k[2] != 'client_disconnected'} }"
        problems.append(f"ledger: {disconnected} rows with reason client_disconnected for {left} clients that left"
                        f"{odd}")
    result = await asyncio.to_thread(verify, path)
    if not result.ok:
        problems.append(f"ledger chain broken: row {result.first_bad_id}: {result.reason}")
    return rows + rand


async def check_still_answers(session: aiohttp.ClientSession, url: str, admin_url: str, fake: SoakUpstream,
                              prefix: str, problems: list[str]) -> int:
    """One good call per API and stream mode on a fresh run; the run view counts them. Returns steps."""
    run = f"{prefix}-final"
    steps = 0
    for api in APIS:
        for stream in (False, True):
            spec = Spec("std", run, api, stream, "ok")
            headers = {"x-tollgate-agent": "std", "x-tollgate-run-id": run, "x-soak-id": f"{run}-{steps}",
                       "x-soak-scenario": "ok"}
            async with session.post(f"{url}{api}", json=request_body(spec, steps, "final"), headers=headers) as resp:
                data = await resp.read()
                problem = judge(spec, resp.status, data)
                if problem is not None:
                    problems.append(f"after the soak: {problem}")
            steps += 1
    status, view = await admin_get(session, f"{admin_url}/admin/runs/{run}")
    if status != 200 or view["llm_calls"] != steps or view["reserved_usd"] != 0:
        problems.append(f"after the soak: run view {view}")
    return steps


# -- in-process: tasks, connections, fds ------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_links() -> Counter[str]:
    links: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            links["socket" if target.startswith("socket:") else target] += 1
    return links


def fake_conn_task(task: asyncio.Task[Any], fake_port: int) -> bool:
    """A fake upstream's keep-alive handler task of an idle pooled gateway connection (legitimate)."""
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    if not isinstance(owner, RequestHandler) or owner.transport is None:
        return False
    sockname = owner.transport.get_extra_info("sockname")
    return bool(sockname) and sockname[1] == fake_port


def describe(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    where = f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}" if frame is not None else "?"
    return f"{task.get_name()} {getattr(coro, '__qualname__', coro)} at {where}"


@dataclass
class InProcBase:
    tasks: set[asyncio.Task[Any]]
    fds: int
    conns: int
    links: Counter[str]


async def inproc_baseline(h: Harness) -> InProcBase:
    """Taken once the warm-up settled. The ledger file is read first: SQLite keeps the fd of a closed
    connection open while another connection of the process holds a lock on the file (the ledger
    writer's), and reuses it on the next open, so this test's own reads must be in the baseline too."""
    await asyncio.to_thread(ledger_counts, h.gateway.config.ledger_file)
    await asyncio.to_thread(verify, h.gateway.config.ledger_file)
    gc.collect()
    fake: SoakUpstream = h.fake  # type: ignore[assignment]
    tasks = {t for t in asyncio.all_tasks() if not fake_conn_task(t, fake.port)}
    return InProcBase(tasks, open_fds(), h.gateway.upstream.open_connections(), fd_links())


async def check_inproc_left(h: Harness, base: InProcBase, problems: list[str], timeout: float = 10.0) -> dict[str, Any]:
    """No task beyond the baseline (but the fake's handlers of idle pooled connections), no busy upstream
    connection, nothing in flight at the fake, fds back to the baseline (plus 2 per extra idle connection).
    Waits up to `timeout`: on a loaded machine the handlers of closed client connections take seconds to end."""
    fake: SoakUpstream = h.fake  # type: ignore[assignment]
    upstream = h.gateway.upstream
    me = asyncio.current_task()

    async def read() -> tuple[bool, dict[str, Any]]:
        gc.collect()
        current = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        fake_tasks = [t for t in current if fake_conn_task(t, fake.port)]
        extra = [t for t in current if t not in base.tasks and t not in fake_tasks]
        conns = upstream.open_connections()
        allowed_fds = base.fds + 2 * max(0, conns - base.conns)
        state = {"tasks": [describe(t) for t in extra], "busy": upstream.busy_connections(), "open": conns,
                 "fake_handler_tasks": len(fake_tasks), "fake_in_flight": fake.in_flight, "fds": open_fds(),
                 "allowed_fds": allowed_fds, "base_fds": base.fds, "base_conns": base.conns}
        ok = (not extra and state["busy"] == 0 and fake.in_flight == 0 and state["fds"] <= allowed_fds
              and len(fake_tasks) <= conns)
        return ok, state

    _ok, state = await until(read, timeout)
    if state["tasks"]:
        problems.append(f"asyncio tasks left ({len(state['tasks'])}): {state['tasks'][:8]}")
    if state["busy"]:
        problems.append(f"upstream connections still busy: {state['busy']} (open {state['open']})")
    if state["fake_in_flight"]:
        problems.append(f"upstream still serving {state['fake_in_flight']} requests")
    if state["fds"] > state["allowed_fds"]:
        problems.append(f"fds: {state['fds']} open, baseline {state['base_fds']} + 2 x "
                        f"{state['open'] - state['base_conns']} idle pooled connections = {state['allowed_fds']}; "
                        f"new: {dict(fd_links() - base.links)}")
    if state["fake_handler_tasks"] > state["open"]:
        problems.append(f"the fake holds {state['fake_handler_tasks']} connections but the pool only "
                        f"{state['open']}")
    return state


async def harness(gateway_factory: GatewayFactory, fake: tuple[SoakUpstream, str], **extra: Any) -> Harness:
    _, url = fake
    return await gateway_factory(providers=providers(url), agents=AGENTS, **extra)


def logged_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """ERROR records of the gateway's process (aiohttp's "Error handling request" included), in short."""
    out = []
    for record in caplog.records:
        if record.levelno >= logging.ERROR:
            exc = record.exc_info[1] if record.exc_info else None
            where = ""
            if exc is not None and exc.__traceback__ is not None:
                frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/gateway/" in f.filename]
                where = " at " + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[::-1][:3])
            out.append(f"{record.name}: {record.getMessage()} {exc!r}{where}")
    return out


class RecordingSending(Sending):
    """`Sending` that remembers every instance: the attempts whose transport never wrote a byte (a client
    that left while the connection was being made) can then be counted (diagnostics only)."""

    __slots__ = ()
    made: ClassVar[list[Sending]] = []

    def __init__(self) -> None:
        super().__init__()
        RecordingSending.made.append(self)


async def test_soak_mixed_traffic_in_process(gateway_factory: GatewayFactory, fake: tuple[SoakUpstream, str],
                                             caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.ERROR)
    RecordingSending.made = []
    monkeypatch.setattr(gateway.proxy, "Sending", RecordingSending)
    upstream, _ = fake
    h = await harness(gateway_factory, fake)
    await h.session.close()  # the harness's session would hold an admin connection across the baseline
    prefix = "inproc"
    stats = Stats()
    started = time.monotonic()
    # warm-up: every path once or more (pools, caches, compiled grammars), then the baseline
    await drive(h.url, h.admin_url, upstream, make_specs(200, prefix, 1), prefix=prefix, concurrency=16,
                stats=stats, resets=True, seed=11)
    await h.gateway.services["ledger"].flush()
    await until(lambda: _idle(h), 5.0)
    base = await inproc_baseline(h)
    specs = make_specs(1400, prefix, 2)
    await drive(h.url, h.admin_url, upstream, specs, prefix=prefix, concurrency=24, stats=stats, resets=True, seed=22)
    soak_s = time.monotonic() - started
    problems: list[str] = []
    async with aiohttp.ClientSession() as session:
        views = await check_runs(session, h.admin_url, prefix, problems)
        sums = await check_metrics(session, h.admin_url, upstream, problems)
        await check_ledger(h.gateway.config.ledger_file, stats.sent, stats.left_mid + stats.left_early, problems,
                           random_sent=stats.random_sent, left_hashes=stats.left)
    state = await check_inproc_left(h, base, problems)
    async with aiohttp.ClientSession() as session:
        final = await check_still_answers(session, h.url, h.admin_url, upstream, prefix, problems)
        await check_ledger(h.gateway.config.ledger_file, stats.sent + final, stats.left_mid + stats.left_early,
                           problems, random_sent=stats.random_sent)
    errors = logged_errors(caplog)
    if errors:
        problems.append(f"{len(errors)} errors logged, e.g. {sorted(set(errors))[:5]}")
    unsent = sum(1 for s in RecordingSending.made if s.started is False)
    if any(p.startswith("metrics: tollgate_upstream_requests_total") for p in problems):
        problems.append(f"  (diagnostic: {unsent} attempts whose transport wrote no byte, their client gone "
                        f"while the upstream connection was being made, of {len(RecordingSending.made)})")
    problems += [f"answer: {a}" for a in stats.anomalies]
    print(f"\nin-process soak: {stats.sent} steps (+{stats.random_sent} random leaves) in {soak_s:.1f}s, {stats.resets} resets, upstream saw "
          f"{upstream.seen} ({upstream.disconnects} disconnects), left mid {stats.left_mid} early {stats.left_early}, "
          f"runs {len(views)}, upstream_requests_total {sums.get('tollgate_upstream_requests_total')}, state {state}")
    print("outcomes:", sorted(stats.outcomes.items()))
    assert not problems, "\n".join(problems)


async def _idle(h: Harness) -> tuple[bool, None]:
    fake: SoakUpstream = h.fake  # type: ignore[assignment]
    return h.gateway.upstream.busy_connections() == 0 and fake.in_flight == 0, None


# -- 200 streams held open, then every client vanishes ----------------------------------------------


async def hold_and_vanish(url: str, fake: SoakUpstream, prefix: str, problems: list[str], n: int = 200,
                          round_: int = 0) -> tuple[list[str], float]:
    """Open `n` streams (all three APIs, 10 runs), read their first bytes, then drop every client
    connection at once. Returns the run ids and the moment they vanished."""
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30))
    runs = [f"{prefix}-vanish-{k}" for k in range(10)]
    opened: list[aiohttp.ClientResponse] = []

    async def open_one(i: int) -> None:
        spec = Spec("std", runs[i % len(runs)], APIS[i % 3], True, "long")
        headers = {"x-tollgate-agent": "std", "x-tollgate-run-id": spec.run, "x-soak-id": f"{prefix}-v{round_}-{i}",
                   "x-soak-scenario": "long"}
        resp = await session.post(f"{url}{spec.api}", json=request_body(spec, i, f"vanish{round_}"), headers=headers)
        opened.append(resp)
        statuses[resp.status] += 1
        if resp.status != 200:
            errors[(await resp.read())[-160:].decode(errors="replace")] += 1
        else:
            await resp.content.readany()

    try:
        await asyncio.wait_for(asyncio.gather(*(open_one(i) for i in range(n))), 30)
        if statuses != {200: n} or fake.in_flight != n:
            problems.append(f"{n} concurrent streams (round {round_}): statuses {dict(statuses)}, upstream serving "
                            f"{fake.in_flight}; errors {dict(errors)}")
    finally:
        for resp in opened:
            resp.close()  # every client goes away at once
        vanished = time.monotonic()
        await session.close()
    return runs, vanished


async def test_200_streams_then_all_clients_vanish(gateway_factory: GatewayFactory,
                                                   fake: tuple[SoakUpstream, str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    upstream, _ = fake
    h = await harness(gateway_factory, fake)
    await h.session.close()
    prefix = "vanish"
    stats = Stats()
    calm = tuple(m for m in MIX if m[4] == "read")  # no client leaves before the 200 streams do
    await drive(h.url, h.admin_url, upstream, make_specs(60, prefix, 3, calm), prefix=prefix, concurrency=8,
                stats=stats, resets=False, seed=33)
    await h.gateway.services["ledger"].flush()
    await until(lambda: _idle(h), 5.0)
    base = await inproc_baseline(h)
    problems: list[str] = []
    runs, vanished = await hold_and_vanish(h.url, upstream, prefix, problems)
    ok, _ = await until(lambda: _idle(h), 3.0)
    released_s = time.monotonic() - vanished
    if not ok:
        problems.append(f"200 vanished streams: after {released_s:.1f}s busy upstream connections "
                        f"{h.gateway.upstream.busy_connections()}, upstream in flight {upstream.in_flight}")
    async with aiohttp.ClientSession() as session:

        async def reserved() -> tuple[bool, list[tuple[str, float, int, int]]]:
            views = [(await admin_get(session, f"{h.admin_url}/admin/runs/{r}"))[1] for r in runs]
            held = [(v["run_id"], v["reserved_usd"], v["reserved_tokens"], v["llm_calls"]) for v in views
                    if v["reserved_usd"] or v["reserved_tokens"]]
            return not held, held

        ok, held = await until(reserved, 3.0)
        if not ok:
            problems.append(f"200 vanished streams: reservations held 3s later: {held}")
        sums = await check_metrics(session, h.admin_url, upstream, problems)
        # no run was reset here: the settled-spend counter equals what the runs show as spent
        spent = 0.0
        for run in runs + [r for ids in run_ids(prefix).values() for r in ids]:
            status, view = await admin_get(session, f"{h.admin_url}/admin/runs/{run}")
            if status == 200:
                spent += view["spent_usd"]
        if abs(spent - sums.get("tollgate_cost_usd_total", 0.0)) > 1e-7:
            problems.append(f"metrics: tollgate_cost_usd_total={sums.get('tollgate_cost_usd_total')} but the runs "
                            f"spent {spent}")
        await check_ledger(h.gateway.config.ledger_file, stats.sent + 200, stats.left_mid + stats.left_early + 200,
                           problems, random_sent=stats.random_sent)
    await check_inproc_left(h, base, problems)
    print(f"\n200 streams vanished: upstream released in {released_s:.2f}s; disconnects seen {upstream.disconnects}")
    errors = logged_errors(caplog)
    if errors:
        problems.append(f"{len(errors)} errors logged, e.g. {sorted(set(errors))[:5]}")
    problems += [f"answer: {a}" for a in stats.anomalies]
    assert not problems, "\n".join(problems)


# -- a real `tollgate serve`: RSS, fds, CLI ledger verify ------------------------------------------


def tollgate_command() -> list[str]:
    script = Path(sys.executable).parent / "tollgate"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """socket inode -> (local port, remote port, state) from /proc/net/tcp{,6} (this netns)."""
    out: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(name).read_text().splitlines()[1:]:
                parts = line.split()
                local, remote, st, inode = parts[1], parts[2], parts[3], int(parts[9])
                out[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), st)
    return out


def fd_census(pid: int, proxy_port: int, admin_port: int, fake_port: int) -> dict[str, int]:
    """The process's fds by kind: client connections on the proxy port, admin connections, upstream
    connections (to the fake), listening sockets, other sockets, other fds."""
    table = _tcp_table()
    counts: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            counts["files"] += 1
            continue
        inode = int(target[8:-1])
        entry = table.get(inode)
        if entry is None:
            counts["other_sockets"] += 1
            continue
        local, remote, st = entry
        if st == "0A":
            counts["listening"] += 1
        elif remote == fake_port:
            counts["upstream"] += 1
        elif local == proxy_port:
            counts["clients"] += 1
        elif local == admin_port:
            counts["admin"] += 1
        else:
            counts["other_sockets"] += 1
    counts["total"] = sum(counts.values())
    return dict(counts)


@dataclass
class Served:
    proc: asyncio.subprocess.Process
    url: str
    admin_url: str
    port: int
    admin_port: int
    log: Path


async def start_serve(fake_url: str, tmp_path: Path, procs: list[asyncio.subprocess.Process]) -> Served:
    """`tollgate serve` from a config file, SQLite state in `tmp_path` (a second start reuses it)."""
    config = {"providers": providers(fake_url), "models": {"gpt-*": "openai", "claude-*": "anthropic"},
              "state": {"backend": "sqlite", "path": "state.db"}, "agents": AGENTS, "shutdown_grace_s": 2}
    path = tmp_path / "tollgate.yaml"
    path.write_text(yaml.safe_dump(config))
    port, admin_port = free_port(), free_port()
    log_path = tmp_path / f"serve-{len(procs)}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONUNBUFFERED"] = "1"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *tollgate_command(), "serve", "--config", str(path), "--port", str(port), "--admin-port", str(admin_port),
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    procs.append(proc)
    s = Served(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", port, admin_port, log_path)
    async with aiohttp.ClientSession() as session:

        async def ready() -> tuple[bool, None]:
            if proc.returncode is not None:
                raise AssertionError(f"tollgate exited {proc.returncode}: {log_path.read_text()}")
            try:
                async with session.get(f"{s.admin_url}/readyz") as resp:
                    return resp.status == 200, None
            except aiohttp.ClientConnectionError:
                return False, None

        ok, _ = await until(ready, 15.0)
        assert ok, "tollgate serve never became ready"
    return s


@pytest.fixture
async def serve_procs() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    procs: list[asyncio.subprocess.Process] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_soak_tollgate_serve_rss_fds_ledger(serve_procs: list[asyncio.subprocess.Process],
                                                  fake: tuple[SoakUpstream, str], tmp_path: Path) -> None:
    if type(asyncio.get_running_loop()).__module__.split(".")[0] != "uvloop":
        pytest.skip("the gateway runs in a subprocess (on uvloop): once is enough")
    upstream, fake_url = fake
    served = await start_serve(fake_url, tmp_path, serve_procs)
    pid = served.proc.pid
    prefix = "serve"
    stats = Stats()
    problems: list[str] = []
    started = time.monotonic()

    async def quiet() -> tuple[bool, dict[str, int]]:
        census = fd_census(pid, served.port, served.admin_port, upstream.port)
        return census.get("clients", 0) == 0 and upstream.in_flight == 0, census

    # warm-up, then two equal halves of the soak with RSS read after each
    await drive(served.url, served.admin_url, upstream, make_specs(300, prefix, 4), prefix=prefix, concurrency=32,
                stats=stats, resets=True, seed=44)
    _, base_fds = await until(quiet, 5.0)
    rss_warm = rss_kib(pid)
    await drive(served.url, served.admin_url, upstream, make_specs(1000, prefix, 5), prefix=prefix, concurrency=32,
                stats=stats, resets=True, seed=55)
    await until(quiet, 5.0)
    rss_half = rss_kib(pid)
    await drive(served.url, served.admin_url, upstream, make_specs(1000, prefix, 6), prefix=prefix, concurrency=32,
                stats=stats, resets=True, seed=66)
    ok, fds_after = await until(quiet, 5.0)
    rss_end = rss_kib(pid)
    soak_s = time.monotonic() - started
    grown_mib = (rss_end - rss_half) / 1024
    if grown_mib >= 10:
        problems.append(f"RSS grew {grown_mib:.1f} MiB in the second half of the soak "
                        f"(warm {rss_warm} KiB, half {rss_half} KiB, end {rss_end} KiB)")
    if fds_after.get("clients", 0):
        problems.append(f"fds: {fds_after['clients']} client connections still open on the proxy port")
    if fds_after.get("files", 0) > base_fds.get("files", 0) + 2:
        problems.append(f"fds: {fds_after.get('files')} non-socket fds against {base_fds.get('files')} after warm-up")
    if fds_after.get("other_sockets", 0) > base_fds.get("other_sockets", 0):
        problems.append(f"fds: unclassified sockets {fds_after} against {base_fds}")
    if fds_after.get("upstream", 0) > 40:  # at most the concurrency, idle in the pool
        problems.append(f"fds: {fds_after.get('upstream')} upstream connections open after a soak at concurrency 32")

    async with aiohttp.ClientSession() as session:
        views = await check_runs(session, served.admin_url, prefix, problems)
        sums = await check_metrics(session, served.admin_url, upstream, problems)
    db = tmp_path / "state.db"
    await check_ledger(db, stats.sent, stats.left_mid + stats.left_early, problems, random_sent=stats.random_sent,
                       left_hashes=stats.left)

    # 200 streams held open, then every client vanishes: the process lets go of everything (twice: the
    # first round may grow the heap to its peak, the second must not grow it further)
    rss_vanish: list[int] = []
    for round_ in range(2):
        runs, vanished = await hold_and_vanish(served.url, upstream, prefix, problems, round_=round_)
        stats.sent += 200
        stats.left_mid += 200
        ok, census = await until(quiet, 3.0)
        released_s = time.monotonic() - vanished
        if not ok:
            problems.append(f"200 vanished streams (serve, round {round_}): after {released_s:.1f}s fds {census}, "
                            f"upstream in flight {upstream.in_flight}")
        rss_vanish.append(rss_kib(pid))
    if rss_vanish[1] - rss_vanish[0] >= 5 * 1024:
        problems.append(f"RSS grew {(rss_vanish[1] - rss_vanish[0]) / 1024:.1f} MiB from the first round of 200 "
                        f"vanished streams to the second ({rss_vanish} KiB)")
    async with aiohttp.ClientSession() as session:

        async def reserved() -> tuple[bool, list[Any]]:
            views = [(await admin_get(session, f"{served.admin_url}/admin/runs/{r}"))[1] for r in runs]
            held = [(v["run_id"], v["reserved_usd"], v["reserved_tokens"]) for v in views
                    if v["reserved_usd"] or v["reserved_tokens"]]
            return not held, held

        ok, held = await until(reserved, 3.0)
        if not ok:
            problems.append(f"200 vanished streams (serve): reservations held 3s later: {held}")
        final = await check_still_answers(session, served.url, served.admin_url, upstream, prefix, problems)
        stats.sent += final
        await check_metrics(session, served.admin_url, upstream, problems)
        before: dict[str, dict[str, Any]] = {}
        for run in [r for ids in run_ids(prefix).values() for r in ids] + runs:
            status, view = await admin_get(session, f"{served.admin_url}/admin/runs/{run}")
            if status == 200:
                before[run] = view
    all_rows = await check_ledger(db, stats.sent, stats.left_mid + stats.left_early, problems,
                                  random_sent=stats.random_sent, left_hashes=stats.left)

    served.proc.send_signal(15)
    try:
        code = await asyncio.wait_for(served.proc.wait(), 10)
        if code != 0:
            problems.append(f"SIGTERM: exit {code}: {served.log.read_text()[-2000:]}")
    except TimeoutError:
        problems.append("SIGTERM: still running 10s later")
    cli = await asyncio.create_subprocess_exec(*tollgate_command(), "ledger", "verify", "--db", str(db),
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(cli.communicate(), 30)
    if cli.returncode != 0 or f"ok: {all_rows} ledger rows" not in out.decode():
        problems.append(f"tollgate ledger verify: exit {cli.returncode}: {out.decode().strip()} (rows {all_rows})")
    log = served.log.read_text(errors="replace")
    if "Traceback" in log or "Error" in log:
        lines = log.splitlines()
        causes = Counter(line.strip() for line in lines if line and not line.startswith(" ") and "Error" in line
                         and "Error handling request" not in line)
        frames = Counter(line.strip() for line in lines if '"/work/main/gateway/' in line)
        problems.append(f"serve log: {log.count('Error handling request')} 'Error handling request' tracebacks; "
                        f"exceptions {dict(causes)}; gateway frames {dict(frames)}")
    # what the process showed before SIGTERM is what its state file holds: a restart shows the same runs
    again = await start_serve(fake_url, tmp_path, serve_procs)
    keys = ("status", "stop_reason", "spent_usd", "input_tokens", "output_tokens", "llm_calls", "tool_calls",
            "reserved_usd", "reserved_tokens")
    async with aiohttp.ClientSession() as session:
        for run, view in before.items():
            status, after = await admin_get(session, f"{again.admin_url}/admin/runs/{run}")
            if status != 200:
                problems.append(f"restart: run {run} gone ({status})")
                continue
            diff = {k: (view[k], after[k]) for k in keys if view[k] != after[k]}
            if diff:
                problems.append(f"restart: run {run} differs from before SIGTERM: {diff}")
    problems += [f"answer: {a}" for a in stats.anomalies]
    print(f"\nserve soak: {stats.sent} steps in {soak_s:.1f}s, {stats.resets} resets; RSS KiB warm {rss_warm} "
          f"half {rss_half} end {rss_end} after-vanish {rss_vanish}; fds base {base_fds} after {fds_after} "
          f"vanish {census} ({released_s:.2f}s); upstream saw {upstream.seen}; runs {len(views)}; "
          f"upstream_requests_total {sums.get('tollgate_upstream_requests_total')}")
    print("outcomes:", sorted(stats.outcomes.items()))
    assert not problems, "\n".join(problems)
