"""App factory: the proxy app and the admin app, with the gateway built in `cleanup_ctx`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gateway.admin import create_admin_app
from gateway.config import Config
from gateway.errors import GatewayError
from gateway.forward import forward_other, unknown_path
from gateway.identity import Identifier
from gateway.ledger import Ledger
from gateway.mcp_flights import end_flights
from gateway.model_list import list_models
from gateway.observe import on_step, redactor_for
from gateway.observe_runs import end_idle_runs, end_late_claims, end_reset, end_with
from gateway.outputs import Resolver, resolve_agent_grammars
from gateway.pricing import Pricer
from gateway.providers import adapters
from gateway.proxy import GATEWAY, chat_handler
from gateway.routing import Router
from gateway.runtime import Gateway
from gateway.store import open_store
from gateway.upstream import Transport, Upstream
from grammars.library import GrammarLibrary
from guards.base import StopCondition
from guards.registry import build_chain
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry

_log = logging.getLogger(__name__)
CONFIG: web.AppKey[Config] = web.AppKey("config", Config)
TELEMETRY: web.AppKey[Telemetry] = web.AppKey("telemetry", Telemetry)
"""A `Telemetry` given to `create_app`: used instead of one built from `OTEL_*`, owned by the caller."""
GUARDS: web.AppKey[dict[str, list[tuple[StopCondition, str]]]] = web.AppKey("guards", dict)
"""Each configured agent's guards (with their on-error policy), built once by `create_app`."""


async def _gateway_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    library = GrammarLibrary.load(config.resolve(config.grammars.dir))
    resolve_agent_grammars(library, config.agents)
    local = await _local_transports(config)
    store = open_store(config)  # SQLite: holds the state file's lock until closed
    upstream = Upstream.create(max_answer_bytes=config.limits.max_answer_bytes)
    ledger: Ledger | None = None
    try:
        gw = Gateway(
            config=config,
            identifier=Identifier(config),
            router=Router(config),
            adapters=adapters(),
            pricer=Pricer(config.pricing),
            store=store,
            upstream=upstream,
            guards=app[GUARDS],
        )
        gw.transports.update(local)
        gw.services["grammars"] = library
        gw.services["resolver"] = Resolver(library, max_source_bytes=config.limits.max_schema_bytes)
        ledger_path = config.ledger_file
        # the run store's own file (locked by it): its ledger is this process's alone, written on the loop
        shares_store = (config.state.backend == "sqlite"
                        and ledger_path.resolve() == config.resolve(config.state.path).resolve())
        ledger = Ledger.open(ledger_path, linger_s=0.05, on_loop=shares_store)
        await ledger.start()
        given = app.get(TELEMETRY)
        if given is None:
            telemetry = setup_telemetry(os.environ, capture_content=config.otel.capture_content)
        else:
            telemetry = given
        gw.services.update(ledger=ledger, telemetry=telemetry, metrics_render=telemetry.metrics.render,
                           redactor=redactor_for(gw), on_reset=[lambda fresh: end_reset(gw, fresh)])
        gw.hooks.on_step.append(lambda step: on_step(gw, step))
        gw.hooks.on_step.append(lambda step: end_with(gw, step))  # after: the step's span ends first
        gw.hooks.on_guard_error.append(telemetry.metrics.guard_error)
    except BaseException:  # startup failed: release what is open, the state file's lock included
        try:
            await upstream.close()
            if ledger is not None:
                await ledger.close()
        finally:
            await store.close()
        raise
    app[GATEWAY] = gw
    try:
        yield
    finally:
        gw.shutting_down = True
        try:
            # the tools/call executions still running are cut and recorded first: they need the upstream,
            # and their rows the ledger and the store (whoever runs the app: `tollgate serve`, a test, ...)
            await end_flights(gw)
            await end_late_claims(gw)
            await upstream.close()
            await ledger.close()  # raises StateUnavailable if rows could not be written: still close the rest
        finally:
            await store.close()
            if given is None:
                await asyncio.to_thread(telemetry.shutdown, 5.0)


async def _local_transports(config: Config) -> dict[str, Transport]:
    """In-process models (`type: outlines`), loaded off the loop. Raises ConfigError when one cannot
    load (the `local` extra missing, no model directory)."""
    loaded: dict[str, Transport] = {}
    for name, provider in config.providers.items():
        if provider.engine == "outlines" and provider.model is not None:
            # only a config with a local model loads the in-process engine's modules
            from gateway.local import OutlinesTransport

            loaded[name] = await asyncio.to_thread(
                OutlinesTransport.load, provider, name=name, model_dir=config.resolve(provider.model)
            )
    return loaded


async def _idle_runs_ctx(app: web.Application) -> AsyncIterator[None]:
    """Runs that simply stop calling end too: their `invoke_agent` root span is exported after
    `otel.run_idle_s` without a step."""
    gw = app[GATEWAY]
    idle = gw.config.otel.run_idle_s

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(idle / 4, 30.0))
            try:
                await end_idle_runs(gw, idle, time.time())
            except GatewayError as exc:  # the store is down: the next sweep tries again
                _log.warning("idle-run sweep skipped: %s", exc.message)

    task = asyncio.get_running_loop().create_task(sweep(), name="tollgate-idle-runs")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _on_shutdown(app: web.Application) -> None:
    gw = app.get(GATEWAY)
    if gw is not None:
        gw.shutting_down = True


def create_app(config: Config, *, telemetry: Telemetry | None = None) -> web.Application:
    """The proxy app. Its body limit is enforced by the pipeline (clear 413 in the caller's format).

    `telemetry`: use this instead of `setup_telemetry(os.environ, ...)` (e.g. `tollgate demo`, which
    collects spans in memory). The caller owns it: the app neither flushes nor shuts it down, and
    `otel.capture_content` is whatever it was built with."""
    app = web.Application(client_max_size=config.limits.max_body_bytes + 1)
    app[CONFIG] = config
    # every agent's guards now: a custom guard that cannot be built is a ConfigError before the gateway
    # listens (`serve` exits 1), never a failure of an agent's step
    app[GUARDS] = {name: build_chain(agent, name) for name, agent in config.agents.items()}
    if telemetry is not None:
        app[TELEMETRY] = telemetry
    app.cleanup_ctx.append(_gateway_ctx)
    app.cleanup_ctx.append(_idle_runs_ctx)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/chat/completions", chat_handler("openai"))
    app.router.add_post("/v1/messages", chat_handler("anthropic"))
    app.router.add_post("/v1/responses", chat_handler("openai_responses"))
    app.router.add_get("/v1/models", list_models)
    app.router.add_route("*", "/v1/{tail:.+}", forward_other)
    app.router.add_route("*", "/mcp/{server}", _mcp_route(config))
    # last: only what nothing above serves; [\s\S], as `.` would leave a path with a newline (`%0a`) to
    # aiohttp's plain-text 404
    app.router.add_route("*", r"/{tail:[\s\S]*}", unknown_path)
    return app


def _mcp_route(config: Config) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The `/mcp/{server}` handler. The MCP proxy's modules (JSON-RPC, tool calls, idempotency,
    approvals' queue) load now when MCP servers are configured, else on the first `/mcp/` request
    (which answers 404 `mcp_server_not_found`, in the same format, through the same handler)."""
    if config.mcp_servers:
        from gateway.mcp import mcp_handler  # configured: load while starting, not on the first call

        return mcp_handler
    return _mcp_on_demand


async def _mcp_on_demand(request: web.Request) -> web.StreamResponse:
    from gateway.mcp import mcp_handler  # no MCP server configured: load only if someone asks

    return await mcp_handler(request)


def create_apps(
    config: Config, *, telemetry: Telemetry | None = None
) -> tuple[web.Application, web.Application]:
    """The proxy app and its admin app (`telemetry`: see `create_app`)."""
    proxy = create_app(config, telemetry=telemetry)
    return proxy, create_admin_app(proxy)
