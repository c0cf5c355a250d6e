"""Step span lifecycle: attributes at start and end, errors, stops, streams, MCP, capture."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.call import Answer
from otel.mcp_attributes import McpOperation
from otel.redact import Redactor
from otel.runs import context_from_headers
from otel.spans import StepSpan, extract_meta_context, inject_meta_context
from otel.telemetry import Telemetry
from tests.otel.conftest import Spans
from tests.otel.samples import (
    AGENT_BEARER,
    ANTHROPIC_ANSWER,
    MCP_OK,
    MCP_TOOL_ERROR,
    OPENAI_ANSWER,
    OPENAI_BODY,
    PROVIDER_KEY,
    anthropic_call,
    mcp_call,
    openai_call,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def start_openai(telemetry: Telemetry, *, stream: bool = False) -> StepSpan:
    return telemetry.start_inference(
        openai_call(stream=stream),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=None,
        attempt=0,
    )


def test_finished_openai_step(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry)
    step.guard_event("budget", "continue", None, None)
    step.finish(OPENAI_ANSWER, cost_usd=0.0123)
    step.end()  # idempotent
    (span,) = spans()
    assert span.name == "chat gpt-4o-mini"
    assert span.kind is SpanKind.CLIENT
    assert span.status.status_code is StatusCode.UNSET
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.schema_url == "https://opentelemetry.io/schemas/1.41.0"
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.response.id"] == "chatcmpl-123"
    assert attrs["gen_ai.usage.input_tokens"] == 120
    assert attrs["tollgate.cost_usd"] == 0.0123
    assert attrs["tollgate.attempt"] == 0
    assert "error.type" not in attrs
    assert [(e.name, dict(e.attributes or {})) for e in span.events] == [
        ("tollgate.guard", {"tollgate.guard.name": "budget", "tollgate.guard.decision": "continue"}),
    ]


def test_anthropic_step_usage_summed_once(telemetry: Telemetry, spans: Spans) -> None:
    step = telemetry.start_inference(
        anthropic_call(),
        provider_name="anthropic",
        server_address="api.anthropic.com",
        server_port=443,
        parent=None,
        attempt=1,
        run_id="r-1",
        agent="support-bot",
    )
    step.finish(ANTHROPIC_ANSWER)
    attrs = dict(spans()[0].attributes or {})
    assert attrs["gen_ai.usage.input_tokens"] == 150
    assert attrs["gen_ai.usage.cache_creation.input_tokens"] == 30
    assert attrs["tollgate.attempt"] == 1
    assert attrs["tollgate.run_id"] == "r-1" and attrs["tollgate.agent"] == "support-bot"


def test_streaming_step_records_time_to_first_chunk(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry, stream=True)
    step.chunk()
    step.chunk()  # only the first counts
    step.finish(OPENAI_ANSWER)
    attrs = dict(spans()[0].attributes or {})
    assert attrs["gen_ai.request.stream"] is True
    ttfc = attrs["gen_ai.response.time_to_first_chunk"]
    assert isinstance(ttfc, float) and 0 <= ttfc < 5
    families = telemetry.metrics.render()[0].decode()
    assert "gen_ai_client_operation_time_to_first_chunk_seconds_count{" in families


def test_each_chunk_after_the_first_is_a_time_per_output_chunk_sample(telemetry: Telemetry, spans: Spans) -> None:
    """semconv.md 3.2: `gen_ai.client.operation.time_per_output_chunk`, one record per chunk after the
    first; a stream of one chunk records none (no series)."""
    for chunks in (4, 1):
        step = start_openai(telemetry, stream=True)
        for _ in range(chunks):
            step.chunk()
        step.finish(OPENAI_ANSWER)
    families = telemetry.metrics.render()[0].decode()
    [count] = [line for line in families.splitlines()
               if line.startswith("gen_ai_client_operation_time_per_output_chunk_seconds_count{")]
    assert count.endswith(" 3.0"), count
    assert "gen_ai_client_operation_time_to_first_chunk_seconds_count{" in families


def test_upstream_failure(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry)
    step.fail("upstream_timeout", "no first byte in 120s")
    (span,) = spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "no first byte in 120s"
    assert dict(span.attributes or {})["error.type"] == "upstream_timeout"
    text = telemetry.metrics.render()[0].decode()
    assert 'error_type="upstream_timeout"' in text


def test_stop_before_upstream_still_has_a_span(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry)
    step.guard_event("budget", "stop", "budget_exhausted", "spent 2.00 of 2.00")
    step.stop("budget_exhausted")
    step.end()
    (span,) = spans()
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "budget_exhausted"
    assert attrs["tollgate.stop_reason"] == "budget_exhausted"
    assert span.status.status_code is StatusCode.ERROR
    # no upstream operation happened: no GenAI client duration sample
    assert "gen_ai_client_operation_duration_seconds_count{" not in telemetry.metrics.render()[0].decode()


def test_stop_after_answer_keeps_usage_and_stop_code(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry)
    step.stop("loop_detected", "same call three times")
    step.finish(OPENAI_ANSWER)
    attrs = dict(spans()[0].attributes or {})
    assert attrs["error.type"] == "loop_detected" and attrs["gen_ai.usage.output_tokens"] == 30
    text = telemetry.metrics.render()[0].decode()
    assert 'gen_ai_client_operation_duration_seconds_count{error_type=""' in text
    assert 'gen_ai_token_type="output"' in text


def test_refusal_without_upstream_has_error_type_and_no_client_metrics(
    telemetry: Telemetry, spans: Spans
) -> None:
    step = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=None,
        start_time=1_700_000_000.0,  # opened late, backdated to the step's start
    )
    step.error("invalid_request", "unpriced model under a USD budget", upstream=False)
    step.end()
    (span,) = spans()
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "invalid_request" and "tollgate.stop_reason" not in attrs
    assert span.status.status_code is StatusCode.ERROR
    assert span.start_time == 1_700_000_000 * 10**9
    assert "gen_ai_client_operation_duration_seconds_count{" not in telemetry.metrics.render()[0].decode()


def test_error_after_the_answer_keeps_usage_and_measures_the_upstream_as_successful(
    telemetry: Telemetry, spans: Spans
) -> None:
    step = start_openai(telemetry)
    step.error("output_nonconforming", None, upstream=False)
    step.error("upstream_unavailable", None, upstream=False)  # the first error wins
    step.finish(OPENAI_ANSWER, cost_usd=0.001)
    attrs = dict(spans()[0].attributes or {})
    assert attrs["error.type"] == "output_nonconforming" and attrs["gen_ai.usage.output_tokens"] == 30
    text = telemetry.metrics.render()[0].decode()
    assert 'gen_ai_client_operation_duration_seconds_count{error_type=""' in text


def test_upstream_error_with_a_partial_answer(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry, stream=True)
    step.chunk()
    step.error("upstream_unavailable", "stream ended early", upstream=True)
    step.finish(Answer(text="par"))
    (span,) = spans()
    assert dict(span.attributes or {})["error.type"] == "upstream_unavailable"
    assert 'error_type="upstream_unavailable"' in telemetry.metrics.render()[0].decode()


def test_stop_wins_over_a_later_error(telemetry: Telemetry, spans: Spans) -> None:
    step = start_openai(telemetry)
    step.stop("tool_not_allowed")
    step.error("client_disconnected", None, upstream=False)
    step.end()
    assert dict(spans()[0].attributes or {})["error.type"] == "tool_not_allowed"


def test_mcp_tool_call(telemetry: Telemetry, spans: Spans) -> None:
    step = telemetry.start_mcp(McpOperation(
        "tools/call", tool_name="read_file", request_id=7, session_id="s-1", protocol_version="2025-06-18",
        server_address="127.0.0.1", server_port=3001,
    ), parent=None)
    step.finish(MCP_OK)
    (span,) = spans()
    assert (span.name, span.kind) == ("tools/call read_file", SpanKind.CLIENT)
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "execute_tool" and attrs["jsonrpc.request.id"] == "7"
    assert "error.type" not in attrs
    assert (
        'mcp_client_operation_duration_seconds_count{error_type="",gen_ai_operation_name="execute_tool"'
        in (telemetry.metrics.render()[0].decode())
    )


def test_mcp_tool_error_and_rpc_error(telemetry: Telemetry, spans: Spans) -> None:
    telemetry.start_mcp(McpOperation("tools/call", tool_name="read_file"), parent=None).finish(MCP_TOOL_ERROR)
    telemetry.start_mcp(McpOperation("tools/list"), parent=None).fail("-32601", "Method not found")
    tool_error, rpc_error = spans()
    assert dict(tool_error.attributes or {})["error.type"] == "tool_error"
    assert tool_error.status.status_code is StatusCode.ERROR
    assert rpc_error.name == "tools/list"
    assert {
        k: v
        for k, v in (rpc_error.attributes or {}).items()
        if k in ("error.type", "rpc.response.status_code")
    } == {
        "error.type": "-32601",
        "rpc.response.status_code": "-32601",
    }
    assert rpc_error.status.description == "Method not found"


def test_an_mcp_servers_http_error_is_not_a_json_rpc_code(telemetry: Telemetry, spans: Spans) -> None:
    """A server's HTTP 500 with no JSON-RPC response: `error.type` is the status, but it is no
    `rpc.response.status_code` (which names a JSON-RPC error code), on the span or the metric."""
    step = telemetry.start_mcp(McpOperation("tools/call", tool_name="boom"), parent=None)
    step.error("500", None, upstream=True, jsonrpc=False)
    step.end()
    [span] = spans()
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "500" and "rpc.response.status_code" not in attrs
    rendered = telemetry.metrics.render()[0].decode()
    assert 'error_type="500"' in rendered and 'rpc_response_status_code="500"' not in rendered


def test_capture_off_by_default(telemetry: Telemetry, spans: Spans, redactor: Redactor) -> None:
    step = start_openai(telemetry)
    step.capture_input(openai_call(), redactor)
    step.capture_output(OPENAI_ANSWER, redactor)
    step.finish(OPENAI_ANSWER)
    assert not [k for k in spans()[0].attributes or {} if "messages" in k or "instructions" in k]


def test_capture_on_is_redacted(
    captured: Telemetry, exporter: InMemorySpanExporter, redactor: Redactor
) -> None:
    body = {
        **OPENAI_BODY,
        "messages": [{"role": "user", "content": f"key {PROVIDER_KEY}, Bearer {AGENT_BEARER}"}],
    }
    step = captured.start_inference(
        openai_call(body),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=None,
        attempt=0,
    )
    step.capture_input(openai_call(body), redactor)
    step.capture_output(Answer(text=f"echo {PROVIDER_KEY}", finish_reasons=("stop",)), redactor)
    step.finish(None)
    assert captured.force_flush()
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    dumped = json.dumps(attrs)
    assert PROVIDER_KEY not in dumped and AGENT_BEARER not in dumped
    assert json.loads(str(attrs["gen_ai.input.messages"]))[0]["parts"][0]["content"] == (
        "key [REDACTED], Bearer [REDACTED]"
    )
    assert json.loads(str(attrs["gen_ai.tool.definitions"])) == [{"type": "function", "name": "get_weather"}]
    assert "gen_ai.system_instructions" not in attrs  # OpenAI: system messages are history


def test_capture_mcp_arguments_and_result(
    captured: Telemetry, exporter: InMemorySpanExporter, redactor: Redactor
) -> None:
    step = captured.start_mcp(McpOperation("tools/call", tool_name="read_file"), parent=None)
    step.capture_input(mcp_call(arguments=f'{{"token": "{PROVIDER_KEY}"}}'), redactor)
    step.capture_output(MCP_OK, redactor)
    step.finish(MCP_OK)
    assert captured.force_flush()
    attrs = dict(exporter.get_finished_spans()[0].attributes or {})
    assert attrs["gen_ai.tool.call.arguments"] == '{"token":"[REDACTED]"}'
    assert attrs["gen_ai.tool.call.result"] == "Welcome!"


def test_parent_context_and_propagation(telemetry: Telemetry, spans: Spans) -> None:
    parent = context_from_headers({"Traceparent": TRACEPARENT})
    step = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=parent,
        attempt=0,
    )
    meta: dict[str, object] = {"progressToken": 1}
    inject_meta_context(meta, step.context)
    step.finish(OPENAI_ANSWER)
    (span,) = spans()
    assert span.parent is not None and span.parent.span_id == 0xB7AD6B7169203331
    assert span.context is not None and span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert meta["traceparent"] == f"00-0af7651916cd43dd8448eb211c80319c-{span.context.span_id:016x}-01"
    assert meta["progressToken"] == 1


def test_meta_context_round_trip() -> None:
    ctx = extract_meta_context(
        {"traceparent": TRACEPARENT, "tracestate": "k=v", "baggage": "a=b", "other": 1}
    )
    assert ctx is not None
    meta: dict[str, object] = {}
    inject_meta_context(meta, ctx)
    assert meta == {"traceparent": TRACEPARENT, "tracestate": "k=v", "baggage": "a=b"}
    assert extract_meta_context(None) is None
    assert extract_meta_context({"traceparent": "garbage"}) is None
    assert extract_meta_context({"progressToken": 3}) is None
    empty: dict[str, object] = {}
    inject_meta_context(empty, None)
    assert empty == {}


def test_telemetry_errors_never_reach_the_caller(telemetry: Telemetry, spans: Spans) -> None:
    class Broken(Redactor):
        def redact(self, text: str) -> str:
            raise RuntimeError("boom")

    captured = Telemetry.__new__(Telemetry)
    captured.__dict__.update(telemetry.__dict__)
    captured.capture_content = True
    step = captured.start_inference(
        openai_call(), provider_name="openai", server_address="h", server_port=1, parent=None, attempt=0
    )
    step.capture_input(openai_call(), Broken())
    step.finish(Answer(usage="not usage"))  # type: ignore[arg-type]
    step.end()
    assert telemetry.errors() == {"span.capture_input": 1, "span.finish": 1, "span.end": 1}
    assert (
        'tollgate_telemetry_errors_total{component="span.finish"} 1.0'
        in telemetry.metrics.render()[0].decode()
    )
    assert len(spans()) == 1  # the span still ended


@pytest.mark.parametrize("env", [{"OTEL_SDK_DISABLED": "true"}, {}])
def test_tracing_off_passes_agent_context_through(env: dict[str, str]) -> None:
    from otel.setup import setup_telemetry

    telemetry = setup_telemetry(env, exporter=InMemorySpanExporter() if env else None)
    assert not telemetry.tracing
    parent = context_from_headers({"traceparent": TRACEPARENT})
    step = telemetry.start_inference(
        openai_call(), provider_name="openai", server_address="h", server_port=1, parent=parent, attempt=0
    )
    assert not step.is_recording
    meta: dict[str, object] = {}
    inject_meta_context(meta, step.context)
    assert meta["traceparent"] == TRACEPARENT  # unchanged: the agent's span stays the upstream's parent
    step.guard_event("budget", "continue")
    step.finish(OPENAI_ANSWER, cost_usd=0.1)
    assert "gen_ai_client_operation_duration_seconds_count{" in telemetry.metrics.render()[0].decode()
    assert telemetry.run_parent("r", "a") is not None
    assert telemetry.spans_dropped() == 0 and telemetry.errors() == {}
    assert telemetry.shutdown()
