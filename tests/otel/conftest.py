"""Fixtures: a real SDK pipeline into an in-memory exporter (flushed, never slept on)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.redact import Redactor
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.otel.samples import PROVIDER_KEY

Spans = Callable[[], list[ReadableSpan]]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def telemetry(exporter: InMemorySpanExporter) -> Iterator[Telemetry]:
    telemetry = setup_telemetry({}, exporter=exporter)
    yield telemetry
    telemetry.shutdown()


@pytest.fixture
def captured(exporter: InMemorySpanExporter) -> Iterator[Telemetry]:
    """Telemetry with content capture on."""
    telemetry = setup_telemetry(
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"}, exporter=exporter
    )
    yield telemetry
    telemetry.shutdown()


@pytest.fixture
def spans(exporter: InMemorySpanExporter, telemetry: Telemetry) -> Spans:
    """Flush, then the finished spans in end order."""

    def finished() -> list[ReadableSpan]:
        assert telemetry.force_flush()
        return list(exporter.get_finished_spans())

    return finished


@pytest.fixture
def redactor() -> Redactor:
    return Redactor((r"ACME-\d{6}",), secrets=(PROVIDER_KEY,))
