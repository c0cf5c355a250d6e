"""FastTracer against the SDK tracer: the same operations export the same spans."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace import sampling as Sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    set_span_in_context,
)

from otel._fastspan import FastTracer


class Counting(IdGenerator):
    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        return 0xABC0000 + self.n


def tracers(sampler: Sampling.Sampler, limits: SpanLimits) -> tuple[Tracer, InMemorySpanExporter, Tracer, InMemorySpanExporter]:
    resource = Resource({"service.name": "t"})
    sdk_out, fast_out = InMemorySpanExporter(), InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler, resource=resource, id_generator=Counting(), span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(sdk_out))
    sdk = provider.get_tracer("tollgate", "1", schema_url="https://s")
    fast = FastTracer(processor=SimpleSpanProcessor(fast_out), sampler=sampler, ids=Counting(), resource=resource,
                      scope=InstrumentationScope("tollgate", "1", "https://s"), limits=limits)
    return sdk, sdk_out, fast, fast_out


def shape(span: ReadableSpan) -> dict[str, Any]:
    return {
        "name": span.name, "kind": span.kind, "context": span.context, "parent": span.parent,
        "attributes": list((span.attributes or {}).items()), "status": (span.status.status_code, span.status.description),
        "events": [(e.name, dict(e.attributes or {})) for e in span.events], "dropped_events": span.dropped_events,
        "dropped_attributes": span.dropped_attributes, "start": span.start_time, "end": span.end_time,
        "resource": span.resource.attributes, "scope": span.instrumentation_scope,
    }


def story(tracer: Tracer) -> None:
    parent = tracer.start_span("parent", Context(), SpanKind.SERVER, {"a": 1}, start_time=0)
    child = tracer.start_span("chat m", set_span_in_context(parent), SpanKind.CLIENT,
                              {"gen_ai.operation.name": "chat", "list": ["x", "y"]}, start_time=5)
    child.set_attribute("tollgate.guards", "budget:allow")
    child.set_attribute("late.first", True)
    child.set_attribute("tollgate.guards", "budget:allow,caps:allow")  # moves to the end
    child.set_attributes({"n": 2, "f": 1.5, "long": "v" * 50})
    for i in range(5):
        child.add_event(f"guard{i}", {"i": i}, timestamp=10 + i)
    child.set_status(Status(StatusCode.UNSET))
    child.set_status(StatusCode.ERROR, "budget_exhausted")
    child.update_name("chat m2")
    child.end(end_time=20)
    child.set_attribute("after", 1)
    child.end(end_time=30)
    with pytest.raises(ValueError):
        with tracer.start_span("boom", set_span_in_context(parent), start_time=40) as span:
            span.set_status(Status(StatusCode.OK))
            raise ValueError("no")
    with pytest.raises(KeyError), tracer.start_span("boom2", set_span_in_context(parent), start_time=50):
        raise KeyError("k")
    parent.end(end_time=0)


def stories(sampler: Sampling.Sampler, limits: SpanLimits, run: Callable[[Tracer], None]) -> tuple[list[Any], list[Any]]:
    sdk, sdk_out, fast, fast_out = tracers(sampler, limits)
    run(sdk)
    run(fast)

    def norm(spans: tuple[ReadableSpan, ...]) -> list[Any]:
        out = []
        for span in spans:
            s = shape(span)
            # event timestamps of recorded exceptions are "now"; stack traces name the tracer's frames
            s["events"] = [(n, {k: v for k, v in a.items() if k != "exception.stacktrace"}) for n, a in s["events"]]
            if s["name"].startswith("boom"):
                s["end"] = None
            out.append(s)
        return out

    return norm(sdk_out.get_finished_spans()), norm(fast_out.get_finished_spans())


@pytest.mark.parametrize(
    "limits",
    [SpanLimits(), SpanLimits(max_events=3, max_span_attributes=4, max_attribute_length=10, max_span_attribute_length=10)],
    ids=["default", "tight"],
)
def test_same_spans_as_the_sdk(limits: SpanLimits) -> None:
    sdk, fast = stories(Sampling.ParentBased(Sampling.ALWAYS_ON), limits, story)
    assert [s["name"] for s in fast] == ["chat m2", "boom", "boom2", "parent"]
    assert fast == sdk


def test_dropped_traces_are_not_recorded() -> None:
    sdk, fast = stories(Sampling.ALWAYS_OFF, SpanLimits(), story)
    assert fast == sdk == []
    _, _, tracer, _ = tracers(Sampling.ALWAYS_OFF, SpanLimits())
    span: Span = tracer.start_span("x")
    assert isinstance(span, NonRecordingSpan) and not span.get_span_context().trace_flags.sampled


def test_parent_sampling_decision_is_followed() -> None:
    _, _, tracer, out = tracers(Sampling.ParentBased(Sampling.ALWAYS_ON), SpanLimits())
    root = tracer.start_span("root")
    unsampled = NonRecordingSpan(root.get_span_context().__class__(
        root.get_span_context().trace_id, 7, is_remote=True))
    child = tracer.start_span("child", set_span_in_context(unsampled))
    assert not child.is_recording()
    root.end()
    assert [s.name for s in out.get_finished_spans()] == ["root"]
