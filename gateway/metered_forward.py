"""The metered forwarded paths (`gateway.metered.METERS`) through the pipeline's stages:

    identify -> parse -> guard.before (reserve) -> shape -> forward -> settle -> record -> respond

as a model call goes, with a `Step` of its run: the reservation is made and settled by the same
`guard_before` / `settle` (so it holds across concurrent calls and sidecars sharing a run store), the step
is in the run's step list (`record`), its span, metrics and ledger row come from the step hooks. What it
skips: tools, grammars, re-asks and the judging of its answer (there is nothing in it to judge).

A non-streamed answer passes to the agent a chunk at a time as it arrives; its bytes are also kept, up to
`limits.max_answer_bytes`, to read its usage once whole (a longer one is charged its reservation). A
streamed legacy completion goes through the model calls' relay (`gateway.relay.relay_stream`), event by
event, with the usage chunk tollgate asked for hidden from an agent that did not ask for it.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from gateway.call import Call
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ShuttingDown,
    StateUnavailable,
    Stopped,
    UpstreamError,
)
from gateway.http1_wire import Sending
from gateway.identity import Identity
from gateway.metered import Meter, MeteredAdapter, answer_of, guards_for, output_bound
from gateway.observe import begin_step, start_span, step_span
from gateway.output_limits import whole_limit
from gateway.pipeline import (
    guard_before,
    output_limit,
    parse_json,
    provider_secret,
    settle,
    shape,
    upstream_request,
)
from gateway.proxy import GATEWAY, answer_refused, finish, respond
from gateway.relay import relay_stream
from gateway.request_body import read_body
from gateway.respond import base_headers, echo_headers, error_response
from gateway.runtime import Gateway
from gateway.step import Step
from gateway.upstream import Scrubber, UpstreamResponse, answer_headers, scrub, secret_bytes
from guards.chain import GuardChain
from otel.http import HTTP_RESPONSE_STATUS_CODE


async def forward_metered(request: web.Request, meter: Meter) -> web.StreamResponse:
    """One metered call. Errors are OpenAI's (these are OpenAI paths); a stop is always a 403, whatever
    `on_stop` says: a stop message is an assistant answer, which these APIs do not give."""
    gw = request.app[GATEWAY]
    adapter = MeteredAdapter(meter)
    identity: Identity | None = None
    call: Call | None = None
    try:
        if gw.shutting_down:
            raise ShuttingDown("tollgate is shutting down")
        identity = gw.identifier.identify(request.headers)
        limits = gw.config.limits
        raw = await read_body(request, limits)
        body = parse_json(raw, limits)
        call = meter.parse(body, raw, limits)
        try:
            route = gw.router.route(call.model)
            if route.provider.type != "openai" or route.provider.engine != "http":
                raise InvalidRequest(f"model {call.model!r} is not served by an OpenAI API provider over "
                                     f"HTTP, which {request.path[:200]!r} needs")
        except GatewayError as exc:
            await _stopped_first(gw, identity)  # a stopped run is stopped on every upstream path
            raise exc from None
    except GatewayError as exc:
        refusal = error_response(adapter, exc, base_headers(identity) if identity else echo_headers(request.headers))
        if identity is not None and call is not None:  # a parsed call refused before its step is a step too
            await answer_refused(gw, identity, call, exc, request, refusal)
        return refusal
    price = gw.pricer.lookup(route.model if route.prefixed else call.model, route.provider.type,
                             output_billed=meter.output != "none", service_tier=call.service_tier)
    step = Step(adapter, identity, call, route, body, raw, price=price)
    limit = output_limit(step)
    if meter.output == "model_limit" and not (price is not None and price.max_output_tokens):
        limit = whole_limit(route.model, limit)  # nothing sent holds a compaction: the model's whole limit
    step.output_bound = output_bound(meter, call, limit)
    step.guards = GuardChain(guards_for(meter, step.output_bound), lambda name: _guard_error(gw, name))
    begin_step(gw, step, request.headers)
    response: web.StreamResponse | None = None
    try:
        response = await _run(gw, step, request, meter)
    except GatewayError as exc:  # a stop (403, sticky), a held budget, a bad request, the upstream failing
        step.status = exc.status
        step.error_type = exc.reason if isinstance(exc, Stopped) else exc.code
        response = error_response(adapter, exc, base_headers(identity, step))
    except asyncio.CancelledError:  # the client went away (handler_cancellation) or the grace ended
        step.error_type = step.error_type or gw.cut_reason()
        raise
    finally:
        await finish(gw, step, answered=response is not None)
    return await respond(gw, step, request, response)


async def _run(gw: Gateway, step: Step, request: web.Request, meter: Meter) -> web.StreamResponse:
    """guard.before -> shape -> forward -> settle; the response, prepared already when it streams."""
    await guard_before(gw, step)
    _send_reserved_limit(step, meter)
    payload = shape(step)  # the original bytes, unless the model's prefix, `max_tokens` or usage changed
    url, headers = upstream_request(step, request.headers)
    if request.rel_url.raw_query_string:  # as other forwarded paths keep it (e.g. `api-version`)
        url += "?" + request.rel_url.raw_query_string
    headers.update(start_span(gw, step, request.headers))
    step.attempts += 1
    # from here the upstream may receive the request (and bill it): a failure or a client that leaves
    # is charged at the reservation, unless the transport says nothing was written
    step.extra["sent"] = True
    sending = Sending()
    try:
        upstream = await gw.transport(step.route.provider_name).open(
            "POST", url, headers, payload, step.route.provider.timeouts, sending)
    except GatewayError as exc:
        step.extra["sent"] = isinstance(exc, UpstreamError) and exc.request_sent
        raise
    except BaseException:  # the client left (cancelled) while the call was queued, connecting or sent
        step.extra["sent"] = sending.started is not False
        raise
    step.status = upstream.status
    span = step_span(gw, step)
    if span is not None:
        span.set(HTTP_RESPONSE_STATUS_CODE, upstream.status)
    if upstream.status >= 300:
        return await _refused(gw, step, upstream)
    if step.call.stream:
        return await relay_stream(gw, step, request, upstream)
    return await _pass_through(gw, step, request, upstream, meter)


def _send_reserved_limit(step: Step, meter: Meter) -> None:
    """A budgeted completion sent without a `max_tokens` (or with null) was reserved the default 16 tokens
    OpenAI uses; other OpenAI-wire servers default to more (llama.cpp: no limit; vLLM reads null as "up to
    the context"), and settlement believes the usage they report: the upstream is told what was reserved."""
    budget = step.identity.policy.budget
    grant = step.reservation
    if meter.output != "max_tokens" or grant is None or (budget.usd is None and budget.tokens is None):
        return
    sent = step.body.get("max_tokens")
    if isinstance(sent, int) and not isinstance(sent, bool):
        return  # the grant was written already where it is lower (`guard_before`)
    step.adapter.set_max_tokens(step.body, grant.units, prefer_completion_field=False)
    step.max_tokens_set = grant.units
    step.changed = True


async def _refused(gw: Gateway, step: Step, upstream: UpstreamResponse) -> web.Response:
    """An upstream error answer: billed nothing, relayed whole with the provider key scrubbed (read
    bounded by `limits.max_answer_bytes`, a longer one is a 502)."""
    try:
        data = await upstream.read()
    finally:
        upstream.release()
        await settle(gw, step, None, charged=False)
    step.error_type = str(upstream.status)
    secret = provider_secret(step.route.provider)
    headers = answer_headers(upstream.headers, base_headers(step.identity, step), secret=secret)
    return web.Response(status=upstream.status, body=scrub(data, secret_bytes(secret)), headers=headers)


async def _pass_through(gw: Gateway, step: Step, request: web.Request, upstream: UpstreamResponse,
                        meter: Meter) -> web.StreamResponse:
    """A 2xx answer relayed a chunk at a time, its bytes kept (up to `limits.max_answer_bytes`) to read its
    usage once whole. A longer body, or one without usage, is charged the reservation; so is one that
    breaks off or whose client leaves. The status line is gone by then: a body that broke off is ended by
    closing the connection without its final chunk, the only signal left."""
    keep = gw.config.limits.max_answer_bytes
    parts: list[bytes] = []
    size = 0
    ended = False
    secret = provider_secret(step.route.provider)
    headers = answer_headers(upstream.headers, base_headers(step.identity, step), secret=secret)
    out = web.StreamResponse(status=upstream.status, headers=headers)
    scrubber = Scrubber(secret_bytes(secret))  # a success may echo the key too (a debugging upstream)
    try:
        await out.prepare(request)
        async for chunk in upstream.chunks():
            size += len(chunk)
            if size <= keep:
                parts.append(chunk)
            elif parts:
                parts.clear()  # too long to read its usage whole: charged its reservation
            if step.first_chunk_at is None:
                step.first_chunk_at = time.monotonic()
            if sent := scrubber.feed(chunk):
                await out.write(sent)
        if rest := scrubber.finish():
            await out.write(rest)
        ended = True
    except GatewayError as exc:
        step.error_type = exc.code
    except ConnectionResetError:
        step.error_type = "client_disconnected"
    finally:
        upstream.release()
    step.answer = answer_of(meter, b"".join(parts)) if ended and size <= keep else None
    try:
        await settle(gw, step, step.answer)  # no answer, or no usage in it: the whole reservation
    except GatewayError as exc:  # the run store failed (it keeps the settlement to replay); the answer is out
        step.error_type = step.error_type or exc.code
    if not ended and request.transport is not None:
        # a body cut short must not reach the agent as a whole one: no final chunk, the connection closes
        request.transport.close()
    return out  # its end is written by the respond stage, once the step is recorded


async def _stopped_first(gw: Gateway, identity: Identity) -> None:
    """Raise the run's stop, if it is stopped: a call refused before its step (no provider for its model)
    answers with the reason that stopped the run, as every path does. A store that cannot say leaves the
    refusal as it was."""
    try:
        state = await gw.store.get(identity.run_id, steps=False, reservations=False)
    except StateUnavailable:
        return
    if state is not None and state.stopped:
        raise Stopped(state.stop_reason or "stopped", state.stop_detail or "the run is stopped")


def _guard_error(gw: Gateway, guard: str) -> None:
    for hook in gw.hooks.on_guard_error:
        hook(guard)
