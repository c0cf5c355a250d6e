"""Stage `record` for calls that have no pipeline step: the `/v1` paths tollgate forwards unguarded
(files, batches, models, ...: embeddings, legacy completions and compaction are metered steps, see
`gateway.metered`), and model calls refused before their step exists.

Each forwarded call gets one CLIENT span under the agent's trace context (else its run's root), whose
context goes upstream in `traceparent`; it ends once the answer has streamed back, with the status or
the failure. A call refused because its run is stopped gets a span and a ledger row saying so, as
every stop does (DESIGN section 4). A model call refused once parsed but before its step exists (no
provider serves its model, a grammar or tool schema tollgate cannot check) is a step too: a span with
`error.type` = the refusal's code and a ledger row. Never raises: telemetry errors are counted by
`Telemetry`.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from opentelemetry.context import Context

from gateway.call import Call, digest
from gateway.errors import GatewayError, InvalidRequest
from gateway.identity import Identity
from gateway.ledger import Ledger, LedgerEntry
from gateway.observe import provider_endpoint, telemetry_of
from gateway.routing import Route
from gateway.runtime import Gateway
from otel.attributes import provider_name_for
from otel.http import HTTP_RESPONSE_STATUS_CODE
from otel.propagation import context_from_headers
from otel.spans import StepLabels, StepSpan
from otel.telemetry import Telemetry

__all__ = ["body_model", "current_root", "end_forward", "refused_call", "refused_forward", "start_forward"]


def start_forward(gw: Gateway, identity: Identity, headers: Mapping[str, str], *, method: str, url: str,
                  operation: str | None, model: str | None, route: Route, epoch: int,
                  segment: int) -> StepSpan | None:
    """Open the span of a call about to be forwarded, under the agent's trace context, else under the run
    epoch's root `segment` (`RunState.root_segment(step=False)`); None when telemetry is off."""
    telemetry = telemetry_of(gw)
    if telemetry is None:
        return None
    provider = route.provider
    provider_name, address, port = provider_endpoint(provider.type, provider.base_url, route.provider_name)
    return _open(telemetry, headers, (epoch, segment), method, url.partition("?")[0], operation, model, identity,
                 StepLabels(operation=operation or "", provider=provider_name, request_model=model,
                            server_address=address or None, server_port=port))


def _open(telemetry: Telemetry, headers: Mapping[str, str], root: tuple[int, int], method: str, url: str,
          operation: str | None, model: str | None, identity: Identity, labels: StepLabels) -> StepSpan:
    """The span, under the agent's trace context, else its run's root (`root`: epoch, segment)."""
    parent = _parent(telemetry, headers, identity, root)
    if operation is None:
        return telemetry.start_http(method, url, labels=labels, parent=parent, run_id=identity.run_id,
                                    agent=identity.agent)
    return telemetry.start_inference(Call(protocol="openai", operation=operation, model=model or ""),
                                     provider_name=labels.provider, server_address=labels.server_address or "",
                                     server_port=labels.server_port or 0, parent=parent,
                                     run_id=identity.run_id, agent=identity.agent)


def _parent(telemetry: Telemetry, headers: Mapping[str, str], identity: Identity, root: tuple[int, int]) -> Context:
    """The agent's trace context when it sent one, else its run's root (`root`: epoch, segment). A call
    that writes nothing to the run is given the run's last root, not its next one: no sweep or stop would
    export a root it opened (`RunState.root_segment(step=False)`)."""
    epoch, segment = root
    return context_from_headers(headers) or telemetry.run_parent(identity.run_id, identity.agent, epoch=epoch,
                                                                 segment=segment)


def end_forward(span: StepSpan | None, *, status: int | None, failure: str | None = None) -> None:
    """End the span: the upstream's `status` (an error from 400 on), or `failure`, the code of what broke
    (`upstream_timeout`, `client_disconnected`, ...)."""
    if span is None:
        return
    if status is not None:
        span.set(HTTP_RESPONSE_STATUS_CODE, status)
    if failure is not None:
        span.error(failure, None, upstream=failure != "client_disconnected")
        span.end()
    elif status is not None and status >= 400:
        span.fail(str(status))
    else:
        span.finish(None)


def refused_forward(gw: Gateway, identity: Identity, error: GatewayError, headers: Mapping[str, str], *,
                    method: str, operation: str | None, epoch: int, segment: int, body: bytes = b"") -> None:
    """A call refused before forwarding because its run is stopped: a span and a ledger row with the
    stop's reason (other refusals are the caller's mistakes, answered without either). `body`: the
    request's, read already; the row names the `model` it names and hashes it as model calls' rows do."""
    reason = error.stop_reason
    if reason is None:
        return
    model = body_model(body)
    telemetry = telemetry_of(gw)
    if telemetry is not None:
        span = _open(telemetry, headers, (epoch, segment), method, "", operation, model, identity,
                     StepLabels(operation=operation or "", request_model=model))
        span.stop(reason, error.redacted)
        span.end()
    ledger: Ledger | None = gw.services.get("ledger")
    if ledger is not None:
        ledger.append_nowait(LedgerEntry(agent=identity.agent, run_id=identity.run_id,
                                         operation=operation or "http", model=model or "",
                                         input_hash=digest(body), decision="stop", reason=reason,
                                         detail=error.redacted))


async def current_root(gw: Gateway, identity: Identity) -> tuple[int, int]:
    """(epoch, segment) of the run's root a call that is no step of it goes under: its current epoch and
    last root (`RunState.root_segment(step=False)`); (1, 0) for a run the store does not hold yet, or
    cannot read now."""
    try:
        state = await gw.store.get(identity.run_id, steps=False, reservations=False)
    except GatewayError:  # the refusal is answered already; only where its span goes is at stake
        return 1, 0
    return (state.epoch, state.root_segment(step=False)) if state is not None else (1, 0)


def body_model(body: bytes) -> str | None:
    """The `model` a request body names when it is a JSON object naming one as a string, else None
    (an upload or a form fails at its first byte)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


async def refused_call(gw: Gateway, identity: Identity, call: Call, error: GatewayError,
                       headers: Mapping[str, str], *, started: float) -> None:
    """A model call refused after it was parsed but before its step exists (`model_not_found`, a grammar
    or tool schema that cannot be checked): a span with `error.type` = the code and a ledger row, as for
    a step refused in the pipeline. Its provider and server are its route's, or the provider its API
    implies without one (`_refused_endpoint`). Its parent is the agent's trace context, else the root of
    the run's current epoch, which this reads from the store (call it once the refusal was answered: the
    read never delays the answer); a store that fails the read leaves the span under the run's first
    root. `started`: when the call arrived (Unix seconds)."""
    reason = error.stop_reason or error.code
    # a bad request's message may quote what the agent sent (its schema, its grammar): the code says it
    detail = "" if isinstance(error, InvalidRequest) else error.redacted
    telemetry = telemetry_of(gw)
    if telemetry is not None:
        parent = context_from_headers(headers)
        if parent is None:
            epoch, segment = await current_root(gw, identity)
            parent = telemetry.run_parent(identity.run_id, identity.agent, epoch=epoch, segment=segment)
        provider_name, address, port = _refused_endpoint(gw, call)
        span = telemetry.start_inference(call, provider_name=provider_name, server_address=address,
                                         server_port=port, parent=parent, run_id=identity.run_id,
                                         agent=identity.agent, start_time=started)
        if error.stop_reason:
            span.stop(reason, detail or None)
        else:
            span.error(reason, detail or None, upstream=False)
        span.end()
    ledger: Ledger | None = gw.services.get("ledger")
    if ledger is not None:
        ledger.append_nowait(LedgerEntry(agent=identity.agent, run_id=identity.run_id,
                                         operation=call.operation, model=call.model,
                                         input_hash=call.request_hash,
                                         decision="stop" if error.stop_reason else "error", reason=reason,
                                         detail=detail))


def _refused_endpoint(gw: Gateway, call: Call) -> tuple[str, str, int]:
    """(`gen_ai.provider.name`, server address, server port) of a model call refused before its step.

    With a route whose provider speaks the call's API, that provider's, as its steps' spans name it (a
    schema tollgate cannot check, a grammar it does not know: the model would have gone there). Without
    one, no upstream was chosen: no server, and the provider name is the one the request's API implies,
    as `provider_name_for` names a provider of that type on a host it does not recognise: `anthropic` for
    the Messages API, `openai_compatible` for the OpenAI APIs. `gen_ai.provider.name` is Required on an
    inference span and custom values are allowed (semconv notes 1.1, 1.2); `openai` itself would claim
    api.openai.com (and the `openai.*` attributes it brings) for a call no provider was chosen for. A
    route to a provider of another API (a Messages call for a model an OpenAI provider serves) counts as
    none: the call could never go there, and its provider's flavour would describe another API's body."""
    adapter = gw.adapters.get(call.protocol)
    wire = adapter.provider_type if adapter is not None else "openai"
    route = gw.router.find(call.model) if call.model else None
    if route is not None and route.provider.type == wire:
        provider = route.provider
        return provider_endpoint(provider.type, provider.base_url, route.provider_name)
    return provider_name_for(wire, ""), "", 0
