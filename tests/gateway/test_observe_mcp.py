"""`gateway.observe_mcp`: what an MCP server's answer tells the span of a `tools/call` and of every
relayed message."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway.call import ToolResult
from gateway.jsonrpc import Message
from gateway.observe_mcp import _answer
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.gateway.test_mcp import MODERN, MODERN_META, mcp_client, raw_post
from tests.gateway.test_telemetry_probe import families, flushed, otel_env, samples, sink  # noqa: F401
from tests.otel.otlp_sink import OtlpSink, WireSpan

ERROR = 2  # OTLP Status.ERROR

CALL = Message({"jsonrpc": "2.0", "id": 7, "method": "tools/call"}, "tools/call", 7, {})


@pytest.mark.parametrize(("outcome", "code", "description"), [
    # semconv (mcp.md): the status description is JSONRPCError.message; it was the code
    ({"error": {"code": -32602, "message": "Invalid params: path is required"}}, "-32602",
     "Invalid params: path is required"),
    ({"error": {"code": -32000, "message": "x" * 1000}}, "-32000", "x" * 256),  # bounded
    ({"error": {"code": "bad", "message": ""}}, "_OTHER", None),
    ({"error": {"code": -32601}}, "-32601", None),
    (None, None, None),
    ({"result": "odd"}, None, None),
])
def test_a_json_rpc_error_gives_its_code_and_message(outcome: dict[str, Any] | None, code: str | None,
                                                     description: str | None) -> None:
    assert _answer(outcome, CALL) == (None, code, description)


def test_a_result_is_the_tool_s_answer() -> None:
    answer, code, description = _answer({"result": {"content": [{"type": "text", "text": "hi"}], "isError": True}},
                                        CALL)
    assert (code, description) == (None, None)
    assert answer is not None and answer.is_error
    assert answer.tool_result == ToolResult("7", '[{"type":"text","text":"hi"}]', True)


# -- relayed messages through a running gateway (real `mcp` SDK client and server) ----------------------


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start()
    yield server
    server.stop()


async def traced_gateway(factory: GatewayFactory, files: mcp_server.RunningServer) -> Harness:
    return await factory(mcp_servers={"files": {"url": files.url}},
                         agents={"bot": {"tools": {"allow": ["files/read_file"]}}})


def attr(span: WireSpan, key: str) -> Any:
    return span.attributes.get(key, ("", None))[1]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_every_relayed_method_has_its_mcp_client_span(
    gateway_factory: GatewayFactory, sink: OtlpSink, files: mcp_server.RunningServer, mode: str
) -> None:
    """semconv.md 1.8: an MCP CLIENT span `{mcp.method.name} {target}` for every request and
    notification, not only `tools/call`; the forwarded message carries the span's trace context in
    `params._meta`; all of a run's spans share its trace."""
    h = await traced_gateway(gateway_factory, files)
    async with mcp_client(h, mode=mode, run=f"relay-{mode}") as client:
        listed = await client.list_tools()
        await client.call_tool("read_file", {"path": "a"})
    spans = await flushed(h, sink)
    assert [t.name for t in listed.tools] == ["read_file"]
    names = [s.name for s in spans if s.name != "invoke_agent bot"]
    assert "tools/list" in names and "tools/call read_file" in names, names
    if mode == "legacy":
        assert {"initialize", "notifications/initialized"} <= set(names), names
    by_name = {s.name: s for s in spans}
    listing = by_name["tools/list"]
    assert (listing.kind, attr(listing, "mcp.method.name"), attr(listing, "error.type")) == (3, "tools/list", None)
    assert attr(listing, "server.address") == "127.0.0.1" and attr(listing, "jsonrpc.request.id") is not None
    assert len({s.trace_id for s in spans}) == 1, [(s.name, s.trace_id) for s in spans]
    [forwarded] = [m for _, m in files.seen.requests if m is not None and m.get("method") == "tools/list"]
    assert forwarded["params"]["_meta"]["traceparent"].startswith(f"00-{listing.trace_id}-{listing.span_id}-")
    fams = await families(h)
    methods = {s.labels["mcp_method_name"] for s in samples(fams, "mcp_client_operation_duration_seconds", "_count")}
    assert {"tools/list", "tools/call"} <= methods, methods


@pytest.mark.parametrize("json_response", [False, True])
async def test_a_json_rpc_error_to_a_relayed_request_is_the_span_s_error(
    gateway_factory: GatewayFactory, sink: OtlpSink, json_response: bool
) -> None:
    """semconv.md 1.8: on a JSON-RPC error response `error.type` and `rpc.response.status_code` are its
    code, the status ERROR with its message; `prompts/get` names its span by the prompt. Read from an
    SSE answer and from a JSON one (relayed as it streams)."""
    files = mcp_server.start(json_response=json_response)
    try:
        h = await traced_gateway(gateway_factory, files)
        await _prompt_error(h, sink)
    finally:
        files.stop()


async def _prompt_error(h: Harness, sink: OtlpSink) -> None:
    body = {"jsonrpc": "2.0", "id": 4, "method": "prompts/get", "params": {"name": "nope", "_meta": MODERN_META}}
    headers = {**MODERN, "mcp-method": "prompts/get", "mcp-name": "nope"}
    status, answer = await raw_post(h, body, run="relay-err", headers=headers)
    [span] = [s for s in await flushed(h, sink) if s.name == "prompts/get nope"]
    code = str(answer["error"]["code"])
    assert (status, attr(span, "error.type"), attr(span, "rpc.response.status_code")) == (200, code, code), answer
    assert attr(span, "gen_ai.prompt.name") == "nope" and span.status_code == ERROR
    durations = samples(await families(h), "mcp_client_operation_duration_seconds", "_count")
    assert [s.labels["error_type"] for s in durations if s.labels["mcp_method_name"] == "prompts/get"] == [code]


async def test_a_notification_and_a_server_failure_are_spans_too(
    gateway_factory: GatewayFactory, sink: OtlpSink, files: mcp_server.RunningServer
) -> None:
    """A notification has a span without `jsonrpc.request.id`; a server that cannot be reached makes
    the relayed request's span an error with tollgate's code, as its answer says."""
    h = await traced_gateway(gateway_factory, files)
    note = {"jsonrpc": "2.0", "method": "notifications/roots/list_changed", "params": {"_meta": MODERN_META}}
    headers = {**MODERN, "mcp-method": "notifications/roots/list_changed"}
    headers.pop("mcp-name")
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(note), headers={
            "x-tollgate-agent": "bot", "x-tollgate-run-id": "relay-note", "content-type": "application/json",
            "accept": "application/json, text/event-stream", **headers}) as resp:
        assert resp.status < 300, await resp.text()
    files.stop()
    ping = {"jsonrpc": "2.0", "id": 9, "method": "ping", "params": {"_meta": MODERN_META}}
    status, answer = await raw_post(h, ping, run="relay-note", headers={**MODERN, "mcp-method": "ping"} | {
        "mcp-name": ""})
    spans = {s.name: s for s in await flushed(h, sink)}
    assert attr(spans["notifications/roots/list_changed"], "jsonrpc.request.id") is None
    assert spans["notifications/roots/list_changed"].status_code != ERROR
    assert status >= 500 and attr(spans["ping"], "error.type") == answer["error"]["data"]["code"], answer


HEADERS = {"x-tollgate-agent": "bot", "content-type": "application/json",
           "accept": "application/json, text/event-stream"}


async def test_a_client_response_reaches_the_server_as_sent_without_a_span(
    gateway_factory: GatewayFactory, sink: OtlpSink, files: mcp_server.RunningServer
) -> None:
    """The client's answer to a server's request (sampling, elicitation, roots, ping) is no operation of
    the client: no span, no sample, and no trace context added (JSON-RPC responses have no `params`;
    strict servers, the TypeScript SDK's among them, refuse one that has)."""
    h = await traced_gateway(gateway_factory, files)
    sent = {"jsonrpc": "2.0", "id": "srv-1", "result": {"roots": []}}
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(sent),
                              headers={**HEADERS, "x-tollgate-run-id": "answers"}) as resp:
        await resp.read()
    [received] = [m for _, m in files.seen.requests if m is not None and m.get("id") == "srv-1"]
    assert received == sent
    assert [s.name for s in await flushed(h, sink)] == []
    assert samples(await families(h), "mcp_client_operation_duration_seconds", "_count") == []


async def test_resource_methods_name_their_resource(
    gateway_factory: GatewayFactory, sink: OtlpSink, files: mcp_server.RunningServer
) -> None:
    """semconv mcp.md: `mcp.resource.uri` is conditionally required on resources/read, /subscribe and
    /unsubscribe."""
    h = await traced_gateway(gateway_factory, files)
    for i, method in enumerate(("resources/read", "resources/subscribe", "resources/unsubscribe")):
        body = {"jsonrpc": "2.0", "id": i, "method": method, "params": {"uri": "file:///a.txt"}}
        async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body),
                                  headers={**HEADERS, "x-tollgate-run-id": "res"}) as resp:
            await resp.read()
    uris = {s.name: attr(s, "mcp.resource.uri") for s in await flushed(h, sink) if s.name.startswith("resources/")}
    assert uris == dict.fromkeys(("resources/read", "resources/subscribe", "resources/unsubscribe"),
                                 "file:///a.txt")
