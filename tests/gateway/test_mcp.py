"""The MCP proxy through a running gateway, with the official `mcp` SDK on both sides.

A real `MCPServer` (Streamable HTTP, loopback, its own thread) sits behind `/mcp/files`; the SDK's
client talks to the gateway, in the handshake era (`legacy`: sessions, SSE answers, GET stream,
DELETE) and in the 2026-07-28 era (`auto` probes `server/discover`; JSON answers, routing headers).
The server logs every message it receives, so each test states what reached it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import orjson
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from gateway import mcp_guards
from gateway.call import ToolCall
from gateway.outputs import CHECK_ON_LOOP_CHARS
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server

MODES = ["legacy", "auto"]
POLICY_REFUSED = -32003
TOOLS = {
    "allow": ["files/read_file", "files/write_note", "files/delete_*"],
    "approval": ["files/delete_*"],
    "tiers": {"files/write_*": "write", "files/delete_*": "dangerous"},
    "approval_timeout_s": 5,
}


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start(slow_s=0.3)
    yield server
    server.stop()


async def gateway(factory: GatewayFactory, files: mcp_server.RunningServer, **policy: Any) -> Harness:
    policy.setdefault("tools", TOOLS)
    extra = policy.pop("config", {})
    return await factory(mcp_servers={"files": {"url": files.url, "headers": {"x-server-token": "s3cret"}}},
                         agents={"bot": policy}, **extra)


@asynccontextmanager
async def mcp_client(h: Harness, *, mode: str = "legacy", run: str = "r1",
                     headers: dict[str, str] | None = None) -> AsyncIterator[Client]:
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run, **(headers or {})}
    async with (
        httpx2.AsyncClient(headers=hdrs, timeout=httpx2.Timeout(30, read=60)) as http,
        Client(streamable_http_client(f"{h.url}/mcp/files", http_client=http), mode=mode) as client,
    ):
        yield client


async def refused(coro: Any) -> dict[str, Any]:
    """The JSON-RPC error a refused call raised: {"code", "message", "data"}."""
    with pytest.raises(MCPError) as info:
        await coro
    return info.value.error.model_dump()


def text(result: Any) -> str:
    assert not result.is_error, result
    return str(result.content[0].text)


async def raw_post(h: Harness, body: bytes | dict[str, Any], *, server: str = "files", run: str = "r1",
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run, "content-type": "application/json",
            "accept": "application/json, text/event-stream", **(headers or {})}
    async with h.session.post(f"{h.url}/mcp/{server}", data=data, headers=hdrs) as resp:
        return resp.status, orjson.loads(await resp.read())


def call(name: str, arguments: Any, rpc_id: int = 7, **params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": name, "arguments": arguments, **params}}


MODERN = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "read_file"}
MODERN_META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientInfo":
               {"name": "test", "version": "0"}, "io.modelcontextprotocol/clientCapabilities": {}}


async def admin(h: Harness, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with h.session.request(method, f"{h.admin_url}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def pending(h: Harness, count: int = 1) -> list[dict[str, Any]]:
    for _ in range(500):
        _, data = await admin(h, "GET", "/admin/approvals?status=pending")
        if len(data["approvals"]) >= count:
            return data["approvals"]  # type: ignore[no-any-return]
        await asyncio.sleep(0.01)
    raise AssertionError("no pending approval appeared")


# -- allow-list ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_allowed_tools_work_denied_tools_are_invisible_and_never_reach_the_server(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, mode: str
) -> None:
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode=mode) as client:
        listed = await client.list_tools()
        assert sorted(t.name for t in listed.tools) == ["delete_file", "read_file", "write_note"]
        assert text(await client.call_tool("read_file", {"path": "a.txt"})) == "contents of a.txt"
        error = await refused(client.call_tool("admin_reset", {"confirm": True}))  # called by name anyway
        assert error["code"] == POLICY_REFUSED and error["data"] == {"code": "tool_not_allowed"}
        assert error["message"].startswith("tool_not_allowed: tool 'files/admin_reset'")
        # on_violation: reject stops the run; a stopped run refuses every later call with its reason
        error = await refused(client.call_tool("read_file", {"path": "b.txt"}))
        assert error["data"] == {"code": "tool_not_allowed"} and "run is stopped" in error["message"]
    assert files.seen.calls() == [("read_file", {"path": "a.txt"})]
    assert "tools/list" in files.seen.methods()
    run = await h.run("r1")
    assert run["status"] == "stopped" and run["stop_reason"] == "tool_not_allowed"
    assert [s["tool_calls"] for s in run["steps"]] == [["files/read_file"], ["files/admin_reset"],
                                                       ["files/read_file"]]
    # the agent's tollgate headers stay home, the server's configured headers are added
    for sent in files.seen.headers:
        assert sent["x-server-token"] == "s3cret"
        assert not any(k.startswith("x-tollgate-") for k in sent)


async def test_legacy_session_headers_get_stream_and_delete_are_relayed(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode="legacy") as client:
        assert text(await client.call_tool("read_file", {"path": "x"})) == "contents of x"
        for _ in range(200):  # the SDK opens its GET stream in the background
            if any(m == "GET" for m, _ in files.seen.requests):
                break
            await asyncio.sleep(0.01)
    methods = [m for m, _ in files.seen.requests]
    assert "GET" in methods and methods[-1] == "DELETE"
    session = files.seen.headers[-1].get("mcp-session-id")
    assert session and all(hd.get("mcp-session-id") == session for hd in files.seen.headers[1:])
    assert files.seen.headers[-1].get("mcp-protocol-version") == "2025-11-25"


async def test_drop_refuses_the_call_without_stopping_the_run(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, tools={**TOOLS, "on_violation": "drop"})
    async with mcp_client(h, mode="auto") as client:
        error = await refused(client.call_tool("admin_reset", {"confirm": True}))
        assert error["data"] == {"code": "tool_not_allowed"}
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
    assert files.seen.calls() == [("read_file", {"path": "a"})]
    assert (await h.run("r1"))["status"] == "active"


async def test_every_page_of_tools_list_is_filtered(gateway_factory: GatewayFactory) -> None:
    server = mcp_server.start(page_size=1)
    try:
        h = await gateway(gateway_factory, server, tools={"allow": ["files/read_file", "files/write_note"]})
        async with mcp_client(h, mode="legacy") as client:
            names: list[str] = []
            cursor: str | None = None
            pages = 0
            while True:
                page = await client.list_tools(cursor=cursor)
                pages += 1
                names += [t.name for t in page.tools]
                cursor = page.next_cursor
                if cursor is None:
                    break
        assert pages == 4 and names == ["read_file", "write_note"]  # denied pages arrive empty
    finally:
        server.stop()


async def test_unicode_look_alike_names_are_refused_and_named(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, tools={"allow": ["files/read_file"], "on_violation": "drop"})
    async with mcp_client(h, mode="auto") as client:
        for name in ("re\u0430d_file", "\u0440ead_file", "read_file\u200b", "Read_file", "read_file "):
            error = await refused(client.call_tool(name, {"path": "a"}))
            assert error["data"] == {"code": "tool_not_allowed"}
        error = await refused(client.call_tool("re\u0430d_file", {"path": "a"}))
        assert "U+0430 CYRILLIC SMALL LETTER A at index 8" in error["message"]
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
    assert files.seen.calls() == [("read_file", {"path": "a"})]


# -- bad input -------------------------------------------------------------------------------------------


async def test_bad_input_gets_clear_json_rpc_errors_and_nothing_is_forwarded(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, config={"limits": {"max_body_bytes": 4096}})
    cases: list[tuple[bytes | dict[str, Any], int, int, str]] = [
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", ', 400, -32700, "not valid JSON"),
        (orjson.dumps([call("read_file", {"path": "a"})]), 400, -32600, "batch requests"),
        ({"id": 1, "method": "tools/call", "params": {"name": "read_file"}}, 400, -32600, '"jsonrpc" must be "2.0"'),
        ({"jsonrpc": "2.0", "id": True, "method": "ping"}, 400, -32600, '"id" must be'),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": []}, 400, -32600, '"params" must be'),
        ({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "read_file"}}, 400, -32600,
         "not a notification"),
        ({"jsonrpc": "2.0", "id": 1}, 400, -32600, "exactly one of"),
        (call("read_file", "path=a"), 200, -32602, '"arguments" must be an object'),
        ({**call("read_file", {}), "params": {"arguments": {}}}, 400, -32600, '"params.name"'),
        (orjson.dumps(call("read_file", {"path": "a" * 5000})), 413, -32600, "exceeds the limit"),
    ]
    for body, status, code, words in cases:
        got, answer = await raw_post(h, body)
        assert (got, answer["error"]["code"]) == (status, code), answer
        assert words in answer["error"]["message"]
    got, answer = await raw_post(h, call("read_file", {"path": "a"}), server="nope")
    assert got == 404 and answer["error"]["data"] == {"code": "mcp_server_not_found"}
    # routing headers (MCP 2026-07-28) must agree with the body that was judged
    got, answer = await raw_post(h, call("read_file", {"path": "a"}), headers={"Mcp-Name": "delete_file"})
    assert got == 400 and answer["error"]["code"] == -32020
    assert files.seen.requests == []
    assert (await admin(h, "GET", "/admin/runs/r1"))[0] == 404  # refused input touches no run state


async def test_arguments_are_checked_against_the_listed_input_schema(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode="auto") as client:
        await client.list_tools()
        for bad in ({"path": 5}, {}):
            error = await refused(client.call_tool("read_file", bad))
            assert error["code"] == -32602 and error["data"] == {"code": "invalid_arguments"}
        assert text(await client.call_tool("read_file", {"path": "ok"})) == "contents of ok"
    assert files.seen.calls() == [("read_file", {"path": "ok"})]


async def test_long_arguments_are_checked_in_a_worker_thread(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check within its keyword budget may take seconds for a megabyte: as for an answer, the loop
    does not wait for it."""
    threads: list[int] = []
    validate = mcp_guards.validate_tool_arguments

    def recorded(schema: Any, arguments: Any) -> Any:
        threads.append(threading.get_ident())
        return validate(schema, arguments)

    monkeypatch.setattr(mcp_guards, "validate_tool_arguments", recorded)
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode="auto") as client:
        await client.list_tools()
        assert text(await client.call_tool("read_file", {"path": "ok"})) == "contents of ok"
        long = "p" * (CHECK_ON_LOOP_CHARS + 1)
        assert text(await client.call_tool("read_file", {"path": long})) == f"contents of {long}"
    assert threads[0] == threading.get_ident() != threads[1]


async def test_duplicate_keys_cannot_smuggle_a_different_tool(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, tools={"allow": ["files/read_file"], "on_violation": "drop"})
    body = (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"read_file",'
            b'"arguments":{"path":"a"},"name":"admin_reset"}}')
    status, answer = await raw_post(h, body)
    assert status == 200 and answer["error"]["data"] == {"code": "tool_not_allowed"}  # judged: the last key
    body = (b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"admin_reset",'
            b'"arguments":{"path":"a"},"name":"read_file"}}')
    await raw_post(h, body)
    assert files.seen.calls() == [("read_file", {"path": "a"})]  # the server parsed what was judged


# -- approval --------------------------------------------------------------------------------------------


async def test_approval_approve_deny_and_timeout(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, tools={**TOOLS, "approval_timeout_s": 0.5})
    async with mcp_client(h, mode="legacy") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        [item] = await pending(h)
        assert {k: item[k] for k in ("run_id", "agent", "tool", "arguments", "status")} == {
            "run_id": "r1", "agent": "bot", "tool": "files/delete_file", "arguments": {"path": "a"},
            "status": "pending"}
        assert files.seen.calls() == []  # parked: the server has not seen it
        status, decided = await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        assert status == 200 and decided["status"] == "approved" and decided["decided_by"] == "alice"
        assert text(await task) == "deleted a"

        task = asyncio.create_task(client.call_tool("delete_file", {"path": "b"}))
        [item] = await pending(h)
        await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "deny", "by": "bob"})
        error = await refused(task)
        assert error["code"] == POLICY_REFUSED and error["data"] == {"code": "approval_denied"}
        assert "denied by bob" in error["message"]
        status, again = await admin(h, "POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "eve"})
        assert status == 400 and again["error"]["code"] == "already_decided"

        error = await refused(client.call_tool("delete_file", {"path": "c"}))  # nobody decides
        assert error["data"] == {"code": "approval_timeout"}
    assert files.seen.calls() == [("delete_file", {"path": "a"})]
    _, listed = await admin(h, "GET", "/admin/approvals")
    assert [(a["arguments"]["path"], a["status"], a["decided_by"]) for a in listed["approvals"]] == [
        ("a", "approved", "alice"), ("b", "denied", "bob"), ("c", "timed_out", "tollgate (timeout)")]
    assert (await h.run("r1"))["status"] == "active"  # a denial refuses one call, it does not stop the run


async def test_admin_approval_endpoint_rejects_bad_requests(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files)
    assert await admin(h, "GET", "/admin/approvals") == (200, {"approvals": []})
    status, body = await admin(h, "POST", "/admin/approvals/nope", {"decision": "approve", "by": "a"})
    assert status == 404 and body["error"]["code"] == "not_found"
    for bad in ({"decision": "maybe", "by": "a"}, {"decision": "approve"}, {"decision": "deny", "by": " "}, [1]):
        status, body = await admin(h, "POST", "/admin/approvals/nope", bad)
        assert status == 400 and body["error"]["code"] == "invalid_request"


# -- idempotency -----------------------------------------------------------------------------------------


async def test_a_repeated_write_reaches_the_server_once_and_both_callers_get_its_result(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode="legacy") as one, mcp_client(h, mode="auto") as two:
        first, second = await asyncio.gather(one.call_tool("write_note", {"text": "hi"}),
                                             two.call_tool("write_note", {"text": "hi"}))
        assert text(first) == text(second) == "note 1 saved: hi"
        assert text(await two.call_tool("write_note", {"text": "hi"})) == "note 1 saved: hi"  # later repeat
        # an explicit idempotency key makes a call distinct, and is itself idempotent
        key: Any = {"tollgate/idempotency_key": "second-hi"}
        assert text(await one.call_tool("write_note", {"text": "hi"}, meta=key)) == "note 2 saved: hi"
        assert text(await two.call_tool("write_note", {"text": "hi"}, meta=key)) == "note 2 saved: hi"
    assert files.notes == ["hi", "hi"]
    # a reset run starts afresh: nothing recorded
    await admin(h, "POST", "/admin/runs/r1/reset")
    async with mcp_client(h, mode="auto") as client:
        assert text(await client.call_tool("write_note", {"text": "hi"})) == "note 3 saved: hi"
    # other runs never share results
    async with mcp_client(h, mode="auto", run="r2") as client:
        assert text(await client.call_tool("write_note", {"text": "hi"})) == "note 4 saved: hi"
    assert len(files.seen.calls()) == 4


async def test_read_tools_are_not_deduplicated(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode="auto") as client:
        for _ in range(2):
            assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
    assert len(files.seen.calls()) == 2


# -- guards ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_tool_calls_count_toward_the_cap_before_they_run(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, mode: str
) -> None:
    h = await gateway(gateway_factory, files, caps={"tool_calls": 2})
    async with mcp_client(h, mode=mode) as client:
        for path in ("a", "b"):
            await client.call_tool("read_file", {"path": path})
        error = await refused(client.call_tool("read_file", {"path": "c"}))
        assert error["data"] == {"code": "tool_call_cap"}
    assert [args["path"] for _, args in files.seen.calls()] == ["a", "b"]  # the third never ran
    run = await h.run("r1")
    assert (run["status"], run["stop_reason"], run["tool_calls"]) == ("stopped", "tool_call_cap", 2)


async def test_a_call_executing_a_proposed_tool_call_does_not_count_again(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, caps={"tool_calls": 1})
    store = h.gateway.store
    # what the LLM path records when a model's answer proposes read_file(path=a): counted, pending
    await store.add("r1", "bot", "tool_calls", 1.0, limit=1.0, code="tool_call_cap", now=0.0)
    await store.push("r1", "bot", "pending_calls", (ToolCall("c1", "read_file", '{"path": "a"}').fingerprint,), 100)
    async with mcp_client(h, mode="auto") as client:
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
        error = await refused(client.call_tool("read_file", {"path": "b"}))  # no proposal: counts, over the cap
        assert error["data"] == {"code": "tool_call_cap"}
    assert (await h.run("r1"))["tool_calls"] == 1


@pytest.mark.parametrize("mode", MODES)
async def test_a_looping_call_is_stopped_before_it_reaches_the_server(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, mode: str
) -> None:
    h = await gateway(gateway_factory, files, loop={"window": 3, "max_distinct": 1})
    async with mcp_client(h, mode=mode) as client:
        for _ in range(2):
            await client.call_tool("read_file", {"path": "same"})
        error = await refused(client.call_tool("read_file", {"path": "same"}))
        assert error["data"] == {"code": "loop_detected"}
    assert len(files.seen.calls()) == 2
    assert (await h.run("r1"))["stop_reason"] == "loop_detected"


@pytest.mark.parametrize("mode", MODES)
async def test_results_feed_the_no_progress_guard(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, mode: str
) -> None:
    h = await gateway(gateway_factory, files, loop={"window": 10, "max_distinct": 1, "stall_steps": 2})
    async with mcp_client(h, mode=mode) as client:
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"  # new result
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"  # stalled once
        error = await refused(client.call_tool("read_file", {"path": "a"}))  # twice: the result is withheld
        assert error["data"] == {"code": "no_progress"}
    assert len(files.seen.calls()) == 3
    assert (await h.run("r1"))["stop_reason"] == "no_progress"


async def test_agent_keys_identify_mcp_calls_and_never_reach_the_server(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, keys=["tg-bot-key"])
    async with mcp_client(h, mode="auto", headers={"authorization": "Bearer tg-bot-key"}) as client:
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
    assert all("authorization" not in sent for sent in files.seen.headers)
    status, answer = await raw_post(h, call("read_file", {"path": "a"}), headers={"authorization": "Bearer bad"})
    assert status == 401 and answer["error"]["data"] == {"code": "invalid_api_key"}
    assert len(files.seen.calls()) == 1


async def test_an_oversized_server_answer_is_refused_not_relayed(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await gateway(gateway_factory, files, tools={"allow": None}, config={"limits": {"max_body_bytes": 700}})
    async with mcp_client(h, mode="auto") as client:
        error = await refused(client.list_tools())  # the full tool list (about 1 KB) is over the limit
        assert error["data"] == {"code": "upstream_unavailable"} and "exceeds the limit" in error["message"]
    status, answer = await raw_post(h, call("read_file", {"path": "a"}, _meta=MODERN_META), headers=MODERN)
    assert status == 200 and answer["result"]["content"][0]["text"] == "contents of a", answer


@pytest.mark.parametrize("proposed", ["read_file", "files/read_file", "mcp_files__read_file"])
async def test_a_proposal_from_a_real_model_answer_is_executed_without_counting_twice(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer, proposed: str,
) -> None:
    """By whichever name the model saw the tool: its own, `server/tool`, or the Agents SDK's with
    `include_server_in_tool_names` (`mcp_files__read_file`, which counted twice: a cap halved)."""
    from tests.fakes.upstream import Reply, openai_completion, tool_call

    tools = {**TOOLS, "allow": [*TOOLS["allow"], proposed]}
    h = await gateway(gateway_factory, files, caps={"tool_calls": 1}, tools=tools)
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call(proposed, '{"path": "a"}', "c1")])))
    async with h.session.post(f"{h.url}/v1/chat/completions",
                              json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "read a"}]},
                              headers={"x-tollgate-agent": "bot", "x-tollgate-run-id": "r1"}) as resp:
        assert resp.status == 200
    assert (await h.run("r1"))["tool_calls"] == 1
    async with mcp_client(h, mode="auto") as client:
        assert text(await client.call_tool("read_file", {"path": "a"})) == "contents of a"
        error = await refused(client.call_tool("read_file", {"path": "b"}))
        assert error["data"] == {"code": "tool_call_cap"}
    assert (await h.run("r1"))["tool_calls"] == 1


async def test_mcp_calls_are_ledger_rows(gateway_factory: GatewayFactory, files: mcp_server.RunningServer) -> None:
    h = await gateway(gateway_factory, files)
    async with mcp_client(h, mode="auto") as client:
        await client.call_tool("read_file", {"path": "a"})
        await refused(client.call_tool("secret_tool", {}))
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = [r for r in ledger.rows("r1") if r["operation"].startswith("tools/call")]
    assert [(r["operation"], r["decision"], r["reason"]) for r in rows] == [
        ("tools/call read_file", "executed", None),
        ("tools/call secret_tool", "rejected", "tool_not_allowed"),
    ]
