"""Forwarded calls: the GenAI operation of a path, and the HTTP client span of the others."""

from __future__ import annotations

import pytest

from otel.http import HTTP_RESPONSE_STATUS_CODE, http_client_attributes, operation_for_path
from otel.spans import StepLabels
from otel.telemetry import Telemetry
from tests.otel.conftest import Spans


@pytest.mark.parametrize(
    ("tail", "operation"),
    [("/embeddings", "embeddings"), ("/Embeddings/", "embeddings"), ("/completions", "text_completion"),
     ("/files", None), ("/embeddings/x", None), ("", None)],
)
def test_operation_for_path(tail: str, operation: str | None) -> None:
    assert operation_for_path(tail) == operation


def test_http_client_attributes() -> None:
    assert http_client_attributes("GET", "https://api.x/v1/files", "api.x", 443) == {
        "http.request.method": "GET", "url.full": "https://api.x/v1/files", "server.address": "api.x",
        "server.port": 443}
    assert http_client_attributes("POST", "", None, 0) == {"http.request.method": "POST"}
    assert HTTP_RESPONSE_STATUS_CODE == "http.response.status_code"


def test_start_http_is_a_client_span_outside_the_genai_metrics(telemetry: Telemetry, spans: Spans) -> None:
    labels = StepLabels(operation="", provider="openai", server_address="api.x", server_port=443)
    step = telemetry.start_http("DELETE", "https://api.x/v1/files/f", labels=labels, parent=None, run_id="r",
                                agent="a")
    step.set(HTTP_RESPONSE_STATUS_CODE, 500)
    step.fail("500")
    [span] = spans()
    assert span.name == "DELETE" and span.kind.name == "CLIENT"
    assert dict(span.attributes or {}) == {
        "http.request.method": "DELETE", "url.full": "https://api.x/v1/files/f", "server.address": "api.x",
        "server.port": 443, "tollgate.run_id": "r", "tollgate.agent": "a", "http.response.status_code": 500,
        "error.type": "500"}
    assert "gen_ai_client_operation_duration_seconds_count" not in telemetry.metrics.render()[0].decode()
