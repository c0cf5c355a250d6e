"""An OTLP/HTTP receiver for tests: decodes real protobuf `ExportTraceServiceRequest`s.

Runs as an aiohttp app on 127.0.0.1:0 (semconv note section 7). The SDK exporter is synchronous, so
the code under test flushes from a worker thread (`asyncio.to_thread`) while the loop serves the sink.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]  # protobuf has no stubs
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PROTOBUF = "application/x-protobuf"


def any_value(value: AnyValue) -> tuple[str, Any]:
    """(oneof kind, Python value): the kind proves the wire type (int_value, double_value, ...)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return kind, [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return kind, {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return (kind or "", getattr(value, kind) if kind else None)


def typed_attributes(attributes: Any) -> dict[str, tuple[str, Any]]:
    return {kv.key: any_value(kv.value) for kv in attributes if isinstance(kv, KeyValue)}


@dataclass
class WireSpan:
    name: str
    kind: int  # INTERNAL=1, SERVER=2, CLIENT=3
    trace_id: str
    span_id: str
    parent_span_id: str
    status_code: int  # UNSET=0, OK=1, ERROR=2
    status_message: str
    schema_url: str
    scope: str
    attributes: dict[str, tuple[str, Any]]
    events: list[tuple[str, dict[str, tuple[str, Any]]]]
    resource: dict[str, tuple[str, Any]]

    def value(self, key: str) -> Any:
        return self.attributes[key][1]


@dataclass
class OtlpSink:
    spans: list[WireSpan] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    gzipped: int = 0
    url: str = ""

    async def traces(self, request: web.Request) -> web.Response:
        if request.content_type != PROTOBUF:
            return web.Response(status=415)
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            self.gzipped += 1
            if raw[:2] == b"\x1f\x8b":  # aiohttp usually inflates request bodies itself
                raw = gzip.decompress(raw)
        self.payloads.append(raw)
        message = ExportTraceServiceRequest()
        try:
            message.ParseFromString(raw)
        except DecodeError:
            return web.Response(status=400)
        for resource_spans in message.resource_spans:
            resource = typed_attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        WireSpan(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            status_code=span.status.code,
                            status_message=span.status.message,
                            schema_url=scope_spans.schema_url,
                            scope=scope_spans.scope.name,
                            attributes=typed_attributes(span.attributes),
                            events=[(e.name, typed_attributes(e.attributes)) for e in span.events],
                            resource=resource,
                        )
                    )
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=20 * 1024 * 1024)
        app.router.add_post("/v1/traces", self.traces)
        return app


@asynccontextmanager
async def running_sink() -> AsyncIterator[OtlpSink]:
    sink = OtlpSink()
    runner = web.AppRunner(sink.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sink.url = f"http://127.0.0.1:{port}"
    try:
        yield sink
    finally:
        await runner.cleanup()
