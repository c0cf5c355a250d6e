"""Step spans: one CLIENT span per upstream attempt (inference) or MCP request.

Lifecycle (util-genai's start / stop / fail shape), all methods safe to call in any order and none
ever raises:

    step = telemetry.start_inference(call, provider_name=..., server_address=..., server_port=...,
                                     parent=ctx, attempt=0)
    try:
        step.guard_event("budget", "continue")
        headers.update(inject_headers(step.context))
        ... forward ...; step.chunk() on each streamed chunk
        step.capture_input(call, redactor)          # no-ops unless capture is on
        step.capture_output(answer, redactor)
        step.finish(answer, cost_usd=cost)          # records the answer and ends the span
    except UpstreamTimeout:
        step.fail("upstream_timeout")               # error.type + status ERROR, ends the span
    finally:
        step.end()                                  # idempotent safety net

A guard stop calls `step.stop(code)`: `error.type` and `tollgate.stop_reason` = the stop code,
status ERROR; then `step.end()` (stopped before upstream: no GenAI client metrics, since no client
operation happened) or `step.finish(answer)` (stopped after the answer: metrics describe the
successful upstream operation, the span the stopped step).
`step.error(code, upstream=...)` marks a refusal that is not a stop, or an upstream failure, without
ending the span (a partial answer can still be finished); a span keeps the first error code set.

Ending the span also records the semconv histograms in `Metrics` (duration, token usage, time to
first chunk and per output chunk; MCP duration), with `error.type` of an upstream failure only.
"""

from __future__ import annotations

import time
from typing import Literal

from opentelemetry.context import Context
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv._incubating.attributes import rpc_attributes as Rpc
from opentelemetry.semconv.attributes import error_attributes as Error
from opentelemetry.trace import Span, Status, StatusCode, set_span_in_context
from opentelemetry.util.types import AttributeValue

from gateway.call import Answer, Call
from otel import content
from otel._labels import StepLabels, is_rpc_code
from otel._prometheus import HistogramChild
from otel._safe import ErrorCounter, guarded
from otel.attributes import (
    EMBEDDINGS,
    TOLLGATE_COST_USD,
    TOLLGATE_GUARD_EVENT,
    TOLLGATE_STOP_REASON,
    TOOL_ERROR,
    guard_event_attributes,
    inference_end_attributes,
)
from otel.metrics import Metrics
from otel.propagation import extract_meta_context, headers_for, inject_meta_context
from otel.redact import Redactor

__all__ = ["StepKind", "StepLabels", "StepSpan", "extract_meta_context", "inject_meta_context"]

StepKind = Literal["inference", "mcp"]


class StepSpan:
    """One step's span and its metric labels. Created by `Telemetry.start_inference` / `start_mcp`
    per request; not shared between requests."""

    __slots__ = (
        "_answer",
        "_capture",
        "_context",
        "_ended",
        "_error_set",
        "_errors",
        "_gaps",
        "_kind",
        "_labels",
        "_last_chunk",
        "_metrics",
        "_parent",
        "_recording",
        "_rpc_code",
        "_span",
        "_start",
        "_stopped",
        "_ttfc",
        "_upstream",
        "_upstream_error",
    )

    def __init__(
        self,
        span: Span,
        *,
        kind: StepKind,
        parent: Context | None,
        labels: StepLabels,
        metrics: Metrics | None,
        errors: ErrorCounter,
        capture: bool,
        started: float | None = None,
    ) -> None:
        """`started`: `time.perf_counter()` when the step's operation began, if before now."""
        self._span = span
        self._kind = kind
        self._parent = parent
        self._labels = labels
        self._metrics = metrics
        self._errors = errors
        self._recording = span.is_recording()
        self._capture = capture and self._recording
        self._start = time.perf_counter() if started is None else started
        self._context: Context | None = None
        self._ended = False
        self._error_set = False
        self._stopped = False
        self._upstream = False
        self._upstream_error: str | None = None
        self._rpc_code: str | None = None
        self._answer: Answer | None = None
        self._ttfc: float | None = None
        self._last_chunk = 0.0
        self._gaps: HistogramChild | None = None

    @property
    def span(self) -> Span:
        return self._span

    @property
    def is_recording(self) -> bool:
        return self._recording

    @property
    def context(self) -> Context:
        """Context holding this span: parent for nested spans, source for `inject_headers` /
        `inject_meta_context`. When tracing is off it holds the caller's parent unchanged."""
        if self._context is None:
            self._context = set_span_in_context(self._span, self._parent or Context())
        return self._context

    def trace_headers(self) -> dict[str, str]:
        """W3C trace headers for the upstream: `inject_headers(self.context)` without the context."""
        return headers_for(self._span.get_span_context())

    @guarded("span.set")
    def set(self, key: str, value: AttributeValue) -> None:
        if self._recording:
            self._span.set_attribute(key, value)

    @guarded("span.guard_event")
    def guard_event(
        self, name: str, decision: str, reason: str | None = None, detail: str | None = None
    ) -> None:
        """A guard, tool or grammar decision on this step, as a `tollgate.guard` span event."""
        if self._recording:
            self._span.add_event(TOLLGATE_GUARD_EVENT, guard_event_attributes(name, decision, reason, detail))

    @guarded("span.chunk")
    def chunk(self) -> None:
        """A streamed chunk (an event) arrived: the first is the time to first chunk, each later one a
        time-per-output-chunk sample, from the previous one."""
        now = time.perf_counter()
        last, self._last_chunk = self._last_chunk, now
        if self._ttfc is not None:
            if self._gaps is None and self._metrics is not None:
                self._gaps = self._metrics.chunk_gaps()
            if self._gaps is not None:
                self._gaps.observe(now - last)
            return
        self._ttfc = now - self._start
        self._upstream = True
        if self._recording:
            self._span.set_attribute(GenAI.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, self._ttfc)

    @guarded("span.capture_input")
    def capture_input(self, call: Call, redactor: Redactor) -> None:
        """Opt-in content of the request (redacted); a no-op unless capture is on and recording."""
        if not self._capture:
            return
        if self._kind == "mcp":
            self._set_content(GenAI.GEN_AI_TOOL_CALL_ARGUMENTS, content.tool_call_arguments(call), redactor)
            return
        self._set_content(GenAI.GEN_AI_INPUT_MESSAGES, content.input_messages(call), redactor)
        self._set_content(GenAI.GEN_AI_SYSTEM_INSTRUCTIONS, content.system_instructions(call), redactor)
        self._set_content(GenAI.GEN_AI_TOOL_DEFINITIONS, content.tool_definitions(call), redactor)

    @guarded("span.capture_output")
    def capture_output(self, answer: Answer, redactor: Redactor) -> None:
        """Opt-in content of the answer (redacted); a no-op unless capture is on and recording."""
        if not self._capture:
            return
        if self._kind == "mcp":
            self._set_content(GenAI.GEN_AI_TOOL_CALL_RESULT, content.tool_call_result(answer), redactor)
        else:
            self._set_content(GenAI.GEN_AI_OUTPUT_MESSAGES, content.output_messages(answer), redactor)

    def _set_content(self, key: str, text: str | None, redactor: Redactor) -> None:
        if text:
            self._span.set_attribute(key, redactor.redact(text))

    @guarded("span.stop")
    def stop(self, code: str, message: str | None = None) -> None:
        """A guard stopped the step (DESIGN section 4 code). Does not end the span."""
        self._stopped = True
        self._error_set = True
        if self._recording:
            self._span.set_attribute(Error.ERROR_TYPE, code)
            self._span.set_attribute(TOLLGATE_STOP_REASON, code)
            self._span.set_status(Status(StatusCode.ERROR, message or code))

    @guarded("span.finish")
    def finish(self, answer: Answer | None, *, cost_usd: float | None = None) -> None:
        """The upstream answered: record the answer (usage, response id/model, finish reasons; for MCP
        `error.type = tool_error` when the result is an error) and the step's cost, then end."""
        try:
            if answer is not None:
                self._answer = answer
                self._upstream = True
                if self._recording:
                    self._record_answer(answer)
            if cost_usd is not None and self._recording:
                self._span.set_attribute(TOLLGATE_COST_USD, float(cost_usd))
        finally:
            self.end()

    def _record_answer(self, answer: Answer) -> None:
        if self._kind == "mcp":
            if answer.is_error and not self._stopped and not self._error_set:
                self._error_set = True
                self._upstream_error = self._upstream_error or TOOL_ERROR
                self._span.set_attribute(Error.ERROR_TYPE, self._upstream_error)
                self._span.set_status(Status(StatusCode.ERROR, "tool returned an error"))
            return
        self._span.set_attributes(inference_end_attributes(answer, provider_name=self._labels.provider,
                                                           operation=self._labels.operation))

    @guarded("span.fail")
    def fail(self, error_type: str, message: str | None = None) -> None:
        """The upstream operation failed (`upstream_timeout`, `upstream_unavailable`, an HTTP status
        such as `429`, a JSON-RPC code such as `-32602`, or `_OTHER`): `error.type`, status ERROR, end."""
        try:
            self.error(error_type, message, upstream=True)
        finally:
            self.end()

    @guarded("span.error")
    def error(self, error_type: str, message: str | None = None, *, upstream: bool, jsonrpc: bool = True) -> None:
        """The step failed; does not end the span. `upstream=True`: the upstream operation failed, as
        for `fail` (the GenAI metrics carry `error.type`). `upstream=False`: tollgate refused or broke
        off the step without a stop (`invalid_request`, `output_nonconforming`, `client_disconnected`):
        `error.type` and status ERROR on the span; an upstream operation that did happen is still
        measured as a success. The first error code (or a stop's) is never overwritten. On an MCP span a
        numeric `error_type` is the JSON-RPC error code (`rpc.response.status_code`), unless `jsonrpc`
        is False: the server's HTTP status, when it answered no JSON-RPC response."""
        first = not (self._stopped or self._error_set)
        rpc = upstream and jsonrpc and self._kind == "mcp" and is_rpc_code(error_type)
        if upstream:
            self._upstream = True
            self._upstream_error = error_type
            self._rpc_code = error_type if rpc else self._rpc_code
        else:
            self._stopped = True
        if self._recording:
            if rpc:
                self._span.set_attribute(Rpc.RPC_RESPONSE_STATUS_CODE, error_type)
            if first:
                self._error_set = True
                self._span.set_attribute(Error.ERROR_TYPE, error_type)
                self._span.set_status(Status(StatusCode.ERROR, message or error_type))

    @guarded("span.end")
    def end(self) -> None:
        """End the span and record the step's metrics; idempotent."""
        if self._ended:
            return
        self._ended = True
        duration = time.perf_counter() - self._start
        try:
            self._record_metrics(duration)
        finally:
            self._span.end()

    def _record_metrics(self, duration: float) -> None:
        metrics = self._metrics
        if metrics is None or (self._stopped and not self._upstream):
            return
        labels = self._labels
        if self._kind == "mcp":
            metrics.observe_mcp(
                method=labels.method,
                tool_name=labels.tool_name, prompt_name=labels.prompt_name,
                operation=labels.operation or None,
                protocol_version=labels.protocol_version,
                server_address=labels.server_address,
                server_port=labels.server_port,
                rpc_status_code=self._rpc_code,
                error_type=self._upstream_error,
                duration_s=duration,
            )
            return
        answer = self._answer
        usage = answer.usage if answer is not None else None
        response_model = answer.model if answer is not None else None  # the chunk metrics' too
        metrics.observe_inference(
            operation=labels.operation, provider=labels.provider, request_model=labels.request_model,
            response_model=response_model, server_address=labels.server_address, server_port=labels.server_port,
            error_type=self._upstream_error,
            duration_s=duration,
            input_tokens=usage.input_tokens if usage else None,
            output_tokens=usage.output_tokens if usage and labels.operation != EMBEDDINGS else None,
        )
        if self._ttfc is not None:
            metrics.observe_chunks(operation=labels.operation, provider=labels.provider,
                                   request_model=labels.request_model, response_model=response_model,
                                   server_address=labels.server_address, server_port=labels.server_port,
                                   seconds=self._ttfc, gaps=self._gaps)
