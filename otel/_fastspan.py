"""A tracer whose recording spans are plain records until they end, then SDK `ReadableSpan`s.

Why: tollgate opens and ends a span on every step, on the event loop. The SDK span takes a lock on
every call, validates and copies every attribute into a `BoundedAttributes`, builds bounded lists for
events and links, runs `on_start` of every processor, and keeps self-metrics; on the benchmark that
was a tenth of the gateway's CPU per request. Our attributes are typed by construction, so a span
here keeps them in a dict and builds the `ReadableSpan` once, when it ends, for the same span
processor. What reaches the processor is what the SDK tracer would hand it: same ids, sampling
decision, trace flags, resource, scope, limits (applied at the end), events and status.

Spans are not thread-safe (each belongs to one request on the event loop).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from time import time_ns
from types import MappingProxyType, TracebackType
from typing import Any, Final

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.semconv.attributes import exception_attributes as Exc
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    get_current_span,
    use_span,
)
from opentelemetry.util.types import AttributeValue

from gateway.frozen_init import fast_init

__all__ = ["FastSpan", "FastTracer", "Reserved"]

_SAMPLED_DECISIONS = frozenset({Decision.RECORD_AND_SAMPLE})
_PLAIN: Final = frozenset({str, bool, int, float})  # attribute values the SDK keeps as they are
_NO_ATTRIBUTES: Final[Mapping[str, AttributeValue]] = MappingProxyType({})
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_DEFAULT = TraceFlags(TraceFlags.DEFAULT)


def _stored(value: AttributeValue) -> AttributeValue:
    """As the SDK keeps a value: sequences as tuples (a list the caller changes later stays as set)."""
    return tuple(value) if type(value) is list else value


@fast_init
@dataclass(frozen=True, slots=True)
class Reserved:
    """A span decided but not started: its context (what goes upstream), its parent, whether it
    records, and what the sampler added (the SDK puts those first)."""

    context: SpanContext
    parent: SpanContext | None
    recording: bool
    sampler_attributes: Mapping[str, AttributeValue]


class FastTracer(Tracer):
    """`Tracer.start_span` with the SDK's semantics, producing `FastSpan`s for one processor."""

    def __init__(
        self,
        *,
        processor: SpanProcessor,
        sampler: Sampler,
        ids: IdGenerator,
        resource: Resource,
        scope: InstrumentationScope,
        limits: SpanLimits,
    ) -> None:
        self.processor = processor
        self.sampler = sampler
        self.ids = ids
        self.resource = resource
        self.scope = scope
        self.limits = limits
        count, length = limits.max_span_attributes, limits.max_span_attribute_length
        # attributes need the SDK's bounding only when a limit can bite: a value length limit, or
        # more attributes than the count limit (checked per span at the end)
        self._max_attributes = count if count is not None else 1 << 30
        self._bounded = length is not None
        # an event's attributes need the SDK's cleaning only when a limit can bite or a value is not plain
        events = limits.max_event_attributes
        self._event_room = events if events is not None else 1 << 30
        self._events_bounded = limits.max_attribute_length is not None

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> Span:
        reserved = self.reserve(name, context, kind, attributes, links)
        return self.start_reserved(reserved, name, kind, None, start_time)

    def reserve(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] | None = None,
    ) -> Reserved:
        """The span's identity (ids, sampling decision, parent), decided now; the span itself follows
        with `start_reserved`. Lets a caller send the trace context before it builds the span."""
        parent: SpanContext | None = get_current_span(context).get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = self.ids.generate_trace_id()
            random_id = self.ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random_id = parent.trace_flags.random_trace_id
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        decision = result.decision
        flags = _SAMPLED if decision in _SAMPLED_DECISIONS else _DEFAULT
        if random_id:
            flags = TraceFlags(flags | TraceFlags.RANDOM_TRACE_ID)
        span_id = self.ids.generate_span_id()
        span_context = SpanContext(
            trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=result.trace_state
        )
        return Reserved(span_context, parent, decision is not Decision.DROP, result.attributes)

    def start_reserved(
        self,
        reserved: Reserved,
        name: str,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        start_time: int | None = None,
    ) -> Span:
        """The span of `reserve`: `attributes` come after the sampler's own, as in the SDK."""
        if not reserved.recording:
            return NonRecordingSpan(reserved.context)
        # the sampler's attributes first, then the others; sequences kept as tuples (`_stored`, inlined in
        # the common case, a sampler that adds none: no call per value)
        sampled = reserved.sampler_attributes
        attrs = {k: tuple(v) if type(v) is list else v for k, v in (attributes or {}).items() if k not in sampled}
        if sampled:
            attrs = {**{k: _stored(v) for k, v in sampled.items()}, **attrs}
        span_start = time_ns() if start_time is None else start_time
        return FastSpan(self, name, reserved.context, reserved.parent, kind, attrs, span_start)

    @contextmanager
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, AttributeValue] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                      set_status_on_exception=set_status_on_exception) as current:
            yield current

    def finish(self, span: FastSpan) -> None:
        """Hand an ended span to the processor as the `ReadableSpan` the SDK would have built."""
        attributes: Mapping[str, Any] = span.attributes
        limits = self.limits
        if self._bounded or len(attributes) > self._max_attributes:
            attributes = BoundedAttributes(limits.max_span_attributes, attributes, immutable=False,
                                           max_value_len=limits.max_span_attribute_length)
        events: Sequence[Event] = tuple(span.events)
        if limits.max_events is not None and len(events) > limits.max_events:
            events = BoundedList.from_seq(limits.max_events, events)  # the last ones, with a drop count
        readable = ReadableSpan(
            name=span.name,
            context=span.context,
            parent=span.parent,
            resource=self.resource,
            attributes=attributes,
            events=events,
            kind=span.kind,
            status=span.status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=self.scope,
        )
        self.processor.on_end(readable)


class FastSpan(Span):
    """A recording span: attributes in a dict, events in a list, until `end()`."""

    __slots__ = ("_tracer", "attributes", "context", "end_time", "events", "kind", "name", "parent",
                 "start_time", "status")

    def __init__(
        self,
        tracer: FastTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        self._tracer = tracer
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.attributes = attributes
        self.events: list[Event] = []
        self.status = Status(StatusCode.UNSET)
        self.start_time = start_time
        self.end_time: int | None = None

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self.end_time is None:
            attributes = self.attributes
            if key in attributes:
                del attributes[key]  # a key set again moves to the end, as in the SDK's BoundedAttributes
            attributes[key] = tuple(value) if type(value) is list else value  # `_stored`, inlined: per attribute

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self.end_time is not None:
            return
        own = self.attributes
        for key, value in attributes.items():  # `set_attribute` for each, inlined (a span's answer sets ~8)
            own.pop(key, None)
            own[key] = tuple(value) if type(value) is list else value

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None,
                  timestamp: int | None = None) -> None:
        if self.end_time is None:
            tracer = self._tracer
            kept: Mapping[str, AttributeValue]
            if not attributes:
                kept = _NO_ATTRIBUTES
            elif (not tracer._events_bounded and len(attributes) <= tracer._event_room
                  and all(type(k) is str and k and type(v) in _PLAIN for k, v in attributes.items())):
                kept = MappingProxyType(dict(attributes))  # what BoundedAttributes would keep, nothing dropped
            else:
                limits = tracer.limits
                kept = BoundedAttributes(limits.max_event_attributes, attributes, immutable=True,
                                         max_value_len=limits.max_attribute_length)
            self.events.append(Event(name, kept, time_ns() if timestamp is None else timestamp))

    def add_link(self, context: SpanContext, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        """Links are not recorded: tollgate adds none (`start_span` ignores `links` likewise)."""

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # the SDK's rules: an OK status is final; UNSET never overwrites
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, AttributeValue] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        module, name = type(exception).__module__, type(exception).__qualname__
        self.add_event("exception", {
            Exc.EXCEPTION_TYPE: f"{module}.{name}" if module and module != "builtins" else name,
            Exc.EXCEPTION_MESSAGE: str(exception),
            Exc.EXCEPTION_STACKTRACE: "".join(traceback.format_exception(exception)),
            Exc.EXCEPTION_ESCAPED: str(escaped),
            **(attributes or {}),
        }, timestamp)

    def __exit__(self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
                 exc_tb: TracebackType | None) -> None:
        """As the SDK span: an exception leaving the `with` is recorded and sets status ERROR."""
        if exc_val is not None and self.is_recording():
            self.record_exception(exc_val, escaped=True)
            self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is None:
            self.end_time = time_ns() if end_time is None else end_time
            self._tracer.finish(self)
