"""`GET /v1/models`: the merged model lists of every provider reached over HTTP, after the in-process
models (`local_models`).

Each provider's list is read to its end (Anthropic's is paged: `has_more`, `after_id`), with the
credentials its model calls carry (the agent's own for a `passthrough_auth` provider). The merged list
answers both SDKs: OpenAI's `{"object": "list", "data"}` and Anthropic's page fields (`has_more`,
`first_id`, `last_id`), paged over the merged list by the caller's `limit`, `after_id` and `before_id`;
a model two providers list is in it once (`once_each`).
Errors are in the caller's wire format. A stopped run's list is refused like any forwarded call of it
(403 with the stop's reason, a span and a ledger row).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson
from aiohttp import web
from multidict import CIMultiDict

from gateway.config import Config
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ShuttingDown,
    UpstreamUnavailable,
)
from gateway.forward import passing_run, refuse_stopped, wire_of
from gateway.identity import Identity
from gateway.observe_forward import end_forward, refused_forward, start_forward
from gateway.pipeline import CREDENTIALS, add_credentials, provider_secret
from gateway.proxy import GATEWAY
from gateway.respond import JSON, base_headers, echo_headers, error_response
from gateway.routing import Route
from gateway.runtime import Gateway
from gateway.upstream import scrub, secret_bytes

MAX_PAGES = 50  # a provider's list read page by page stops here (50,000 models at Anthropic's largest page)
PAGE_LIMIT = 1000  # Anthropic's largest page
MAX_LIMIT = 1000  # the most a caller's `limit` may ask for


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    adapter = gw.adapters[wire_of(request)]
    identity: Identity | None = None
    epoch, segment = 1, 0  # the run's root, for the spans (a model list is no step of the run)
    try:
        if gw.shutting_down:
            raise ShuttingDown("tollgate is shutting down")
        identity = gw.identifier.identify(request.headers)
        paging = _paging(request.query)
        state = await passing_run(gw, identity)
        if state is not None:
            epoch, segment = state.epoch, state.root_segment(step=False)
            refuse_stopped(state)  # as for every forwarded call
    except GatewayError as exc:
        if identity is None:
            return error_response(adapter, exc, echo_headers(request.headers))
        refused_forward(gw, identity, exc, request.headers, method="GET", operation=None, epoch=epoch,
                        segment=segment)
        return error_response(adapter, exc, base_headers(identity))
    merged = local_models(gw.config)
    reached = 0
    for name, provider in gw.config.providers.items():
        if provider.engine != "http":  # an in-process model has no list to ask for: `local_models`
            continue
        items = await _models_of(gw, Route(name, provider, "", False), request.headers, identity,
                                 (epoch, segment))
        if items is None:
            continue
        reached += 1
        merged.extend({**item, "owned_by": item.get("owned_by", name), "provider": name}
                      for item in items if isinstance(item, dict))
    if any(p.engine == "http" for p in gw.config.providers.values()) and reached == 0:
        return error_response(adapter, UpstreamUnavailable("no provider answered the model list"),
                              base_headers(identity))
    body = orjson.dumps(page(once_each(gw, merged), *paging))
    return web.Response(body=body, content_type=JSON, headers=base_headers(identity))


def once_each(gw: Gateway, models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each model id once (providers serving one model both list it): the entry of the provider a call of
    that model is routed to, else the first, in the place of the first. Paging by id (`after_id`) needs
    ids that name one place: a repeated one sent the SDK's paging round in a circle."""
    by_id: dict[Any, dict[str, Any]] = {}
    for model in models:
        model_id = model.get("id")
        kept = by_id.setdefault(model_id, model)
        if kept is not model and isinstance(model_id, str):
            route = gw.router.find(model_id)
            if route is not None and model.get("provider") == route.provider_name != kept.get("provider"):
                by_id[model_id] = model
    return list(by_id.values())


def local_models(config: Config) -> list[dict[str, Any]]:
    """The entries of in-process models: each exact name `models:` routes to one (a glob names no model
    to list)."""
    return [{"id": model, "object": "model", "created": 0, "owned_by": name, "provider": name}
            for model, name in config.models.items()
            if not any(c in model for c in "*?[") and config.providers[name].engine != "http"]


async def _models_of(gw: Gateway, route: Route, asked: Mapping[str, str], identity: Identity,
                     root: tuple[int, int]) -> list[Any] | None:
    """Every entry of one provider's list, or None when it did not answer with one. Each page asked
    is a CLIENT span, as any forwarded call is."""
    provider = route.provider
    headers: CIMultiDict[str] = CIMultiDict()
    if provider.passthrough_auth:  # its model calls carry the agent's credentials: so does its list
        headers.extend((k, v) for k, v in asked.items() if k.lower() in CREDENTIALS)
    if provider.type == "anthropic" and "anthropic-version" in asked:
        headers["anthropic-version"] = asked["anthropic-version"]
    add_credentials(provider, headers)
    base = provider.base_url.rstrip("/") + ("/v1/models" if provider.type == "anthropic" else "/models")
    items: list[Any] = []
    after: str | None = None
    for _ in range(MAX_PAGES):
        url = base if provider.type != "anthropic" else f"{base}?limit={PAGE_LIMIT}" + (
            f"&after_id={quote(after, safe='')}" if after else "")
        span = start_forward(gw, identity, asked, method="GET", url=url, operation=None, model=None, route=route,
                             epoch=root[0], segment=root[1])
        sent = headers.copy()
        if span is not None:
            sent.update(span.trace_headers())
        try:
            upstream = await gw.upstream.open("GET", url, sent, None, provider.timeouts)
            try:
                data = await upstream.read()
            finally:
                upstream.release()
        except GatewayError as exc:
            end_forward(span, status=None, failure=exc.code)
            return None
        end_forward(span, status=upstream.status)
        if upstream.status >= 300:
            return None
        try:  # a debugging upstream may echo the key it was sent: never in the merged list
            answer = orjson.loads(scrub(data, secret_bytes(provider_secret(provider))))
            found = answer.get("data") or []
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if not isinstance(found, list):
            return None
        items.extend(found)
        last = answer.get("last_id")
        if not (answer.get("has_more") is True and isinstance(last, str) and last and last != after):
            break
        after = last
    return items


def _paging(query: Mapping[str, str]) -> tuple[int | None, str | None, str | None]:
    """The caller's `limit`, `after_id` and `before_id` (Anthropic's list parameters)."""
    limit: int | None = None
    raw = query.get("limit")
    if raw is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
            raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}")
        limit = int(raw)
    return limit, query.get("after_id") or None, query.get("before_id") or None


def page(models: list[dict[str, Any]], limit: int | None, after: str | None, before: str | None) -> dict[str, Any]:
    """One page of the merged list, as both SDKs read it. Without a limit, every model after `after_id`
    (or before `before_id`); an id that is not in the list gives an empty page."""
    ids = [m.get("id") for m in models]
    start, end = 0, len(models)
    if after is not None:
        start = ids.index(after) + 1 if after in ids else end
    if before is not None:
        end = ids.index(before) if before in ids else 0
    chosen = models[start:end]
    more = False
    if limit is not None and len(chosen) > limit:
        more = True
        # `before_id` pages backwards: the page is the models just before it
        chosen = chosen[-limit:] if before is not None and after is None else chosen[:limit]
    first = chosen[0].get("id") if chosen else None
    last = chosen[-1].get("id") if chosen else None
    return {"object": "list", "data": chosen, "has_more": more, "first_id": first, "last_id": last}
