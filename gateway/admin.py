"""Admin port: health, readiness, Prometheus metrics, runs, approvals of parked tool calls."""

from __future__ import annotations

import base64
import hmac
import json
import math
import time
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from gateway.admin_guard import cross_site_refusal, host_refusal
from gateway.approvals import routes as approval_routes
from gateway.errors import InvalidRequest, RequestTooLarge, StateUnavailable
from gateway.proxy import GATEWAY
from gateway.runtime import Gateway
from gateway.store.base import RunsCursor

PROXY_APP: web.AppKey[web.Application] = web.AppKey("proxy_app", web.Application)
JSON = "application/json"
_OPEN = frozenset({"/healthz", "/readyz"})
RUNS_PAGE = 1000  # default and largest page of GET /admin/runs (a run view with its steps is a few KB)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type=JSON)


def _gateway(request: web.Request) -> Gateway | None:
    proxy = request.app[PROXY_APP]
    return proxy.get(GATEWAY)


@web.middleware
async def _auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    if request.path in _OPEN:
        return await _answer(request, handler)
    gw = _gateway(request)
    if gw is None:
        return _unavailable()  # the token is not known yet: fail closed
    token = gw.config.admin.token
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    local = str(sockname[0]) if isinstance(sockname, tuple) and sockname else None
    refusal = cross_site_refusal(request.method, request.headers) or (
        None if token else host_refusal(request.headers.get("host"), local))
    if refusal is not None:
        return _json({"error": {"code": "forbidden", "message": refusal}}, 403)
    if token:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        # header text is decoded with surrogateescape: encode it back the same way, never raise
        presented_bytes = presented.strip().encode("utf-8", "surrogateescape")
        good = hmac.compare_digest(presented_bytes, token.encode("utf-8", "surrogateescape"))
        if not good or scheme.lower() != "bearer":
            response = _json({"error": {"code": "unauthorized", "message": "admin token required"}}, 401)
            response.headers["WWW-Authenticate"] = 'Bearer realm="tollgate-admin"'
            return response
    return await _answer(request, handler)


async def _answer(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The handler's answer, with the errors aiohttp and the store raise as JSON like every admin answer."""
    try:
        return await handler(request)
    except StateUnavailable as exc:  # the run store is down: say so, as the proxy port does
        return _json({"error": {"code": exc.code, "message": exc.message}}, exc.status)
    except web.HTTPNotFound:  # the router's own answer is plain text: JSON like every other admin answer
        return _json({"error": {"code": "not_found", "message": f"no admin endpoint at {request.path}"}}, 404)
    except web.HTTPRequestEntityTooLarge as exc:  # a body over aiohttp's client_max_size: plain text too
        message = exc.text or "request body too large"
        return _json({"error": {"code": RequestTooLarge.code, "message": message}}, RequestTooLarge.status)
    except web.HTTPMethodNotAllowed as exc:
        response = _json({"error": {"code": "method_not_allowed",
                                    "message": f"{request.method} is not a method of {request.path}"}}, 405)
        response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return response


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    gw = _gateway(request)
    if gw is None or gw.shutting_down:
        return _json({"status": "not ready"}, 503)
    return _json({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    gw = _gateway(request)
    render = gw.services.get("metrics_render") if gw is not None else None
    if render is None:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        return web.Response(body=generate_latest(CollectorRegistry()), headers={"Content-Type": CONTENT_TYPE_LATEST})
    payload, content_type = render()
    return web.Response(body=payload, headers={"Content-Type": content_type})


def _unavailable() -> web.Response:
    return _json({"error": {"code": "not_ready", "message": "gateway not ready"}}, 503)


async def list_runs(request: web.Request) -> web.Response:
    """`{"runs": [...]}`, a page of at most `limit` runs (1 to RUNS_PAGE, default RUNS_PAGE) in the
    store's listing order (`RunStore.runs_page`: least recently updated first), plus `"next"`, an opaque
    cursor, when more runs follow: `?cursor=<next>` answers the page after it. A bad `limit` or
    `cursor` is a 400 invalid_request."""
    gw = _gateway(request)
    if gw is None:
        return _unavailable()
    try:
        limit = _page_limit(request.query.get("limit"))
        after = None if "cursor" not in request.query else decode_cursor(request.query["cursor"])
    except InvalidRequest as exc:
        return _json({"error": {"code": exc.code, "message": exc.message}}, exc.status)
    page = await gw.store.runs_page(after, limit)
    body: dict[str, object] = {"runs": [r.view() for r in page.runs]}
    if page.next is not None:
        body["next"] = encode_cursor(page.next)
    return _json(body)


def _page_limit(text: str | None) -> int:
    if text is None:
        return RUNS_PAGE
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= RUNS_PAGE:
        raise InvalidRequest(f"limit must be an integer from 1 to {RUNS_PAGE}")
    return limit


def encode_cursor(position: RunsCursor) -> str:
    """The `next` of a page: URL-safe text, opaque to clients (JSON keeps the float exact: its repr)."""
    return base64.urlsafe_b64encode(json.dumps([position[0], position[1]]).encode()).decode().rstrip("=")


def decode_cursor(text: str) -> RunsCursor:
    """The position `encode_cursor` wrote. Raises InvalidRequest for anything else."""
    position = None
    try:
        at, run_id = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        # not float(at) alone: it would take a string; a huge int overflows, NaN and infinity pass it
        if type(at) in (int, float) and isinstance(run_id, str):
            run_id.encode()  # run ids are UTF-8 text: a lone surrogate (UnicodeEncodeError) names none
            position = (float(at), run_id)
    except (ValueError, TypeError, OverflowError, RecursionError):  # not base64, not JSON, not a pair
        pass
    if position is None or not math.isfinite(position[0]):
        raise InvalidRequest("cursor is not one GET /admin/runs gave out: pass a page's `next` unchanged")
    return position


async def get_run(request: web.Request) -> web.Response:
    gw = _gateway(request)
    if gw is None:
        return _unavailable()
    run = await gw.store.get(request.match_info["run_id"])
    if run is None:
        return _json({"error": {"code": "not_found", "message": "no such run"}}, 404)
    return _json(run.view())


async def reset_run(request: web.Request) -> web.Response:
    gw = _gateway(request)
    if gw is None:
        return _unavailable()
    run_id = request.match_info["run_id"]
    gw.history_marks.bump(run_id)  # steps judged on the history before the reset read it again
    run = await gw.store.reset(run_id, time.time())
    if run is None:
        return _json({"error": {"code": "not_found", "message": "no such run"}}, 404)
    for hook in gw.services.get("on_reset", ()):
        hook(run)  # the run epoch that ended: its root span (claimed by the reset) is exported
    return _json(run.view())


def create_admin_app(proxy: web.Application) -> web.Application:
    app = web.Application(middlewares=[_auth])
    app[PROXY_APP] = proxy
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/runs", list_runs)
    app.router.add_post("/admin/runs/{run_id:.+}/reset", reset_run)
    app.router.add_get("/admin/runs/{run_id:.+}", get_run)
    app.router.add_routes(approval_routes(_gateway))
    return app
