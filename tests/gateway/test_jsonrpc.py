"""JSON-RPC framing for the MCP proxy (pure), the approval queue and the result cache."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import orjson
import pytest

from gateway.approvals import AlreadyDecided, ApprovalQueue, UnknownApproval
from gateway.errors import (
    ApprovalTimeout,
    RequestTimeout,
    RequestTooLarge,
    ToolNotAllowed,
    UndecodableBody,
    UpstreamTimeout,
)
from gateway.idempotency import ResultCache
from gateway.jsonrpc import (
    BadArguments,
    BadMessage,
    check_routing_headers,
    decode_header_value,
    filter_tools,
    gateway_error,
    is_task_handle,
    parse_message,
    replace_event_data,
    replayed,
    result_content,
    untasked,
    without_resumption,
)


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        (b"{", -32700, "not valid JSON"),
        (b"[]", -32600, "batch"),
        (b'"x"', -32600, "one JSON-RPC message object"),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', -32600, '"jsonrpc" must be "2.0"'),
        (b'{"jsonrpc": "2.0", "id": null, "method": "ping"}', -32600, '"id" must be'),
        (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', -32600, '"id" must be'),
        (b'{"jsonrpc": "2.0", "id": 18446744073709551616, "method": "ping"}', -32600, "fit in 64 bits"),
        (b'{"jsonrpc": "2.0", "id": -9223372036854775809, "method": "ping"}', -32600, "fit in 64 bits"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": ""}', -32600, '"method" must be'),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "x", "params": 3}', -32600, '"params" must be'),
        (b'{"jsonrpc": "2.0", "id": 1, "result": {}, "error": {}}', -32600, "exactly one"),
        (b'{"jsonrpc": "2.0", "result": {}}', -32600, "exactly one"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "x", "params": {"a": [[[[1]]]]}}', -32600, "nests deeper"),
    ],
)
def test_malformed_messages_are_refused(raw: bytes, code: int, words: str) -> None:
    with pytest.raises(BadMessage) as info:
        parse_message(raw, max_depth=4)
    assert info.value.rpc_code == code and words in info.value.message


def test_well_formed_messages_parse() -> None:
    request = parse_message(b'{"jsonrpc": "2.0", "id": "a", "method": "tools/list"}', 64)
    assert (request.method, request.id, request.params, request.is_request) == ("tools/list", "a", {}, True)
    note = parse_message(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}', 64)
    assert note.id is None and not note.is_request
    answer = parse_message(b'{"jsonrpc": "2.0", "id": 3, "result": {}}', 64)
    assert answer.method is None and answer.id == 3


def test_routing_headers_must_match_the_body() -> None:
    message = parse_message(orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                          "params": {"name": "re\u0430d"}}), 64)
    encoded = "=?base64?" + base64.b64encode("re\u0430d".encode()).decode() + "?="
    assert decode_header_value(encoded) == "re\u0430d" and decode_header_value("=?base64?!!?=") == "=?base64?!!?="
    check_routing_headers(message, ["tools/call"], [encoded])
    check_routing_headers(message, [], [])
    check_routing_headers(message, ["tools/call", "tools/call"], [encoded, "re\u0430d"])
    for methods, names in ((["tools/list"], []), ([], ["read"]), ([], ["=?base64?cmVhZA==?="]),
                           (["tools/call", "tools/list"], []), ([], [encoded, "admin_reset"])):
        with pytest.raises(BadMessage) as info:
            check_routing_headers(message, methods, names)  # every copy must agree
        assert info.value.rpc_code == -32020


def test_errors_map_to_json_rpc_codes_and_statuses() -> None:
    status, body = gateway_error(7, ToolNotAllowed("tool 'x' is not allowed"))
    assert status == 200 and body == {"jsonrpc": "2.0", "id": 7, "error": {
        "code": -32003, "message": "tool_not_allowed: tool 'x' is not allowed", "data": {"code": "tool_not_allowed"}}}
    assert gateway_error(1, ApprovalTimeout("late"))[1]["error"]["data"] == {"code": "approval_timeout"}
    assert gateway_error(1, BadArguments("bad"))[0:1] == (200,)
    assert gateway_error(1, BadArguments("bad"))[1]["error"]["code"] == -32602
    assert gateway_error(None, RequestTooLarge("big"))[0] == 413
    status, body = gateway_error(None, UpstreamTimeout("slow"))
    assert status == 504 and body["error"]["data"] == {"code": "upstream_timeout"}
    status, body = gateway_error(None, RequestTimeout("stalled"))  # the client's request, not the upstream
    assert status == 408 and body["error"]["code"] == -32600
    assert body["error"]["data"] == {"code": "request_timeout"}
    assert gateway_error(None, UndecodableBody("gzip"))[1]["error"]["code"] == -32600


def tools_page(*names: Any, **extra: Any) -> dict[str, Any]:
    tools = [{"name": n, "inputSchema": {"type": "object"}} if isinstance(n, str) else n for n in names]
    return {"jsonrpc": "2.0", "id": 1, "result": {"tools": tools, **extra}}


def test_filter_tools_keeps_allowed_tools_pagination_and_fails_closed() -> None:
    seen: list[str] = []
    page = tools_page("read", "delete", {"title": "no name"}, {"name": 5}, nextCursor="2")
    out = filter_tools(page, lambda n: n != "delete", lambda n, s: seen.append(n), private=True)
    assert out is not None and [t["name"] for t in out["result"]["tools"]] == ["read"]
    assert out["result"]["nextCursor"] == "2" and seen == ["read"]
    assert filter_tools(tools_page("read"), lambda n: True, lambda n, s: None, private=True) is None
    shared = filter_tools(tools_page("read", cacheScope="public"), lambda n: True, lambda n, s: None, private=True)
    assert shared is not None and shared["result"]["cacheScope"] == "private"
    assert filter_tools(tools_page("read", cacheScope="public"), lambda n: True, lambda n, s: None,
                        private=False) is None
    assert filter_tools({"jsonrpc": "2.0", "id": 1, "error": {}}, lambda n: False, lambda n, s: None,
                        private=True) is None


def test_results_replay_in_the_requesters_protocol_era() -> None:
    legacy = {"jsonrpc": "2.0", "id": 1, "result": {"content": [], "isError": False}}
    modern = orjson.loads(replayed(legacy, "x", "2026-07-28"))
    assert modern == {"jsonrpc": "2.0", "id": "x", "result": {"resultType": "complete", "content": [],
                                                              "isError": False}}
    assert orjson.loads(replayed(modern, 2, "2025-11-25"))["result"] == {"content": [], "isError": False}
    assert orjson.loads(replayed({"jsonrpc": "2.0", "id": 1, "error": {"code": 1}}, 9, None))["id"] == 9


def test_result_content_ignores_server_stamps() -> None:
    a = {"content": [{"type": "text", "text": "x"}], "_meta": {"at": 1}, "resultType": "complete"}
    b = {"content": [{"type": "text", "text": "x"}], "_meta": {"at": 2}}
    assert result_content(a) == result_content(b) and result_content({"isError": True})[1] is True


def test_replace_event_data_keeps_the_other_fields() -> None:
    raw = b"event: message\r\nid: 42\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n"
    assert replace_event_data(raw, b'{"b":2}') == b'event: message\nid: 42\ndata: {"b":2}\n\n'


def test_integers_beyond_64_bits_are_read_exactly() -> None:
    message = parse_message(b'{"jsonrpc": "2.0", "id": 18446744073709551615, "method": "tools/call", "params": '
                            b'{"arguments": {"n": 1180591620717411303425, "s": "12345678901234567890123"}}}', 8)
    assert message.id == 2**64 - 1
    assert message.params["arguments"] == {"n": 2**70 + 1, "s": "12345678901234567890123"}


@pytest.mark.parametrize(
    ("raw", "out"),
    [
        (b"id: 5\nretry: 10\ndata: \n\n", b"data: \n\n"),  # a priming event: nothing left to resume with
        (b"event: message\r\nid: 7\r\ndata: {}\r\n\r\n", b"event: message\r\ndata: {}\r\n\r\n"),
        (b"id\ndata: a\n\n", b"data: a\n\n"),  # a field without a colon is a field all the same
        (b"identity: 3\ndata: {\"id\": 1}\n\n", b"identity: 3\ndata: {\"id\": 1}\n\n"),  # not the id field
    ],
)
def test_without_resumption_drops_the_id_and_retry_fields(raw: bytes, out: bytes) -> None:
    assert without_resumption(raw) == out


async def test_approval_queue_decides_once_times_out_and_denies_on_cancel() -> None:
    queue = ApprovalQueue(keep=2)
    item = queue.request("r", "bot", "files/rm", {"path": "a"})
    waiter = asyncio.create_task(queue.wait(item, 5))
    await asyncio.sleep(0)
    assert queue.decide(item.id, "approve", "alice").status == "approved"
    assert (await waiter).decided_by == "alice"
    with pytest.raises(AlreadyDecided):
        queue.decide(item.id, "deny", "bob")
    with pytest.raises(UnknownApproval):
        queue.decide("nope", "deny", "bob")
    with pytest.raises(ValueError, match="approve"):
        queue.decide(item.id, "maybe", "bob")
    late = queue.request("r", "bot", "files/rm", {})
    assert (await queue.wait(late, 0.01)).status == "timed_out"
    gone = queue.request("r", "bot", "files/rm", {})
    task = asyncio.create_task(queue.wait(gone, 5))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone.status == "denied" and gone.decided_by == "tollgate (caller went away)"
    pending = queue.request("r", "bot", "files/rm", {})
    assert [a.id for a in queue.list()] == [gone.id, pending.id]  # decided records make room first
    assert queue.list("pending") == [pending]


async def test_result_cache_shares_one_execution_and_bounds_memory() -> None:
    cache = ResultCache(max_entries=2, max_bytes=200)
    leader, future = cache.begin(("r", 1, "k"))
    again, same = cache.begin(("r", 1, "k"))
    assert leader and not again and same is future
    cache.finish(("r", 1, "k"), {"result": 1}, record=True)
    assert await future == {"result": 1} and cache.recorded(("r", 1, "k")) == {"result": 1}
    assert cache.recorded(("r", 2, "k")) is None  # another epoch (a reset run) shares nothing
    cache.finish(("r", 1, "a"), {"result": 2}, record=True)
    cache.finish(("r", 1, "b"), {"result": 3}, record=True)
    assert cache.recorded(("r", 1, "k")) is None  # least recently used went first
    cache.finish(("r", 1, "huge"), {"result": "x" * 500}, record=True)
    assert cache.recorded(("r", 1, "huge")) is None and cache.recorded(("r", 1, "b")) == {"result": 3}
    leader, failed = cache.begin(("r", 1, "f"))
    cache.finish(("r", 1, "f"), {"error": {}}, record=False)
    assert await failed == {"error": {}} and cache.recorded(("r", 1, "f")) is None


def test_untasked_refuses_a_task_and_drops_the_tasks_extension() -> None:
    caps = "io.modelcontextprotocol/clientCapabilities"
    plain = parse_message(b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t"}}', 8)
    assert untasked(plain) is plain
    with pytest.raises(BadMessage):
        untasked(parse_message(b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","task":{}}}', 8))
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "_meta": {
        "k": 1, caps: {"roots": {}, "extensions": {"io.modelcontextprotocol/tasks": {}, "x/y": {}}}}}}
    kept = untasked(parse_message(orjson.dumps(body), 8))
    assert kept.params["_meta"] == {"k": 1, caps: {"roots": {}, "extensions": {"x/y": {}}}}
    assert kept.body["params"] is kept.params and kept.params["name"] == "t"


@pytest.mark.parametrize(
    ("result", "task"),
    [({"resultType": "task", "taskId": "t"}, True), ({"task": {"taskId": "t"}}, True),
     ({"content": []}, False), ({"resultType": "input_required"}, False), ({"task": "words"}, False)],
)
def test_is_task_handle(result: dict[str, Any], task: bool) -> None:
    assert is_task_handle(result) is task
