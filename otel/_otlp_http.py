"""The SDK's OTLP/HTTP protobuf span exporter with a cheaper encoder (imported only when configured).

`OTLPSpanExporter.export` encodes each batch with `otel._encode.encode_request` (same bytes as the
SDK's `encode_spans(...).SerializePartialToString()`, several times cheaper) and hands them to the
SDK's own HTTP client, so headers, compression, timeouts, retries and the exporter's metrics are the
SDK's; the batch is posted with the SDK's urllib3 transport rather than its requests one where the
two behave alike (`prefer_urllib3`, called by `otel.setup`). Whenever the fast path does not apply
(a batch the encoder declines, an oversized request, after shutdown, or an SDK version whose exporter
internals differ) the SDK's `export` runs instead, with its own logging and error reporting.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import certifi
import requests
from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as _SdkExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE

from otel._encode import encode_request

__all__ = ["OTLPSpanExporter"]

_log = logging.getLogger("tollgate.otel")
_INTERNALS = ("_client", "_metrics", "_max_request_size", "_shutdown")
# proxy variables requests honours and urllib3 does not: with one set, requests stays
_PROXY_ENV = tuple(
    name for base in ("http_proxy", "https_proxy", "all_proxy") for name in (base, base.upper())
)


class OTLPSpanExporter(_SdkExporter):
    """Drop-in `opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter`."""

    def prefer_urllib3(self, env: Mapping[str, str]) -> None:
        """Post with the SDK's urllib3 transport instead of its requests one: requests cost ~1 ms of CPU
        per export against ~0.4 ms (500 posts of 30 KB to a loopback sink), on the thread that shares
        the GIL with the event loop. Only where the two behave alike: the SDK built a plain session
        (no credential provider: no auth, headers or hooks of its own) and no proxy variable is set;
        certificates are verified against the bundle requests would use."""
        client: Any = getattr(self, "_client", None)
        transport = getattr(client, "_transport", None)
        session = getattr(transport, "_session", None)
        if type(transport) is not RequestsHTTPTransport or type(session) is not requests.Session:
            return
        if session.auth is not None or any(session.hooks.values()) or session.proxies:
            return
        if dict(session.headers) != dict(requests.utils.default_headers()):
            return
        if any(env.get(name) for name in _PROXY_ENV):
            return
        verify = session.verify
        if verify is True:  # requests' own choice of CA bundle (`merge_environment_settings`)
            verify = env.get("REQUESTS_CA_BUNDLE") or env.get("CURL_CA_BUNDLE") or certifi.where()
        client._transport = Urllib3HTTPTransport(verify=verify, cert=session.cert)
        session.close()

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
