"""The MCP proxy's transport half: per-request context, per-process state, and the relay of a
server's answer (JSON or SSE) with one JSON-RPC response replaced by a judgement before the client
sees it. Network I/O goes through `gateway.upstream` only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from gateway import exact_json
from gateway.config import McpServer
from gateway.errors import GatewayError, UpstreamUnavailable
from gateway.http1_wire import Sending
from gateway.idempotency import ResultCache
from gateway.identity import Identity
from gateway.jsonrpc import RequestId, gateway_error, replace_event_data, without_resumption
from gateway.providers.common import json_depth_ok
from gateway.providers.sse import SseEvent, SseParser, format_event
from gateway.respond import STOP_HEADER
from gateway.runtime import Gateway
from gateway.tools import ToolPolicy, mcp_tool_name
from gateway.upstream import UpstreamResponse, answer_headers, forwardable

SERVICE = "mcp"
DRAIN_AFTER_ANSWER_S = 0.2  # an SSE answer read on after its response (a server ends it at once), for its connection
RESUME_DELAY_MS = 1000  # before resuming a stream whose server gave no `retry` (the MCP SDK's default)
MAX_RESUMES = 3  # attempts in a row to resume a request's stream that bring no new event
# the least pause before a resumption: a server polling with `retry: 0` (each stream a new priming event,
# so each counts as progress) must not make tollgate reconnect in a tight loop
MIN_RESUME_DELAY_MS = 100
MAX_SCHEMAS = 4096
Transform = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
Observe = Callable[[Mapping[str, Any]], None]  # given the server's JSON-RPC response, as it came
OBSERVED_BYTES = 64 * 1024  # of an unjudged JSON answer kept to read its response for the span


@dataclass(slots=True)
class McpState:
    """Per-process MCP state: the `inputSchema` of every tool seen in a `tools/list` answer (per
    server), and the recorded results of side-effecting calls."""

    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: ResultCache = field(default_factory=ResultCache)
    drains: set[asyncio.Task[None]] = field(default_factory=set)  # answered streams read on (`_drain_later`)

    def remember(self, server: str, tool: str, schema: Any) -> None:
        known = self.schemas.setdefault(server, {})
        if isinstance(schema, dict) and (tool in known or len(known) < MAX_SCHEMAS):
            known[tool] = schema


def state_of(gw: Gateway) -> McpState:
    state = gw.services.get(SERVICE)
    if not isinstance(state, McpState):
        state = gw.services[SERVICE] = McpState()
    return state


@dataclass(slots=True)
class McpRequest:
    """One request to `/mcp/{server}` once identified. `headers` go on the response."""

    gw: Gateway
    request: web.Request
    identity: Identity
    server_name: str
    server: McpServer
    policy: ToolPolicy
    headers: dict[str, str]
    lost: GatewayError | None = None  # why `relay` ended a started answer without the response (`relay`)

    def allowed(self, tool: str) -> bool:
        return self.policy.allowed(mcp_tool_name(self.server_name, tool))

    def request_key(self, rpc_id: Any) -> tuple[str, str, str, str, str]:
        """Names one JSON-RPC request of this client (run, agent, server, MCP session, id as the SDKs
        match it), so a `notifications/cancelled` finds the call it cancels and no other. The agent is
        part of it: agents sharing a run number their requests independently (and, in the 2026-07-28
        era, have no session to tell them apart)."""
        number = _as_number(rpc_id)
        return (self.identity.run_id, self.identity.agent, self.server_name,
                self.request.headers.get("Mcp-Session-Id", ""), str(number) if number is not None else repr(rpc_id))

    async def open(
        self, method: str, body: bytes | None, sending: Sending | None = None, *, resume_after: str | None = None
    ) -> UpstreamResponse:
        """Send the request on to the MCP server (through `gateway.upstream`, the one network seam).
        `sending` learns whether the request may have reached the server, for a caller cancelled
        meanwhile. `resume_after`: a GET resuming a stream after that event id (`Last-Event-ID`)."""
        drop = frozenset({"authorization", "x-api-key"}) if self.gw.config.keyed else frozenset()
        headers = forwardable(self.request.headers, drop=drop)  # repeated fields forwarded as they came
        headers.update(self.server.headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        if resume_after is not None:
            headers.popall("Content-Type", None)
            headers["Accept"] = "text/event-stream"
            headers["Last-Event-ID"] = resume_after
        return await self.gw.upstream.open(method, self.server.url, headers, body, self.server.timeouts, sending)


def _is_response(value: Any, rpc_id: RequestId | None) -> bool:
    return (isinstance(value, dict) and ("result" in value or "error" in value) and "id" in value
            and (rpc_id is None or same_id(value["id"], rpc_id)))


def same_id(a: Any, b: Any) -> bool:
    """JSON-RPC ids as the MCP SDKs match them: a string of digits is the number it spells (`"7"`
    answers request 7), so a response a client accepts is never one tollgate failed to recognise."""
    return bool(a == b or (_as_number(a) is not None and _as_number(a) == _as_number(b)))


def _as_number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _json_kind(kind: str) -> bool:
    """Content types an MCP SDK client parses as JSON (`application/json`, `application/json-rpc`, ...)."""
    return kind.startswith("application/json") or kind.endswith("+json")


async def relay(
    mcp: McpRequest, upstream: UpstreamResponse, rpc_id: RequestId | None, transform: Transform | None,
    observe: Observe | None = None,
) -> web.StreamResponse:
    """Relay the server's answer. With `transform`, the JSON-RPC response to `rpc_id` (every response
    when None) is replaced by what `transform` returns before the client sees it; other events stream
    through at once; an SSE answer ends for the client right after that response. Judged answers fail
    closed: a 2xx JSON answer without that response, an SSE event that is not JSON, or another content
    type is an error, never relayed unjudged. If the client goes away, an SSE answer is still read to
    its response, so `transform` sees it. `observe` is given the response to `rpc_id` when it was read
    (an unjudged JSON answer only when it is at most `OBSERVED_BYTES`)."""
    kind = upstream.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    judged = transform is not None and upstream.status < 300
    out: web.StreamResponse | None = None
    answered: UpstreamResponse | None = None
    try:
        if judged and _json_kind(kind):
            data = await _read_limited(upstream, mcp.gw.config.limits.max_body_bytes)
            try:
                message = exact_json.loads(data)
            except orjson.JSONDecodeError:
                message = None
            if transform is None or not _is_response(message, rpc_id):
                raise UpstreamUnavailable("the MCP server answered without a JSON-RPC response to the request")
            _check_depth(message, mcp.gw.config.limits.max_json_depth)
            if observe is not None:
                observe(message)
            changed = await transform(message)
            data = data if changed is message else exact_json.dumps(changed)
            headers = answer_headers(upstream.headers, mcp.headers)
            return web.Response(status=upstream.status, body=data, headers=headers)
        if judged and kind != "text/event-stream":
            raise UpstreamUnavailable(f"the MCP server answered with content type {kind[:60]!r}, "
                                      "neither JSON nor an event stream")
        headers = answer_headers(upstream.headers, mcp.headers)
        out = web.StreamResponse(status=upstream.status, headers=headers)
        client = await _prepare(out, mcp.request)
        # a request's stream is followed to its response (and resumed) even when nothing in it is judged
        if kind == "text/event-stream" and upstream.status < 300 and (judged or rpc_id is not None):
            answered = await _relay_events(mcp, upstream, out, rpc_id, transform, client, observe)
        elif client:
            kept = _Kept() if observe is not None and rpc_id is not None and _json_kind(kind) else None
            async for chunk in upstream.chunks():
                if kept is not None:
                    kept.add(chunk)
                if not await _write(out, chunk):
                    return out
            await _end(out)
            if kept is not None:
                kept.observe(rpc_id, observe)
        return out
    except GatewayError as exc:
        if out is None:
            raise
        mcp.lost = exc  # the status line is gone: the stream's end (and its error event) is the signal
        return out
    finally:
        if answered is not upstream:
            upstream.release()
        if answered is not None:
            _drain_later(mcp, answered)


@dataclass(slots=True)
class _Kept:
    """The first `OBSERVED_BYTES` of an answer relayed as it streams, read once it has ended."""

    parts: list[bytes] = field(default_factory=list)
    size: int = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= OBSERVED_BYTES:
            self.parts.append(chunk)

    def observe(self, rpc_id: RequestId | None, observe: Observe | None) -> None:
        if observe is None or self.size > OBSERVED_BYTES:
            return
        try:
            message = exact_json.loads(b"".join(self.parts))
        except orjson.JSONDecodeError:
            return  # relayed as it came: the client judges what it is
        if _is_response(message, rpc_id):
            observe(message)


@dataclass(slots=True)
class _Resumption:
    """Where a request's event stream can be resumed from (the SSE `Last-Event-ID` rules)."""

    last_id: str | None = None
    retry_ms: int | None = None
    failures: int = 0  # reconnections in a row that brought no new event

    def saw(self, event: SseEvent) -> None:
        if event.id is not None:
            if event.id and event.id != self.last_id:  # the stream moved on: it is worth resuming again
                self.failures = 0
            self.last_id = event.id or None  # an empty id resets it: the stream cannot be resumed
        if event.retry is not None:
            self.retry_ms = event.retry


async def _relay_events(
    mcp: McpRequest, upstream: UpstreamResponse, out: web.StreamResponse, rpc_id: RequestId | None,
    transform: Transform | None, client: bool, observe: Observe | None = None,
) -> UpstreamResponse | None:
    """Relay events until the response to `rpc_id`. A server may end a request's stream before the
    response and let the client resume it (`Last-Event-ID`, MCP "Resumability and Redelivery"):
    tollgate resumes it itself, so the response still comes on the judged stream; the client is given
    no event ids, so it never resumes one around tollgate. A stream that ends for good without the
    response ends with a JSON-RPC error for `rpc_id`, and raises."""
    resumption = _Resumption() if rpc_id is not None else None
    depth = mcp.gw.config.limits.max_json_depth
    current = upstream
    answered = False
    try:
        while True:
            parser = SseParser(mcp.gw.config.limits.max_body_bytes)
            async for chunk in current.chunks():
                for event in parser.feed(chunk):
                    if resumption is not None:
                        resumption.saw(event)
                    part, answered = await _event(event.raw, event.data, rpc_id, transform, depth, observe)
                    if resumption is not None:
                        part = without_resumption(part)
                    client = client and await _write(out, part)  # a client gone: still read to the response
                    if answered:
                        break
                if answered:
                    break
            if answered or resumption is None:
                break
            if current is not upstream:
                current.release()
            current = await _resume(mcp, resumption)
        if client:
            await _end(out)  # the request's stream has done its job: the client needs nothing after it
        if not answered:
            return None
        current, finished = upstream, current  # handed to the caller, not released below
        return finished
    except (GatewayError, ValueError) as exc:  # ValueError: an SSE event over the size limit
        failure = exc if isinstance(exc, GatewayError) else UpstreamUnavailable(str(exc))
        if client and rpc_id is not None and not answered:  # the client learns it, in its own format
            error_event = format_event(orjson.dumps(gateway_error(rpc_id, failure)[1]), "message")
            if await _write(out, error_event):
                await _end(out)
        raise failure from None
    finally:
        if current is not upstream:
            current.release()


def _drain_later(mcp: McpRequest, answered: UpstreamResponse) -> None:
    """Read on what the server still sends after the response, so its connection returns to the pool; a
    server holding the stream open gets its connection closed after `DRAIN_AFTER_ANSWER_S`. In a task of
    its own: the call is answered, its span and ledger row are not kept waiting for the server."""

    async def drain() -> None:
        try:
            with contextlib.suppress(TimeoutError, GatewayError):
                async with asyncio.timeout(DRAIN_AFTER_ANSWER_S):
                    async for _ in answered.chunks():
                        pass
        finally:
            answered.release()

    drains = state_of(mcp.gw).drains
    task = asyncio.get_running_loop().create_task(drain(), name="tollgate-mcp-drain")
    drains.add(task)  # a strong reference until it ends
    task.add_done_callback(drains.discard)


async def _resume(mcp: McpRequest, resumption: _Resumption) -> UpstreamResponse:
    """The stream resumed after its last event, after the server's `retry` delay (capped at the idle
    timeout, at least `MIN_RESUME_DELAY_MS`). Raises UpstreamUnavailable when it cannot be: no event id,
    the server refuses (4xx), or `MAX_RESUMES` attempts in a row that brought nothing new."""
    while True:
        if resumption.last_id is None:
            raise UpstreamUnavailable("the MCP server ended the stream without a response to the request")
        if resumption.failures >= MAX_RESUMES:
            raise UpstreamUnavailable(f"the MCP server ended the stream without a response, and {MAX_RESUMES} "
                                      "attempts to resume it brought nothing")
        resumption.failures += 1
        delay_ms = RESUME_DELAY_MS if resumption.retry_ms is None else resumption.retry_ms
        # capped before dividing: `retry` is any run of digits, too large for a float
        await asyncio.sleep(max(MIN_RESUME_DELAY_MS, min(delay_ms, int(mcp.server.timeouts.idle * 1000))) / 1000)
        upstream = await mcp.open("GET", None, resume_after=resumption.last_id)
        kind = upstream.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if upstream.status == 200 and kind == "text/event-stream":
            return upstream
        upstream.release()
        if 400 <= upstream.status < 500:  # the server will not resume it (no session, no event store)
            raise UpstreamUnavailable(f"the MCP server ended the stream without a response and refused to "
                                      f"resume it ({upstream.status})")


async def _event(
    raw: bytes, data: str, rpc_id: RequestId | None, transform: Transform | None, depth: int,
    observe: Observe | None = None,
) -> tuple[bytes, bool]:
    """The event to relay, and whether it was the response to `rpc_id` (never for a GET stream). Without
    `transform` nothing is judged: the response is only recognised, so its stream can be resumed."""
    if not data or (transform is None and rpc_id is None):
        return raw, False
    try:
        message = exact_json.loads(data.encode())
    except orjson.JSONDecodeError:  # what a client might still read must not pass unjudged
        if transform is None:
            return raw, False
        raise UpstreamUnavailable("the MCP server sent an event whose data is not JSON") from None
    if not _is_response(message, rpc_id):
        if rpc_id is not None and _is_response(message, None):
            # SDK clients take any response on a request's stream as its answer (they rewrite its id)
            raise UpstreamUnavailable("the MCP server sent a response to another request on this request's stream")
        return raw, False
    if observe is not None and rpc_id is not None:
        observe(message)
    if transform is None:
        return raw, True
    _check_depth(message, depth)
    changed = await transform(message)
    return (raw if changed is message else replace_event_data(raw, exact_json.dumps(changed))), rpc_id is not None


def _check_depth(message: dict[str, Any], limit: int) -> None:
    """A response to judge nests no deeper than a request may (`limits.max_json_depth`): judging walks it."""
    if not json_depth_ok(message, limit):
        raise UpstreamUnavailable(f"the MCP server's response nests deeper than {limit} levels")


async def _prepare(out: web.StreamResponse, request: web.Request) -> bool:
    """Send the status line and headers; False when the client has gone away already (a call kept
    running after its client left is still read to its response, so its result is judged and kept)."""
    try:
        await out.prepare(request)
    except ConnectionResetError:
        return False
    return True


async def _write(out: web.StreamResponse, data: bytes) -> bool:
    """False once the client has gone away."""
    try:
        if data:
            await out.write(data)
    except ConnectionResetError:
        return False
    return True


async def _end(out: web.StreamResponse) -> None:
    try:
        await out.write_eof()
    except ConnectionResetError:
        pass  # SDK clients close an answer's stream as soon as its response arrived


async def _read_limited(upstream: UpstreamResponse, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in upstream.chunks():
        size += len(chunk)
        if size > limit:
            raise UpstreamUnavailable(f"the MCP server's answer exceeds the limit of {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def refusal(exc: GatewayError, rpc_id: RequestId | None, headers: dict[str, str]) -> web.Response:
    """A refused MCP request's answer: its JSON-RPC error (`gateway_error`), a stop's reason in
    `x-tollgate-stop-reason`, and the connection closed after a body that could not be read."""
    status, body = gateway_error(rpc_id, exc)
    if exc.stop_reason:
        headers = {**headers, STOP_HEADER: exc.stop_reason}
    response = web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                            headers=headers)
    if exc.closes_connection:
        response.force_close()
    return response
