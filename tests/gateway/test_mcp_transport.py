"""The MCP relay's own behaviour against a scripted server: a request's event stream that the server
ends before the response is resumed by tollgate (`Last-Event-ID`), so the response is still judged;
the client never gets an event id to resume around tollgate; a stream that cannot be resumed ends
with a JSON-RPC error for the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway import mcp_transport
from gateway.mcp_transport import MAX_RESUMES, MIN_RESUME_DELAY_MS
from tests.conftest import GatewayFactory, Harness
from tests.fakes.scripted import ScriptedServer
from tests.gateway.test_mcp_calls import tool_rows
from tests.gateway.test_mcp_probe import call, raw

POLICY = {"tools": {"allow": ["files/read_file", "files/write_note"], "tiers": {"files/write_*": "write"},
                    "on_violation": "drop"}}


class PollingServer(ScriptedServer):
    """Answers every POST request with an SSE stream that holds only a priming event (`id`, `retry`,
    no data) and ends: the client must resume it with a GET carrying `Last-Event-ID`. `resume` is
    what each GET answers: "answer" (the response, with a new event id), "prime" (another priming
    event, the same id), "empty" (a stream with no event), "silent" (a stream held open with nothing
    in it) or an HTTP status."""

    def __init__(self, resume: str | int = "answer", *, event_id: bool = True,
                 tools: list[str] | None = None) -> None:
        self.resume, self.event_id = resume, event_id
        self.tools = tools or ["read_file", "write_note", "admin_reset"]
        self.pending: dict[str, dict[str, Any]] = {}  # event id -> the response it precedes
        self.gets: list[dict[str, str]] = []
        self.times: list[float] = []  # when each GET arrived
        self.calls: list[str] = []

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("params") or {}
        if body["method"] == "tools/list":
            result: dict[str, Any] = {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in self.tools]}
        else:
            self.calls.append(str(params.get("name")))
            result = {"content": [{"type": "text", "text": f"ran {params.get('name')} {len(self.calls)}"}]}
        return {"jsonrpc": "2.0", "id": body["id"], "result": result}

    async def stream(self, request: web.Request, *events: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            last = request.headers.get("Last-Event-ID", "")
            self.gets.append(dict(request.headers))
            self.times.append(time.monotonic())
            if isinstance(self.resume, int):
                return web.Response(status=self.resume)
            if self.resume == "empty":
                return await self.stream(request)
            if self.resume == "silent":  # the stream opens and nothing comes
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await asyncio.Event().wait()
            if self.resume == "prime":
                return await self.stream(request, f"id: {last}\nretry: 1\ndata: \n\n".encode())
            if self.resume == "poll" and len(self.gets) < 3:  # still running: a new priming event, no pause
                self.pending[f"{last}+"] = self.pending.pop(last)
                return await self.stream(request, f"id: {last}+\nretry: 0\ndata: \n\n".encode())
            message = self.pending.pop(last)
            return await self.stream(request, f"id: {last}-done\nevent: message\ndata: ".encode()
                                     + orjson.dumps(message) + b"\n\n")
        body = orjson.loads(await request.read())
        if "id" not in body:
            return web.Response(status=202)
        event_id = f"e{len(self.pending) + len(self.gets) + 1}"
        self.pending[event_id] = self.answer(body)
        prime = f"id: {event_id}\nretry: 1\ndata: \n\n" if self.event_id else "data: \n\n"
        return await self.stream(request, prime.encode())


@asynccontextmanager
async def polling(**kw: Any) -> AsyncIterator[PollingServer]:
    server = await PollingServer(**kw).start()
    try:
        yield server
    finally:
        await server.close()


async def gateway(factory: GatewayFactory, url: str, **server: Any) -> Harness:
    return await factory(mcp_servers={"files": {"url": url, **server}}, agents={"bot": POLICY})


def events(data: bytes) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an SSE answer."""
    out = []
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        payload = b"\n".join(line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:"))
        if payload:
            out.append(orjson.loads(payload))
    return out


async def test_a_stream_ended_before_its_response_is_resumed_and_the_response_judged(
    gateway_factory: GatewayFactory,
) -> None:
    async with polling() as srv:
        h = await gateway(gateway_factory, srv.url)
        status, _, data = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 200
        assert events(data) == [{"jsonrpc": "2.0", "id": 7,
                                 "result": {"content": [{"type": "text", "text": "ran read_file 1"}]}}]
        assert [g["Last-Event-ID"] for g in srv.gets] == ["e1"]
        assert srv.gets[0]["Accept"] == "text/event-stream" and "Content-Type" not in srv.gets[0]
        # the client gets no event id (nor a retry delay) to resume the stream with, around tollgate
        assert b"id:" not in data and b"retry:" not in data, data
        assert [(r["decision"], r["reason"]) for r in await tool_rows(h)] == [("executed", None)]


async def test_a_resumed_tools_list_is_still_filtered(gateway_factory: GatewayFactory) -> None:
    async with polling() as srv:
        h = await gateway(gateway_factory, srv.url)
        status, _, data = await raw(h, "POST", {"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {}})
        assert status == 200
        (message,) = events(data)
        assert [t["name"] for t in message["result"]["tools"]] == ["read_file", "write_note"]


async def test_a_resumed_write_is_recorded_for_its_identical_retry(gateway_factory: GatewayFactory) -> None:
    async with polling() as srv:
        h = await gateway(gateway_factory, srv.url)
        _, _, first = await raw(h, "POST", call("write_note", {"text": "x"}))
        status, headers, again = await raw(h, "POST", call("write_note", {"text": "x"}, rpc_id=8))
        assert status == 200 and headers.get("x-tollgate-idempotent-replay") == "true"
        assert events(first)[0]["result"] == orjson.loads(again)["result"]
        assert srv.calls == ["write_note"]
        assert sorted(r["decision"] for r in await tool_rows(h)) == ["executed", "replayed"]


async def unanswered(h: Harness) -> dict[str, Any]:
    status, _, data = await raw(h, "POST", call("read_file", {"path": "a"}))
    assert status == 200  # the stream had begun: the error comes as its last event
    (message,) = events(data)
    assert message["id"] == 7 and message["error"]["data"]["code"] == "upstream_unavailable", message
    (row,) = await tool_rows(h)
    assert (row["decision"], row["reason"]) == ("refused", "upstream_unavailable"), row
    view = await h.run("r1")
    assert [(s["status"], s["refusal"]) for s in view["steps"]] == [(502, "upstream_unavailable")]
    return message


async def test_a_stream_without_an_event_id_ends_with_an_error_for_the_call(gateway_factory: GatewayFactory) -> None:
    async with polling(event_id=False) as srv:
        h = await gateway(gateway_factory, srv.url)
        message = await unanswered(h)
        assert "without a response" in message["error"]["message"]
        assert srv.gets == []


async def test_a_server_refusing_to_resume_ends_the_call_with_an_error(gateway_factory: GatewayFactory) -> None:
    async with polling(resume=405) as srv:
        h = await gateway(gateway_factory, srv.url)
        message = await unanswered(h)
        assert "refused to resume it (405)" in message["error"]["message"]
        assert len(srv.gets) == 1


@pytest.mark.parametrize("resume", ["prime", "empty", 503])
async def test_resuming_is_bounded_when_resumed_streams_bring_nothing(
    gateway_factory: GatewayFactory, resume: str | int
) -> None:
    async with polling(resume=resume) as srv:
        h = await gateway(gateway_factory, srv.url)
        await unanswered(h)
        assert len(srv.gets) == MAX_RESUMES


async def test_a_server_error_answer_is_an_error_row_not_a_replay(gateway_factory: GatewayFactory) -> None:
    async def broken(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=500, text="boom")

    app = web.Application()
    app.router.add_route("*", "/mcp", broken)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        h = await gateway(gateway_factory, str(server.make_url("/mcp")))
        status, _, _ = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 500
        assert [r["decision"] for r in await tool_rows(h)] == ["error"]
    finally:
        await server.close()


async def test_a_server_polling_with_no_pause_is_resumed_at_a_bounded_pace(gateway_factory: GatewayFactory) -> None:
    """Each stream brings a new priming event (progress) with `retry: 0`: tollgate still pauses
    `MIN_RESUME_DELAY_MS` between resumptions instead of reconnecting in a tight loop."""
    async with polling(resume="poll") as srv:
        h = await gateway(gateway_factory, srv.url)
        status, _, data = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 200 and events(data)[0]["result"]["content"][0]["text"] == "ran read_file 1"
        assert len(srv.gets) == 3
        gaps = [b - a for a, b in zip(srv.times, srv.times[1:], strict=False)]
        assert min(gaps) >= MIN_RESUME_DELAY_MS / 1000 * 0.9, gaps


class HoldingServer(ScriptedServer):
    """Answers a POST with an SSE stream holding the response, then keeps the stream open until `let_go`."""

    def __init__(self) -> None:
        self.let_go = asyncio.Event()
        self.ended = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        result = {"content": [{"type": "text", "text": "held"}]}
        await resp.write(b"event: message\ndata: " + orjson.dumps({"jsonrpc": "2.0", "id": body["id"], "result": result})
                         + b"\n\n")
        await self.let_go.wait()
        await resp.write_eof()
        self.ended.set()
        return resp


async def test_a_call_is_recorded_while_its_server_still_holds_the_stream(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's stream is read on after the response only for its connection, in the background:
    the call's ledger row does not wait for it (the drain's limit raised here, so waiting would show)."""
    monkeypatch.setattr(mcp_transport, "DRAIN_AFTER_ANSWER_S", 30.0)
    server = await HoldingServer().start()
    try:
        h = await gateway(gateway_factory, server.url)
        status, _, data = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 200 and events(data)[0]["result"]["content"][0]["text"] == "held"
        async with asyncio.timeout(5):
            while not await tool_rows(h):
                await asyncio.sleep(0.01)
        assert not server.ended.is_set() and mcp_transport.state_of(h.gateway).drains
        server.let_go.set()  # the drain reads the stream to its end and lets the connection go
        async with asyncio.timeout(5):
            await server.ended.wait()
            while mcp_transport.state_of(h.gateway).drains:
                await asyncio.sleep(0.01)
    finally:
        server.let_go.set()
        await server.close()


async def test_a_resumed_stream_silent_past_the_idle_timeout_ends_the_call(gateway_factory: GatewayFactory) -> None:
    """`timeouts.idle` is the longest silence tollgate waits for on a request's stream, first or resumed:
    past it the call ends with a JSON-RPC error (`upstream_timeout`) and a `refused` row, once."""
    async with polling(resume="silent") as srv:
        h = await gateway(gateway_factory, srv.url, timeouts={"idle": 0.3})
        started = time.monotonic()
        status, _, data = await raw(h, "POST", call("read_file", {"path": "a"}))
        assert status == 200 and time.monotonic() - started < 5
        assert events(data)[-1]["error"]["data"]["code"] == "upstream_timeout", data
        assert len(srv.gets) == 1
        assert [r["decision"] for r in await tool_rows(h)] == ["refused"]


def test_a_refusal_is_a_json_rpc_error_carrying_its_stop_and_closing_after_a_broken_body() -> None:
    from gateway.errors import ToolNotAllowed, UndecodableBody
    from gateway.jsonrpc import gateway_error
    from gateway.mcp_transport import refusal

    stop = ToolNotAllowed("tool 'rm' is not in the agent's allow-list")
    stopped = refusal(stop, 7, {"x-tollgate-run-id": "r"})
    assert (stopped.status, orjson.loads(stopped.body)) == gateway_error(7, stop)  # type: ignore[arg-type]
    assert stopped.headers["x-tollgate-stop-reason"] == "tool_not_allowed"
    assert stopped.headers["x-tollgate-run-id"] == "r" and stopped.keep_alive is not False
    broken = refusal(UndecodableBody("request body cannot be decoded"), None, {})
    assert broken.status == 400 and "x-tollgate-stop-reason" not in broken.headers
    assert broken.keep_alive is False  # the connection closes after it


@pytest.mark.parametrize(("chunks", "rpc_id", "observed"), [
    ([b'{"jsonrpc":"2.0","id":3,', b'"result":{}}'], 3, [{"jsonrpc": "2.0", "id": 3, "result": {}}]),
    ([b'{"jsonrpc":"2.0","id":"3","error":{"code":-1}}'], 3, [{"jsonrpc": "2.0", "id": "3", "error": {"code": -1}}]),
    ([b'{"jsonrpc":"2.0","id":4,"result":{}}'], 3, []),  # another request's
    ([b"not json"], 3, []),
    ([b'{"jsonrpc":"2.0","id":3,"result":"', b"x" * mcp_transport.OBSERVED_BYTES, b'"}'], 3, []),  # too long to keep
])
def test_an_unjudged_json_answer_is_observed_only_when_it_is_the_response_and_bounded(
    chunks: list[bytes], rpc_id: int, observed: list[Any]
) -> None:
    kept = mcp_transport._Kept()
    for chunk in chunks:
        kept.add(chunk)
    seen: list[Any] = []
    kept.observe(rpc_id, seen.append)
    assert seen == observed
    assert sum(map(len, kept.parts)) <= mcp_transport.OBSERVED_BYTES
