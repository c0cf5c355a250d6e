"""The app factory loads only what the config uses: importing the gateway and starting it with a
regex-grammar agent and no MCP server never loads jsonschema, the MCP proxy or the local model engine
(they cost startup time and memory); configuring them loads them while starting, not on a request.

Import checks run in a fresh interpreter: this test process has long since imported everything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.app import create_app, create_apps
from gateway.config import parse_config
from gateway.errors import StateUnavailable
from gateway.store.sqlite import SqliteRunStore

# modules only a configured (or first-used) feature needs
FEATURE_MODULES = ("jsonschema", "referencing", "gateway.mcp", "gateway.mcp_calls", "gateway.jsonrpc",
                   "gateway.idempotency", "gateway.local", "gateway.local_wire", "gateway.demo", "yaml")

_STARTUP = """
import asyncio, json, sys
from aiohttp import web
from gateway.app import create_apps
from gateway.config import parse_config

async def main():
    config = parse_config(json.loads(sys.argv[1]), env={}, base_dir=sys.argv[2])
    proxy, admin = create_apps(config)
    created = set(sys.modules)
    runner = web.AppRunner(proxy)
    await runner.setup()  # runs the gateway's startup (grammars, store, ledger, telemetry)
    started = set(sys.modules)
    await runner.cleanup()
    print(json.dumps({"created": sorted(created), "started": sorted(started)}))

asyncio.run(main())
"""


def _config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "providers": {"p": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "k"}},
        "models": {"gpt-*": "p"},
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")},
        "agents": {"default": {"budget": {"usd": 10}, "loop": {"window": 6, "max_distinct": 3},
                               "output": {"grammar": "regex:[a-z ]+"}}},
    }
    data.update(overrides)
    return data


def _modules_around_startup(config: dict[str, Any], tmp_path: Path) -> dict[str, set[str]]:
    """sys.modules of a fresh interpreter once the apps are created (`created`) and once the proxy app
    has started (`started`). Tracing is off, so nothing tries to connect."""
    env = {"PATH": "/usr/bin:/bin", "OTEL_SDK_DISABLED": "true"}
    out = subprocess.run(
        [sys.executable, "-c", _STARTUP, json.dumps(config), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).parents[2], check=False,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    return {"created": set(seen["created"]), "started": set(seen["started"])}


def _loaded(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in FEATURE_MODULES or m in FEATURE_MODULES}


def test_importing_the_server_loads_no_feature_module() -> None:
    code = "import sys, json, gateway.cli, gateway.server; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2], check=True)
    modules = set(json.loads(out.stdout))
    assert "gateway.app" in modules and "aiohttp" in modules  # the probe did import the server
    assert _loaded(modules) == set()


def test_starting_without_the_features_loads_none_of_them(tmp_path: Path) -> None:
    seen = _modules_around_startup(_config(tmp_path), tmp_path)
    assert "llguidance" in seen["started"] and "gateway.ledger" in seen["started"]  # it did start
    assert _loaded(seen["started"]) == set()


def test_configured_features_load_while_starting(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        mcp_servers={"files": {"url": "http://127.0.0.1:9/mcp"}},
        agents={"default": {"output": {"grammar": "ticket"}}},  # the shipped JSON Schema grammar
    )
    seen = _modules_around_startup(config, tmp_path)
    assert {"gateway.mcp", "gateway.mcp_calls"} <= seen["created"]  # MCP is configured: loaded up front
    assert "jsonschema" not in seen["created"]
    assert {"jsonschema", "grammars.schema"} <= seen["started"]  # the agent's JSON grammar compiled


async def test_mcp_path_without_mcp_servers_answers_404(tmp_path: Path) -> None:
    config = parse_config(_config(tmp_path, state={"backend": "memory"}), env={}, base_dir=str(tmp_path))
    proxy, _ = create_apps(config)
    server = TestServer(proxy, host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as session, session.post(
            server.make_url("/mcp/files"), json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        ) as resp:
            body = await resp.json()
            assert resp.status == 404
            assert body["error"]["data"] == {"code": "mcp_server_not_found"}
            assert resp.headers["x-tollgate-run-id"] == "default:default"
    finally:
        await server.close()


async def test_a_failed_startup_releases_the_state_file(tmp_path: Path) -> None:
    """Startup fails after the run store took its lock (here the ledger cannot open): the lock is
    released, so the app can be built again in the same process."""
    data = {"providers": {"o": {"type": "openai", "base_url": "http://127.0.0.1:9/v1"}}, "models": {"gpt-*": "o"},
            "state": {"backend": "sqlite", "path": "s.db"}, "ledger": {"path": "missing-dir/l.db"}}
    app = create_app(parse_config(data, env={}, base_dir=str(tmp_path)))
    ctx = app.cleanup_ctx[0](app)
    with pytest.raises(StateUnavailable, match="cannot open the ledger"):
        await ctx.__anext__()
    store = SqliteRunStore.open(tmp_path / "s.db")
    await store.close()
