"""Stage `record` for MCP `tools/call`: the step in the run view, a span, samples and a ledger row per
call.

`start_tool_span` opens the MCP CLIENT span before the call is forwarded (parent from
`params._meta`, else the HTTP `traceparent`, else the run root) and returns the body to forward with
the span's context in `params._meta`; `end_tool_span` ends it (or opens and ends one for a call
refused before forwarding), appends the ledger row, and exports the run's root span when the call
stopped the run. Every other relayed message (`initialize`, `tools/list`, `prompts/get`, notifications,
...) gets its span too: `start_relay_span` / `end_relay_span`, no step and no ledger row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.context import Context

from gateway import exact_json
from gateway.call import Answer, Call, ToolCall, ToolResult, canonical_json, digest
from gateway.errors import GatewayError
from gateway.jsonrpc import NAME_BEARING, is_final_result
from gateway.ledger import Ledger, LedgerEntry
from gateway.observe import STOP_GUARD, UPSTREAM_ERRORS, append_written, as_decided, telemetry_of
from gateway.observe_forward import current_root
from gateway.observe_runs import end_root
from gateway.store.base import RunState
from guards.base import Decision
from otel.attributes import TOLLGATE_GUARDS, TOOLS_CALL
from otel.mcp_attributes import McpOperation
from otel.propagation import context_from_headers, extract_meta_context, inject_meta_context
from otel.spans import StepSpan
from otel.telemetry import Telemetry

if TYPE_CHECKING:
    from gateway.jsonrpc import Message
    from gateway.mcp_transport import McpRequest


async def record_tool_step(
    mcp: McpRequest, tool: str, status: int, stop: str | None, refused: GatewayError | None, started: float,
    failure: str | None = None, *, epoch: int | None = None,
) -> None:
    """The step as the admin API lists it under the run (the keys of a model call's step, plus
    `refusal`: the code of a refusal that did not stop the run, such as `approval_denied`, and `error`:
    why nobody got the answer, `client_disconnected` or `shutting_down`; decision `error` when the call
    ended so without a decision, or with the server's own error status relayed). `epoch`: the one the
    call was admitted in, when it was read (a call in flight across a reset is no step of the fresh run)."""
    decision = ("stop" if stop else "refuse" if refused is not None else
                "error" if failure or status >= 400 else "allow")
    step = {
        "at": time.time(), "operation": "execute_tool", "model": mcp.server_name, "provider": "mcp",
        "stream": False, "status": status, "decision": decision, "stop_reason": stop,
        "refusal": refused.code if refused is not None and not stop else None, "error": failure,
        "cost_usd": 0.0, "input_tokens": None, "output_tokens": None, "tool_calls": [tool], "attempts": 1,
        "duration_ms": round((time.monotonic() - started) * 1000, 3),
    }
    if epoch is not None:
        step["epoch"] = epoch
    try:
        await mcp.gw.store.record_step(mcp.identity.run_id, mcp.identity.agent, step, time.time())
    except GatewayError:
        return  # the step list is a convenience view; the decision itself was already made and applied


def _trace_parent(mcp: McpRequest, message: Message) -> Context | None:
    """The trace context the agent sent: in `params._meta` (mcp.md), else in the HTTP headers."""
    meta = message.params.get("_meta")
    ctx = extract_meta_context(meta if isinstance(meta, Mapping) else None)
    return ctx if ctx is not None else context_from_headers(mcp.request.headers)


def _protocol_version(mcp: McpRequest, message: Message) -> str | None:
    version = mcp.request.headers.get("MCP-Protocol-Version")
    meta = message.params.get("_meta")
    if not version and isinstance(meta, Mapping):
        modern = meta.get("io.modelcontextprotocol/protocolVersion")
        version = modern if isinstance(modern, str) else None
    return version or None


_METHOD_CHARS = 128  # of a method no MCP revision defines, kept in the span's name
# the methods whose span names the resource (`mcp.resource.uri`: conditionally required for them)
_ON_RESOURCE = frozenset({"resources/read", "resources/subscribe", "resources/unsubscribe"})


def _operation(mcp: McpRequest, message: Message, tool: str | None) -> McpOperation:
    url = urlsplit(mcp.server.url)
    method = (message.method or "")[:_METHOD_CHARS]
    named = message.params.get(NAME_BEARING.get(method, ""))
    uri = message.params.get("uri") if method in _ON_RESOURCE else None
    return McpOperation(
        method, tool_name=tool, prompt_name=named if method == "prompts/get" and isinstance(named, str) else None,
        resource_uri=uri if isinstance(uri, str) else None,
        request_id=message.id, session_id=mcp.request.headers.get("Mcp-Session-Id"),
        protocol_version=_protocol_version(mcp, message), server_address=url.hostname,
        server_port=url.port or (443 if url.scheme == "https" else 80),
    )


def _open_tool(
    telemetry: Telemetry, mcp: McpRequest, message: Message, tool: str, run: RunState | None,
    start_time: float | None
) -> StepSpan:
    """The span of a tool call: a step of the run, under the root its next export carries (`run`: as the
    call read it; None: the run's first)."""
    parent = _trace_parent(mcp, message)
    if parent is None:
        parent = telemetry.run_parent(mcp.identity.run_id, mcp.identity.agent, epoch=run.epoch if run else 1,
                                      segment=run.root_segment() if run else 0)
    return telemetry.start_mcp(_operation(mcp, message, tool), parent=parent, run_id=mcp.identity.run_id,
                               agent=mcp.identity.agent, start_time=start_time)


def _traced_body(message: Message, span: StepSpan) -> bytes:
    """The message to forward, with the span's trace context in `params._meta` (mcp.md)."""
    meta = message.params.get("_meta", {})
    if not isinstance(meta, dict):
        return exact_json.dumps(message.body)  # not ours to repair: the server judges it
    traced: dict[str, Any] = dict(meta)
    inject_meta_context(traced, span.context)
    if traced == meta:
        return exact_json.dumps(message.body)
    return exact_json.dumps({**message.body, "params": {**message.params, "_meta": traced}})


def start_tool_span(mcp: McpRequest, message: Message, tool: str,
                    run: RunState | None) -> tuple[StepSpan | None, bytes]:
    """Open the MCP CLIENT span `tools/call {tool}` just before the call is forwarded. Returns it and
    the body to forward: the request with the span's trace context in `params._meta` (mcp.md)."""
    telemetry = telemetry_of(mcp.gw)
    if telemetry is None:
        return None, exact_json.dumps(message.body)
    span = _open_tool(telemetry, mcp, message, tool, run, None)
    if telemetry.capture_content:
        span.capture_input(_tool_call(message, tool), mcp.gw.services["redactor"])
    return span, _traced_body(message, span)


async def start_relay_span(mcp: McpRequest, message: Message) -> tuple[StepSpan | None, bytes]:
    """Open the MCP CLIENT span of a message relayed as is (every method but `tools/call`: `initialize`,
    `tools/list`, `prompts/get {prompt}`, `resources/read`, notifications, ...). Returns it and the body
    to forward, as `start_tool_span`. Such a message is no step of the run: without the agent's trace
    context it goes under the run's last root, not a new one (so a session's `initialize` and
    `tools/list` share the trace of the steps that follow; of a run that never has a step, no root is
    exported: the idle sweep finds runs in the store, which holds runs with steps).

    A JSON-RPC response (the client's answer to a server's request: sampling, elicitation, roots, ping)
    is no operation of the client: it gets no span and reaches the server as sent (a response has no
    `params`, and strict servers refuse one that does)."""
    telemetry = telemetry_of(mcp.gw)
    if telemetry is None or message.method is None:
        return None, exact_json.dumps(message.body)
    parent = _trace_parent(mcp, message)
    if parent is None:
        epoch, segment = await current_root(mcp.gw, mcp.identity)
        parent = telemetry.run_parent(mcp.identity.run_id, mcp.identity.agent, epoch=epoch, segment=segment)
    span = telemetry.start_mcp(_operation(mcp, message, None), parent=parent, run_id=mcp.identity.run_id,
                               agent=mcp.identity.agent)
    return span, _traced_body(message, span)


def end_relay_span(span: StepSpan | None, *, status: int | None, response: Mapping[str, Any] | None,
                   failure: GatewayError | None = None, gone: bool = False) -> None:
    """End a relayed message's span: the server's HTTP `status` and, when it was read, its JSON-RPC
    `response` (an error's code is `error.type`); `failure` what broke the relay; `gone`: the client left."""
    if span is None:
        return
    if failure is not None:
        span.error(failure.code, failure.redacted, upstream=failure.code in UPSTREAM_ERRORS)
    elif gone:
        span.error("client_disconnected", None, upstream=False)
    rpc_code, rpc_message = _rpc_error(response)
    if rpc_code is not None:
        span.error(rpc_code, rpc_message, upstream=True)
    elif status is not None and status >= 400:
        span.error(str(status), None, upstream=True, jsonrpc=False)
    span.end()


def _tool_call(message: Message, tool: str) -> Call:
    arguments = message.params.get("arguments")
    text = exact_json.dumps(arguments if arguments is not None else {}).decode()
    return Call(protocol="mcp", operation="execute_tool", model="", tool_call=ToolCall(str(message.id), tool, text))


_RPC_MESSAGE_CHARS = 256  # of a JSON-RPC error's message kept as the span's status description


def _rpc_error(outcome: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """The JSON-RPC error code of a server's response (`_OTHER` when not an integer) and its message
    (semconv: the span's status description), or None twice when it is no error."""
    error = outcome.get("error") if outcome is not None else None
    if not isinstance(error, Mapping):
        return None, None
    code, text = error.get("code"), error.get("message")
    return (str(code) if isinstance(code, int) else "_OTHER",
            text[:_RPC_MESSAGE_CHARS] if isinstance(text, str) and text else None)


def _answer(outcome: Mapping[str, Any] | None, message: Message) -> tuple[Answer | None, str | None, str | None]:
    """The server's response as an `Answer`, or its JSON-RPC error code and message."""
    if outcome is None:
        return None, None, None
    rpc_code, rpc_message = _rpc_error(outcome)
    if rpc_code is not None:
        return None, rpc_code, rpc_message
    result = outcome.get("result")
    if not isinstance(result, Mapping):
        return None, None, None
    is_error = result.get("isError") is True
    content = result.get("content")
    text = exact_json.dumps(content).decode() if content is not None else ""
    return Answer(is_error=is_error, tool_result=ToolResult(str(message.id), text, is_error)), None, None


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
    approved_by: str | None = None,
    failure: str | None = None,
    replayed: bool = False,
    status: int = 200,
    decisions: Sequence[Decision] = (),
    replayed_reason: str | None = None,
) -> None:
    """End a `tools/call`'s span. `span` is None when the call never reached the server (refused,
    replayed): one is opened now, backdated to `started_wall`. `outcome` is the server's JSON-RPC
    response when it answered; `stop` the stop code the agent was given, if any; `run` the run as
    read before the call (None when the call was refused before that); `approved_by` who approved it
    when it was parked for approval (the ledger row says so); `failure` why nobody got the answer
    (`client_disconnected`, `shutting_down`: the span is an error; without a decision or a result the
    row's decision is `error`); `decisions` the guards' (the `tollgate.guards` attribute and
    `tollgate_guard_decisions_total`, as for a model call); `replayed_reason` the code of the refusal a
    replay gave again (the row's reason). A stop exports the run's root span."""
    gw = mcp.gw
    telemetry = telemetry_of(gw)
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
        span = _open_tool(telemetry, mcp, message, tool, state if state is not None else run, started_wall)
        if telemetry.capture_content:
            span.capture_input(_tool_call(message, tool), gw.services["redactor"])
    if decisions:  # a cap the run store refused reads as the caps' stop, as for a model call
        decisions = as_decided(list(decisions), stop, refused.redacted if refused is not None else None)
        if span.is_recording:
            span.set(TOLLGATE_GUARDS, ",".join(f"{d.guard}:{d.action}" for d in decisions))
        metrics.guard_decisions([(d.guard, d.action, d.reason) for d in decisions])
    if stop:
        reason = refused.redacted if refused is not None else None
        span.guard_event(STOP_GUARD.get(stop, "tollgate"), "stop" if stopped_now else "reject", stop, reason)
        if stopped_now:
            span.stop(stop, reason)
        else:
            span.error(stop, reason, upstream=False)
    elif refused is not None:
        upstream = outcome is None and refused.code in UPSTREAM_ERRORS
        span.error(refused.code, refused.redacted, upstream=upstream)
    if failure is not None:
        span.error(failure, None, upstream=False)  # the server's answer, if any, still measures as it was
    elif status >= 400 and not stop and refused is None and outcome is None and not replayed:
        span.error(str(status), None, upstream=True, jsonrpc=False)  # the server's HTTP error, relayed as it came
    answer, rpc_code, rpc_message = _answer(outcome, message)
    if rpc_code is not None:
        span.error(rpc_code, rpc_message, upstream=True)
    if stopped_now and (run is None or not run.stopped):
        metrics.run_stopped(stop or "stopped")
    decision = _tool_decision(outcome, refused, stop, failure, replayed=replayed)
    metrics.tool_call(decision)
    if answer is not None and telemetry.capture_content:
        span.capture_output(answer, gw.services["redactor"])
    span.finish(answer)
    if stopped_now and state is not None:
        await end_root(gw, state)
    ledger: Ledger | None = gw.services.get("ledger")
    if ledger is not None:
        arguments = message.params.get("arguments")
        entry = LedgerEntry(
            agent=mcp.identity.agent, run_id=mcp.identity.run_id, operation=f"{TOOLS_CALL} {tool}",
            model=mcp.server_name, input_hash=digest(tool.encode(), canonical_json(arguments or {})),
            decision=decision,
            reason=stop or (refused.code if refused is not None else None) or (failure if decision == "error" else None)
            or (replayed_reason if decision == "replayed" else None),
            detail=_detail(refused, approved_by, failure if decision != "error" else None),
        )
        if stop:  # written before the agent hears of the stop, as a model call's stop is
            await append_written(ledger, entry)
        else:
            ledger.append_nowait(entry)


def _detail(refused: GatewayError | None, approved_by: str | None, failure: str | None) -> str:
    parts = [refused.redacted if refused is not None else f"approved by {approved_by}" if approved_by else ""]
    if failure is not None:
        parts.append(f"nobody got the answer ({failure})")
    return "; ".join(p for p in parts if p)


def _tool_decision(
    outcome: Mapping[str, Any] | None, refused: GatewayError | None, stop: str | None, failure: str | None = None,
    *, replayed: bool = False,
) -> str:
    if stop:
        return "rejected" if stop == "tool_not_allowed" else "stopped"
    if refused is not None:
        return {"approval_denied": "denied", "approval_timeout": "denied"}.get(refused.code, "refused")
    if outcome is not None:
        result = outcome.get("result")
        # SEP-2322: the server asked for more input; nothing ran (the retry with it is the execution)
        return "input_required" if isinstance(result, Mapping) and not is_final_result(result) else "executed"
    # nothing judged: a recorded result given again, else the server answered no JSON-RPC response (a 5xx)
    return "replayed" if replayed and failure is None else "error"
