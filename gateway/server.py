"""`tollgate serve`: run the proxy and admin apps until SIGTERM/SIGINT, then drain gracefully.

On a signal the gateway stops accepting connections, answers new requests on open connections with
503 `shutting_down`, lets in-flight requests and streams finish within `shutdown_grace_s`, then exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from aiohttp import web

from gateway.app import create_apps
from gateway.config import Config
from gateway.errors import ConfigError
from gateway.proxy import GATEWAY


async def serve(config: Config, *, host: str, port: int, admin_host: str, admin_port: int) -> None:
    proxy, admin = create_apps(config)
    # handler_cancellation: a client that goes away cancels its handler at once, and with it the
    # upstream request, even while the relay is holding events and has nothing to write
    runner = web.AppRunner(
        proxy, shutdown_timeout=config.shutdown_grace_s, access_log=None, handler_cancellation=True
    )
    admin_runner = web.AppRunner(admin, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    await admin_runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        admin_site = web.TCPSite(admin_runner, admin_host, admin_port)
        await admin_site.start()
        bound = _port(site)
        admin_bound = _port(admin_site)
        print(
            f"tollgate listening on http://{host}:{bound} (admin http://{admin_host}:{admin_bound}); "
            f"state: {config.state.backend}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        gw = proxy.get(GATEWAY)
        if gw is not None:
            gw.shutting_down = True
        print("tollgate: draining in-flight requests", flush=True)
    finally:
        await runner.cleanup()
        await admin_runner.cleanup()


def _port(site: web.TCPSite) -> int:
    server = site._server  # aiohttp exposes the bound socket only through the server object
    sockets = getattr(server, "sockets", None) or []
    return int(sockets[0].getsockname()[1]) if sockets else 0


def run(config: Config, *, host: str, port: int, admin_host: str, admin_port: int) -> int:
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
    return 0
