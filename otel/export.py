"""Span export that never costs a request anything, and counts what it loses.

`CountingSpanProcessor` is the SDK `BatchSpanProcessor` (bounded deque, one daemon worker thread that
calls the exporter) with drop accounting around it:

- *queue full*: `span.end()` only appends to the bounded queue. We count spans accepted but not yet
  handed to the exporter; a span ending while that count is at capacity is dropped (the newest,
  not the SDK's oldest) and counted, so the SDK queue itself never overflows and every lost span is
  counted exactly once. (The SDK pops a batch just before calling the exporter; a span ending in
  that instant may be dropped although it would have fit.)
- *export failures*: every span of a batch whose export fails or raises (collector down, 4xx, timeout,
  retries exhausted) is a drop.
- *after shutdown*: spans ending after `shutdown()` are drops.

With the collector unreachable, the worker thread retries in the background (the OTLP exporters' own
bounded backoff) while requests keep appending to the queue: the cost per span stays one deque append.
`abort()` makes a stuck exporter give up at once (used by a bounded `Telemetry.shutdown`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

__all__ = ["CountingSpanExporter", "CountingSpanProcessor", "DropCounter", "bounded", "shutdown_within"]


class DropCounter:
    """Spans waiting in the queue, and spans lost; shared by the processor and its exporter."""

    __slots__ = ("_capacity", "_closed", "_dropped", "_lock", "_pending")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._pending = 0
        self._dropped = 0
        self._closed = False
        self._lock = threading.Lock()

    def enqueue(self) -> bool:
        """One span ends: True if it may enter the queue; False if it is dropped (queue full or
        closed), which is counted."""
        with self._lock:
            if self._closed:
                self._dropped += 1
                return False
            if self._pending >= self._capacity:
                self._dropped += 1
                return False
            self._pending += 1
            return True

    def handed(self, count: int) -> None:
        """`count` spans left the queue for the exporter."""
        with self._lock:
            self._pending = max(0, self._pending - count)

    def lost(self, count: int) -> None:
        with self._lock:
            self._dropped += count

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def abandon(self) -> None:
        """Spans still queued after shutdown will never be exported: count them as drops."""
        with self._lock:
            self._dropped += self._pending
            self._pending = 0

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped


class CountingSpanExporter(SpanExporter):
    """Wraps the real exporter: failed batches are counted, exceptions never escape."""

    def __init__(self, inner: SpanExporter, drops: DropCounter) -> None:
        self._inner = inner
        self._drops = drops
        self._aborted = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._drops.handed(len(spans))
        if self._aborted.is_set():
            self._drops.lost(len(spans))
            return SpanExportResult.FAILURE
        try:
            result = self._inner.export(spans)
        except Exception:  # noqa: BLE001 - any exporter failure is a lost batch, counted below
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._drops.lost(len(spans))
        return result

    def abort(self) -> None:
        """Stop exporting now: interrupts the inner exporter's retry backoff; later batches are drops."""
        if not self._aborted.is_set():
            self._aborted.set()
            self._inner.shutdown()

    def shutdown(self) -> None:
        if not self._aborted.is_set():
            self._aborted.set()
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class CountingSpanProcessor(SpanProcessor):
    """`BatchSpanProcessor` with drop accounting; see the module docstring."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int = 2048,
        schedule_delay_millis: float = 5000,
        max_export_batch_size: int = 512,
        export_timeout_millis: float = 30000,
    ) -> None:
        self._drops = DropCounter(max_queue_size)
        self._exporter = CountingSpanExporter(exporter, self._drops)
        self._batch = BatchSpanProcessor(
            self._exporter,
            max_queue_size=max_queue_size,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=min(max_export_batch_size, max_queue_size),
            export_timeout_millis=export_timeout_millis,
            meter_provider=NoOpMeterProvider(),
        )

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        if self._drops.enqueue():
            self._batch.on_end(span)

    def dropped(self) -> int:
        return self._drops.dropped

    def abort(self) -> None:
        self._exporter.abort()

    def shutdown(self) -> None:
        self._drops.close()
        self._batch.shutdown()  # type: ignore[no-untyped-call]  # unannotated in opentelemetry-sdk 1.45
        self._drops.abandon()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


def bounded(action: Callable[[], object], timeout_s: float) -> threading.Thread:
    """Run `action` on a daemon helper thread and wait at most `timeout_s` for it; the thread is
    returned (still alive if it overran)."""
    worker = threading.Thread(target=action, name="tollgate-otel-flush", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return worker


def shutdown_within(provider: TracerProvider, processor: CountingSpanProcessor, timeout_s: float) -> bool:
    """Shut the provider down within `timeout_s`; past it the exporter is aborted (its retries end,
    the rest of the queue counts as dropped). True if it finished in time."""
    worker = bounded(provider.shutdown, timeout_s)
    if not worker.is_alive():
        return True
    processor.abort()
    worker.join(1.0)
    return False
