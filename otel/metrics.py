"""Prometheus metrics for the admin `/metrics` endpoint, on a registry of their own.

The GenAI histograms mirror the semconv v1.41 client metrics (`gen-ai-metrics.md`, `mcp.md`) with
their bucket boundaries; labels are the semconv attribute names with dots turned into underscores,
and an absent attribute is the empty label value. Gateway counters are `tollgate_*`.

Cardinality: a label fed by something an agent controls (model names, agent names, tool names, the
`MCP-Protocol-Version` it sends) keeps at most `label_limit` distinct values per label, then reports
`_OTHER`. Never a run id in a label.
Every method swallows and counts its own errors (`tollgate_telemetry_errors_total{component}`).
`StepSpan` calls `observe_inference` / `observe_chunks` / `observe_mcp` itself when it ends;
call them directly only for operations that have no `StepSpan`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv.attributes import error_attributes as Error
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from otel._labels import GENAI_LABELS, MCP_LABELS, label
from otel._prometheus import (
    BoundedLabel,
    CallbackCounter,
    CounterChild,
    CounterFamily,
    GaugeValue,
    HistogramChild,
    HistogramFamily,
)
from otel._safe import ErrorCounter, guarded

__all__ = ["DURATION_BUCKETS", "INPUT", "MCP_BUCKETS", "OUTPUT", "TOKEN_BUCKETS", "Metrics", "label"]

# Bucket boundaries, semconv v1.41 `explicit_bucket_boundaries_advisory`.
# fmt: off
DURATION_BUCKETS: Final = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# fmt: on
TOKEN_BUCKETS: Final = tuple(float(4**i) for i in range(14))  # 1, 4, 16, ... 67108864
MCP_BUCKETS: Final = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
INPUT: Final = GenAI.GenAiTokenTypeValues.INPUT.value
OUTPUT: Final = GenAI.GenAiTokenTypeValues.OUTPUT.value


_PLANS: Final = 1024  # memoised label sets -> children (keys hold raw, agent-controlled values)


class _InferencePlan:
    """The children one `observe_inference` label set feeds (token ones made on first use)."""

    __slots__ = ("common", "duration", "tokens_in", "tokens_out")

    def __init__(self, common: tuple[str, ...], duration: HistogramChild) -> None:
        self.common = common
        self.duration = duration
        self.tokens_in: HistogramChild | None = None
        self.tokens_out: HistogramChild | None = None


class Metrics:
    """All of tollgate's Prometheus series. One per process (per `Telemetry`); called from the event
    loop's thread only (see `otel._prometheus`)."""

    def __init__(
        self,
        *,
        errors: ErrorCounter | None = None,
        spans_dropped: Callable[[], int] | None = None,
        budget_reserved: Callable[[], float] | None = None,
        label_limit: int = 200,
    ) -> None:
        self._errors = errors or ErrorCounter()
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._model = BoundedLabel(label_limit)
        self._response_model = BoundedLabel(label_limit)
        self._agent = BoundedLabel(label_limit)
        self._tool = BoundedLabel(label_limit)
        self._prompt = BoundedLabel(label_limit)
        self._method = BoundedLabel(label_limit)  # MCP methods: the client names them, any string
        self._protocol = BoundedLabel(label_limit)
        histogram, counter = self._histogram, self._counter
        self._duration = histogram("gen_ai_client_operation_duration_seconds",
            "GenAI operation duration (semconv gen_ai.client.operation.duration).",
            (*GENAI_LABELS, label(Error.ERROR_TYPE)), DURATION_BUCKETS)
        self._tokens = histogram("gen_ai_client_token_usage",
            "Tokens used per operation (semconv gen_ai.client.token.usage).",
            (*GENAI_LABELS, label(GenAI.GEN_AI_TOKEN_TYPE)), TOKEN_BUCKETS)
        self._ttfc = histogram("gen_ai_client_operation_time_to_first_chunk_seconds",
            "Time to the first streamed chunk (semconv gen_ai.client.operation.time_to_first_chunk).",
            GENAI_LABELS, DURATION_BUCKETS)
        self._tpoc = histogram("gen_ai_client_operation_time_per_output_chunk_seconds",
            "Time between streamed chunks (semconv gen_ai.client.operation.time_per_output_chunk).",
            GENAI_LABELS, DURATION_BUCKETS)
        self._mcp = histogram("mcp_client_operation_duration_seconds",
            "MCP request duration (semconv mcp.client.operation.duration).", MCP_LABELS, MCP_BUCKETS)
        self._guard = counter("tollgate_guard_decisions", "Guard decisions.", ("guard", "decision", "reason"))
        self._inference_plans: dict[tuple[str | int | None, ...], _InferencePlan] = {}
        self._guard_plans: dict[tuple[tuple[str, str, str | None], ...], tuple[tuple[CounterChild, int], ...]] = {}
        self._guard_errors = counter("tollgate_guard_errors", "Guards that raised.", ("guard",))
        self._stopped = counter("tollgate_runs_stopped", "Runs stopped, by stop code.", ("reason",))
        self._tools = counter("tollgate_tool_calls", "Tool calls, by decision.", ("decision",))
        self._checks = counter("tollgate_output_checks", "Output grammar checks.", ("kind", "result"))
        self._reasks = counter("tollgate_reasks", "Re-asks after a nonconforming output.", ()).labels()
        self._cost = counter("tollgate_cost_usd", "Settled spend, USD.", ("agent", "provider", "model"))
        self._upstream = counter(
            "tollgate_upstream_requests", "Upstream requests, by status.", ("provider", "status")
        )
        self._reserved = GaugeValue("tollgate_budget_reserved_usd", "USD reserved by in-flight steps.", budget_reserved)
        r.register(self._reserved)
        if spans_dropped is not None:
            read_dropped = spans_dropped
            r.register(
                CallbackCounter(
                    "tollgate_spans_dropped",
                    "Spans lost: export queue full or export failed.",
                    None,
                    lambda: [("", float(read_dropped()))],
                )
            )
        r.register(
            CallbackCounter(
                "tollgate_telemetry_errors",
                "Errors swallowed by telemetry code.",
                "component",
                lambda: [(k, float(v)) for k, v in sorted(self._errors.counts().items())],
            )
        )

    def _histogram(
        self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> HistogramFamily:
        family = HistogramFamily(name, doc, labels, buckets)
        self.registry.register(family)
        return family

    def _counter(self, name: str, doc: str, labels: tuple[str, ...]) -> CounterFamily:
        family = CounterFamily(name, doc, labels)
        self.registry.register(family)
        return family

    def _genai(
        self,
        operation: str,
        provider: str,
        request_model: str | None,
        response_model: str | None,
        server_address: str | None,
        server_port: int | None,
    ) -> tuple[str, ...]:
        return (
            operation,
            provider,
            self._model(request_model),
            self._response_model(response_model),
            server_address or "",
            str(server_port) if server_address and server_port is not None else "",
        )

    @guarded("metrics.observe_inference")
    def observe_inference(
        self,
        *,
        operation: str,
        provider: str,
        request_model: str | None,
        response_model: str | None,
        server_address: str | None,
        server_port: int | None,
        error_type: str | None,
        duration_s: float,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """One finished upstream inference: duration, and token usage when the provider reported it.
        Steps mostly repeat the same few label sets, so each set's children are memoised (a token
        series is only created, and so exposed, once a count is observed)."""
        key = (operation, provider, request_model, response_model, server_address, server_port, error_type)
        plan = self._inference_plans.get(key)
        if plan is None:
            common = self._genai(operation, provider, request_model, response_model, server_address, server_port)
            plan = _InferencePlan(common, self._duration.labels(*common, error_type or ""))
            if len(self._inference_plans) >= _PLANS:
                self._inference_plans.clear()
            self._inference_plans[key] = plan
        plan.duration.observe(duration_s)
        if input_tokens is not None:
            if plan.tokens_in is None:
                plan.tokens_in = self._tokens.labels(*plan.common, INPUT)
            plan.tokens_in.observe(input_tokens)
        if output_tokens is not None:
            if plan.tokens_out is None:
                plan.tokens_out = self._tokens.labels(*plan.common, OUTPUT)
            plan.tokens_out.observe(output_tokens)

    @guarded("metrics.observe_chunks")
    def observe_chunks(
        self,
        *,
        operation: str,
        provider: str,
        request_model: str | None,
        response_model: str | None,
        server_address: str | None,
        server_port: int | None,
        seconds: float,
        gaps: HistogramChild | None = None,
    ) -> None:
        """A stream's time to first chunk and, in `gaps` (a `chunk_gaps()` it filled), the time before
        each later chunk; recorded once the stream ended, with the response model its duration has."""
        labels = self._genai(operation, provider, request_model, response_model, server_address, server_port)
        self._ttfc.labels(*labels).observe(seconds)
        if gaps is not None:
            self._tpoc.labels(*labels).merge(gaps)

    @staticmethod
    def chunk_gaps() -> HistogramChild:
        """An empty accumulator of one stream's chunk gaps, for `observe_chunks` (a step observes them
        without label lookups while it streams)."""
        return HistogramChild(DURATION_BUCKETS)

    @guarded("metrics.observe_mcp")
    def observe_mcp(
        self,
        *,
        method: str,
        tool_name: str | None,
        prompt_name: str | None,
        operation: str | None,
        protocol_version: str | None,
        server_address: str | None,
        server_port: int | None,
        rpc_status_code: str | None,
        error_type: str | None,
        duration_s: float,
    ) -> None:
        port = str(server_port) if server_address and server_port is not None else ""
        self._mcp.labels(
            self._method(method),
            self._tool(tool_name),
            self._prompt(prompt_name),
            operation or "",
            self._protocol(protocol_version),
            server_address or "",
            port,
            rpc_status_code or "",
            error_type or "",
        ).observe(duration_s)

    @guarded("metrics.guard_decision")
    def guard_decision(self, guard: str, decision: str, reason: str | None = None) -> None:
        self._guard.labels(guard, decision, reason or "").inc()

    @guarded("metrics.guard_decision")
    def guard_decisions(self, decisions: Iterable[tuple[str, str, str | None]]) -> None:
        """Several `guard_decision`s at once (a step's whole list): one increment per label set.
        Steps mostly repeat the same few lists, so each list's children and counts are memoised."""
        key = tuple(decisions)
        plan = self._guard_plans.get(key)
        if plan is None:
            counts: dict[tuple[str, str, str], int] = {}
            for guard, decision, reason in key:
                labels = (guard, decision, reason or "")
                counts[labels] = counts.get(labels, 0) + 1
            plan = tuple((self._guard.labels(*labels), count) for labels, count in counts.items())
            if len(self._guard_plans) >= _PLANS:
                self._guard_plans.clear()
            self._guard_plans[key] = plan
        for child, count in plan:
            child.inc(count)

    @guarded("metrics.guard_error")
    def guard_error(self, guard: str) -> None:
        self._guard_errors.labels(guard).inc()

    @guarded("metrics.run_stopped")
    def run_stopped(self, reason: str) -> None:
        self._stopped.labels(reason).inc()

    @guarded("metrics.tool_call")
    def tool_call(self, decision: str) -> None:
        """A tool call proposed or executed: `allowed`, `rejected`, `dropped`, `approved`, `denied`..."""
        self._tools.labels(decision).inc()

    @guarded("metrics.output_check")
    def output_check(self, kind: str, result: str) -> None:
        """A grammar verdict: kind `json_schema`/`regex`/..., result `pass`/`fail`."""
        self._checks.labels(kind, result).inc()

    @guarded("metrics.reask")
    def reask(self) -> None:
        self._reasks.inc()

    @guarded("metrics.cost")
    def cost(self, agent: str, provider: str, model: str, usd: float) -> None:
        """Settled spend of one step (after guard.after)."""
        if usd > 0:
            self._cost.labels(self._agent(agent), provider, self._model(model)).inc(usd)

    @guarded("metrics.upstream_request")
    def upstream_request(self, provider: str, status: int | str) -> None:
        """One upstream HTTP exchange: its status code, or `timeout` / `unreachable`."""
        self._upstream.labels(provider, str(status)).inc()

    @guarded("metrics.set_budget_reserved")
    def set_budget_reserved(self, usd: float) -> None:
        """Only when no `budget_reserved` callback was given at construction."""
        self._reserved.set(usd)

    def render(self) -> tuple[bytes, str]:
        """(payload, content type) of the Prometheus text exposition format 0.0.4."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
