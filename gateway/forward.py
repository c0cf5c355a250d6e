"""Paths other than the guarded model calls: `GET /v1/models` (every provider's list, merged), other
`/v1/...` calls forwarded and traced (a spelling of a guarded path is that model call; a POST to a path
the provider bills per token, `gateway.metered.METERS`, is reserved and settled against the run's
budget), and a JSON 404 for anything else."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, unquote

import orjson
from aiohttp import web

from gateway import multipart
from gateway.batches import rewrites_urls, with_gateway_urls
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    PathNotFound,
    ShuttingDown,
    StateUnavailable,
    Stopped,
    both_formats,
)
from gateway.identity import Identity
from gateway.metered import METERS
from gateway.metered_forward import forward_metered
from gateway.observe_forward import end_forward, refused_forward, start_forward
from gateway.pipeline import CREDENTIALS, TRACE_HEADERS, add_credentials, parse_json, provider_secret
from gateway.providers.base import Adapter
from gateway.proxy import GATEWAY, handle_chat
from gateway.request_body import read_body
from gateway.respond import JSON, base_headers, echo_headers, error_response
from gateway.runtime import Gateway
from gateway.store.base import RunState
from gateway.unguarded import forbidden
from gateway.upstream import Scrubber, answer_headers, forwardable, lenient_segment, scrub, secret_bytes
from otel.http import operation_for_path
from otel.spans import StepSpan

# the guarded model-call paths, by the protocol their handler speaks
GUARDED_PATHS = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic", "/v1/responses": "openai_responses"}


def canonical_path(path: str) -> str:
    """`path` (decoded) as a lenient server reads it: lower case, each segment without `;parameters`
    and surrounding whitespace or control characters, no empty segments. `/v1//Chat/completions;x/`
    is `/v1/chat/completions`."""
    parts = (lenient_segment(part).lower() for part in path.split("/"))
    return "/" + "/".join(part for part in parts if part)


async def forward_other(request: web.Request) -> web.StreamResponse:
    """Any other `/v1/...` call: routed by the body's `model` (or to the first OpenAI provider), streamed
    back unchanged, unless the run is stopped. A POST to a spelling of a guarded path (doubled or
    trailing slashes, case, an encoded slash or space) is that model call, guards and all: an upstream
    that normalises paths must not make it a way around them; other methods than GET there are refused.
    A POST to a spelling of a metered path is metered the same way."""
    path = canonical_path(request.path)
    protocol = GUARDED_PATHS.get(path)
    if protocol is not None and request.method == "POST":
        return await handle_chat(request, protocol)
    meter = METERS.get(path)
    if meter is not None and request.method == "POST":  # billed per token: reserved and settled
        return await forward_metered(request, meter)
    gw = request.app[GATEWAY]
    dialect = wire_of(request)
    adapter: Adapter = gw.adapters[dialect]
    identity: Identity | None = None
    tail = request.rel_url.raw_path.removeprefix("/v1")
    operation = operation_for_path(tail)
    epoch, segment = 1, 0  # the run's root, for its spans (a forwarded call is no step of the run)
    raw = b""
    span: StepSpan | None = None
    try:
        if gw.shutting_down:
            raise ShuttingDown("tollgate is shutting down")
        identity = gw.identifier.identify(request.headers)
        if protocol is not None and request.method not in ("GET", "HEAD"):
            raise InvalidRequest(f"{request.method} is not a method of {canonical_path(request.path)}")
        state = await passing_run(gw, identity)
        # before the stop check, as for model calls: the ledger row of a refusal hashes the body
        raw = await read_body(request, gw.config.limits)
        if state is not None:
            epoch, segment = state.epoch, state.root_segment(step=False)
            refuse_stopped(state)
        refused = forbidden(request.method, path, identity.policy)  # not a step (`gateway.unguarded`)
        if refused is not None:
            raise refused
        route = None
        model = None
        if raw and request.content_type == JSON:
            model = parse_json(raw, gw.config.limits).get("model")
            if isinstance(model, str):
                route = gw.router.route(model)
                if route.prefixed:
                    raw = orjson.dumps({**orjson.loads(raw), "model": route.model})
        elif raw and (field := multipart.text_field(raw, request.headers.get("Content-Type", ""), "model")):
            model, where = field  # an upload (audio, images) names its model in a form field
            route = gw.router.route(model)
            if route.prefixed:
                raw = multipart.replace_field(raw, where, route.model)
        elif (named := model_in_path(tail)) is not None:  # `GET /v1/models/{id}`: asked of its provider
            route = gw.router.find(named)
            if route is not None and route.prefixed:
                tail = "/models/" + quote(route.model, safe="/:@")
        route = route or gw.router.default_for(dialect)
        if route is None:
            raise ModelNotFound("no provider is configured for this path")
        provider = route.provider
        if provider.engine != "http":
            asked = model_in_path(request.rel_url.raw_path.removeprefix("/v1"))  # the name as asked for
            if asked is not None and request.method in ("GET", "HEAD"):  # an in-process model describes itself
                entry = {"id": asked, "object": "model", "created": 0, "owned_by": route.provider_name}
                return web.Response(body=orjson.dumps(entry), content_type=JSON, headers=base_headers(identity))
            raise InvalidRequest(f"model {route.model!r} runs in-process and serves Chat Completions only")
        base = provider.base_url.rstrip("/")
        url = base + (("/v1" + tail) if provider.type == "anthropic" else tail)
        drop = frozenset() if provider.passthrough_auth else CREDENTIALS
        headers = forwardable(request.headers, drop=drop | TRACE_HEADERS)  # repeated fields as they came
        add_credentials(provider, headers)
        span = start_forward(gw, identity, request.headers, method=request.method, url=url, operation=operation,
                             model=model if isinstance(model, str) else None, route=route, epoch=epoch, segment=segment)
        headers.update(span.trace_headers() if span is not None else _agent_trace(request.headers))
        if request.rel_url.raw_query_string:
            url += "?" + request.rel_url.raw_query_string
        upstream = await gw.upstream.open(request.method, url, headers, raw or None, provider.timeouts)
    except GatewayError as exc:
        if span is not None:
            end_forward(span, status=None, failure=exc.code)
        elif identity is not None:
            refused_forward(gw, identity, exc, request.headers, method=request.method, operation=operation,
                            epoch=epoch, segment=segment, body=raw)
        return error_response(adapter, exc, base_headers(identity) if identity else echo_headers(request.headers))
    secret = provider_secret(provider)
    headers_out = answer_headers(upstream.headers, base_headers(identity), secret=secret)
    out = web.StreamResponse(status=upstream.status, headers=headers_out)
    failure: str | None = None
    try:
        # read whole: an error may echo the key tollgate sent (scrubbed, as in every answer); a batch
        # object's provider URLs are moved to the gateway (`gateway.batches`). Other bodies stream through,
        # a chunk at a time
        batch = rewrites_urls(path) and upstream.headers.get("Content-Type", "").startswith(JSON)
        if upstream.status >= 400 or batch:
            try:  # bounded by `limits.max_answer_bytes`
                body = await upstream.read()
            except GatewayError as exc:  # nothing was sent yet: the error in the caller's wire format
                failure = exc.code
                return error_response(adapter, exc, base_headers(identity))
            body = scrub(body, secret_bytes(secret))
            if upstream.status < 400:
                body = with_gateway_urls(body, provider.base_url, str(request.url.origin()))
            out.content_length = len(body)
            await out.prepare(request)
            await out.write(body)
        elif request.method == "HEAD":  # no body follows: the upstream's length is the answer's
            if (length := upstream.headers.get("Content-Length", "")).isdigit():
                out.content_length = int(length)
            await out.prepare(request)
        else:
            await out.prepare(request)
            scrubber = Scrubber(secret_bytes(secret))  # a success may echo the key too (a debugging upstream)
            async for chunk in upstream.chunks():
                if sent := scrubber.feed(chunk):
                    await out.write(sent)
            if rest := scrubber.finish():
                await out.write(rest)
        await out.write_eof()
    except GatewayError as exc:
        failure = exc.code  # the status line is gone; closing the stream early is the only signal left
    except ConnectionResetError:
        failure = "client_disconnected"
    finally:
        upstream.release()
        end_forward(span, status=upstream.status, failure=failure)
    return out


async def passing_run(gw: Gateway, identity: Identity) -> RunState | None:
    """The run of a call that passes through without guards (a forwarded path, the model list): None
    when it has none yet, or when the store is down and the agent's `state_failure` is `fail_open`.
    Raises StateUnavailable otherwise."""
    try:
        return await gw.store.get(identity.run_id, steps=False, reservations=False)
    except StateUnavailable:
        if identity.policy.state_failure != "fail_open":
            raise
        return None


def refuse_stopped(state: RunState) -> None:
    """A stopped run is stopped on every upstream path: raises Stopped with its reason."""
    if state.stopped:
        raise Stopped(state.stop_reason or "stopped", state.stop_detail or "the run is stopped")


def model_in_path(tail: str) -> str | None:
    """The model id of a `/models/{id}` path (after `/v1`), decoded; None for any other path."""
    prefix = "/models/"
    if not tail.startswith(prefix) or len(tail) == len(prefix):
        return None
    return unquote(tail[len(prefix):])


def wire_of(request: web.Request) -> str:
    """The wire format of a forwarded call, for its errors and its default provider: Anthropic's for its
    Messages API paths (`/v1/messages/count_tokens`, `/v1/messages/batches`, ...) and for any call the
    Anthropic SDK makes (it always sends `anthropic-version`), else OpenAI's."""
    if "anthropic-version" in request.headers or canonical_path(request.path).startswith("/v1/messages/"):
        return "anthropic"
    return "openai"


def _agent_trace(headers: Mapping[str, str]) -> dict[str, str]:
    """Telemetry off: the agent's own trace context goes upstream as it came (not its baggage, which
    carries tollgate's run id, as on model calls)."""
    return {name: value for name in ("traceparent", "tracestate") if (value := headers.get(name)) is not None}


async def unknown_path(request: web.Request) -> web.Response:
    """Any other path of the proxy port: a JSON 404 both SDKs read, with the run id echoed."""
    error = PathNotFound(f"tollgate serves nothing at {request.path[:200]!r} (model calls are under /v1/, "
                         f"MCP servers under /mcp/<server>)")
    return web.Response(status=error.status, body=both_formats(error), content_type=JSON,
                        headers=echo_headers(request.headers))
