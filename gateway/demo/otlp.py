"""Spans collected in memory, written as OTLP JSON (an `ExportTraceServiceRequest`) that Jaeger's UI
loads from its search page ("Upload JSON").

OTLP JSON is protobuf's JSON mapping with three differences (OTLP specification, "JSON Protobuf
Encoding"): trace and span ids are lowercase hex, not base64; enums are integers; keys are
lowerCamelCase. The spans go through the OTLP exporter's own encoder (`encode_spans`, from
`opentelemetry-exporter-otlp-proto-common`, a dependency of the http exporter tollgate requires), so
the file holds exactly what an OTLP exporter would have sent; ids are then rewritten to hex.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from google.protobuf.json_format import MessageToDict  # type: ignore[import-untyped]  # protobuf has no stubs
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan

__all__ = ["otlp_json", "write_otlp_json"]

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(item: dict[str, Any]) -> None:
    for key in _ID_KEYS:
        value = item.get(key)
        if isinstance(value, str) and value:
            item[key] = base64.b64decode(value).hex()


def otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The spans as one OTLP JSON `ExportTraceServiceRequest` (`{"resourceSpans": [...]}`)."""
    document: dict[str, Any] = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    document.setdefault("resourceSpans", [])
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                _hex_ids(span)
                for link in span.get("links", []):
                    _hex_ids(link)
    return document


def write_otlp_json(path: str | Path, spans: Sequence[ReadableSpan]) -> int:
    """Write `otlp_json(spans)` to `path` (UTF-8, indented); returns the number of spans written."""
    Path(path).write_bytes(orjson.dumps(otlp_json(spans), option=orjson.OPT_INDENT_2) + b"\n")
    return len(spans)
