"""Proxy routes: model calls through the pipeline, other `/v1/...` paths forwarded and traced."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web

from gateway.call import Answer, Call
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    OutputNonconforming,
    RunReset,
    ShuttingDown,
    StateUnavailable,
    Stopped,
    UpstreamError,
)
from gateway.http1_wire import Sending
from gateway.identity import Identity
from gateway.observe import UPSTREAM_STATUS, begin_step, ledger_stop_now, start_span
from gateway.observe_forward import refused_call
from gateway.observe_runs import claim_stop
from gateway.outputs import OutputPlan, apply_native, judge, off_loop_if_long, plan_outputs
from gateway.pipeline import (
    count_unjudged_hosted,
    guard_after,
    guard_before,
    parse_json,
    provider_secret,
    settle,
    shape,
    stop_answer,
    upstream_request,
)
from gateway.pricing import ModelPrice
from gateway.providers.base import Adapter
from gateway.providers.responses_tools import offered_tools, offers_preview_search
from gateway.providers.tool_wire import drop_calls, drop_stream_calls
from gateway.relay import collect_stream, relay_stream
from gateway.request_body import read_body
from gateway.respond import base_headers, echo_headers, error_response, malformed_upstream, stop_response
from gateway.routing import Route
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.store.base import RunState
from gateway.toolgate import TOOL_NOT_ALLOWED, answers_something, judge_tools, shape_tools, without
from gateway.upstream import answer_headers, scrub, secret_bytes
from grammars.tool_args import check_tool_schemas
from guards.loop import forgiven, retry_marks

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def chat_handler(protocol: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle_chat(request, protocol)

    return handler


async def handle_chat(request: web.Request, protocol: str) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    adapter = gw.adapters[protocol]
    identity: Identity | None = None
    call: Call | None = None
    try:
        if gw.shutting_down:
            raise ShuttingDown("tollgate is shutting down")
        identity = gw.identifier.identify(request.headers)
        limits = gw.config.limits
        raw = await read_body(request, limits)
        body = parse_json(raw, limits)
        call = adapter.parse_request(body, raw, limits)
        route = gw.router.route(call.model)
        if route.provider.type != adapter.provider_type:
            raise InvalidRequest(
                f"model {call.model!r} is served by a {route.provider.type} provider; "
                f"call it through that provider's API"
            )
        if route.provider.engine != "http" and protocol != "openai":
            raise InvalidRequest(f"model {call.model!r} runs in-process and serves Chat Completions only")
        if route.provider.engine != "http":  # its chat template may add more than the body's size bounds
            # imported here: only in-process models need it (it is torch-free, but not small)
            from gateway.local import OutlinesTransport

            transport = gw.transports[route.provider_name]
            assert isinstance(transport, OutlinesTransport)
            read = await asyncio.to_thread(transport.prompt_tokens, raw)
            call = replace(call, input_overhead=call.input_overhead + max(0, read - call.input_bytes))
        tool_policy = gw.tool_policy(identity.agent, identity.policy)
        if call.tools:  # a schema tollgate cannot check is a 400 before anything is reserved or sent
            await check_tool_schemas(((t.name, t.parameters) for t in call.tools if tool_policy.allowed(t.name)),
                                     max_bytes=limits.max_schema_bytes)
        output = identity.policy.output
        plan = await plan_outputs(gw.services["resolver"], call, request.headers, output.grammar, output.retries,
                                  output.stream_check, route.provider.dialect)
    except GatewayError as exc:
        refusal = error_response(adapter, exc, base_headers(identity) if identity else echo_headers(request.headers))
        if identity is not None and call is not None:  # a parsed call refused before its step is a step too
            await answer_refused(gw, identity, call, exc, request, refusal)
        return refusal
    step = Step(adapter, identity, call, route, body, raw, price=price_for(gw, route, call), outputs=plan,
                original=dict(body), tools=tool_policy)
    begin_step(gw, step, request.headers)
    response: web.StreamResponse | None = None
    try:
        if step.tools is not None and shape_tools(step.tools, call, step.body):
            step.changed = True
            step.original = dict(step.body)  # re-asks never offer what the agent may not use
            step.call = offered(adapter, call, step.body)
            if step.call is not call:
                step.price = price_for(gw, route, step.call)
        if plan is not None:  # after `original`: a re-ask adds the native fields (and their bound) again
            step.changed = add_native(step, plan) or step.changed
        response = await run_step(gw, step, request)
    except Stopped as exc:
        step.status = 200 if identity.policy.on_stop == "message" else 403
        step.error_type = exc.reason
        response = stop_response(step, exc)
    except GatewayError as exc:
        step.status = exc.status
        step.error_type = exc.code
        response = error_response(adapter, exc, base_headers(identity, step))
    except asyncio.CancelledError:  # the client went away (handler_cancellation) or the grace ended
        step.error_type = step.error_type or gw.cut_reason()
        raise
    finally:
        await finish(gw, step, answered=response is not None)
    assert response is not None  # every path above assigned it or raised
    return await respond(gw, step, request, response)


def price_for(gw: Gateway, route: Route, call: Call) -> ModelPrice | None:
    """The price a step is reserved at: its model's, with the fees of the billed tools it offers, at the
    service tier it asks for."""
    return gw.pricer.lookup(route.model if route.prefixed else call.model, route.provider.type,
                            searches=bool(call.search_limits), preview_search=call.search_preview,
                            service_tier=call.service_tier)


def offered(adapter: Adapter, call: Call, body: dict[str, Any]) -> Call:
    """`call` as the allow-list left its body (`shape_tools`): a billed tool it no longer offers holds,
    costs and refuses nothing. The same call when it offered none."""
    if not (call.unpriced_tools or call.unreserved_tools or call.search_limits):
        return call
    return replace(call, unpriced_tools=adapter.unpriced_tools(body) if call.unpriced_tools else (),
                   unreserved_tools=adapter.unreserved_tools(body) if call.unreserved_tools else (),
                   search_limits=adapter.search_limits(body) if call.search_limits else (),
                   search_sizes=adapter.search_sizes(body) if call.search_limits else (),
                   search_preview=call.search_preview and offers_preview_search(offered_tools(body)))


async def conclude(gw: Gateway, step: Step) -> None:
    """The end of every step that began, whatever happened to it (run in a `finally`): a reservation a
    failure left is settled, charged if the upstream may have done the work; what the provider ran
    unjudged is counted; the step is recorded."""
    if step.reservation is not None:
        try:
            await settle(gw, step, None, charged=bool(step.extra.get("sent")))
        except GatewayError:
            step.extra["settle_failed"] = True  # the store is down; the response is already decided
    await count_unjudged_hosted(gw, step)
    await mark_retry(gw, step)
    await record(gw, step)


async def finish(gw: Gateway, step: Step, *, answered: bool) -> None:
    """`conclude` the step (run in a `finally`), then run its hooks unless it has an answer still to send
    (`respond` runs them once it is sent): also when concluding fails, the client having left meanwhile."""
    try:
        await conclude(gw, step)
    except BaseException:  # cancelled while the step was concluded: its hooks run all the same
        gw.notify(step)
        raise
    if not answered:  # no answer to send: cancelled, or failed unexpectedly
        gw.notify(step)


RELAYED_ERROR = "relayed_error"  # step.extra: the step's answer is the provider's error answer, relayed
SDK_RETRIED = frozenset({408, 409, 429})  # and every 5xx: what the openai and anthropic SDKs retry by themselves


def sdk_retried(status: int | None) -> bool:
    return status is not None and (status >= 500 or status in SDK_RETRIED)


def _sdk_retry(step: Step) -> bool:
    """The step's answer is the provider's own error answer to the agent's own request (no re-ask), one
    its SDK retries with the same bytes (not a charged failure of tollgate's: a 502 for a malformed or
    oversized answer, a 504)."""
    return bool(step.extra.get(RELAYED_ERROR)) and step.reasks == 0 and sdk_retried(step.status)


def _forgiven_error(step: Step) -> bool:
    """An SDK-retried error (`_sdk_retry`) forgiven so far (`guards.loop.forgiven`: an agent resending
    it forever counts again)."""
    snapshot = step.extra.get("snapshot")
    return _sdk_retry(step) and forgiven(snapshot if isinstance(snapshot, RunState) else None, step.call.request_hash)


async def mark_retry(gw: Gateway, step: Step) -> None:
    """An SDK-retried error (`_sdk_retry`): the request is marked in the run's history
    (`guards.loop.retry_marks`), before the agent hears of it, so that retry is no step without progress.
    Best effort: a store that fails now counts the retry."""
    if step.stop_reason or not _sdk_retry(step):
        return
    with contextlib.suppress(GatewayError, RunReset):  # a reset since: the fresh run has no such request
        await gw.write_effects(step.run_id, step.agent, retry_marks(step.call.request_hash, step.decisions),
                               epoch=step.extra.get("epoch"))


async def respond(gw: Gateway, step: Step, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Send a concluded step's answer: a stop's ledger row first (durable before the agent hears of it),
    the step's telemetry after the answer left (never on the agent's critical path)."""
    try:  # the hooks run however it ends: a client leaving while the stop's row is written included
        if step.stop_reason:
            await ledger_stop_now(gw, step)
        await send(response, request, step)
    finally:
        gw.notify(step)
    return response


async def answer_refused(gw: Gateway, identity: Identity, call: Call, error: GatewayError, request: web.Request,
                         response: web.StreamResponse) -> None:
    """Send the refusal of a parsed call that has no step, then record it (`refused_call`): its span's
    parent is read from the store, which must not delay the answer."""
    started = time.time()
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError:
        pass  # nobody to answer; the refusal is recorded all the same
    finally:
        await refused_call(gw, identity, call, error, request.headers, started=started)


async def send(response: web.StreamResponse, request: web.Request, step: Step) -> None:
    """Hand the answer to the client now (aiohttp's own send after the handler returns is then a
    no-op). A client that went away is the step's outcome, not an error of the handler."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError:
        step.error_type = step.error_type or "client_disconnected"


async def run_step(gw: Gateway, step: Step, request: web.Request) -> web.StreamResponse:
    """guard.before -> shape -> forward -> inspect (bounded re-ask) -> guard.after -> respond."""
    plan = step.outputs
    retries = plan.retries if plan is not None else step.identity.policy.output.retries
    while True:
        await guard_before(gw, step)
        payload = shape(step)
        url, headers = upstream_request(step, request.headers)
        headers.update(start_span(gw, step, request.headers))
        step.attempts += 1
        transport = gw.transport(step.route.provider_name)
        # from here the upstream may receive the request (and bill it): a failure or a client that
        # leaves is charged at the reservation, unless the transport says nothing was written
        step.extra["sent"] = True
        sending = Sending()
        step.extra.pop(UPSTREAM_STATUS, None)  # this attempt's, not a re-asked one's
        try:
            upstream = await transport.open("POST", url, headers, payload, step.route.provider.timeouts, sending)
        except GatewayError as exc:
            step.extra["sent"] = isinstance(exc, UpstreamError) and exc.request_sent
            raise
        except BaseException:  # the client left (cancelled) while the call was queued, connecting or sent
            step.extra["sent"] = sending.started is not False
            raise
        step.extra[UPSTREAM_STATUS] = upstream.status  # what the upstream said, however the step ends
        # several choices (`n`) interleave in one stream: checked as a whole, like `stream_check: buffer`.
        # Without a text constraint, `buffer` still holds a stream that offers tools: their calls'
        # arguments are judged, and a held stream can be re-asked
        if plan is None:
            incremental = step.identity.policy.output.stream_check != "buffer" or not step.call.tools
        else:
            incremental = plan.stream_check != "buffer" and (step.call.params.choice_count or 1) == 1
        if step.call.stream and upstream.status < 300 and incremental:
            return await relay_stream(gw, step, request, upstream)
        if step.call.stream and upstream.status < 300:
            data, answer = await collect_stream(gw, step, upstream, gw.config.limits.max_answer_bytes)
        else:
            try:
                data = await upstream.read()
            except GatewayError:
                if upstream.status >= 300:  # an upstream error answer, however long, is billed nothing
                    await settle(gw, step, None, charged=False)
                raise
            finally:
                upstream.release()
            step.status = upstream.status
            if upstream.status >= 300:  # generated nothing; one the SDKs retry is no model call of the run
                step.extra[RELAYED_ERROR] = True  # the provider's own error answer, not tollgate's 502/504
                await settle(gw, step, None, charged=False, counted=not _forgiven_error(step))
                step.error_type = str(upstream.status)
                secret = provider_secret(step.route.provider)
                headers_out = answer_headers(upstream.headers, base_headers(step.identity, step), secret=secret)
                return web.Response(status=upstream.status, body=scrub(data, secret_bytes(secret)),
                                    headers=headers_out)
            parsed = _parse_body(data)
            try:
                answer = step.adapter.parse_answer(parsed)
            except (AttributeError, TypeError, KeyError, ValueError) as exc:  # valid JSON, wrong shape
                raise malformed_upstream(f"unexpected answer shape ({type(exc).__name__})") from None
        step.answer = answer
        await settle(gw, step, answer)
        tools = judge_tools(step.tools, answer) if step.tools is not None else None
        if tools is not None:
            step.extra["tools_denied"] = len(tools.denied)
            if tools.action == "reject" or step.extra.get("tool_reasked"):
                await stop_answer(gw, step, TOOL_NOT_ALLOWED, tools.detail)
            left = True
            if step.call.stream:
                data = drop_stream_calls(step.call.protocol, data, tools.names)
            else:
                left = drop_calls(step.call.protocol, parsed, tools.names)
                data = orjson.dumps(parsed)
            answer = step.answer = without(answer, tools.names)
            if step.call.stream:  # held whole (`stream_check: buffer`): nothing of it was sent yet
                left = answers_something(answer)
            step.extra["tools_dropped"] = len(tools.denied)
            if not left:
                step.extra["tool_reasked"] = True
                step.reasks += 1
                _discard(step, answer)
                reask(gw, step, answer.text, tools.instruction)
                continue
        verdict = await off_loop_if_long(answer, functools.partial(judge, plan, step.call, answer))
        if verdict is None:
            break
        step.violations.append(f"{verdict.kind}: {verdict.violation.redacted}")  # telemetry: no content
        # the re-ask of an answer the drop left empty is the tool's, not one of the grammar's
        if step.reasks - bool(step.extra.get("tool_reasked")) >= retries:
            raise OutputNonconforming(
                f"the answer still breaks its {verdict.kind} constraint after {step.reasks} re-asks: "
                f"{verdict.violation.message}"
            )
        step.reasks += 1
        _discard(step, answer)
        reask(gw, step, answer.text if verdict.answer_text is None else verdict.answer_text, verdict.instruction)
    hosted = step.extra.get("hosted_discarded", 0)
    if hosted:  # what the provider ran for re-asked attempts counts with the answer the agent gets
        answer = replace(answer, hosted_calls=answer.hosted_calls + hosted)
    await guard_after(gw, step, answer)
    secret = provider_secret(step.route.provider)
    response_headers = answer_headers(upstream.headers, base_headers(step.identity, step), secret=secret)
    if step.call.stream:
        response_headers.update({"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    # an answer that echoes the key tollgate sent reaches the agent without it, as a relayed stream does
    return web.Response(status=upstream.status, body=scrub(data, secret_bytes(secret)), headers=response_headers)


def _parse_body(data: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise malformed_upstream(str(exc)) from None
    if not isinstance(parsed, dict):
        raise malformed_upstream("not a JSON object")
    return parsed


def _discard(step: Step, answer: Answer) -> None:
    """An attempt about to be re-asked: the tool calls its provider ran are remembered for the cap."""
    if answer.hosted_calls:
        step.extra["hosted_discarded"] = step.extra.get("hosted_discarded", 0) + answer.hosted_calls


def reask(gw: Gateway, step: Step, answer_text: str, instruction: str) -> None:
    """Rebuild the request from the agent's original body plus one instruction (never stacked)."""
    body = step.adapter.with_instruction(step.original, answer_text, instruction)
    raw = orjson.dumps(body)
    step.call = step.adapter.parse_request(body, raw, gw.config.limits)
    step.body, step.raw = dict(body), raw
    step.changed = True
    if step.outputs is not None:
        add_native(step, step.outputs)


def add_native(step: Step, plan: OutputPlan) -> bool:
    """Merge the plan's native constraint fields into the step's body (True when it changed): what they
    add is input the upstream bills, so the input bound the budget reserves grows by their size."""
    changed = apply_native(plan, step.body, step.call.protocol)
    if plan.native:
        step.call = replace(step.call, input_bytes=step.call.input_bytes + len(orjson.dumps(plan.native)))
    return changed


async def record(gw: Gateway, step: Step) -> None:
    """Stage `record`: the run's step list (and a stopped run's trace ends). The step's own telemetry
    hooks (`gw.notify`, which never raise) run once the answer is sent."""
    if step.extra.get("state_failed") or step.error_type == StateUnavailable.code:
        return  # the store just failed this step: waiting out its deadline again would delay the answer
    try:
        filed = await gw.store.record_step(step.run_id, step.agent, step.summary(), time.time())
        step.extra.setdefault("epoch", filed)  # refused before it read the run: its trace is the current epoch's
        if step.stop_reason:  # the run's root ends once the step's own span has (`observe_runs.end_with`)
            await claim_stop(gw, step)
    except GatewayError:
        step.extra["record_failed"] = True
