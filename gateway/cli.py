"""Command line: `tollgate serve | check-config | demo | runs | ledger verify` (DESIGN section 1)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import ConfigError

if TYPE_CHECKING:
    import urllib.error
    import urllib.request

    from gateway.config import Config


def _load(path: str | None) -> Config:
    from gateway.config import default_config, load_config

    if path:
        return load_config(path)
    if Path("tollgate.yaml").exists():
        return load_config("tollgate.yaml")
    return default_config()


def cmd_serve(args: argparse.Namespace) -> int:
    # Until the gateway listens (`server.freeze_startup_heap` turns it back on), the cyclic collector
    # would only walk the modules, config and apps being built, which all live as long as the process:
    # two full collections of ~60,000 objects, ~40 ms each, of the start to the first answer.
    gc.disable()
    from gateway.server import run

    try:
        config = _load(args.config)
    except ConfigError as exc:
        _print_problems(exc)
        return 1
    host = args.host or config.listen.host
    port = config.listen.port if args.port is None else args.port
    admin_port = config.admin.port if args.admin_port is None else args.admin_port
    try:
        return run(config, host=host, port=port, admin_host=config.admin.host, admin_port=admin_port)
    except ConfigError as exc:  # found while building the gateway (a custom guard), before it listens
        _print_problems(exc)
        return 1


def _print_problems(exc: ConfigError) -> None:
    for path, message in exc.problems:
        print(f"error: {path}: {message}", file=sys.stderr)


def cmd_check_config(args: argparse.Namespace) -> int:
    from gateway.config import load_config

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
    print(
        f"ok: {len(config.providers)} providers, {len(config.models)} model routes, "
        f"{len(config.agents)} agents, {len(config.mcp_servers)} MCP servers, state {config.state.backend}"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(args.otlp_json)


def cmd_runs(args: argparse.Namespace) -> int:
    import urllib.error  # the HTTP client is only for this command, not for `serve` and the rest

    url = args.admin.rstrip("/") + "/admin/runs"
    try:
        runs = _admin_get(url)["runs"]
    except urllib.error.HTTPError as exc:
        exc.close()  # its body is never read: free the connection now
        print(_http_error_line(url, exc), file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        print(f"error: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(format_runs(runs))
    return 0


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
    from gateway.ledger import verify

    path = args.db
    if path is None:
        try:
            config = _load(None)
        except ConfigError as exc:
            _print_problems(exc)
            return 1
        path = str(config.ledger_file)
    if not Path(path).exists():
        print(f"error: no ledger at {path}", file=sys.stderr)
        return 1
    result = verify(path)
    if result.ok:
        print(f"ok: {result.rows} ledger rows, chain intact; head hash {result.head}")
        return 0
    print(f"TAMPERED: first bad row id {result.first_bad_id}: {result.reason}", file=sys.stderr)
    return 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tollgate", description="Sidecar gateway for AI agents.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--admin-port", type=int)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)
    demo = sub.add_parser("demo", help="offline tour: a scripted model, MCP server and agent trip the guards")
    demo.add_argument("--otlp-json", metavar="FILE",
                      help="also write the tour's traces as OTLP JSON (loads in Jaeger's UI)")
    demo.set_defaults(func=cmd_demo)
    runs = sub.add_parser("runs", help="table of runs")
    runs.add_argument("--admin", default="http://127.0.0.1:9464")
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
