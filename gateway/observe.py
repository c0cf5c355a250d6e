"""Stage `record`: one step becomes a span, Prometheus samples and a ledger row.

Telemetry never changes behaviour: every call here is cheap, and failures are counted by the
telemetry layer itself, never raised into the request. Spans start before the upstream call (so the
trace context can be propagated upstream) and end here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.ledger import Ledger, LedgerEntry
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import RunState
from otel.attributes import TOLLGATE_GUARDS, provider_name_for
from otel.redact import Redactor
from otel.runs import RunTotals, context_from_headers, inject_headers, path_fingerprint
from otel.spans import StepSpan
from otel.telemetry import Telemetry


def start_span(gw: Gateway, step: Step, headers: Mapping[str, str]) -> dict[str, str]:
    """Open the step's CLIENT span; returns the trace headers to send upstream."""
    telemetry: Telemetry | None = gw.services.get("telemetry")
    if telemetry is None:
        return {}
    provider = step.route.provider
    url = urlsplit(provider.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    parent = context_from_headers(headers)
    if parent is None:
        parent = telemetry.run_parent(step.run_id, step.agent, epoch=step.extra.get("epoch", 1))
    span = telemetry.start_inference(
        step.call, provider_name=provider_name_for(provider.type, provider.base_url, custom=step.route.provider_name),
        server_address=url.hostname or "", server_port=port, parent=parent, attempt=step.attempts,
        run_id=step.run_id, agent=step.agent,
    )
    step.extra["span"] = span
    if telemetry.capture_content:
        span.capture_input(step.call, gw.services["redactor"])
    return inject_headers(span.context)


def on_step(gw: Gateway, step: Step) -> None:
    """The record stage for a finished step (every outcome)."""
    telemetry: Telemetry | None = gw.services.get("telemetry")
    ledger: Ledger | None = gw.services.get("ledger")
    decision = "stop" if step.stop_reason else ("error" if step.error_type else "allow")
    if telemetry is not None:
        metrics = telemetry.metrics
        for d in step.decisions:
            metrics.guard_decision(d.guard, d.action, d.reason)
        if step.stop_reason:
            metrics.run_stopped(step.stop_reason)
        if step.answer is not None:
            for _ in step.answer.tool_calls:
                metrics.tool_call("allowed" if not step.stop_reason else "stopped")
        denied = int(step.extra.get("tools_denied", 0))
        dropped = int(step.extra.get("tools_dropped", 0))
        for _ in range(dropped):
            metrics.tool_call("dropped")
        for _ in range(denied - dropped):
            metrics.tool_call("rejected")
        for kind in step.outputs.kinds if step.outputs is not None else ():
            metrics.output_check(kind, "fail" if step.violations and decision != "allow" else "pass")
        for _ in range(step.reasks):
            metrics.reask()
        if step.cost_usd:
            metrics.cost(step.agent, step.route.provider_name, step.call.model, step.cost_usd)
        if step.attempts:
            metrics.upstream_request(step.route.provider_name, step.status or (step.error_type or "error"))
        span: StepSpan | None = step.extra.get("span")
        if span is not None:
            # every decision is on the span as one attribute; events (costly in the SDK) mark stops
            span.set(TOLLGATE_GUARDS, ",".join(f"{d.guard}:{d.action}" for d in step.decisions))
            for d in step.decisions:
                if d.stopped:
                    span.guard_event(d.guard, d.action, d.reason, d.detail or None)
            for violation in step.violations:
                span.guard_event("output", "reask", None, violation)
            if step.stop_reason:
                span.stop(step.stop_reason, step.stop_detail)
            elif step.error_type:
                span.fail(step.error_type)
            else:
                if telemetry.capture_content and step.answer is not None:
                    span.capture_output(step.answer, gw.services["redactor"])
                span.finish(step.answer, cost_usd=step.cost_usd)
            span.end()
    if ledger is not None:
        ledger.append_nowait(LedgerEntry(
            agent=step.agent, run_id=step.run_id, operation=step.call.operation, model=step.call.model,
            input_hash=step.call.request_hash, decision="reask" if step.reasks and decision == "allow" else decision,
            reason=step.stop_reason or step.error_type, detail=step.stop_detail or "",
        ))


def end_run(gw: Gateway, state: RunState) -> None:
    """Export the run's `invoke_agent` root span with its totals (when the run stops or is reset)."""
    telemetry: Telemetry | None = gw.services.get("telemetry")
    if telemetry is None:
        return
    decisions = [f"{s.get('operation')}:{s.get('decision')}:{s.get('stop_reason') or ''}" for s in state.steps]
    totals = RunTotals(
        cost_usd=state.used.get("usd", 0.0),
        input_tokens=int(state.used.get("input_tokens", 0)),
        output_tokens=int(state.used.get("output_tokens", 0)),
        llm_calls=int(state.used.get("llm_calls", 0)),
        tool_calls=int(state.used.get("tool_calls", 0)),
        stop_reason=state.stop_reason,
        path_fingerprint=path_fingerprint(decisions),
    )
    telemetry.end_run(state.run_id, state.agent, started_at=state.started_at or time.time(), totals=totals,
                      epoch=state.epoch)


def redactor_for(gw: Gateway) -> Redactor:
    secrets = tuple(p.api_key for p in gw.config.providers.values() if p.api_key)
    secrets += tuple(k for a in gw.config.agents.values() for k in a.keys)
    return Redactor(gw.config.otel.redact, secrets=secrets)
