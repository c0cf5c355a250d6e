"""Hostile probes of the MCP proxy and tool policy (`/mcp/{server}`).

Two kinds of MCP server sit behind the gateway, both on loopback: the official SDK server of
`tests.fakes.mcp_server` for ordinary flows, and `RawServer` below, a hand-written Streamable HTTP
server whose answers a test can bend (ids echoed as strings, content types, SSE, hanging).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import orjson
import pytest
from aiohttp import web
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.scripted import ScriptedServer
from tests.fakes.upstream import Reply, openai_completion, tool_call
from tests.gateway.test_mcp import refused, text

POLICY_REFUSED = -32003
TOOLS = {
    "allow": ["files/read_file", "files/write_note", "files/delete_*"],
    "approval": ["files/delete_*"],
    "tiers": {"files/write_*": "write", "files/delete_*": "dangerous"},
    "approval_timeout_s": 5,
}


# -- helpers ---------------------------------------------------------------------------------------------


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start()
    yield server
    server.stop()


async def gateway(factory: GatewayFactory, url: str, **policy: Any) -> Harness:
    policy.setdefault("tools", TOOLS)
    extra = policy.pop("config", {})
    servers = policy.pop("servers", {"files": {"url": url}})
    return await factory(mcp_servers=servers, agents={"bot": policy}, **extra)


@asynccontextmanager
async def mcp_client(h: Harness, *, mode: str = "legacy", run: str = "r1", server: str = "files",
                     headers: dict[str, str] | None = None) -> AsyncIterator[Client]:
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run, **(headers or {})}
    async with (
        httpx2.AsyncClient(headers=hdrs, timeout=httpx2.Timeout(15, read=15)) as http,
        Client(streamable_http_client(f"{h.url}/mcp/{server}", http_client=http), mode=mode) as client,
    ):
        yield client


def call(name: Any, arguments: Any = None, rpc_id: Any = 7, **params: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"name": name, **params}
    if arguments is not None:
        p["arguments"] = arguments
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call", "params": p}


async def raw(h: Harness, method: str, body: bytes | dict[str, Any] | None = None, *, server: str = "files",
              run: str = "r1", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run, "content-type": "application/json",
            "accept": "application/json, text/event-stream", **(headers or {})}
    async with h.session.request(method, f"{h.url}/mcp/{server}", data=data, headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def post(h: Harness, body: bytes | dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any]]:
    status, _, data = await raw(h, "POST", body, **kw)
    return status, orjson.loads(data)


async def admin(h: Harness, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with h.session.request(method, f"{h.admin_url}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def pending(h: Harness, count: int = 1) -> list[dict[str, Any]]:
    for _ in range(1000):
        _, data = await admin(h, "GET", "/admin/approvals?status=pending")
        if len(data["approvals"]) >= count:
            return data["approvals"]  # type: ignore[no-any-return]
        await asyncio.sleep(0.005)
    raise AssertionError("no pending approval appeared")


async def propose(h: Harness, *calls: tuple[str, str], run: str = "r1") -> None:
    """A model answer through the gateway that proposes `calls` (name, JSON arguments)."""
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[
        tool_call(name, args, f"c{i}") for i, (name, args) in enumerate(calls)])))
    async with h.session.post(f"{h.url}/v1/chat/completions",
                              json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "go"}]},
                              headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": run}) as resp:
        assert resp.status == 200, await resp.text()


def sse(message: dict[str, Any]) -> bytes:
    return b"event: message\ndata: " + orjson.dumps(message) + b"\n\n"


TOOL_DEFS = {
    "read_file": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    "write_note": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    "admin_reset": {"type": "object", "properties": {"confirm": {"type": "boolean"}}},
}


class RawServer(ScriptedServer):
    """A minimal hand-written MCP Streamable HTTP server (handshake era, no sessions) on loopback.

    `id_as_str`: responses echo the request id as a string (`7` -> `"7"`), which the official SDKs
    correlate (`coerce_request_id`). `content_type`: of JSON answers. `use_sse`: answer requests
    with an SSE stream. `hang`: `tools/call` never answers. `page_size`: paginate `tools/list`."""

    def __init__(self, *, id_as_str: bool = False, content_type: str = "application/json",
                 use_sse: bool = False, hang: bool = False, page_size: int | None = None,
                 tools: list[str] | None = None, drop_calls: int = 0, input_rounds: int = 0,
                 sse_prelude: bytes = b"") -> None:
        self.id_as_str, self.content_type, self.use_sse, self.hang = id_as_str, content_type, use_sse, hang
        self.page_size = page_size
        self.drop_calls = drop_calls
        self.input_rounds = input_rounds
        self.sse_prelude = sse_prelude
        self.get_events: list[dict[str, Any]] = []
        self.tools = tools or list(TOOL_DEFS)
        self.received: list[dict[str, Any]] = []
        self.mcp_names: list[list[str]] = []  # the Mcp-Name fields of each POST, as received
        self.calls: list[tuple[str, Any]] = []
        self.notes = 0
        self.release = asyncio.Event()

    async def close(self) -> None:
        self.release.set()
        await super().close()

    def result(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "initialize":
            return {"protocolVersion": params.get("protocolVersion", "2025-06-18"),
                    "capabilities": {"tools": {"listChanged": True}}, "serverInfo": {"name": "raw", "version": "0"}}
        if method == "tools/list":
            tools = [{"name": n, "description": n, "inputSchema": TOOL_DEFS.get(n, {"type": "object"})}
                     for n in self.tools]
            if not self.page_size:
                return {"tools": tools}
            start = int(params.get("cursor") or 0)
            end = start + self.page_size
            page: dict[str, Any] = {"tools": tools[start:end]}
            if end < len(tools):
                page["nextCursor"] = str(end)
            return page
        if method == "tools/call":
            name = params.get("name")
            if self.input_rounds and params.get("requestState") != f"round-{self.input_rounds}":
                done = int(str(params.get("requestState") or "round-0").split("-")[1])
                return {"resultType": "input_required", "requestState": f"round-{done + 1}"}
            self.calls.append((str(name), params.get("arguments")))
            if name == "write_note":
                self.notes += 1
                return {"content": [{"type": "text", "text": f"note {self.notes}"}], "isError": False}
            return {"content": [{"type": "text", "text": f"ran {name}"}], "isError": False}
        return {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            if not self.get_events:
                return web.Response(status=405)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            for event in self.get_events:
                await resp.write(sse(event))
            await resp.write_eof()
            return resp
        if request.method == "DELETE":
            return web.Response(status=200)
        body = orjson.loads(await request.read())
        self.received.append(body)
        self.mcp_names.append(request.headers.getall("Mcp-Name", []))
        if "id" not in body or "method" not in body:
            return web.Response(status=202)
        if body["method"] == "tools/call" and self.drop_calls:
            self.drop_calls -= 1  # the connection breaks before the call runs
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if body["method"] == "tools/call" and self.hang:
            await self.release.wait()
        rid = str(body["id"]) if self.id_as_str else body["id"]
        message = {"jsonrpc": "2.0", "id": rid, "result": self.result(body["method"], body.get("params") or {})}
        if self.use_sse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if self.sse_prelude:
                await resp.write(self.sse_prelude)
            await resp.write(sse(message))
            await resp.write_eof()
            return resp
        return web.Response(body=orjson.dumps(message), headers={"Content-Type": self.content_type})


@asynccontextmanager
async def raw_server(**kw: Any) -> AsyncIterator[RawServer]:
    server = await RawServer(**kw).start()
    try:
        yield server
    finally:
        await server.close()


def listed_names(answer: dict[str, Any]) -> list[str]:
    return [t["name"] for t in answer["result"]["tools"]]


LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
RAW_TOOLS = {"allow": ["files/read_file", "files/write_note"], "tiers": {"files/write_*": "write"},
             "on_violation": "drop"}


# -- the server's answer: correlation and content type ----------------------------------------------------


async def test_raw_server_baseline_tools_list_is_filtered(gateway_factory: GatewayFactory) -> None:
    """Control for the probes below: the same hand-written server, ids echoed as sent."""
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        status, answer = await post(h, LIST)
        assert status == 200 and listed_names(answer) == ["read_file", "write_note"]
        async with mcp_client(h) as client:
            assert sorted(t.name for t in (await client.list_tools()).tools) == ["read_file", "write_note"]


@pytest.mark.parametrize("use_sse", [False, True], ids=["json", "sse"])
async def test_tools_list_echoing_the_id_as_a_string_is_still_filtered(
    gateway_factory: GatewayFactory, use_sse: bool
) -> None:
    """The official SDKs correlate a response whose id is the request's integer id as a string
    (`mcp.shared.dispatcher.coerce_request_id`, "matches the TS SDK"), so the agent accepts that
    response as its `tools/list` answer: the gateway must filter it too."""
    async with raw_server(id_as_str=True, use_sse=use_sse) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        async with mcp_client(h) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
        assert "admin_reset" not in names, f"the agent was shown a denied tool: {names}"


async def test_a_string_echoed_id_on_an_sse_tools_call_does_not_skip_the_judgement(
    gateway_factory: GatewayFactory,
) -> None:
    """A result the agent accepts must have been judged: a `write` tool's result recorded
    (idempotency) and fed to the guards. With a JSON answer the gateway fails closed on an id it does
    not recognise; with an SSE answer it relays the result unjudged, so the identical write runs again."""
    async with raw_server(id_as_str=True, use_sse=True) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        async with mcp_client(h) as client:
            try:
                first: Any = await client.call_tool("write_note", {"text": "hi"})
            except MCPError as exc:
                first = exc  # failing closed, as for a JSON answer, is fine too
            if isinstance(first, MCPError):
                return
            assert text(first) == "note 1"
            second = await client.call_tool("write_note", {"text": "hi"})
        assert srv.calls == [("write_note", {"text": "hi"})], "a delivered write was not recorded: it ran twice"
        assert text(second) == "note 1"


@pytest.mark.parametrize("ctype", ["application/json-rpc", "application/jsonrequest"])
async def test_tools_list_with_a_json_ish_content_type_is_never_relayed_unfiltered(
    gateway_factory: GatewayFactory, ctype: str
) -> None:
    """The official SDK reads any answer whose Content-Type *starts with* `application/json` as
    JSON; the gateway only judges exactly `application/json`. Whatever it relays, a denied tool must
    not reach the agent (filter it, or fail closed)."""
    async with raw_server(content_type=ctype) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        status, _, data = await raw(h, "POST", LIST)
        assert b"admin_reset" not in data, (status, data[:300])


# -- proposals and the tool-call cap ----------------------------------------------------------------------

MODEL_TOOLS = {**TOOLS, "allow": [*TOOLS["allow"], "read_file", "delete_file", "write_note"]}


async def test_a_proposal_executed_twice_counts_the_second_execution(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url, caps={"tool_calls": 1}, tools=MODEL_TOOLS)
    await propose(h, ("read_file", '{"path": "a"}'))
    async with mcp_client(h) as client:
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
        error = await refused(client.call_tool("read_file", {"path": "a"}))  # no proposal left: counts
        assert error["data"] == {"code": "tool_call_cap"}
    assert files.seen.calls() == [("read_file", {"path": "a"})]
    run = await h.run("r1")
    assert (run["tool_calls"], run["stop_reason"]) == (1, "tool_call_cap")


async def test_two_identical_proposals_are_two_executions_and_key_order_does_not_matter(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url, caps={"tool_calls": 3}, tools=MODEL_TOOLS)
    await propose(h, ("write_note", '{"text": "x"}'), ("read_file", '{ "path" : "a" }'),
                  ("read_file", '{"path":"a"}'))
    assert (await h.run("r1"))["tool_calls"] == 3
    async with mcp_client(h, mode="auto") as client:
        for _ in range(2):
            assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
        assert text(await client.call_tool("write_note", {"text": "x"})) == "note 1 saved: x"
        error = await refused(client.call_tool("read_file", {"path": "a"}))
        assert error["data"] == {"code": "tool_call_cap"}
    run = await h.run("r1")
    assert run["tool_calls"] == 3 and run["stop_reason"] == "tool_call_cap"


async def test_one_proposal_executed_concurrently_is_uncounted_only_once(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url, caps={"tool_calls": 1}, tools=MODEL_TOOLS)
    await propose(h, ("read_file", '{"path": "a"}'))
    async with mcp_client(h, mode="auto") as one, mcp_client(h, mode="auto") as two:
        results = await asyncio.gather(one.call_tool("read_file", {"path": "a"}),
                                       two.call_tool("read_file", {"path": "a"}), return_exceptions=True)
    errors = [r for r in results if isinstance(r, MCPError)]
    assert len(errors) == 1 and errors[0].error.data == {"code": "tool_call_cap"}, results
    assert len(files.seen.calls()) == 1
    assert (await h.run("r1"))["tool_calls"] == 1


async def test_a_proposal_whose_execution_timed_out_in_approval_is_still_not_executed(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """DESIGN 5: an MCP call matching a proposed, *not yet executed* call is that proposal's
    execution and does not count again. A call refused by the approval timeout never ran, so the
    agent's retry of it still executes the proposal: it must be parked again, not stop the run."""
    h = await gateway(gateway_factory, files.url, caps={"tool_calls": 1},
                      tools={**MODEL_TOOLS, "approval_timeout_s": 0.2})
    await propose(h, ("delete_file", '{"path": "a"}'))
    async with mcp_client(h, mode="auto") as client:
        error = await refused(client.call_tool("delete_file", {"path": "a"}))
        assert error["data"] == {"code": "approval_timeout"}
        retry = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        parked = asyncio.create_task(pending(h))
        done, _ = await asyncio.wait([retry, parked], return_when=asyncio.FIRST_COMPLETED)
        if retry in done:
            parked.cancel()
            raise AssertionError(f"the retry was not parked: {retry.exception() or retry.result()}")
        [item] = await parked
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        assert text(await retry) == "deleted a"
    run = await h.run("r1")
    assert (run["status"], run["tool_calls"]) == ("active", 1)


async def test_a_proposal_whose_execution_never_reached_the_server_still_counts_once(
    gateway_factory: GatewayFactory,
) -> None:
    """Same rule when the call could not be sent (the server is unreachable): the call did not
    execute, so its retries do not count a second time."""
    tools = {"allow": ["files/read_file", "read_file"]}
    h = await gateway(gateway_factory, closed_port_url(), caps={"tool_calls": 1}, tools=tools)
    await propose(h, ("read_file", '{"path": "a"}'))
    for rpc_id in (7, 8, 9):
        status, answer = await post(h, call("read_file", {"path": "a"}, rpc_id=rpc_id))
        assert status == 502 and answer["error"]["data"] == {"code": "upstream_unavailable"}, answer
    run = await h.run("r1")
    assert run["tool_calls"] == 1 and run["status"] == "active"


async def test_a_call_the_server_may_have_received_counts_again(gateway_factory: GatewayFactory) -> None:
    """The server dropped the connection after the request was written: it may have run the call, so
    a retry is a new call (never under-counted)."""
    async with raw_server(drop_calls=1) as srv:
        tools = {"allow": ["files/read_file", "read_file"]}
        h = await gateway(gateway_factory, srv.url, caps={"tool_calls": 1}, tools=tools)
        await propose(h, ("read_file", '{"path": "a"}'))
        status, answer = await post(h, call("read_file", {"path": "a"}))
        assert status == 502 and answer["error"]["data"] == {"code": "upstream_unavailable"}, answer
        status, answer = await post(h, call("read_file", {"path": "a"}, rpc_id=8))
        assert answer["error"]["data"]["code"] == "tool_call_cap", (status, answer)
        assert srv.calls == []


# -- caller mistakes and transport failures: never a 500, always JSON-RPC ---------------------------------


def closed_port_url() -> str:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/mcp"


async def test_an_unreachable_server_is_a_502_json_rpc_error_for_every_method(gateway_factory: GatewayFactory) -> None:
    h = await gateway(gateway_factory, closed_port_url(), tools=RAW_TOOLS)
    for method, body in (("POST", call("read_file", {"path": "a"})), ("POST", LIST), ("GET", None), ("DELETE", None)):
        status, headers, data = await raw(h, method, body)
        answer = orjson.loads(data)
        assert status == 502, (method, status, data)
        assert answer["error"]["data"] == {"code": "upstream_unavailable"}, answer
        assert answer["id"] == (body or {}).get("id")
        assert headers.get("x-tollgate-run-id") == "r1"
    run = await h.run("r1")
    assert run["status"] == "active"


async def test_a_hanging_server_is_a_504_json_rpc_error(gateway_factory: GatewayFactory) -> None:
    async with raw_server(hang=True) as srv:
        servers = {"files": {"url": srv.url, "timeouts": {"connect": 2, "first_byte": 0.3, "idle": 0.3}}}
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS, servers=servers)
        status, answer = await post(h, call("read_file", {"path": "a"}))
        assert status == 504 and answer["error"]["data"] == {"code": "upstream_timeout"}, answer
        assert answer["id"] == 7


async def test_unknown_server_is_404_for_every_method(gateway_factory: GatewayFactory, files: mcp_server.RunningServer) -> None:
    h = await gateway(gateway_factory, files.url)
    for method, body in (("POST", LIST), ("GET", None), ("DELETE", None)):
        for name in ("nope", "Files", "files%00"):
            status, _, data = await raw(h, method, body, server=name)
            assert status == 404, (method, name, data)
            assert orjson.loads(data)["error"]["data"] == {"code": "mcp_server_not_found"}
    for method in ("PUT", "PATCH", "OPTIONS"):  # a JSON-RPC error, as every other refusal of the endpoint
        status, headers, data = await raw(h, method, LIST)
        assert status == 405 and "POST" in headers.get("Allow", "")
        error = orjson.loads(data)["error"]
        assert error["code"] == -32600 and error["data"] == {"code": "method_not_allowed"}
        assert method in error["message"]
    assert files.seen.requests == []


@pytest.mark.parametrize("name", [123, None, [], {}, "", True, 1.5])
async def test_a_tools_call_name_that_is_not_a_non_empty_string_is_a_400(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, name: Any
) -> None:
    h = await gateway(gateway_factory, files.url)
    status, answer = await post(h, call(name, {"path": "a"}))
    assert status == 400 and answer["error"]["code"] == -32600, answer
    assert answer["id"] == 7
    assert files.seen.requests == []
    assert (await admin(h, "GET", "/admin/runs/r1"))[0] == 404


@pytest.mark.parametrize("name", ["files/read_file", "READ_FILE", "Read_File", "read_file\u0000", " read_file",
                                  "read_file/../admin_reset", "read_fil", "read_file\n", "\u0072ead_file\u0301"])
async def test_near_miss_and_prefixed_names_are_refused_and_never_forwarded(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, name: str
) -> None:
    h = await gateway(gateway_factory, files.url, tools={"allow": ["files/read_file"], "on_violation": "drop"})
    status, answer = await post(h, call(name, {"path": "a"}))
    assert status == 200 and answer["error"]["data"] == {"code": "tool_not_allowed"}, answer
    assert files.seen.calls() == []
    assert (await h.run("r1"))["status"] == "active"


@pytest.mark.parametrize("arguments", [[], "path=a", 5, True, [{"path": "a"}]])
async def test_arguments_that_are_not_an_object_are_invalid_params(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, arguments: Any
) -> None:
    h = await gateway(gateway_factory, files.url)
    status, answer = await post(h, call("read_file", arguments))
    assert status == 200 and answer["error"]["code"] == -32602, answer
    assert answer["error"]["data"] == {"code": "invalid_arguments"}
    assert files.seen.calls() == []


async def test_a_batch_mixing_allowed_and_denied_calls_is_refused_whole(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url)
    batch = [call("read_file", {"path": "a"}, rpc_id=1), call("admin_reset", {"confirm": True}, rpc_id=2)]
    status, answer = await post(h, orjson.dumps(batch))
    assert status == 400 and answer["error"]["code"] == -32600, answer
    status, answer = await post(h, b"[]")
    assert status == 400 and answer["error"]["code"] == -32600, answer
    assert files.seen.requests == []
    assert (await admin(h, "GET", "/admin/runs/r1"))[0] == 404  # nothing judged: nothing stopped


@pytest.mark.parametrize("depth", [70, 5000, 200_000])
async def test_deeply_nested_bodies_are_400_not_500(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, depth: int
) -> None:
    h = await gateway(gateway_factory, files.url)
    nested = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file","arguments":{"x":' + \
        b"[" * depth + b"]" * depth + b"}}}"
    status, answer = await post(h, nested)
    assert status == 400 and answer["error"]["code"] in (-32600, -32700), answer
    assert files.seen.requests == []


async def test_wrong_content_type_or_accept_is_never_a_500(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url)
    for headers in ({"content-type": "text/plain"}, {"accept": "text/html"}, {"content-type": "application/x-www-form-urlencoded"}):
        status, _, data = await raw(h, "POST", LIST, headers=headers)
        assert status < 500, (headers, status, data)
    status, _, data = await raw(h, "POST", b"", headers={"content-type": "application/json"})
    assert status == 400 and orjson.loads(data)["error"]["code"] == -32700, data
    status, _, data = await raw(h, "POST", b"\xff\xfe{}")
    assert status == 400, data


async def test_the_run_id_comes_from_baggage_for_mcp_calls(gateway_factory: GatewayFactory) -> None:
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        headers = {"x-tollgate-agent": "bot", "baggage": "other=1, tollgate.run_id=bag%2Drun;prop=x",
                   "content-type": "application/json", "accept": "application/json, text/event-stream"}
        async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(call("read_file", {"path": "a"})),
                                  headers=headers) as resp:
            assert resp.status == 200 and resp.headers["x-tollgate-run-id"] == "bag-run"
            body = await resp.read()
        assert b"ran read_file" in body, body
        run = await h.run("bag-run")
        assert [s["tool_calls"] for s in run["steps"]] == [["files/read_file"]]
        # the header wins over baggage
        async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(call("read_file", {"path": "b"})),
                                  headers={**headers, "x-tollgate-run-id": "hdr"}) as resp:
            assert resp.headers["x-tollgate-run-id"] == "hdr"
        assert (await h.run("hdr"))["steps"][0]["tool_calls"] == ["files/read_file"]


# -- multi-round-trip calls, the GET stream, pagination ---------------------------------------------------

MODERN_HEADERS = {"mcp-protocol-version": "2026-07-28"}


async def test_an_input_required_round_trip_is_one_tool_call(gateway_factory: GatewayFactory) -> None:
    """SEP-2322: `resultType: input_required` means nothing ran (mcp_calls.py says so); the client
    retries the same call with the echoed `requestState`. The tool runs once, so it is one tool call:
    the retry must neither count a second time nor look like a loop."""
    async with raw_server(input_rounds=1) as srv:
        h = await gateway(gateway_factory, srv.url, caps={"tool_calls": 1}, tools=RAW_TOOLS,
                          loop={"window": 2, "max_distinct": 1})
        status, first = await post(h, call("read_file", {"path": "a"}), headers=MODERN_HEADERS)
        assert status == 200 and first["result"]["resultType"] == "input_required", first
        status, second = await post(h, call("read_file", {"path": "a"}, rpc_id=8, requestState="round-1"),
                                    headers=MODERN_HEADERS)
        assert status == 200 and "result" in second, second
        assert second["result"]["content"][0]["text"] == "ran read_file"
        run = await h.run("r1")
        assert (run["status"], run["tool_calls"]) == ("active", 1), run


async def test_the_get_stream_relays_notifications_and_ends_at_a_replayed_response(
    gateway_factory: GatewayFactory,
) -> None:
    """A response on the GET stream is a request's stream resumed around tollgate (which gives its
    clients no event ids to do so): it would reach the agent unjudged, so the stream ends before it."""
    async with raw_server() as srv:
        srv.get_events = [
            {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"},
            {"jsonrpc": "2.0", "id": "srv-1", "method": "ping"},
            {"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": n, "inputSchema": {"type": "object"}}
                                                            for n in ("read_file", "admin_reset")]}},
        ]
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        status, headers, data = await raw(h, "GET", headers={"accept": "text/event-stream"})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        assert headers.get("x-tollgate-run-id") == "r1"
        events = [orjson.loads(line[5:]) for line in data.splitlines() if line.startswith(b"data:")]
        assert [e.get("method") for e in events] == ["notifications/tools/list_changed", "ping"], events


async def test_arguments_are_checked_against_schemas_listed_on_a_later_page(gateway_factory: GatewayFactory) -> None:
    async with raw_server(page_size=1) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        cursor: str | None = None
        names: list[str] = []
        for rpc_id in range(1, 10):
            params = {"cursor": cursor} if cursor else {}
            status, page = await post(h, {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/list", "params": params})
            assert status == 200, page
            names += listed_names(page)
            cursor = page["result"].get("nextCursor")
            if cursor is None:
                break
        assert names == ["read_file", "write_note"]
        status, answer = await post(h, call("write_note", {"text": 5}))  # write_note came on page 2
        assert status == 200 and answer["error"]["code"] == -32602, answer
        assert srv.calls == []


# -- approvals racing with the run ------------------------------------------------------------------------


async def test_a_parked_call_is_refused_when_the_run_stopped_meanwhile(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url)
    async with mcp_client(h, mode="auto") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        [item] = await pending(h)
        error = await refused(client.call_tool("admin_reset", {"confirm": True}))  # reject: the run stops
        assert error["data"] == {"code": "tool_not_allowed"}
        status, _ = await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        assert status == 200
        error = await refused(task)
        assert error["code"] == POLICY_REFUSED and error["data"] == {"code": "tool_not_allowed"}
    assert files.seen.calls() == []


async def test_concurrent_identical_dangerous_calls_share_one_approval(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files.url)
    async with mcp_client(h, mode="auto") as one, mcp_client(h, mode="auto") as two:
        tasks = [asyncio.create_task(c.call_tool("delete_file", {"path": "a"})) for c in (one, two)]
        [item] = await pending(h)
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        results = await asyncio.gather(*tasks)
    assert [text(r) for r in results] == ["deleted a", "deleted a"]
    assert files.seen.calls() == [("delete_file", {"path": "a"})]
    _, listed = await admin(h, "GET", "/admin/approvals")
    assert len(listed["approvals"]) == 1


async def test_identical_parked_calls_denied_together_say_so_in_the_ledger(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """The duplicate shares the first call's denial: its ledger row is a replay of `approval_denied`, not
    a replay with no reason (which reads as a replayed result)."""
    h = await gateway(gateway_factory, files.url)
    tasks = [asyncio.create_task(post(h, call("delete_file", {"path": "a"}, rpc_id=i))) for i in (1, 2)]
    [item] = await pending(h)
    await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "deny", "by": "alice"})
    answers = await asyncio.gather(*tasks)
    assert [a["error"]["data"]["code"] for _, a in answers] == ["approval_denied", "approval_denied"]
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = sorted((r["decision"], r["reason"]) for r in ledger.rows("r1") if r["operation"].startswith("tools/call"))
    assert rows == [("denied", "approval_denied"), ("replayed", "approval_denied")]
    assert files.seen.calls() == []


async def test_a_caller_that_goes_away_while_parked_denies_its_approval(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """aiohttp's TestServer runs handlers with handler_cancellation, as `tollgate serve` does: nobody
    can approve a call whose caller is gone, and the server never sees it."""
    h = await gateway(gateway_factory, files.url)
    headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "r1", "content-type": "application/json",
               "accept": "application/json, text/event-stream", **MODERN_HEADERS}
    body = orjson.dumps(call("delete_file", {"path": "a"}))
    task = asyncio.create_task(h.session.post(f"{h.url}/mcp/files", data=body, headers=headers))
    [item] = await pending(h)
    task.cancel()  # the agent goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(1000):
        _, listed = await admin(h, "GET", "/admin/approvals")
        [item] = listed["approvals"]
        if item["status"] != "pending":
            break
        await asyncio.sleep(0.005)
    assert item["status"] == "denied", item
    status, _ = await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
    assert status == 400
    assert files.seen.calls() == []


# -- SSE framing and header smuggling ---------------------------------------------------------------------

LOG = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "hi"}})


@pytest.mark.parametrize("blank", [b"\n\r\n", b"\r\n\r"], ids=["LF-then-CRLF", "CRLF-then-CR"])
async def test_sse_events_ended_by_mixed_line_terminators_are_still_judged(
    gateway_factory: GatewayFactory, blank: bytes
) -> None:
    """SSE allows CRLF, LF and CR as line terminators, mixed (the SDK's parser normalises them all).
    A notification whose blank line mixes them, then the `tools/list` response: the client reads two
    events; the gateway must not read one unparseable event and relay it unfiltered."""
    async with raw_server(use_sse=True, sse_prelude=b"event: message\ndata: " + LOG + blank) as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        async with mcp_client(h) as client:
            names = sorted(t.name for t in (await asyncio.wait_for(client.list_tools(), 10)).tools)
        assert "admin_reset" not in names, f"the agent was shown a denied tool: {names}"


async def test_a_repeated_mcp_name_header_must_agree_with_the_body_in_every_copy(
    gateway_factory: GatewayFactory,
) -> None:
    """MCP 2026-07-28 routing headers must agree with the judged body "so a server that routes by
    header cannot be sent somewhere else"; the gateway forwards repeated fields as they came, so every
    copy must agree, not only the first."""
    from multidict import CIMultiDict

    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        headers: CIMultiDict[str] = CIMultiDict({"x-tollgate-agent": "bot", "x-tollgate-run-id": "r1",
                                                 "content-type": "application/json", "accept": "application/json"})
        headers.add("Mcp-Method", "tools/call")
        headers.add("Mcp-Name", "read_file")
        headers.add("Mcp-Name", "admin_reset")
        async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(call("read_file", {"path": "a"})),
                                  headers=headers) as resp:
            answer = orjson.loads(await resp.read())
        assert resp.status == 400 and answer["error"]["code"] == -32020, (answer, srv.mcp_names)
        assert srv.calls == []


async def test_a_tools_call_answered_with_a_json_ish_content_type_is_judged_or_refused(
    gateway_factory: GatewayFactory,
) -> None:
    """The SDK takes `application/json-rpc` as JSON; the gateway relays it unjudged, so a `write`
    tool's delivered result is not recorded and the identical call runs again."""
    async with raw_server(content_type="application/json-rpc") as srv:
        h = await gateway(gateway_factory, srv.url, tools=RAW_TOOLS)
        status, first = await post(h, call("write_note", {"text": "hi"}))
        if status != 200 or "result" not in first:
            return  # failing closed is fine
        status, second = await post(h, call("write_note", {"text": "hi"}, rpc_id=8))
        assert srv.calls == [("write_note", {"text": "hi"})], "a delivered write was not recorded: it ran twice"
        assert second["result"] == first["result"]


# -- cancellation and stop signalling ---------------------------------------------------------------------


async def test_a_parked_call_the_client_cancelled_is_not_run_when_approved_later(gateway_factory: GatewayFactory) -> None:
    """The client cancels a parked call with `notifications/cancelled` (its HTTP request may stay
    open, as SDK clients keep reading the POST). A human approving afterwards must not make the
    cancelled call run: "nobody approves a call that can no longer run" (gateway/approvals.py)."""
    async with raw_server() as srv:
        tools = {"allow": ["files/read_file", "files/delete_*"], "approval": ["files/delete_*"], "approval_timeout_s": 5}
        h = await gateway(gateway_factory, srv.url, tools=tools)
        task = asyncio.create_task(post(h, call("delete_file", {"path": "a"}, rpc_id=41)))
        [item] = await pending(h)
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 41, "reason": "user"}}
        status, _, _ = await raw(h, "POST", cancel)
        assert status == 202
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        status, answer = await task
        assert srv.calls == [], f"a cancelled call ran after approval: {answer}"


async def test_a_rejected_mcp_call_says_why_in_header_body_and_run(gateway_factory: GatewayFactory) -> None:
    async with raw_server() as srv:
        h = await gateway(gateway_factory, srv.url, tools={**RAW_TOOLS, "on_violation": "reject"})
        status, headers, data = await raw(h, "POST", call("admin_reset", {"confirm": True}))
        answer = orjson.loads(data)
        assert status == 200 and answer["error"]["code"] == POLICY_REFUSED
        assert answer["error"]["data"] == {"code": "tool_not_allowed"} and answer["id"] == 7
        assert headers.get("x-tollgate-stop-reason") == "tool_not_allowed"
        status, headers, data = await raw(h, "POST", call("read_file", {"path": "a"}, rpc_id=8))
        assert orjson.loads(data)["error"]["data"] == {"code": "tool_not_allowed"}
        assert headers.get("x-tollgate-stop-reason") == "tool_not_allowed"
        run = await h.run("r1")
        assert (run["status"], run["stop_reason"]) == ("stopped", "tool_not_allowed")
        assert srv.calls == []
        # a reset run starts afresh
        assert (await admin(h, "POST", "/admin/runs/r1/reset"))[0] == 200
        status, answer = await post(h, call("read_file", {"path": "a"}, rpc_id=9))
        assert "result" in answer, answer
