"""The SDK's OTLP/HTTP protobuf span exporter with a cheaper encoder (imported only when configured).

`OTLPSpanExporter.export` encodes each batch with `otel._encode.encode_request` (same bytes as the
SDK's `encode_spans(...).SerializePartialToString()`, several times cheaper) and hands them to the
SDK's own HTTP client, so headers, compression, timeouts, retries and the exporter's metrics are the
SDK's. Whenever the fast path does not apply (a batch the encoder declines, an oversized request,
after shutdown, or an SDK version whose exporter internals differ) the SDK's `export` runs instead,
with its own logging and error reporting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as _SdkExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE

from otel._encode import encode_request

__all__ = ["OTLPSpanExporter"]

_log = logging.getLogger("tollgate.otel")
_INTERNALS = ("_client", "_metrics", "_max_request_size", "_shutdown")


class OTLPSpanExporter(_SdkExporter):
    """Drop-in `opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter`."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self._fast_path():
            return super().export(spans)
        try:
            data = encode_request(spans)
        except Exception:  # noqa: BLE001 - anything unusual is the SDK encoder's to handle (or log)
            _log.debug("fast OTLP encoding declined a batch; using the SDK encoder", exc_info=True)
            return super().export(spans)
        limit = self._max_request_size
        if isinstance(limit, int) and 0 < limit < len(data):
            return super().export(spans)  # the SDK drops it, logs and records the error
        with self._metrics.export_operation(len(spans)) as result:
            outcome = self._client.export(data)
            if not outcome.success:
                result.error = outcome.error
                status = outcome.status_code
                result.error_attrs = {HTTP_RESPONSE_STATUS_CODE: status} if status is not None else None
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _fast_path(self) -> bool:
        """The SDK internals the fast path uses exist (opentelemetry-exporter-otlp-proto-http 1.4x)."""
        if not all(hasattr(self, name) for name in _INTERNALS) or self._shutdown:
            return False
        return callable(getattr(self._client, "export", None)) and callable(
            getattr(self._metrics, "export_operation", None)
        )
