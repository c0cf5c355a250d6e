"""`tollgate serve`: run the proxy and admin apps until SIGTERM/SIGINT, then drain gracefully.

On a signal the gateway stops accepting connections, closes idle keep-alive connections, lets in-flight
requests and streams finish within `shutdown_grace_s`, then exits 0; a request that still reaches a
handler meanwhile gets 503 `shutting_down`. A tool call still parked for approval when the grace ends
is denied and answered `approval_denied` (aiohttp waits for a handler once more after the grace before
cutting it); tool calls that are cut are still recorded before the run store and the ledger close.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from gateway.app import create_apps
from gateway.approvals import deny_after_grace
from gateway.config import Config, Limits
from gateway.errors import ConfigError, StateUnavailable
from gateway.proxy import GATEWAY
from gateway.runner import GatewayRunner


def handler_args(limits: Limits) -> dict[str, Any]:
    """HTTP parser settings for `GatewayRunner(..., **handler_args(limits))` (or `TestServer.start_server`).

    aiohttp's parser refuses a request line or a header field (name + value) over `max_header_bytes`
    and more than `max_headers` fields before any routing: a 400 whose JSON both wire formats read
    (`gateway.runner`; no handler ran, so the API called is unknown). Everything that passes the parser
    meets the same limits again, as a total, in `gateway.identity.check_headers`, which answers 400 in
    the caller's format. A connection with no request under way is closed after `body_idle_s`: one that
    never completes a request head (sent nothing, half a head, a head a byte at a time) held a file
    descriptor for aiohttp's default hour, so a few hundred of them refused every agent."""
    return {
        # tollgate decodes a body's Content-Encoding itself (`gateway.body_codings` says why)
        "auto_decompress": False,
        "keepalive_timeout": limits.body_idle_s,
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
        "max_headers": limits.max_headers,
    }


def admin_exposure_warning(config: Config, admin_host: str) -> str | None:
    """A warning when the admin port listens beyond loopback with no `admin.token`: anyone who can reach
    it can read every run and reset runs (which clears their budgets)."""
    if config.admin.token:
        return None
    try:
        if ipaddress.ip_address(admin_host.strip("[]")).is_loopback:
            return None
    except ValueError:
        if admin_host == "localhost":
            return None
    return (f"tollgate: warning: the admin port listens on {admin_host} without admin.token; anyone who can "
            f"reach it can read runs and reset budgets (set admin.token, or admin.host: 127.0.0.1)")


class LostAtShutdown(StateUnavailable):
    """The gateway served and stopped, but what it held could not all be saved (ledger rows counted lost)."""


async def serve(config: Config, *, host: str, port: int, admin_host: str, admin_port: int) -> None:
    warning = admin_exposure_warning(config, admin_host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    proxy, admin = create_apps(config)
    # handler_cancellation: a client that goes away cancels its handler at once, and with it the
    # upstream request, even while the relay is holding events and has nothing to write
    runner = GatewayRunner(
        proxy, shutdown_timeout=config.shutdown_grace_s, access_log=None, handler_cancellation=True,
        **handler_args(config.limits),
    )
    admin_runner = GatewayRunner(admin, shutdown_timeout=1.0, access_log=None, **handler_args(config.limits))
    await runner.setup()
    await admin_runner.setup()
    parked: asyncio.Task[None] | None = None
    listened = False
    try:
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        admin_site = web.TCPSite(admin_runner, admin_host, admin_port)
        await admin_site.start()
        bound = _port(site)
        admin_bound = _port(admin_site)
        listened = True
        freeze_startup_heap()
        print(
            f"tollgate listening on http://{host}:{bound} (admin http://{admin_host}:{admin_bound}); "
            f"state: {config.state.backend}",
            flush=True,
        )
        if not config.providers:
            print("tollgate: no provider is configured: every model call is a 404 model_not_found (set "
                  "OPENAI_API_KEY / ANTHROPIC_API_KEY for the embedded default, or list providers: in the config)",
                  file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        gw = proxy.get(GATEWAY)
        if gw is not None:
            gw.shutting_down = True
            gw.grace_ends = loop.time() + config.shutdown_grace_s  # aiohttp cuts handlers no earlier
            parked = loop.create_task(deny_after_grace(gw, config.shutdown_grace_s))
        print("tollgate: draining in-flight requests", flush=True)
    finally:
        try:
            await runner.cleanup()
        except StateUnavailable as exc:
            if listened:  # the gateway served: what failed is saving what it holds (ledger rows), not starting
                raise LostAtShutdown(exc.message) from exc
            raise
        if parked is not None:
            parked.cancel()  # the drain is over (perhaps before the grace ended): nothing is left parked
        await admin_runner.cleanup()


def freeze_startup_heap() -> None:
    """Move what exists once the gateway listens (modules, config, apps, compiled grammars: it lives as
    long as the process) out of the cyclic collector's reach.

    Why: under load, objects that outlive a few collections (spans waiting in the export queue, cached
    runs) keep promoting to the oldest generation, and every few seconds that triggers a full
    collection. With the startup heap in it, that collection walks ~65,000 objects: a 40-60 ms stall
    of the event loop (measured with `gc.callbacks` under `make bench`'s load), which alone decides the
    p99 latency. Frozen, the same collection walks what was promoted since startup: ~0.5 ms. O(1);
    garbage cycles that exist at this moment are kept (created once, at startup). Turns the collector
    back on (`tollgate serve` starts with it off)."""
    gc.freeze()
    gc.enable()


def _port(site: web.TCPSite) -> int:
    server = site._server  # aiohttp exposes the bound socket only through the server object
    sockets = getattr(server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else 0


def run(config: Config, *, host: str, port: int, admin_host: str, admin_port: int) -> int:
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop  # measured faster for the proxy loop; optional

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(config, host=host, port=port, admin_host=admin_host, admin_port=admin_port))
    except OSError as exc:
        print(f"tollgate: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # found while starting, e.g. a local model that cannot load
        for path, message in exc.problems:
            print(f"error: {path}: {message}", file=sys.stderr)
        return 1
    except LostAtShutdown as exc:
        print(f"tollgate: stopped, but not everything was saved: {exc.message}", file=sys.stderr)
        return 1
    except StateUnavailable as exc:  # e.g. the state file is another gateway's, or cannot be opened
        print(f"tollgate: cannot start: {exc.message}", file=sys.stderr)
        return 1
    return 0
