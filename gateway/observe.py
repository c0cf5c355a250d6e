"""Stage `record`: one step becomes spans, Prometheus samples and a ledger row.

Telemetry never changes behaviour: every call here is cheap, and failures are counted by the
telemetry layer itself, never raised into the request. A span's identity is decided before the
upstream call (so the trace context can be propagated upstream) and the span is built while the
upstream works, starting at the moment it was decided; it ends here.

Model calls: one CLIENT span per upstream *attempt* (a re-ask is a new attempt).

- `start_span` opens the span of the attempt about to be forwarded and returns the trace headers
  for the upstream. It is safe to call on every pass of the re-ask loop: a second call for the same
  attempt returns the same headers; a call for a new attempt first ends the previous attempt's span
  (its answer, cost and the reason of the re-ask). `proxy.run_step` calls it on every pass.
- `on_step` ends the last span with the step's outcome. A step that never reached the upstream (a
  guard stopped it, the request was refused) still gets a span, backdated to the step's start, with
  `error.type` = the stop or error code; a stop always carries a `tollgate.guard` event.
- Trace parent: the agent's W3C `traceparent` when it sent one, else the run's `invoke_agent` root
  (ids derived from run id and epoch), which `end_run` exports when the run stops or is reset.
  `begin_step` caches the agent's context on the step; without it a step stopped before
  `start_span` lands in the run's trace even when the agent sent a `traceparent`.

MCP `tools/call` steps are recorded by `gateway.observe_mcp`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from opentelemetry.context import Context

from gateway.call import Call
from gateway.ledger import Ledger, LedgerEntry
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import RunState
from gateway.toolgate import TOOL_NOT_ALLOWED
from gateway.upstream import scrub_answer, scrub_text
from guards.base import Decision
from otel._fastspan import Reserved
from otel.attributes import TOLLGATE_GUARDS, provider_name_for
from otel.metrics import Metrics
from otel.propagation import headers_for
from otel.redact import Redactor
from otel.runs import context_from_headers
from otel.spans import StepSpan
from otel.telemetry import Telemetry

STOP_ROW_WAIT_S: Final = 2.0  # the most a stop waits for its ledger row before it is answered
_LEDGERED: Final = "ledgered"  # step.extra: the step's ledger row is written (a stop, before its answer)

# step.extra keys ("span" and "trace_headers" are also read by relay.py / proxy.py)
SPAN: Final = "span"
HEADERS: Final = "trace_headers"
UPSTREAM_STATUS: Final = "upstream_status"  # the status the upstream answered (set by proxy.py)
_ATTEMPT: Final = "span_attempt"  # the attempt index of step.extra[SPAN]
_PARENT: Final = "trace_parent"  # the agent's trace context (Context), or None when it sent none
_DECISIONS: Final = "span_decisions"  # step.decisions already put on an earlier attempt's span
_OPENED: Final = "span_opened"  # len(step.decisions) when the current span opened (its guard.before ran)
_VIOLATIONS: Final = "span_violations"  # step.violations already put on an earlier attempt's span
_RESERVED: Final = "reserved_usd"  # this step's contribution to the in-flight reserved-USD gauge
_DROPS: Final = "span_drops"  # the tool-drop event is on a span already
_PENDING: Final = "span_pending"  # (attempt, Reserved, time.time(), perf_counter()) of a span not yet built

UPSTREAM_ERRORS: Final = frozenset({"upstream_unavailable", "upstream_timeout"})
# the guard behind a stop that no guard decision names (a store denial of a claim, a tool refusal)
STOP_GUARD: Final[Mapping[str, str]] = {
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


def telemetry_of(gw: Gateway) -> Telemetry | None:
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
    return telemetry.run_parent(step.run_id, step.agent, epoch=step.extra.get("epoch", 1),
                                segment=step.extra.get("segment", 0))


@functools.lru_cache(maxsize=256)
def provider_endpoint(provider_type: str, base_url: str, custom: str) -> tuple[str, str, int]:
    """(`gen_ai.provider.name`, server address, server port) of a configured provider; constant per
    provider, so computed once (parsing the URL and matching hosts on every step cost microseconds)."""
    url = urlsplit(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return provider_name_for(provider_type, base_url, custom=custom), url.hostname or "", port


def forwarded_call(step: Step) -> Call:
    """The step's call as the upstream is given it: with the `max_tokens` the budget clamp wrote into
    the body (`gen_ai.request.max_tokens` is what was sent, not what the agent asked for)."""
    call = step.call
    granted = step.max_tokens_set
    if granted is None or granted == call.max_tokens:
        return call
    return dataclasses.replace(call, max_tokens=granted)


def _open(
    gw: Gateway, telemetry: Telemetry, step: Step, attempt: int, start_time: float | None,
    reserved: Reserved | None = None,
    started: float | None = None,
) -> StepSpan:
    provider = step.route.provider
    provider_name, address, port = provider_endpoint(provider.type, provider.base_url, step.route.provider_name)
    span = telemetry.start_inference(
        forwarded_call(step),
        provider_name=provider_name,
        server_address=address, server_port=port, parent=_parent(telemetry, step), attempt=attempt,
        run_id=step.run_id, agent=step.agent, start_time=start_time, reserved=reserved, started=started,
    )
    step.extra[SPAN] = span
    step.extra[_ATTEMPT] = attempt
    step.extra[_OPENED] = len(step.decisions)
    if telemetry.capture_content:
        span.capture_input(step.call, gw.services["redactor"])
    return span


def start_span(gw: Gateway, step: Step, headers: Mapping[str, str]) -> dict[str, str]:
    """Open the CLIENT span of the attempt about to be forwarded (`step.attempts` not yet counted);
    returns the trace headers to send upstream. See the module docstring for re-asks.

    Only the span's identity is decided here; the span is built on the loop's next turn, while the
    upstream works (the request is written before `Transport.open` first waits), so the agent does
    not wait for it. Whatever needs the span first builds it (`step_span`)."""
    telemetry = telemetry_of(gw)
    if telemetry is None:
        return {}
    begin_step(gw, step, headers)
    span = step_span(gw, step)
    if span is not None:
        if step.extra.get(_ATTEMPT) == step.attempts:
            cached: dict[str, str] = step.extra.get(HEADERS, {})
            return cached
        _end_reasked(gw, telemetry, step, span)
    reserved = telemetry.reserve_inference(step.call, _parent(telemetry, step))
    step.extra[_PENDING] = (step.attempts, reserved, time.time(), time.perf_counter())
    out = headers_for(reserved.context)
    step.extra[HEADERS] = out
    asyncio.get_running_loop().call_soon(step_span, gw, step)
    return out


def step_span(gw: Gateway, step: Step) -> StepSpan | None:
    """The span of the step's current attempt (built now if `start_span` only decided it), or None
    before `start_span`. Never raises."""
    pending = step.extra.pop(_PENDING, None)
    if pending is not None:
        telemetry = telemetry_of(gw)
        if telemetry is not None:
            attempt, reserved, wall, started = pending
            _open(gw, telemetry, step, attempt, wall, reserved, started)
            _reserve(gw, telemetry.metrics, step)
    span: StepSpan | None = step.extra.get(SPAN)
    return span


def _end_reasked(gw: Gateway, telemetry: Telemetry, step: Step, span: StepSpan) -> None:
    """The attempt of `span` was answered and re-asked: end its span with that answer."""
    _reported(step)
    _annotate(span, step, final=False)
    if telemetry.capture_content and step.answer is not None:
        span.capture_output(step.answer, gw.services["redactor"])
    telemetry.metrics.upstream_request(step.route.provider_name, _upstream_status(step))
    _release(gw, telemetry.metrics, step)
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
    if final:
        decisions = as_decided(decisions, step.stop_reason, step.stop_detail)
    if span.is_recording:  # the joined string is only ever an attribute
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
        # the stop came from the tool gate or a guard that took no part in the attempt, not a decision
        span.guard_event(STOP_GUARD.get(step.stop_reason, "tollgate"), "stop", step.stop_reason,
                         step.stop_detail or None)


def _upstream_status(step: Step) -> str:
    """`status` label of `tollgate_upstream_requests` for the attempt that just ended: the upstream's
    own status (also of an answer it could not use, or a stream the agent left), `timeout`, or
    `unreachable` (no answer); never the status tollgate answered."""
    status = step.extra.get(UPSTREAM_STATUS)
    if status:
        return str(status)
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
    return code in UPSTREAM_ERRORS or code.isdigit()


def _end_spans(gw: Gateway, telemetry: Telemetry, step: Step) -> float:
    """End the step's last span with its outcome; returns the settled cost of all its attempts."""
    span = step_span(gw, step)
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
        provider = step.answer is not None and step.answer.provider_error == step.error_type  # its own error event
        upstream = reached and (provider or _is_upstream_error(step.error_type))  # also a stream that broke off
        span.error(step.error_type, None, upstream=upstream)
    elif step.answer is not None and step.answer.provider_error:  # relayed as it came, but a failure
        span.error(step.answer.provider_error, None, upstream=True)
    if not reached:
        span.end()
        return step.spent.get("usd", 0.0)
    if step.extra.get("sent", True):  # an attempt that wrote no byte (queued, never connected) was none
        telemetry.metrics.upstream_request(step.route.provider_name, _upstream_status(step))
    if telemetry.capture_content and step.answer is not None:
        span.capture_output(step.answer, gw.services["redactor"])
    span.finish(step.answer, cost_usd=step.cost_usd)
    return step.spent.get("usd", 0.0)


def as_decided(decisions: list[Decision], reason: str | None, detail: str | None) -> list[Decision]:
    """`decisions` of a step stopped with `reason` (None: not stopped), where a stop the run store decided
    reads as the stop of the guard whose claim did not fit (its last `allow`): the budget's claims and
    the caps' counts are checked atomically by the store, not by the guard, and a span or a count saying
    `budget:allow` on a step the budget stopped would contradict its own stop. Model calls and MCP
    tool calls alike."""
    guard = STOP_GUARD.get(reason) if reason else None
    if guard is None or any(d.stopped for d in decisions):
        return decisions
    for index in range(len(decisions) - 1, -1, -1):
        if decisions[index].guard == guard and decisions[index].action == "allow":
            assert reason is not None
            stop = Decision.stop(guard, reason, detail or f"the run is stopped ({reason})")
            return [*decisions[:index], stop, *decisions[index + 1:]]
    return decisions


def _step_metrics(metrics: Metrics, step: Step, decision: str) -> None:
    if step.decisions:
        decided = as_decided(step.decisions, step.stop_reason, step.stop_detail)
        metrics.guard_decisions([(d.guard, d.action, d.reason) for d in decided])
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


def _reported(step: Step) -> None:
    """The step's answer and error code as spans, metrics and the ledger report them: with the provider
    key tollgate sent replaced, as in the agent's copy (an upstream may echo it in an id, a model name,
    an error code: `scrub_answer`)."""
    provider = step.route.provider
    secret = None if provider.passthrough_auth else provider.api_key
    if secret is None:
        return
    if step.answer is not None:
        step.answer = scrub_answer(step.answer, secret)
    if step.error_type:
        step.error_type = scrub_text(step.error_type, secret)


def on_step(gw: Gateway, step: Step) -> None:
    """The record stage for a finished step (every outcome)."""
    _reported(step)
    telemetry = telemetry_of(gw)
    ledger: Ledger | None = gw.services.get("ledger")
    decision = "stop" if step.stop_reason else ("error" if step.error_type else "allow")
    if telemetry is not None:
        _step_metrics(telemetry.metrics, step, decision)
        cost = _end_spans(gw, telemetry, step)
        if cost:
            telemetry.metrics.cost(step.agent, step.route.provider_name, step.call.model, cost)
    if ledger is not None and not step.extra.get(_LEDGERED):
        ledger.append_nowait(_ledger_entry(step))


async def ledger_stop_now(gw: Gateway, step: Step) -> None:
    """Write a stopping step's ledger row before the agent hears of the stop (called right before it
    is sent), so the audit trail holds every stop the run store holds, whatever happens to the process
    next; `on_step` then writes no second row. Waits `STOP_ROW_WAIT_S` at most (a ledger that cannot
    write keeps the row queued and retries); never raises."""
    ledger: Ledger | None = gw.services.get("ledger")
    if ledger is None or not step.stop_reason or step.extra.get(_LEDGERED):
        return
    step.extra[_LEDGERED] = True
    await append_written(ledger, _ledger_entry(step))


async def append_written(ledger: Ledger, entry: LedgerEntry) -> None:
    """Append `entry` and wait until it is written, `STOP_ROW_WAIT_S` at most (a ledger that cannot
    write keeps the row queued and retries); never raises. For a stop's row, awaited before the stop is
    answered."""
    ledger.append_nowait(entry)
    try:
        async with asyncio.timeout(STOP_ROW_WAIT_S):
            await ledger.flush()
    except TimeoutError:
        return  # still queued: written once the ledger recovers (or counted `lost` at close)


def _ledger_entry(step: Step) -> LedgerEntry:
    row_decision, reason, detail = ledger_decision(step)
    return LedgerEntry(agent=step.agent, run_id=step.run_id, operation=step.call.operation,
                       model=step.call.model, input_hash=step.call.request_hash, decision=row_decision,
                       reason=reason, detail=detail)


def ledger_decision(step: Step) -> tuple[str, str | None, str]:
    """(decision, reason, detail) of a finished step's ledger row: `stop` / `error` with their code,
    whatever else happened; `drop` (reason `tool_not_allowed`) when disallowed tool calls were removed
    from the answer the agent got, so the row never reads as a plain `allow` of an altered answer;
    `reask` when the answer came after re-asks; else `allow`."""
    detail = step.stop_detail or ""
    if step.stop_reason:
        return "stop", step.stop_reason, detail
    if step.error_type:
        return "error", step.error_type, detail
    dropped = int(step.extra.get("tools_dropped", 0))
    if dropped:
        reasked = f", {step.reasks} re-ask(s)" if step.reasks else ""
        return "drop", TOOL_NOT_ALLOWED, f"{dropped} disallowed tool call(s) dropped{reasked}"
    return ("reask" if step.reasks else "allow"), None, detail


# -- in-flight reservations (tollgate_budget_reserved_usd) -----------------------------------------


class _Reserved:
    """USD reserved by this process's steps between forward and record, and how many steps hold some
    (none: exactly 0, whatever float subtraction left)."""

    __slots__ = ("steps", "usd")

    def __init__(self) -> None:
        self.usd = 0.0
        self.steps = 0


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
        if _RESERVED not in step.extra:
            holder.steps += 1
        step.extra[_RESERVED] = step.extra.get(_RESERVED, 0.0) + usd
        metrics.set_budget_reserved(holder.usd)


def _release(gw: Gateway, metrics: Metrics, step: Step) -> None:
    usd = float(step.extra.pop(_RESERVED, 0.0))
    if usd > 0:
        holder = _reserved(gw)
        holder.steps -= 1
        holder.usd = max(0.0, holder.usd - usd) if holder.steps > 0 else 0.0
        metrics.set_budget_reserved(holder.usd)


def redactor_for(gw: Gateway) -> Redactor:
    secrets = tuple(p.api_key for p in gw.config.providers.values() if p.api_key)
    secrets += tuple(k for a in gw.config.agents.values() for k in a.keys)
    return Redactor(gw.config.otel.redact, secrets=secrets)
