"""Run the tour: scripted servers and a real gateway on loopback, three agent runs, their step trees.

`run_demo` returns the exit status: 0 when every run ended the way its scenario says (and the ledger
chain verifies), 1 with a message on stderr otherwise (a guard that did not trip, a server that could
not start, ...). Nothing is written outside a temporary directory except the `--otlp-json` file,
which is written even when the tour fails (its traces help to see why).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_apps
from gateway.config import Config, parse_config
from gateway.demo.agent import DemoError, SampleAgent
from gateway.demo.model import ScriptedModel
from gateway.demo.otlp import write_otlp_json
from gateway.demo.report import render_run
from gateway.demo.scenarios import MCP_SERVER, MODEL, Scenario, scenarios, scripts, tools
from gateway.demo.toolserver import ScriptedToolServer
from gateway.errors import ConfigError
from gateway.ledger_chain import verify
from otel.setup import setup_telemetry

__all__ = ["build_config", "run_demo"]


def build_config(model_url: str, mcp_url: str, workdir: Path, plays: tuple[Scenario, ...]) -> Config:
    """The gateway's config, built in code: the scripted provider for `demo-*` (priced, so a USD
    budget applies), the tool server as MCP server `workspace`, memory state, the ledger in
    `workdir`, and one agent (key `demo-key-<agent>`) per scenario with the scenario's policy."""
    data: dict[str, Any] = {
        "providers": {"scripted": {"type": "openai", "base_url": f"{model_url}/v1",
                                   "api_key": "demo-provider-key"}},
        "models": {"demo-*": "scripted"},
        "mcp_servers": {MCP_SERVER: {"url": f"{mcp_url}/mcp"}},
        "pricing": {"demo-*": {"input_per_mtok": 3.0, "output_per_mtok": 15.0, "max_output_tokens": 4096}},
        "state": {"backend": "memory"},
        "ledger": {"path": str(workdir / "ledger.db")},
        "agents": {p.agent: {"keys": [f"demo-key-{p.agent}"], **p.policy} for p in plays},
    }
    return parse_config(data, env={}, base_dir=str(workdir))


async def _serve(app: web.Application, runners: list[web.AppRunner]) -> str:
    """Start `app` on 127.0.0.1, a free port; returns its base URL. The runner joins `runners`."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    runners.append(runner)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


async def _fetch_run(session: aiohttp.ClientSession, admin_url: str, run_id: str) -> dict[str, Any]:
    url = f"{admin_url}/admin/runs/{run_id}"
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                raise DemoError(f"GET {url} answered {resp.status}: {(await resp.text())[:200]}")
            run: dict[str, Any] = await resp.json()
            return run
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise DemoError(f"GET {url} failed: {exc!r}") from exc


def _flow(value: Any) -> str:
    """`value` in YAML flow style, as it would be written in `tollgate.yaml`."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    return str(value)


def _boxes_ok(out: TextIO) -> bool:
    try:
        "├└│→".encode(out.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


class _Tour:
    """One tour: the servers it started, what it printed and the problems it found."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.problems: list[str] = []
        self.tripped: list[str] = []
        self.runners: list[web.AppRunner] = []

    def say(self, line: str = "") -> None:
        print(line, file=self.out, flush=True)

    async def play(
        self, workdir: Path, telemetry_env: dict[str, str], exporter: InMemorySpanExporter | None
    ) -> None:
        model, server = ScriptedModel(scripts(), model_ids=(MODEL,)), ScriptedToolServer(MCP_SERVER, tools())
        model_url = await _serve(model.app(), self.runners)
        mcp_url = await _serve(server.app(), self.runners)
        plays = scenarios()
        config = build_config(model_url, mcp_url, workdir, plays)
        telemetry = setup_telemetry(telemetry_env, exporter=exporter)
        gateway: list[web.AppRunner] = []
        try:
            proxy, admin = create_apps(config, telemetry=telemetry)
            proxy_url = await _serve(proxy, gateway)
            admin_url = await _serve(admin, gateway)
            self.say("tollgate demo: an offline tour (loopback only, no API keys)")
            self.say(f"  scripted model (OpenAI wire)   {model_url}/v1   {MODEL}, priced $3/$15 per Mtok")
            self.say(f"  scripted MCP tool server       {mcp_url}/mcp   search_docs, read_file, delete_file")
            self.say(f"  tollgate proxy                 {proxy_url}   (MCP at {proxy_url}/mcp/{MCP_SERVER})")
            self.say(f"  tollgate admin                 {admin_url}")
            await self._runs(plays, server, proxy_url, admin_url)
        finally:
            for runner in reversed(gateway):
                await runner.cleanup()  # closes the ledger: its rows are all written after this
            if exporter is not None:
                await asyncio.to_thread(telemetry.force_flush, 5.0)
            await asyncio.to_thread(telemetry.shutdown, 5.0)
        self._check_ledger(workdir / "ledger.db")

    async def _runs(self, plays: tuple[Scenario, ...], server: ScriptedToolServer, proxy_url: str,
                    admin_url: str) -> None:
        suffix = uuid.uuid4().hex[:6]  # fresh run ids (and so trace ids) on every tour
        timeout = aiohttp.ClientTimeout(total=30)
        ascii_only = not _boxes_ok(self.out)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for number, scenario in enumerate(plays, start=1):
                run_id = f"demo-{scenario.name}-{suffix}"
                self.say()
                self.say(f"== run {number}/{len(plays)}: {scenario.title}")
                self.say(f"  agent {scenario.agent}, policy {_flow(dict(scenario.policy))}")
                agent = SampleAgent(session, proxy_url=proxy_url, key=f"demo-key-{scenario.agent}",
                                    run_id=run_id, server=MCP_SERVER, model=MODEL,
                                    say=lambda line: self.say(f"  {line}"))
                found = await scenario.play(agent, server)
                run = await _fetch_run(session, admin_url, run_id)
                if run.get("stop_reason") != scenario.expected:
                    stop = run.get("stop_reason")
                    found.append(f"run stop reason: expected {scenario.expected}, got {stop}")
                self.say()
                self.say(f"  step tree (GET /admin/runs/{run_id}):")
                for line in render_run(run, ascii=ascii_only):
                    self.say(f"  {line}")
                self.problems += [f"run {number} ({scenario.name}): {p}" for p in found]
                self.tripped.append(scenario.expected)

    def _check_ledger(self, path: Path) -> None:
        result = verify(path)
        self.say()
        if result.ok:
            self.say(f"decision ledger: {result.rows} rows, hash chain verified")
        elif result.unreadable:
            self.problems.append(f"decision ledger cannot be read: {result.reason}")
        else:
            self.problems.append(f"decision ledger does not verify: row {result.first_bad_id}: {result.reason}")

    async def close(self) -> None:
        for runner in reversed(self.runners):
            await runner.cleanup()


async def _tour(out: TextIO, err: TextIO, otlp_path: str | None) -> int:
    exporter = InMemorySpanExporter() if otlp_path else None
    env = {"OTEL_SERVICE_NAME": "tollgate-demo"} if exporter is not None else {}
    tour = _Tour(out)
    try:
        with tempfile.TemporaryDirectory(prefix="tollgate-demo-") as tmp:
            try:
                await tour.play(Path(tmp), env, exporter)
            finally:
                await tour.close()
    except (DemoError, ConfigError, OSError) as exc:
        tour.problems.append(f"the tour could not finish: {exc}")
    finally:
        if exporter is not None and otlp_path is not None:
            spans = exporter.get_finished_spans()
            try:
                count = write_otlp_json(otlp_path, spans)
                tour.say(f"traces: {count} spans written to {otlp_path} as OTLP JSON "
                         "(Jaeger UI: Search > Upload JSON)")
            except OSError as exc:
                tour.problems.append(f"cannot write {otlp_path}: {exc}")
    if tour.problems:
        print("tollgate demo: FAILED", file=err)
        for problem in tour.problems:
            print(f"  - {problem}", file=err)
        return 1
    tour.say(f"every guard tripped as expected: {', '.join(tour.tripped)}")
    return 0


def run_demo(otlp_json: str | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Play the tour; print to `out` (stdout) and problems to `err` (stderr). Returns the exit status."""
    return asyncio.run(_tour(out or sys.stdout, err or sys.stderr, otlp_json))
