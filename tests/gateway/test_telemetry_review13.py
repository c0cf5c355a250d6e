"""Review 13 of today's telemetry (f563191..HEAD): each test fails on a real defect.

Spans are asserted on what the OTLP/HTTP sink decoded (tests/otel/otlp_sink.py), metrics on the admin
`/metrics`, decisions on the ledger and the admin run view.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, anthropic_stream, sse_response
from tests.gateway.test_mcp_calls import tool_rows
from tests.gateway.test_mcp_probe import call
from tests.gateway.test_mcp_resume_review import nested, safe_raw, scripted
from tests.gateway.test_mcp_transport import POLICY, PollingServer, events
from tests.gateway.test_telemetry_probe import families, flushed, otel_env, post, samples, sink  # noqa: F401
from tests.otel.otlp_sink import OtlpSink, WireSpan

ERROR = 2  # OTLP Status.ERROR
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
MSG = [{"role": "user", "content": "2+2?"}]


async def mcp_gateway(factory: GatewayFactory, url: str) -> Harness:
    return await factory(mcp_servers={"files": {"url": url}}, agents={"bot": POLICY})


async def tool_spans(h: Harness, sink: OtlpSink) -> list[WireSpan]:
    return [s for s in await flushed(h, sink) if s.name == "tools/call read_file"]


# -- 2. an MCP call answered with a server 5xx ---------------------------------------------------------


async def bad_gateway(request: web.Request) -> web.Response:
    return web.Response(status=502, text="bad gateway")


async def test_a_5xx_tool_call_is_a_span_error_as_its_ledger_row_says(
    gateway_factory: GatewayFactory, sink: OtlpSink
) -> None:
    """semconv.md 1.8: `error.type` "iff the operation fails", status ERROR when it is present; section 8:
    "Upstream error: Span status ERROR. `error.type` = HTTP status code string". 8829d21 made the ledger
    row of a 5xx `error` (and `tollgate_tool_calls_total{decision="error"}`), but the span is left UNSET
    with no `error.type`, and `mcp.client.operation.duration` is recorded as a success (error_type "")."""
    async with scripted(bad_gateway) as url:
        h = await mcp_gateway(gateway_factory, url)
        status, _ = await safe_raw(h, call("read_file", {"path": "a"}))
        rows = await tool_rows(h)
        [span] = await tool_spans(h, sink)
        fams = await families(h)
    assert status == 502
    assert [r["decision"] for r in rows] == ["error"]  # holds
    durations = [s.labels for s in samples(fams, "mcp_client_operation_duration_seconds", "_count")]
    assert (span.status_code, span.attributes.get("error.type", ("", None))[1]) == (ERROR, "502"), (
        span.status_code, span.attributes)
    assert [d["error_type"] for d in durations] == ["502"], durations


async def test_a_5xx_tool_call_step_in_the_run_view_is_not_allowed(gateway_factory: GatewayFactory) -> None:
    """The admin run view's step of a 5xx call says `decision: allow` (status 502, no error) while the
    ledger row of the same call says `error` (mcp_calls._conclude -> record_tool_step: decision is
    `allow` whenever there is no stop, refusal or client failure; `_tool_decision` says `error`).
    record_tool_step's own contract: "decision `error` when the call ended so without a decision"."""
    async with scripted(bad_gateway) as url:
        h = await mcp_gateway(gateway_factory, url)
        await safe_raw(h, call("read_file", {"path": "a"}))
        rows = await tool_rows(h)
        [step] = (await h.run("r1"))["steps"]
    assert [r["decision"] for r in rows] == ["error"]
    assert (step["status"], step["decision"]) == (502, "error"), step


# -- 1./2. an SSE answer that ends the call with a JSON-RPC error ----------------------------------------


class RefusedResume(PollingServer):
    def __init__(self) -> None:
        super().__init__(resume=404)


async def _wrong_id(request: web.Request) -> web.StreamResponse:
    return await sse_response(request, (b'event: message\ndata: {"jsonrpc":"2.0","id":99,"result":{"content":[]}}\n\n',))


async def _too_deep(request: web.Request) -> web.StreamResponse:
    return await sse_response(request, (b'event: message\ndata: {"jsonrpc":"2.0","id":7,"result":{"content":[],"_meta":'
                                        + nested(100, b"1") + b"}}\n\n",))


@pytest.mark.parametrize(("scenario", "phrase"), [
    ("resume_refused", "refused to resume it (404)"),
    ("wrong_id", "a response to another request"),
    ("too_deep", "nests deeper than"),
])
async def test_an_sse_call_ended_with_a_jsonrpc_error_records_that_error(
    gateway_factory: GatewayFactory, sink: OtlpSink, scenario: str, phrase: str
) -> None:
    """semconv.md 1.8: "Status: ERROR when `error.type` is present; the status description is
    `JSONRPCError.message`". The agent gets the JSON-RPC error naming why (the server refused to resume
    the stream, a response to another id, a response too deep), but the span's status description and
    the ledger row's detail both say "the MCP server's stream ended without a response to the call":
    `relay` swallows the exception once the stream is prepared and `mcp_calls._forward` invents a
    generic UpstreamUnavailable (step.lost). The same too-deep response as a JSON answer records "nests
    deeper than 64 levels" in both: the two transports disagree."""
    async with AsyncExitStack() as stack:
        if scenario == "resume_refused":
            server = await RefusedResume().start()
            stack.push_async_callback(server.close)
            url = server.url
        else:
            url = await stack.enter_async_context(scripted(_wrong_id if scenario == "wrong_id" else _too_deep))
        h = await mcp_gateway(gateway_factory, url)
        status, data = await safe_raw(h, call("read_file", {"path": "a"}))
        rows = await tool_rows(h)
        [span] = await tool_spans(h, sink)
    [answer] = events(data)
    message = answer["error"]["message"]
    assert status == 200 and phrase in message, data  # the agent is told why
    assert [(r["decision"], r["reason"]) for r in rows] == [("refused", "upstream_unavailable")]  # holds
    assert span.status_code == ERROR and span.value("error.type") == "upstream_unavailable"  # holds
    assert phrase in span.status_message, f"span status {span.status_message!r}; the agent got {message!r}"
    assert phrase in rows[0]["detail"], f"ledger detail {rows[0]['detail']!r}; the agent got {message!r}"


# -- 4. Anthropic structured outputs: a streamed answer cut for its constraint -----------------------------


async def test_a_cut_anthropic_structured_stream_counts_a_failed_output_check(
    gateway_factory: GatewayFactory, sink: OtlpSink
) -> None:
    """200bd58 made `output_config.format` the request's constraint; a streamed answer breaking it is cut
    with `output_nonconforming` (span error.type and ledger row say so), but
    `tollgate_output_checks_total` counts it `result="pass"`: observe._step_metrics decides
    fail/pass on `step.violations`, which relay_stream never fills for a text verdict. The same answer
    unstreamed (retries exhausted) counts `fail`. (OpenAI's `response_format` streams share the defect.)"""
    h = await gateway_factory(agents={"default": {"output": {"retries": 1}}})
    h.fake.queue(Reply(chunks=anthropic_stream(['{"answer": "', 'x"}'])))
    body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 50, "messages": MSG, "stream": True,
                            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    status, data, _ = await post(h, body, run="cut", path="/v1/messages")
    assert status == 200 and b"output_nonconforming" in data, data
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    assert [(r["decision"], r["reason"]) for r in ledger.rows("cut")] == [("error", "output_nonconforming")]
    [span] = [s for s in await flushed(h, sink) if s.name == "chat claude-sonnet-4-5"]
    assert span.value("error.type") == "output_nonconforming"  # holds
    checks = {(s.labels["kind"], s.labels["result"]): s.value
              for s in samples(await families(h), "tollgate_output_checks", "_total")}
    assert checks == {("json_schema", "fail"): 1.0}, checks
