"""Command line: `tollgate serve | check-config | demo | runs | ledger verify` (DESIGN section 1)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import urllib.error
    import urllib.request
    from types import FrameType

    from gateway.config import Config
    from gateway.errors import ConfigError


def _load(path: str | None) -> Config:
    from gateway.config import default_config, load_config

    if path:
        return load_config(path)
    if Path("tollgate.yaml").exists():
        return load_config("tollgate.yaml")
    return default_config()


class _StartupSignal:
    """SIGTERM or SIGINT before the gateway listens. Until `server.serve` installs its own handlers (which
    drain, then exit 0), the default would kill the process (SIGTERM: exit 143, read as a crash by an
    orchestrator stopping a pod that is still starting) or raise KeyboardInterrupt wherever the start is
    (SIGINT: a traceback). This handler only remembers the stop: raising from it, at whatever point of
    the start the signal lands, proved unsafe (inside a C extension's initialisation orjson crashes the
    process; inside the event loop's own setup uvloop is left running and cannot close). `cmd_serve`
    returns 0 at its next check (the imports are most of the start); later, a thread sends the signal
    again as soon as the server's handler has replaced this one, and the gateway stops as a running one
    does (it has nothing in flight yet)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._received: int | None = None  # a plain field: the handler takes no lock the interrupted code may hold
        self._done = threading.Event()
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)
        threading.Thread(target=self._pass_on, name="tollgate-startup-stop", daemon=True).start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum

    def _pass_on(self) -> None:
        """Until the server's handlers replace this one (then this thread ends): a 10 ms poll, during a
        start that takes about a second."""
        while not self._done.wait(0.01):
            if all(signal.getsignal(signum) != self._handle for signum in self.SIGNALS):
                received = self._received
                if received is not None and callable(signal.getsignal(received)):  # never to a default
                    os.kill(os.getpid(), received)
                return

    def stopped(self) -> bool:
        """Whether the start is to end here (said on stderr)."""
        if self._received is not None:
            name = signal.Signals(self._received).name
            print(f"tollgate: {name} while starting: stopped", file=sys.stderr, flush=True)
        return self._received is not None

    def close(self) -> None:
        """The start ended (the gateway ran and stopped, or failed to start): nothing to pass on."""
        self._done.set()


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the gateway; exit 0 after SIGTERM or SIGINT, also after a SIGTERM while it is still starting."""
    startup = _StartupSignal()  # first: the console script gets here within ~0.1 s of its start
    # Until the gateway listens (`server.freeze_startup_heap` turns it back on), the cyclic collector
    # would only walk the modules, config and apps being built, which all live as long as the process:
    # two full collections of ~60,000 objects, ~40 ms each, of the start to the first answer.
    gc.disable()
    try:
        # imported here, not by the module: the console script reaches the handler above sooner
        from gateway.errors import ConfigError
        from gateway.server import run

        if startup.stopped():
            return 0
        try:
            config = _load(args.config)
        except ConfigError as exc:
            _print_problems(exc)
            return 1
        if startup.stopped():
            return 0
        host = args.host or config.listen.host
        port = config.listen.port if args.port is None else args.port
        admin_port = config.admin.port if args.admin_port is None else args.admin_port
        try:
            return run(config, host=host, port=port, admin_host=config.admin.host, admin_port=admin_port)
        except ConfigError as exc:  # found while building the gateway (a custom guard), before it listens
            _print_problems(exc)
            return 1
    finally:
        startup.close()


def _print_problems(exc: ConfigError) -> None:
    for path, message in exc.problems:
        print(f"error: {path}: {message}", file=sys.stderr)


def cmd_check_config(args: argparse.Namespace) -> int:
    from gateway.config import load_config
    from gateway.errors import ConfigError

    try:
        config = load_config(args.file)
        from gateway.outputs import resolve_agent_grammars
        from grammars.library import GrammarLibrary
        from guards.registry import build_chain

        for name, agent in config.agents.items():
            build_chain(agent, name)
        resolve_agent_grammars(GrammarLibrary.load(config.resolve(config.grammars.dir)), config.agents)
    except ConfigError as exc:
        _print_problems(exc)
        return 1
    for warning in config_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"ok: {len(config.providers)} providers, {len(config.models)} model routes, "
        f"{len(config.agents)} agents, {len(config.mcp_servers)} MCP servers, state {config.state.backend}"
    )
    return 0


def config_warnings(config: Any) -> list[str]:
    """What a valid config will not do that its author likely expects: `check-config` prints them, and
    `serve` the first one at start."""
    import importlib.util

    warnings: list[str] = []
    if not config.providers:
        warnings.append("no provider is configured: every model call is a 404 model_not_found (set "
                        "OPENAI_API_KEY / ANTHROPIC_API_KEY for the embedded default, or list providers:)")
    for name, provider in config.providers.items():
        if provider.engine == "outlines" and importlib.util.find_spec("outlines") is None:
            warnings.append(f"providers.{name}: type outlines needs the local extra (pip install "
                            "'tollgate[local]'): serve refuses this config until it is installed")
    return warnings


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(args.otlp_json)


def cmd_runs(args: argparse.Namespace) -> int:
    """Every run, newest activity first: `GET /admin/runs` page after page, following `next`."""
    import http.client  # the HTTP client is only for this command, not for `serve` and the rest
    import urllib.error

    admin = args.admin if "://" in args.admin else f"http://{args.admin}"  # `127.0.0.1:9464` is meant
    url = admin.rstrip("/") + "/admin/runs"
    try:
        table = format_runs(_all_runs(url))  # a run without the fields a table shows is not a listing
    except urllib.error.HTTPError as exc:
        exc.close()  # its body is never read: free the connection now
        print(_http_error_line(exc.filename or url, exc), file=sys.stderr)  # filename: the page's URL
        return 1
    except http.client.InvalidURL as exc:  # an HTTPException, not an OSError: `--admin` is no URL
        print(f"error: --admin {args.admin!r} is not an http(s) URL: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"error: cannot read {url}: not a listing of runs (a run without {exc})", file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError, TypeError) as exc:
        print(f"error: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(table)
    return 0


def _all_runs(url: str) -> list[dict[str, Any]]:
    """The runs of every page. The pages run least recently updated first, so a run updated while they
    are read comes again in a later page: its last view is kept. Raises TypeError or KeyError for a page
    that is not a listing, ValueError for a `next` cursor given twice (it would never end)."""
    from urllib.parse import quote

    seen: dict[str, dict[str, Any]] = {}
    cursors: set[str] = set()
    page = _admin_get(url)
    while True:
        runs, cursor = page["runs"], page.get("next")
        if not isinstance(runs, list) or not isinstance(cursor, str | None):
            raise TypeError("not a listing of runs")
        new = 0
        for run in runs:
            new += seen.pop(str(run["run_id"]), None) is None
            seen[str(run["run_id"])] = run  # re-inserted: the dict keeps the order of last views
        if cursor is None:
            break
        if runs and not new:
            # a whole page of runs already listed: runs keep taking steps faster than they are read, and
            # following them would never end; every run was listed once
            print("tollgate: runs kept changing while listed; showing each one's latest view read",
                  file=sys.stderr)
            break
        if cursor in cursors:
            raise ValueError("the admin API gave the same next cursor twice")
        cursors.add(cursor)
        page = _admin_get(f"{url}?cursor={quote(cursor, safe='')}")
    return list(reversed(seen.values()))


def _admin_get(url: str) -> Any:
    """GET an admin endpoint with `TOLLGATE_ADMIN_TOKEN`. A redirect answer raises HTTPError."""
    import urllib.request

    request = urllib.request.Request(url)
    token = os.environ.get("TOLLGATE_ADMIN_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with _admin_opener().open(request, timeout=10) as resp:
        return json.loads(resp.read())


def _admin_opener() -> urllib.request.OpenerDirector:
    """An opener that sends the request to the URL given and nowhere else. urlopen's default one follows
    redirects, re-sending the token to whatever host a Location names, and sends every request through
    the environment's HTTP proxy; this one has neither handler, so a 3xx is an HTTPError."""
    import urllib.request

    opener = urllib.request.OpenerDirector()
    handlers = [urllib.request.UnknownHandler(), urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()]
    for handler in handlers:
        opener.add_handler(handler)
    return opener


def _http_error_line(url: str, exc: urllib.error.HTTPError) -> str:
    if exc.code in (301, 302, 303, 307, 308):
        where = exc.headers.get("Location") or "elsewhere"
        return (f"error: {url} redirects ({exc.code}) to {where}; tollgate does not follow redirects "
                "with the admin token: pass the admin API's own URL with --admin")
    if exc.code == 401:
        return (f"error: cannot read {url}: {exc}; the admin port requires its token: set "
                "TOLLGATE_ADMIN_TOKEN to admin.token")
    return f"error: cannot read {url}: {exc}"


def format_runs(runs: list[dict[str, Any]]) -> str:
    header = ["RUN ID", "AGENT", "STATUS", "STOP REASON", "SPENT USD", "TOKENS", "LLM CALLS", "TOOL CALLS"]
    rows = [
        [
            str(r["run_id"]),
            str(r["agent"]),
            str(r["status"]),
            str(r.get("stop_reason") or "-"),
            f"{r.get('spent_usd', 0.0):.6f}",
            str(int(r.get("input_tokens", 0)) + int(r.get("output_tokens", 0))),
            str(r.get("llm_calls", 0)),
            str(r.get("tool_calls", 0)),
        ]
        for r in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def cmd_ledger_verify(args: argparse.Namespace) -> int:
    """Exit 0 and print the row count and head hash when the chain verifies; exit 1 with `TAMPERED` and
    the first bad row when it does not, or with `error:` when the file cannot be read (no row is bad
    then). Without --db the file is `Config.ledger_file` of ./tollgate.yaml, found from the keys that
    decide it alone (`ledger_file_of`): an auditor needs none of the environment variables of the rest."""
    from gateway.config import Config, ledger_file_of
    from gateway.errors import ConfigError
    from gateway.ledger import verify

    path = args.db
    if path is None:
        try:
            found = Path("tollgate.yaml").exists()
            path = str(ledger_file_of("tollgate.yaml") if found else Config().ledger_file)
        except ConfigError as exc:
            _print_problems(exc)
            return 1
    if not Path(path).exists():
        print(f"error: no ledger at {path}", file=sys.stderr)
        return 1
    result = verify(path)
    if result.ok and result.reason:  # no ledger table: an empty chain, but say so (a wrong file, a dropped table)
        print(f"ok: 0 ledger rows: {path} has no ledger table (another file, or the table was dropped?); "
              f"head hash {result.head}")
        return 0
    if result.ok:
        print(f"ok: {result.rows} ledger rows, chain intact; head hash {result.head}")
        return 0
    if result.unreadable:
        print(f"error: cannot read the ledger {path}: {result.reason}", file=sys.stderr)
        return 1
    print(f"TAMPERED: first bad row id {result.first_bad_id}: {result.reason}", file=sys.stderr)
    return 1


def port(text: str) -> int:
    """A TCP port 0-65535 (0: any free one), as `listen.port` and `admin.port` take it: the OS would
    otherwise take a larger number modulo 65536 and listen somewhere nobody asked for."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tollgate", description="Sidecar gateway for AI agents.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config")
    serve.add_argument("--host")
    serve.add_argument("--port", type=port)
    serve.add_argument("--admin-port", type=port)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)
    demo = sub.add_parser("demo", help="offline tour: a scripted model, MCP server and agent trip the guards")
    demo.add_argument("--otlp-json", metavar="FILE",
                      help="also write the tour's traces as OTLP JSON (loads in Jaeger's UI)")
    demo.set_defaults(func=cmd_demo)
    runs = sub.add_parser("runs", help="table of runs")
    runs.add_argument("--admin", default="http://127.0.0.1:9464",
                      help="the admin port's URL (default http://127.0.0.1:9464)")
    runs.set_defaults(func=cmd_runs)
    ledger = sub.add_parser("ledger", help="decision ledger")
    ledger_sub = ledger.add_subparsers(dest="ledger_command", required=True)
    verify = ledger_sub.add_parser("verify", help="re-hash the ledger chain")
    verify.add_argument("--db")
    verify.set_defaults(func=cmd_ledger_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
