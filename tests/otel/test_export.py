"""Export never costs a request anything, and every lost span is counted."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.otel.samples import OPENAI_ANSWER, openai_call

SMALL_QUEUE = {
    "OTEL_BSP_MAX_QUEUE_SIZE": "4",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2",
    "OTEL_BSP_SCHEDULE_DELAY": "60000",
}


class GateExporter(SpanExporter):
    """Blocks in `export` until released (or shut down): a collector that hangs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        self.exported.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


class FailingExporter(SpanExporter):
    def __init__(self, *, raises: bool) -> None:
        self.raises = raises

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.raises:
            raise ConnectionError("collector down")
        return SpanExportResult.FAILURE


def one_step(telemetry: Telemetry) -> float:
    """A full inference step; returns the seconds spent in `finish` (which ends the span)."""
    step = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=None,
        attempt=0,
    )
    step.guard_event("budget", "continue")
    started = time.perf_counter()
    step.finish(OPENAI_ANSWER, cost_usd=0.01)
    return time.perf_counter() - started


def test_queue_full_drops_are_counted() -> None:
    gate = GateExporter()
    telemetry = setup_telemetry(SMALL_QUEUE, exporter=gate)
    one_step(telemetry)
    one_step(telemetry)  # batch size reached: the worker takes both and hangs in export
    assert gate.entered.wait(10)
    for _ in range(4 + 3):  # 4 fit in the queue, 3 do not
        one_step(telemetry)
    assert telemetry.spans_dropped() == 3
    gate.release.set()
    assert telemetry.force_flush()
    assert len(gate.exported) == 6 and telemetry.spans_dropped() == 3
    assert telemetry.shutdown()


def test_export_failures_are_counted() -> None:
    for raises in (False, True):
        telemetry = setup_telemetry({}, exporter=FailingExporter(raises=raises))
        for _ in range(5):
            one_step(telemetry)
        assert telemetry.force_flush()
        assert telemetry.spans_dropped() == 5
        assert telemetry.shutdown()
        one_step(telemetry)  # after shutdown: dropped, counted, no error
        assert telemetry.spans_dropped() == 6
        assert telemetry.errors() == {}
        assert "tollgate_spans_dropped_total 6.0" in telemetry.metrics.render()[0].decode()


def test_shutdown_is_bounded_when_the_collector_hangs() -> None:
    gate = GateExporter()
    telemetry = setup_telemetry(SMALL_QUEUE, exporter=gate)
    one_step(telemetry)
    one_step(telemetry)
    assert gate.entered.wait(10)
    one_step(telemetry)  # queued behind the hung export
    started = time.perf_counter()
    assert telemetry.shutdown(timeout_s=0.2) is False
    assert time.perf_counter() - started < 5
    assert telemetry.spans_dropped() == 1  # the queued span, abandoned with the aborted exporter
    assert telemetry.shutdown() is True  # idempotent


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_collector_down_costs_requests_nothing_and_drops_are_counted() -> None:
    baseline = setup_telemetry({}, exporter=FailingExporter(raises=False))
    down = setup_telemetry(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "300",
            "OTEL_BSP_MAX_QUEUE_SIZE": "64",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "16",
            "OTEL_BSP_SCHEDULE_DELAY": "10",
        }
    )
    steps = 600
    for _ in range(50):  # warm up both
        one_step(baseline), one_step(down)
    base_times = [one_step(baseline) for _ in range(steps)]
    down_times = [one_step(down) for _ in range(steps)]
    # Ending a span is a queue append whatever the collector does: no blocking, no retries inline.
    # (Generous bounds: the worker thread's failed exports still compete for the GIL on a busy box.)
    assert statistics.median(down_times) < statistics.median(base_times) * 3 + 200e-6
    assert sorted(down_times)[int(steps * 0.99)] < 0.05
    assert down.force_flush(timeout_s=10)
    assert down.spans_dropped() == steps + 50  # every span: lost to a full queue or a failed export
    assert down.shutdown(timeout_s=5) and baseline.shutdown()


class BatchSizes(SpanExporter):
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.first = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sizes.append(len(spans))
        self.first.set()
        return SpanExportResult.SUCCESS


def test_export_batches_are_small_by_default_and_configurable() -> None:
    """64 spans per export, not the SDK's 512: the export thread holds the GIL while it encodes, and a
    long burst delays the event loop (the paced p99 of `make bench`)."""
    for env, size in (({}, 64), ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8"}, 8)):
        exporter = BatchSizes()
        telemetry = setup_telemetry({"OTEL_BSP_SCHEDULE_DELAY": "60000", **env}, exporter=exporter)
        try:
            for _ in range(size):
                one_step(telemetry)
            assert exporter.first.wait(10), "a full batch was not exported"
            assert exporter.sizes[0] == size
        finally:
            telemetry.shutdown(5.0)
