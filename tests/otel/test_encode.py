"""`otel._encode.encode_request` writes exactly what the SDK's `encode_spans` would serialise."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from otel._encode import Unsupported, encode_request
from otel.mcp_attributes import McpOperation
from otel.runs import RunTotals
from otel.telemetry import Telemetry
from tests.otel.conftest import Spans
from tests.otel.samples import ANTHROPIC_ANSWER, OPENAI_ANSWER, anthropic_call, openai_call


def _same(spans: list[ReadableSpan]) -> None:
    reference = encode_spans(spans)
    ours = encode_request(spans)
    assert ExportTraceServiceRequest.FromString(ours) == reference
    assert ours == reference.SerializePartialToString()


def _spans(**resource: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "t", **resource}, "https://x/schema"))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_gateway_steps_encode_identically(telemetry: Telemetry, spans: Spans) -> None:
    for call, answer, provider in (
        (openai_call(stream=True), OPENAI_ANSWER, "openai"),
        (anthropic_call(), ANTHROPIC_ANSWER, "anthropic"),
    ):
        parent = telemetry.run_parent("run-1", "bot")
        step = telemetry.start_inference(
            call, provider_name=provider, server_address="api.example.com", server_port=443, parent=parent,
            run_id="run-1", agent="bot",
        )
        step.guard_event("budget", "stop", "budget_exhausted", "no money")
        step.chunk()
        step.stop("budget_exhausted")
        step.finish(answer, cost_usd=0.25)
    mcp = telemetry.start_mcp(McpOperation(
        "tools/call", tool_name="get", request_id=7, server_address="h", server_port=1
    ))
    mcp.fail("-32602")
    telemetry.end_run("run-1", "bot", started_at=1.5, totals=RunTotals(stop_reason="x"))
    finished = spans()
    assert len(finished) == 4
    _same(finished)
    _same(finished[:1])


def test_every_value_kind_and_span_field() -> None:
    provider, exporter = _spans(extra="1")
    tracer = provider.get_tracer("scope-a", "1.2", schema_url="https://x/scope")
    other = provider.get_tracer("scope-b")
    state = TraceState([("k", "v")])
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
    parent = set_span_in_context(NonRecordingSpan(remote))
    attrs = {
        "s": "text", "empty": "", "u": "héllo ☃", "t": True, "f": False, "zero": 0, "i": 7, "neg": -5,
        "big": 2**62, "min": -(2**63), "d": 1.5, "nd": -0.0, "b": b"\x00\x01", "strs": ("a", ""),
        "ints": [1, -2], "floats": (0.5,), "bools": (True, False), "none_tuple": (), "long": "x" * 300,
    }
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes=attrs) as span:
        span.add_event("ev", {"a": 1, "b": ("x",)})
        span.add_event("", None)
        span.set_status(Status(StatusCode.ERROR, "bad"))
    linked = tracer.start_span(
        "child", parent, SpanKind.PRODUCER, {"k": "v"}, links=[Link(remote, {"l": 1}), Link(remote)]
    )
    linked.set_status(Status(StatusCode.OK))
    linked.end()
    for kind in (SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.CONSUMER):
        other.start_span("", kind=kind).end()
    finished = list(exporter.get_finished_spans())
    _same(finished)
    _same(finished[::-1])


def test_resources_and_scopes_group_like_the_sdk() -> None:
    first, exp1 = _spans()
    second, exp2 = _spans(other="yes")
    for provider in (first, second, first):
        provider.get_tracer("a").start_span("x").end()
        provider.get_tracer("b", "2").start_span("y").end()
    mixed = [*exp1.get_finished_spans(), *exp2.get_finished_spans()]
    mixed = [mixed[0], mixed[4], mixed[1], mixed[2], mixed[5], mixed[3]]
    _same(mixed)
    equal = ReadableSpan(
        name="copy", context=mixed[0].context, resource=Resource({"service.name": "t"}, "https://x/schema"),
        instrumentation_scope=InstrumentationScope("a"), start_time=1, end_time=2,
    )
    _same([*mixed, equal])
    _same([ReadableSpan(name="bare", context=mixed[0].context, start_time=1, end_time=2)])


@pytest.mark.parametrize("value", [2**63, "\ud800", {"": 1}, {"k": object()}])
def test_unusual_values_are_left_to_the_sdk(value: object) -> None:
    span = ReadableSpan(
        name="odd", context=SpanContext(1, 2, False), attributes={"odd": value},  # type: ignore[dict-item]
        start_time=1, end_time=2,
    )
    with pytest.raises(Unsupported):
        encode_request([span])
