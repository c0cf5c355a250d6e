"""The request path's shortcuts emit what the plain SDK calls would: trace headers, memoised run
parents, attributes applied at span end, batched guard counters, and the OTLP exporter's encoder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as SdkExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    TraceState,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel._otlp_http import OTLPSpanExporter
from otel.metrics import Metrics
from otel.propagation import headers_for
from otel.setup import exporter_from_env, setup_telemetry
from otel.telemetry import Telemetry
from tests.otel.conftest import Spans
from tests.otel.otlp_sink import OtlpSink, running_sink
from tests.otel.samples import OPENAI_ANSWER, openai_call


@pytest.mark.parametrize(
    "context",
    [
        SpanContext(0x1234, 0x99, False, TraceFlags(1)),
        SpanContext(2**128 - 1, 2**64 - 1, True, TraceFlags(0), TraceState([("a", "1"), ("b", "x=y")])),
        INVALID_SPAN_CONTEXT,
    ],
)
def test_trace_headers_match_the_propagator(context: SpanContext) -> None:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(NonRecordingSpan(context)))
    assert headers_for(context) == carrier


def test_run_parents_are_memoised_and_exact(telemetry: Telemetry) -> None:
    first = telemetry.run_parent("r", "a", epoch=2)
    assert telemetry.run_parent("r", "a", epoch=2) is first
    assert get_current_span(telemetry.run_parent("r", "a", epoch=3)).get_span_context() != (
        get_current_span(first).get_span_context()
    )
    root = get_current_span(first).get_span_context()
    assert root.trace_flags.sampled and not root.is_remote
    assert setup_telemetry({"OTEL_SDK_DISABLED": "true"}).run_parent("r", "a") == Context()


def test_attributes_set_during_a_step_keep_the_sdk_order(telemetry: Telemetry, spans: Spans) -> None:
    step = telemetry.start_inference(
        openai_call(stream=True), provider_name="openai", server_address="h", server_port=1, parent=None
    )
    step.set("tollgate.guards", "budget:allow")
    step.chunk()
    step.set("tollgate.guards", "budget:allow,caps:allow")  # set again: moves to the end, as in the SDK
    step.stop("budget_exhausted")
    step.finish(OPENAI_ANSWER, cost_usd=0.5)
    step.set("late", 1)  # after the end: ignored, as the SDK ignores it
    (span,) = spans()
    keys = list(span.attributes or {})
    tail = ["gen_ai.response.time_to_first_chunk", "tollgate.guards", "error.type", "tollgate.stop_reason"]
    assert keys[keys.index("gen_ai.response.time_to_first_chunk"):][:4] == tail
    assert keys[-1] == "tollgate.cost_usd" and "late" not in keys
    assert span.attributes is not None and span.attributes["tollgate.guards"] == "budget:allow,caps:allow"
    usage = OPENAI_ANSWER.usage
    assert usage is not None and span.attributes["gen_ai.usage.output_tokens"] == usage.output_tokens


def test_guard_decisions_count_like_single_calls() -> None:
    one, batch = Metrics(), Metrics()
    decisions = [("caps", "allow", None), ("budget", "stop", "budget_exhausted"), ("caps", "allow", None)]
    for guard, decision, reason in decisions:
        one.guard_decision(guard, decision, reason)
    batch.guard_decisions(decisions)
    assert one.render() == batch.render()


def test_http_exporter_is_the_sdk_one_with_the_fast_encoder() -> None:
    exporter = exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert isinstance(exporter, OTLPSpanExporter) and isinstance(exporter, SdkExporter)
    assert exporter._fast_path()
    exporter.shutdown()
    assert not exporter._fast_path()


@pytest.fixture
async def sink() -> AsyncIterator[OtlpSink]:
    async with running_sink() as sink:
        yield sink


async def test_batches_the_encoder_declines_go_through_the_sdk(sink: OtlpSink) -> None:
    exporter = OTLPSpanExporter(endpoint=f"{sink.url}/v1/traces", timeout=5)
    context = SpanContext(1, 2, False, TraceFlags(1))
    odd = ReadableSpan(
        name="odd", context=context, attributes={"big": 2**64, "ok": "yes"}, start_time=1, end_time=2
    )
    plain = ReadableSpan(name="plain", context=context, attributes={"ok": "yes"}, start_time=1, end_time=2)
    assert (await asyncio.to_thread(exporter.export, [plain])).name == "SUCCESS"
    assert (await asyncio.to_thread(exporter.export, [odd])).name == "SUCCESS"  # SDK: logs, skips `big`
    exporter.shutdown()
    assert [(s.name, s.attributes) for s in sink.spans] == [
        ("plain", {"ok": ("string_value", "yes")}),
        ("odd", {"ok": ("string_value", "yes")}),
    ]


def test_export_posts_with_urllib3_unless_only_requests_would_honour_the_environment() -> None:
    import certifi
    from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
    from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport

    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    exporter = exporter_from_env(endpoint)
    assert isinstance(exporter, OTLPSpanExporter)
    assert isinstance(exporter._client._transport, Urllib3HTTPTransport)
    assert exporter._client._transport._pool.connection_pool_kw["ca_certs"] == certifi.where()
    bundled = exporter_from_env({**endpoint, "REQUESTS_CA_BUNDLE": "/etc/ca.pem"})
    assert isinstance(bundled, OTLPSpanExporter)
    assert bundled._client._transport._pool.connection_pool_kw["ca_certs"] == "/etc/ca.pem"  # as requests would
    for extra in ({"HTTPS_PROXY": "http://proxy:3128"}, {"all_proxy": "socks5://p:1"}):
        kept = exporter_from_env({**endpoint, **extra})
        assert isinstance(kept, OTLPSpanExporter)
        assert isinstance(kept._client._transport, RequestsHTTPTransport)
