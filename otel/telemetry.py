"""`Telemetry`: the one object the pipeline holds (app state, built by `setup_telemetry`).

It owns a private `TracerProvider` (never installed globally), the drop-counting batch processor and
the Prometheus `Metrics`, and hands out `StepSpan`s. Every method is safe on the request path: it
never raises (errors are counted in `tollgate_telemetry_errors_total`) and never blocks on export.
`shutdown()` and `force_flush()` block for at most their timeout: call them off the event loop
(`await asyncio.to_thread(telemetry.shutdown)`) in the app's cleanup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace import (
    INVALID_SPAN,
    NonRecordingSpan,
    Span,
    SpanKind,
    Status,
    StatusCode,
    get_current_span,
)

from gateway.call import Call
from otel._fastspan import FastTracer, Reserved
from otel._safe import ErrorCounter, guarded
from otel.attributes import (
    EXECUTE_TOOL,
    TOLLGATE_AGENT,
    TOLLGATE_ATTEMPT,
    TOLLGATE_RUN_ID,
    TOOLS_CALL,
    Attributes,
    inference_start_attributes,
)
from otel.export import CountingSpanProcessor, bounded, shutdown_within
from otel.http import http_client_attributes
from otel.mcp_attributes import McpOperation, mcp_attributes, mcp_span_name
from otel.metrics import Metrics
from otel.runs import (
    INVOKE_AGENT,
    RunIdGenerator,
    RunParents,
    RunTotals,
    run_ids,
    run_root_attributes,
)
from otel.spans import StepKind, StepLabels, StepSpan

__all__ = [
    "Telemetry",
]



def _inference_name(call: Call) -> str:
    return f"{call.operation} {call.model}" if call.model else call.operation


def _nanos(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


class Telemetry:
    """Tracing and metrics for one gateway process. Build with `setup_telemetry(env)`."""

    def __init__(
        self,
        *,
        tracer: FastTracer | None,
        provider: TracerProvider | None,
        processor: CountingSpanProcessor | None,
        sampler: Sampler | None,
        ids: RunIdGenerator | None,
        metrics: Metrics,
        errors: ErrorCounter,
        capture_content: bool,
    ) -> None:
        self._tracer = tracer
        self._provider = provider
        self._processor = processor
        self._sampler = sampler
        self._ids = ids
        self._errors = errors
        self._parents = RunParents(sampler) if tracer is not None and sampler is not None else None
        self._lock = threading.Lock()
        self._closed = False
        self.metrics = metrics
        self.capture_content = capture_content

    @property
    def tracing(self) -> bool:
        """True when spans are recorded and exported (an exporter is configured, SDK not disabled)."""
        return self._tracer is not None

    def _passthrough(self, parent: Context | None) -> Span:
        """Tracing off: a non-recording span carrying the parent's context (so it propagates as is)."""
        if parent is None:
            return INVALID_SPAN
        return NonRecordingSpan(get_current_span(parent).get_span_context())

    def _step(self, start: Callable[[FastTracer], Span], parent: Context | None, kind: StepKind,
              labels: StepLabels, started: float | None = None, *, measured: bool = True) -> StepSpan:
        tracer = self._tracer
        try:
            span = start(tracer) if tracer is not None else self._passthrough(parent)
        except Exception:  # noqa: BLE001 - counted; the step still gets a (non-recording) span
            self._errors.record(f"start_{kind}")
            span = self._passthrough(parent)
        return StepSpan(
            span,
            kind=kind,
            parent=parent,
            labels=labels,
            metrics=self.metrics if measured else None,
            errors=self._errors,
            capture=self.capture_content,
            started=started,
        )

    def _tollgate(self, attrs: Attributes, run_id: str | None, agent: str | None) -> Attributes:
        if run_id:
            attrs[TOLLGATE_RUN_ID] = run_id
        if agent:
            attrs[TOLLGATE_AGENT] = agent
        return attrs

    def start_inference(
        self,
        call: Call,
        *,
        provider_name: str,
        server_address: str,
        server_port: int,
        parent: Context | None,
        attempt: int = 0,
        run_id: str | None = None,
        agent: str | None = None,
        start_time: float | None = None,
        reserved: Reserved | None = None,
        started: float | None = None,
    ) -> StepSpan:
        """Start the CLIENT span `{operation} {model}` of one upstream attempt.

        `parent`: `run_parent(...)` or the agent's `context_from_headers(...)`; None starts a new
        trace (the ambient context is never used implicitly). `attempt` counts re-asks of the step.
        `start_time` (Unix seconds; default now) backdates a span opened late, e.g. for a step a
        guard stopped before any upstream call. `reserved`: the span's identity from
        `reserve_inference` (its trace context may already have gone upstream); `started`:
        `time.perf_counter()` at that moment, the start of the duration the metrics record.
        """
        labels = StepLabels(
            operation=call.operation,
            provider=provider_name,
            request_model=call.model or None,
            server_address=server_address or None,
            server_port=server_port,
        )

        def start(tracer: FastTracer) -> Span:
            attrs = inference_start_attributes(
                call, provider_name=provider_name, server_address=server_address, server_port=server_port
            )
            attrs[TOLLGATE_ATTEMPT] = attempt
            attrs = self._tollgate(attrs, run_id, agent)
            name, start_ns = _inference_name(call), _nanos(start_time)
            if reserved is not None:
                return tracer.start_reserved(reserved, name, SpanKind.CLIENT, attrs, start_ns)
            return tracer.start_span(name, parent or Context(), SpanKind.CLIENT, attrs, start_time=start_ns)

        return self._step(start, parent, "inference", labels, started)

    def start_http(self, method: str, url: str, *, labels: StepLabels, parent: Context | None,
                   run_id: str | None = None, agent: str | None = None) -> StepSpan:
        """The HTTP CLIENT span `{method}` of a call forwarded with no GenAI operation (`url` without its
        query string); no GenAI metric measures it."""

        def start(tracer: FastTracer) -> Span:
            attrs = http_client_attributes(method, url, labels.server_address, labels.server_port)
            return tracer.start_span(method, parent or Context(), SpanKind.CLIENT, self._tollgate(attrs, run_id, agent))

        return self._step(start, parent, "inference", labels, measured=False)

    def reserve_inference(self, call: Call, parent: Context | None) -> Reserved:
        """Decide now the identity (ids, sampling) of the span that `start_inference(...,
        reserved=...)` starts later; `.context` is the trace context to send upstream, so the span
        itself can be built while the upstream works. With tracing off (or if deciding fails, which
        is counted): the parent's context, passed through, and nothing recorded."""
        tracer = self._tracer
        if tracer is not None:
            try:
                return tracer.reserve(_inference_name(call), parent or Context(), SpanKind.CLIENT)
            except Exception:  # noqa: BLE001 - counted; the step then sends its parent's context
                self._errors.record("start_inference")
        return Reserved(self._passthrough(parent).get_span_context(), None, False, {})

    def start_mcp(
        self,
        op: McpOperation,
        *,
        parent: Context | None = None,
        run_id: str | None = None,
        agent: str | None = None,
        start_time: float | None = None,
    ) -> StepSpan:
        """Start the MCP CLIENT span `tools/call {tool}` (or `{method}`) of one forwarded request.
        `parent` usually comes from `extract_meta_context(params._meta)` or `run_parent(...)`;
        `start_time` as for `start_inference`."""
        labels = StepLabels(
            operation=EXECUTE_TOOL if op.method == TOOLS_CALL else "",
            method=op.method,
            tool_name=op.tool_name,
            prompt_name=op.prompt_name,
            protocol_version=op.protocol_version,
            server_address=op.server_address,
            server_port=op.server_port,
        )

        def start(tracer: FastTracer) -> Span:
            attrs = self._tollgate(mcp_attributes(op), run_id, agent)
            return tracer.start_span(mcp_span_name(op), parent or Context(), SpanKind.CLIENT, attrs,
                                     start_time=_nanos(start_time))

        return self._step(start, parent, "mcp", labels)

    def run_parent(self, run_id: str, agent: str, *, epoch: int | str = 0, segment: int = 0) -> Context:
        """Parent context for the steps of a run without agent trace context: the (future) root span
        `invoke_agent {agent}` with ids derived from `(run_id, epoch, segment)` (`RunParents`; the segment
        the run store gives: `RunState.root_segment`). Empty when tracing is off."""
        if self._parents is None:
            return Context()
        try:
            return self._parents.get(run_id, agent, epoch, segment)
        except Exception:  # noqa: BLE001 - counted; steps then start their own traces
            self._errors.record("run_parent")
            return Context()

    @guarded("end_run")
    def end_run(self, run_id: str, agent: str, *, started_at: float, totals: RunTotals,
                epoch: int | str = 0, segment: int = 0, start: float | None = None) -> bool:
        """Export the root span of the run epoch's `segment` (start = `start`, else `started_at`, Unix
        seconds; end = now) with its totals (`error.type`: the stop reason). Which segment, and whether
        it is exported at all, is the caller's to decide once (`RunStore.claim_root`). False when tracing
        is off."""
        if self._tracer is None or self._ids is None:
            return False
        trace_id, span_id = run_ids(run_id, epoch, segment)
        name = f"{INVOKE_AGENT} {agent}" if agent else INVOKE_AGENT
        with self._ids.override(trace_id, span_id):
            span = self._tracer.start_span(
                name,
                context=Context(),
                kind=SpanKind.INTERNAL,
                attributes=run_root_attributes(run_id, agent, totals, epoch, segment),
                start_time=int((started_at if start is None else start) * 1e9),
            )
        if totals.stop_reason:
            span.set_status(Status(StatusCode.ERROR, totals.stop_reason))
        span.end()
        return True

    def record_error(self, component: str) -> None:
        """Count a telemetry failure of the caller's (`tollgate_telemetry_errors_total{component}`)."""
        self._errors.record(component)

    def spans_dropped(self) -> int:
        """Spans lost so far: export queue full, export failed, or ended after shutdown."""
        return self._processor.dropped() if self._processor is not None else 0

    def errors(self) -> dict[str, int]:
        """Errors telemetry swallowed, by component (also `tollgate_telemetry_errors_total`)."""
        return self._errors.counts()

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export everything queued; blocks up to `timeout_s`. True if it finished in time."""
        provider = self._provider
        if provider is None or self._closed:
            return True
        return not bounded(provider.force_flush, timeout_s).is_alive()

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush and stop exporting, within `timeout_s` (then the exporter is aborted and what is left
        counts as dropped). Idempotent; spans ending afterwards are dropped and counted."""
        provider, processor = self._provider, self._processor
        with self._lock:
            if self._closed or provider is None or processor is None:
                self._closed = True
                return True
            self._closed = True
        return shutdown_within(provider, processor, timeout_s)
