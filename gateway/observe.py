"""Stage `record`: one step becomes spans, Prometheus samples and a ledger row.

Telemetry never changes behaviour: every call here is cheap, and failures are counted by the
telemetry layer itself, never raised into the request. Spans start before the upstream call (so the
trace context can be propagated upstream) and end here.

Model calls: one CLIENT span per upstream *attempt* (a re-ask is a new attempt).

- `start_span` opens the span of the attempt about to be forwarded and returns the trace headers
  for the upstream. It is safe to call on every pass of the re-ask loop: a second call for the same
  attempt returns the same headers; a call for a new attempt first ends the previous attempt's span
  (its answer, cost and the reason of the re-ask). Called once per step, as `proxy.run_step` does
  today, the one span covers every attempt.
- `on_step` ends the last span with the step's outcome. A step that never reached the upstream (a
  guard stopped it, the request was refused) still gets a span, backdated to the step's start, with
  `error.type` = the stop or error code; a stop always carries a `tollgate.guard` event.
- Trace parent: the agent's W3C `traceparent` when it sent one, else the run's `invoke_agent` root
  (ids derived from run id and epoch), which `end_run` exports when the run stops or is reset.
  `begin_step` caches the agent's context on the step; without it a step stopped before
  `start_span` lands in the run's trace even when the agent sent a `traceparent`.

MCP `tools/call`: `start_tool_span` opens the MCP CLIENT span before the call is forwarded (parent
from `params._meta`, else the HTTP `traceparent`, else the run root) and returns the body to forward
with the span's context in `params._meta`; `end_tool_span` ends it (or opens and ends one for a call
refused before forwarding) and exports the run's root span when the call stopped the run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import orjson
from opentelemetry.context import Context

from gateway.call import Answer, Call, ToolCall, ToolResult
from gateway.errors import GatewayError
from gateway.ledger import Ledger, LedgerEntry
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import RunState
from guards.base import Decision
from otel.attributes import TOLLGATE_GUARDS, TOOLS_CALL, provider_name_for
from otel.metrics import Metrics
from otel.propagation import extract_meta_context, inject_meta_context
from otel.redact import Redactor
from otel.runs import RunTotals, context_from_headers, inject_headers, path_fingerprint
from otel.spans import StepSpan
from otel.telemetry import Telemetry

if TYPE_CHECKING:
    from gateway.jsonrpc import Message
    from gateway.mcp_transport import McpRequest

# step.extra keys ("span" and "trace_headers" are also read by relay.py / proxy.py)
SPAN: Final = "span"
HEADERS: Final = "trace_headers"
_ATTEMPT: Final = "span_attempt"  # the attempt index of step.extra[SPAN]
_PARENT: Final = "trace_parent"  # the agent's trace context (Context), or None when it sent none
_DECISIONS: Final = "span_decisions"  # step.decisions already put on an earlier attempt's span
_OPENED: Final = "span_opened"  # len(step.decisions) when the current span opened (its guard.before ran)
_VIOLATIONS: Final = "span_violations"  # step.violations already put on an earlier attempt's span
_COSTS: Final = "attempt_costs"  # settled cost of the attempts whose spans already ended
_RESERVED: Final = "reserved_usd"  # this step's contribution to the in-flight reserved-USD gauge
_DROPS: Final = "span_drops"  # the tool-drop event is on a span already

_UPSTREAM_ERRORS: Final = frozenset({"upstream_unavailable", "upstream_timeout"})
# the guard behind a stop that no guard decision names (a store denial of a claim, a tool refusal)
_STOP_GUARD: Final[Mapping[str, str]] = {
    "budget_exhausted": "budget",
    "token_budget_exhausted": "budget",
    "llm_call_cap": "caps",
    "tool_call_cap": "caps",
    "time_cap": "caps",
    "loop_detected": "loop",
    "no_progress": "progress",
    "tool_not_allowed": "tools",
}
_RESERVED_SERVICE: Final = "observe.reserved_usd"


def _telemetry(gw: Gateway) -> Telemetry | None:
    telemetry: Telemetry | None = gw.services.get("telemetry")
    return telemetry


# -- model calls ----------------------------------------------------------------------------------


def begin_step(gw: Gateway, step: Step, headers: Mapping[str, str]) -> None:
    """Remember the agent's trace context on the step (cheap; call once, before `run_step`)."""
    if _PARENT not in step.extra:
        step.extra[_PARENT] = context_from_headers(headers)


def _parent(telemetry: Telemetry, step: Step) -> Context:
    agent_ctx: Context | None = step.extra.get(_PARENT)
    if agent_ctx is not None:
        return agent_ctx
    return telemetry.run_parent(step.run_id, step.agent, epoch=step.extra.get("epoch", 1))


def _open(gw: Gateway, telemetry: Telemetry, step: Step, attempt: int, start_time: float | None) -> StepSpan:
    provider = step.route.provider
    url = urlsplit(provider.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    span = telemetry.start_inference(
        step.call,
        provider_name=provider_name_for(provider.type, provider.base_url, custom=step.route.provider_name),
        server_address=url.hostname or "", server_port=port, parent=_parent(telemetry, step), attempt=attempt,
        run_id=step.run_id, agent=step.agent, start_time=start_time,
    )
    step.extra[SPAN] = span
    step.extra[_ATTEMPT] = attempt
    step.extra[_OPENED] = len(step.decisions)
    if telemetry.capture_content:
        span.capture_input(step.call, gw.services["redactor"])
    return span


def start_span(gw: Gateway, step: Step, headers: Mapping[str, str]) -> dict[str, str]:
    """Open the CLIENT span of the attempt about to be forwarded (`step.attempts` not yet counted);
    returns the trace headers to send upstream. See the module docstring for re-asks."""
    telemetry = _telemetry(gw)
    if telemetry is None:
        return {}
    begin_step(gw, step, headers)
    span: StepSpan | None = step.extra.get(SPAN)
    if span is not None:
        if step.extra.get(_ATTEMPT) == step.attempts:
            cached: dict[str, str] = step.extra.get(HEADERS, {})
            return cached
        _end_reasked(gw, telemetry, step, span)
    span = _open(gw, telemetry, step, step.attempts, None)
    _reserve(gw, telemetry.metrics, step)
    out = inject_headers(span.context)
    step.extra[HEADERS] = out
    return out


def _end_reasked(gw: Gateway, telemetry: Telemetry, step: Step, span: StepSpan) -> None:
    """The attempt of `span` was answered and re-asked: end its span with that answer."""
    _annotate(span, step, final=False)
    if telemetry.capture_content and step.answer is not None:
        span.capture_output(step.answer, gw.services["redactor"])
    telemetry.metrics.upstream_request(step.route.provider_name, _upstream_status(step))
    _release(gw, telemetry.metrics, step)
    step.extra[_COSTS] = step.extra.get(_COSTS, 0.0) + step.cost_usd
    span.finish(step.answer, cost_usd=step.cost_usd)


def _annotate(span: StepSpan, step: Step, *, final: bool) -> None:
    """Decisions and violations of the span's attempt: the `tollgate.guards` attribute, and
    `tollgate.guard` events for what refused, stopped, dropped or re-asked (allows are only in the
    attribute: events are costly in the SDK)."""
    # a re-asked attempt's decisions end where the next attempt's guard.before began: nothing else
    # decides between the span's opening and the re-ask (guard.after judges only the kept answer)
    end = len(step.decisions) if final else step.extra.get(_OPENED, len(step.decisions))
    decisions: list[Decision] = step.decisions[step.extra.get(_DECISIONS, 0):end]
    step.extra[_DECISIONS] = end
    span.set(TOLLGATE_GUARDS, ",".join(f"{d.guard}:{d.action}" for d in decisions))
    for d in decisions:
        if d.action != "allow":
            span.guard_event(d.guard, d.action, d.reason, d.detail or None)
    dropped = int(step.extra.get("tools_dropped", 0))
    if dropped and not step.extra.get(_DROPS) and not (final and step.stop_reason):
        step.extra[_DROPS] = True  # a drop re-asks at most once, so it belongs to one attempt
        span.guard_event("tools", "drop", "tool_not_allowed", f"{dropped} disallowed tool call(s) dropped")
    violations = step.violations[step.extra.get(_VIOLATIONS, 0):]
    step.extra[_VIOLATIONS] = len(step.violations)
    for index, violation in enumerate(violations, start=1):
        failed = final and index == len(violations) and step.error_type == "output_nonconforming"
        span.guard_event("output", "fail" if failed else "reask", "output_nonconforming", violation)
    if final and step.stop_reason and not any(d.stopped for d in decisions):
        # the stop came from the store (a claim that did not fit) or the tool gate, not a guard decision
        span.guard_event(_STOP_GUARD.get(step.stop_reason, "tollgate"), "stop", step.stop_reason,
                         step.stop_detail or None)


def _upstream_status(step: Step) -> str:
    """`status` label of `tollgate_upstream_requests` for the attempt that just ended: the upstream's
    own status, `timeout`, or `unreachable` (no usable answer); never the status tollgate answered."""
    if step.answer is not None:  # only a 2xx answer is parsed (the agent may still get a 4xx)
        return str(step.status) if 200 <= step.status < 300 else "200"
    code = step.error_type or ""
    if code.isdigit():
        return code
    if code == "upstream_timeout":
        return "timeout"
    if code == "upstream_unavailable":
        return "unreachable"
    return str(step.status) if step.status else "error"


def _is_upstream_error(code: str) -> bool:
    return code in _UPSTREAM_ERRORS or code.isdigit()


def _end_spans(gw: Gateway, telemetry: Telemetry, step: Step) -> float:
    """End the step's last span with its outcome; returns the settled cost of all its attempts."""
    span: StepSpan | None = step.extra.get(SPAN)
    attempt = step.extra.get(_ATTEMPT, 0)
    if span is not None and attempt < step.reasks and step.attempts == attempt + 1:
        _end_reasked(gw, telemetry, step, span)  # the re-ask never reached the upstream
        span = None
    reached = span is not None
    if span is None:
        start = step.started_wall if step.attempts == 0 else None
        span = _open(gw, telemetry, step, step.reasks, start)
    _release(gw, telemetry.metrics, step)
    _annotate(span, step, final=True)
    if step.stop_reason:
        span.stop(step.stop_reason, step.stop_detail)
    elif step.error_type:
        upstream = reached and _is_upstream_error(step.error_type)  # also a stream that broke off
        span.error(step.error_type, None, upstream=upstream)
    if not reached:
        span.end()
        return float(step.extra.get(_COSTS, 0.0))
    telemetry.metrics.upstream_request(step.route.provider_name, _upstream_status(step))
    if telemetry.capture_content and step.answer is not None:
        span.capture_output(step.answer, gw.services["redactor"])
    span.finish(step.answer, cost_usd=step.cost_usd)
    return float(step.extra.get(_COSTS, 0.0)) + step.cost_usd


def _step_metrics(metrics: Metrics, step: Step, decision: str) -> None:
    for d in step.decisions:
        metrics.guard_decision(d.guard, d.action, d.reason)
    snapshot: RunState | None = step.extra.get("snapshot")
    if step.stop_reason and not (snapshot is not None and snapshot.stopped):
        metrics.run_stopped(step.stop_reason)  # this step stopped the run (not a refusal of a stopped run)
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


def on_step(gw: Gateway, step: Step) -> None:
    """The record stage for a finished step (every outcome)."""
    telemetry = _telemetry(gw)
    ledger: Ledger | None = gw.services.get("ledger")
    decision = "stop" if step.stop_reason else ("error" if step.error_type else "allow")
    if telemetry is not None:
        _step_metrics(telemetry.metrics, step, decision)
        cost = _end_spans(gw, telemetry, step)
        if cost:
            telemetry.metrics.cost(step.agent, step.route.provider_name, step.call.model, cost)
    if ledger is not None:
        ledger.append_nowait(LedgerEntry(
            agent=step.agent, run_id=step.run_id, operation=step.call.operation, model=step.call.model,
            input_hash=step.call.request_hash, decision="reask" if step.reasks and decision == "allow" else decision,
            reason=step.stop_reason or step.error_type, detail=step.stop_detail or "",
        ))


# -- in-flight reservations (tollgate_budget_reserved_usd) -----------------------------------------


class _Reserved:
    """USD reserved by this process's steps between forward and record."""

    __slots__ = ("usd",)

    def __init__(self) -> None:
        self.usd = 0.0


def _reserved(gw: Gateway) -> _Reserved:
    holder = gw.services.get(_RESERVED_SERVICE)
    if not isinstance(holder, _Reserved):
        holder = gw.services[_RESERVED_SERVICE] = _Reserved()
    return holder


def _reserve(gw: Gateway, metrics: Metrics, step: Step) -> None:
    reservation = step.reservation
    usd = float(reservation.amounts.get("usd", 0.0)) if reservation is not None else 0.0
    if usd > 0:
        holder = _reserved(gw)
        holder.usd += usd
        step.extra[_RESERVED] = step.extra.get(_RESERVED, 0.0) + usd
        metrics.set_budget_reserved(holder.usd)


def _release(gw: Gateway, metrics: Metrics, step: Step) -> None:
    usd = float(step.extra.pop(_RESERVED, 0.0))
    if usd > 0:
        holder = _reserved(gw)
        holder.usd = max(0.0, holder.usd - usd)
        metrics.set_budget_reserved(holder.usd)


# -- runs -----------------------------------------------------------------------------------------


def end_run(gw: Gateway, state: RunState) -> None:
    """Export the run's `invoke_agent` root span with its totals (when the run stops or is reset)."""
    telemetry = _telemetry(gw)
    if telemetry is None:
        return
    decisions = [f"{s.get('operation')}:{s.get('decision')}:{s.get('stop_reason') or ''}" for s in state.steps]
    providers = {str(s.get("provider")) for s in state.steps if s.get("operation") != "execute_tool"}
    provider = None
    if len(providers) == 1:
        only = gw.config.providers.get(next(iter(providers)))
        if only is not None:
            provider = provider_name_for(only.type, only.base_url, custom=next(iter(providers)))
    totals = RunTotals(
        cost_usd=state.used.get("usd", 0.0),
        input_tokens=int(state.used.get("input_tokens", 0)),
        output_tokens=int(state.used.get("output_tokens", 0)),
        llm_calls=int(state.used.get("llm_calls", 0)),
        tool_calls=int(state.used.get("tool_calls", 0)),
        stop_reason=state.stop_reason,
        path_fingerprint=path_fingerprint(decisions),
        provider_name=provider,
    )
    telemetry.end_run(state.run_id, state.agent, started_at=state.started_at or time.time(), totals=totals,
                      epoch=state.epoch)


def redactor_for(gw: Gateway) -> Redactor:
    secrets = tuple(p.api_key for p in gw.config.providers.values() if p.api_key)
    secrets += tuple(k for a in gw.config.agents.values() for k in a.keys)
    return Redactor(gw.config.otel.redact, secrets=secrets)


# -- MCP tools/call -------------------------------------------------------------------------------


def _tool_parent(telemetry: Telemetry, mcp: McpRequest, message: Message, epoch: int) -> Context:
    meta = message.params.get("_meta")
    ctx = extract_meta_context(meta if isinstance(meta, Mapping) else None)
    if ctx is None:
        ctx = context_from_headers(mcp.request.headers)
    if ctx is None:
        ctx = telemetry.run_parent(mcp.identity.run_id, mcp.identity.agent, epoch=epoch)
    return ctx


def _protocol_version(mcp: McpRequest, message: Message) -> str | None:
    version = mcp.request.headers.get("MCP-Protocol-Version")
    meta = message.params.get("_meta")
    if not version and isinstance(meta, Mapping):
        modern = meta.get("io.modelcontextprotocol/protocolVersion")
        version = modern if isinstance(modern, str) else None
    return version or None


def _open_tool(
    telemetry: Telemetry, mcp: McpRequest, message: Message, tool: str, epoch: int, start_time: float | None
) -> StepSpan:
    url = urlsplit(mcp.server.url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return telemetry.start_mcp(
        TOOLS_CALL, tool_name=tool, request_id=message.id, session_id=mcp.request.headers.get("Mcp-Session-Id"),
        protocol_version=_protocol_version(mcp, message), server_address=url.hostname, server_port=port,
        parent=_tool_parent(telemetry, mcp, message, epoch), run_id=mcp.identity.run_id,
        agent=mcp.identity.agent, start_time=start_time,
    )


def start_tool_span(mcp: McpRequest, message: Message, tool: str, epoch: int) -> tuple[StepSpan | None, bytes]:
    """Open the MCP CLIENT span `tools/call {tool}` just before the call is forwarded. Returns it and
    the body to forward: the request with the span's trace context in `params._meta` (mcp.md)."""
    telemetry = _telemetry(mcp.gw)
    if telemetry is None:
        return None, orjson.dumps(message.body)
    span = _open_tool(telemetry, mcp, message, tool, epoch, None)
    if telemetry.capture_content:
        span.capture_input(_tool_call(message, tool), mcp.gw.services["redactor"])
    meta = message.params.get("_meta", {})
    if not isinstance(meta, dict):
        return span, orjson.dumps(message.body)  # not ours to repair: the server judges it
    traced: dict[str, Any] = dict(meta)
    inject_meta_context(traced, span.context)
    if traced == meta:
        return span, orjson.dumps(message.body)
    body = {**message.body, "params": {**message.params, "_meta": traced}}
    return span, orjson.dumps(body)


def _tool_call(message: Message, tool: str) -> Call:
    arguments = message.params.get("arguments")
    text = orjson.dumps(arguments if arguments is not None else {}).decode()
    return Call(protocol="mcp", operation="execute_tool", model="", tool_call=ToolCall(str(message.id), tool, text))


def _answer(outcome: Mapping[str, Any] | None, message: Message) -> tuple[Answer | None, str | None]:
    """The server's response as an `Answer`, or its JSON-RPC error code."""
    if outcome is None:
        return None, None
    error = outcome.get("error")
    if isinstance(error, Mapping):
        code = error.get("code")
        return None, str(code) if isinstance(code, int) else "_OTHER"
    result = outcome.get("result")
    if not isinstance(result, Mapping):
        return None, None
    is_error = result.get("isError") is True
    content = result.get("content")
    text = orjson.dumps(content).decode() if content is not None else ""
    return Answer(is_error=is_error, tool_result=ToolResult(str(message.id), text, is_error)), None


async def end_tool_span(
    mcp: McpRequest,
    message: Message,
    tool: str,
    span: StepSpan | None,
    *,
    run: RunState | None,
    outcome: Mapping[str, Any] | None,
    refused: GatewayError | None,
    stop: str | None,
    started_wall: float,
) -> None:
    """End a `tools/call`'s span. `span` is None when the call never reached the server (refused,
    replayed): one is opened now, backdated to `started_wall`. `outcome` is the server's JSON-RPC
    response when it answered; `stop` the stop code the agent was given, if any; `run` the run as
    read before the call (None when the call was refused before that). A stop exports the run's
    root span."""
    gw = mcp.gw
    telemetry = _telemetry(gw)
    if telemetry is None:
        return
    metrics = telemetry.metrics
    state: RunState | None = None
    if stop or run is None:
        try:
            state = await gw.store.get(mcp.identity.run_id)
        except GatewayError:
            state = None
    stopped_now = bool(stop and state is not None and state.stopped and state.stop_reason == stop)
    if span is None:
        epoch = state.epoch if state is not None else (run.epoch if run is not None else 1)
        span = _open_tool(telemetry, mcp, message, tool, epoch, started_wall)
        if telemetry.capture_content:
            span.capture_input(_tool_call(message, tool), gw.services["redactor"])
    if stop:
        reason = refused.message if refused is not None else None
        span.guard_event(_STOP_GUARD.get(stop, "tollgate"), "stop" if stopped_now else "reject", stop, reason)
        if stopped_now:
            span.stop(stop, reason)
        else:
            span.error(stop, reason, upstream=False)
    elif refused is not None:
        upstream = outcome is None and refused.code in _UPSTREAM_ERRORS
        span.error(refused.code, refused.message, upstream=upstream)
    answer, rpc_code = _answer(outcome, message)
    if rpc_code is not None:
        span.error(rpc_code, None, upstream=True)
    if stopped_now and (run is None or not run.stopped):
        metrics.run_stopped(stop or "stopped")
    metrics.tool_call(_tool_decision(outcome, refused, stop))
    if answer is not None and telemetry.capture_content:
        span.capture_output(answer, gw.services["redactor"])
    span.finish(answer)
    if stopped_now and state is not None:
        end_run(gw, state)


def _tool_decision(outcome: Mapping[str, Any] | None, refused: GatewayError | None, stop: str | None) -> str:
    if stop:
        return "rejected" if stop == "tool_not_allowed" else "stopped"
    if refused is not None:
        return {"approval_denied": "denied", "approval_timeout": "denied"}.get(refused.code, "refused")
    return "executed" if outcome is not None else "replayed"


async def end_idle_runs(gw: Gateway, idle_s: float, now: float) -> int:
    """End (export the root span of) every active run with no step for `idle_s`. Returns how many.
    Ending is idempotent per run epoch, so a sweep may see a run again."""
    telemetry: Telemetry | None = gw.services.get("telemetry")
    if telemetry is None or not telemetry.tracing:
        return 0
    ended = 0
    for state in await gw.store.list_runs(1000):
        if state.status == "active" and state.updated_at is not None and now - state.updated_at >= idle_s:
            end_run(gw, state)
            ended += 1
    return ended
