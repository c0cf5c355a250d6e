"""OTLP protobuf wire encoding of finished spans, written directly as bytes.

The SDK's `encode_spans` builds a protobuf message object per span, attribute and value and then
serialises the tree: about a hundred microseconds per gateway span, on the export worker thread,
holding the GIL the event loop needs. `encode_request(spans)` writes the same
`ExportTraceServiceRequest` straight to the wire format (opentelemetry-proto `trace/v1/trace.proto`,
`common/v1/common.proto`): spans grouped by resource, then by instrumentation scope, in first-seen
order, each field exactly as the SDK encoder sets it. The resource and scope are encoded once, and
the encodings of attribute keys and of repeated `(key, value)` pairs (operation, provider, model,
address, agent...) are reused.

Contract: for every batch it accepts, the bytes decode to a message equal to
`encode_spans(spans)` (tests/otel/test_encode.py checks this, byte for byte too). Anything off the
common path (a value type the SDK would coerce or reject, an int beyond int64, a string that is not
valid UTF-8, an empty key) raises `Unsupported`; the caller then uses the SDK encoder, whose
behaviour for those cases (log, skip the attribute) is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind

from otel._wire import Unsupported, attributes, field, pack_fixed32, pack_fixed64, utf8, varint

__all__ = ["Unsupported", "encode_request"]

# opentelemetry-proto Span.SpanKind numbers (the API's SpanKind values are off by one)
_KIND: Final[Mapping[SpanKind, bytes]] = {
    SpanKind.INTERNAL: b"\x30\x01",
    SpanKind.SERVER: b"\x30\x02",
    SpanKind.CLIENT: b"\x30\x03",
    SpanKind.PRODUCER: b"\x30\x04",
    SpanKind.CONSUMER: b"\x30\x05",
}
_FLAGS_LOCAL: Final = b"\x85\x01" + pack_fixed32(0x100)  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAGS_REMOTE: Final = b"\x85\x01" + pack_fixed32(0x300)  # ... | SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def _events(span: ReadableSpan) -> list[bytes]:
    out = []
    for event in span.events:
        parts = [b"\x09" + pack_fixed64(event.timestamp)] if event.timestamp else []
        if event.name:
            parts.append(field(b"\x12", utf8(event.name)))
        parts += attributes(b"\x1a", event.attributes)
        if event.dropped_attributes:
            parts.append(b"\x20" + varint(event.dropped_attributes))
        out.append(field(b"\x5a", b"".join(parts)))
    return out


def _links(span: ReadableSpan) -> list[bytes]:
    out = []
    for link in span.links:
        context = link.context
        parts = [
            b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + context.span_id.to_bytes(8, "big"),
            *attributes(b"\x22", link.attributes),
        ]
        if link.dropped_attributes:
            parts.append(b"\x28" + varint(link.dropped_attributes))
        parts.append(b"\x35" + pack_fixed32(0x300 if context.is_remote else 0x100))
        out.append(field(b"\x6a", b"".join(parts)))
    return out


_UNSET_STATUS: Final = b"\x7a\x00"  # Status{} : code UNSET (0, not written), no message
_NAMES: Final[dict[str, bytes]] = {}  # span name -> its field (names repeat: `chat <model>`, `tools/call`)
_NAMES_LIMIT: Final = 4096


def _name_field(name: str) -> bytes:
    encoded = _NAMES.get(name)
    if encoded is None:
        encoded = field(b"\x2a", utf8(name))
        if len(_NAMES) >= _NAMES_LIMIT:
            _NAMES.clear()
        _NAMES[name] = encoded
    return encoded


def _span(span: ReadableSpan) -> bytes:
    """Payload of one `Span`, fields in number order as the SDK encoder sets them."""
    context = span.get_span_context()
    if context is None:
        raise Unsupported("span without context")
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
    ]
    state = context.trace_state
    if state:
        parts.append(field(b"\x1a", utf8(",".join([f"{k}={v}" for k, v in state.items()]))))
    parent = span.parent
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    name = span.name
    if name:
        parts.append(_name_field(name))
    parts.append(_KIND[span.kind])
    start, end = span.start_time, span.end_time
    if start:
        parts.append(b"\x39" + pack_fixed64(start))
    if end:
        parts.append(b"\x41" + pack_fixed64(end))
    parts += attributes(b"\x4a", span.attributes)
    if span.dropped_attributes:
        parts.append(b"\x50" + varint(span.dropped_attributes))
    if span.events:
        parts += _events(span)
    if span.dropped_events:
        parts.append(b"\x60" + varint(span.dropped_events))
    if span.links:
        parts += _links(span)
    if span.dropped_links:
        parts.append(b"\x70" + varint(span.dropped_links))
    status = span.status
    if status is not None:
        code = status.status_code.value
        if not code and not status.description:
            parts.append(_UNSET_STATUS)
        else:
            payload = field(b"\x12", utf8(status.description)) if status.description else b""
            parts.append(field(b"\x7a", payload + (b"\x18" + varint(code) if code else b"")))
    parts.append(_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return b"".join(parts)


class _Encoded:
    """Encodings of the (few, long-lived) resources and scopes, by identity; the objects are kept
    so an id is never reused while cached."""

    __slots__ = ("resources", "scopes")

    def __init__(self) -> None:
        self.resources: dict[int, tuple[Resource, bytes]] = {}
        self.scopes: dict[int, tuple[InstrumentationScope | None, bytes]] = {}


_ENCODED: Final = _Encoded()


def _resourcefield(resource: Resource) -> bytes:
    cached = _ENCODED.resources.get(id(resource))
    if cached is not None and cached[0] is resource:
        return cached[1]
    encoded = field(b"\x0a", b"".join(attributes(b"\x0a", resource.attributes)))
    if len(_ENCODED.resources) >= 64:
        _ENCODED.resources.clear()
    _ENCODED.resources[id(resource)] = (resource, encoded)
    return encoded


def _scopefield(scope: InstrumentationScope | None) -> bytes:
    cached = _ENCODED.scopes.get(id(scope))
    if cached is not None and cached[0] is scope:
        return cached[1]
    if scope is None:
        encoded = b"\x0a\x00"
    else:
        parts = [field(b"\x0a", utf8(scope.name))] if scope.name else []
        if scope.version:
            parts.append(field(b"\x12", utf8(scope.version)))
        parts += attributes(b"\x1a", scope.attributes)
        encoded = field(b"\x0a", b"".join(parts))
    if len(_ENCODED.scopes) >= 64:
        _ENCODED.scopes.clear()
    _ENCODED.scopes[id(scope)] = (scope, encoded)
    return encoded


def _find(groups: list[tuple[Any, list[Any]]], key: Any) -> list[Any] | None:
    """The group of `key`: identity first (the common case), then equality, as the SDK's dict does."""
    for existing, members in groups:
        if existing is key:
            return members
    for existing, members in groups:
        if existing == key:
            return members
    return None


_Scopes = list[tuple[InstrumentationScope | None, list[bytes]]]


def _grouped(spans: Iterable[ReadableSpan]) -> list[tuple[Resource, _Scopes]]:
    resources: list[tuple[Resource, _Scopes]] = []
    last_resource: Resource | None = None
    last_scope: InstrumentationScope | None = None
    last_members: list[bytes] | None = None
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope or None
        encoded = _span(span)
        if last_members is not None and resource is last_resource and scope is last_scope:
            last_members.append(encoded)
            continue
        scopes = _find(resources, resource)
        if scopes is None:
            scopes = []
            resources.append((resource, scopes))
        members = _find(scopes, scope)
        if members is None:
            members = []
            scopes.append((scope, members))
        members.append(encoded)
        last_resource, last_scope, last_members = resource, scope, members
    return resources


def encode_request(spans: Sequence[ReadableSpan]) -> bytes:
    """`ExportTraceServiceRequest` bytes for `spans`; raises `Unsupported` (see the module docstring)."""
    out = []
    for resource, scopes in _grouped(spans):
        scope_fields = []
        for scope, members in scopes:
            parts = [_scopefield(scope), *[field(b"\x12", m) for m in members]]
            if scope is not None and scope.schema_url:
                parts.append(field(b"\x1a", utf8(scope.schema_url)))
            scope_fields.append(field(b"\x12", b"".join(parts)))
        tail = [field(b"\x1a", utf8(resource.schema_url))] if resource.schema_url else []
        out.append(field(b"\x0a", b"".join([_resourcefield(resource), *scope_fields, *tail])))
    return b"".join(out)
