"""The command line (DESIGN section 1): `tollgate runs` over pages, `tollgate ledger verify` on files it
cannot read or without the config's secrets, and `tollgate serve` stopped by SIGTERM while it starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.cli import main as cli_main
from gateway.ledger import Ledger, LedgerEntry, input_hash
from tests.conftest import GatewayFactory


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TOLLGATE_ADMIN_TOKEN", raising=False)


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`tollgate ...` in a thread, so servers on this loop can answer it."""
    code = await asyncio.to_thread(cli_main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- tollgate runs ---------------------------------------------------------------------------------------


def row(run_id: str, status: str = "active") -> dict[str, Any]:
    return {"run_id": run_id, "agent": "bot", "status": status, "spent_usd": 0.0, "llm_calls": 1}


@contextlib.asynccontextmanager
async def admin_pages(pages: dict[str | None, web.StreamResponse | dict[str, Any]],
                      seen: list[str]) -> AsyncIterator[str]:
    """A fake admin API answering `GET /admin/runs[?cursor=C]` with `pages[C]`; yields its base URL."""

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        page = pages[request.query.get("cursor")]
        return page if isinstance(page, web.StreamResponse) else web.json_response(page)

    app = web.Application()
    app.router.add_get("/admin/runs", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def table_ids(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:]]


async def test_runs_follows_next_and_prints_each_run_once_newest_first(capsys: pytest.CaptureFixture[str]) -> None:
    """Pages come least recently updated first; a run updated while they are read comes again later,
    and its last view is the one printed."""
    pages: dict[str | None, Any] = {
        None: {"runs": [row("a"), row("b")], "next": "c1/+="},
        "c1/+=": {"runs": [row("c"), row("a", "stopped")], "next": "c2"},
        "c2": {"runs": [row("d")]},
    }
    seen: list[str] = []
    async with admin_pages(pages, seen) as url:
        code, out, err = await run_cli(capsys, "runs", "--admin", url)
    assert code == 0, err
    assert seen == ["/admin/runs", "/admin/runs?cursor=c1%2F%2B%3D", "/admin/runs?cursor=c2"]
    assert table_ids(out) == ["d", "a", "c", "b"]
    assert out.splitlines()[2].split()[:3] == ["a", "bot", "stopped"]


@pytest.mark.parametrize("pages, fragment", [
    ({None: {"runs": [row("a")], "next": "c"}, "c": {"runs": [row("b")], "next": "c"}}, "same next cursor twice"),
    ({None: {"runs": [row("a")], "next": "c"}, "c": web.Response(status=400)}, "?cursor=c"),
    ({None: {"runs": {"a": 1}}}, "not a listing"),
    ({None: {"runs": [row("a")], "next": 7}}, "not a listing"),
    ({None: {"runs": [{"run_id": "a", "agent": "bot"}]}}, "not a listing of runs (a run without 'status')"),
], ids=["cursor repeats", "later page refused", "runs not a list", "next not text", "run without status"])
async def test_runs_reports_a_listing_it_cannot_follow(capsys: pytest.CaptureFixture[str],
                                                      pages: dict[str | None, Any], fragment: str) -> None:
    async with admin_pages(pages, []) as url:
        code, out, err = await run_cli(capsys, "runs", "--admin", url)
    assert code == 1 and out == ""
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err, err


@pytest.mark.parametrize("admin", ["not a url", "http://127.0.0.1:abc"])
async def test_runs_with_an_admin_address_that_is_no_url_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                                          admin: str) -> None:
    code, out, err = await run_cli(capsys, "runs", "--admin", admin)
    assert (code, out) == (2, "") and err.startswith(f"error: --admin {admin!r} is not an http(s) URL"), err


@pytest.mark.parametrize("flag", ["--port", "--admin-port"])
@pytest.mark.parametrize("value", ["65536", "99999", "-1", "http"])
def test_serve_refuses_a_port_out_of_range(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    """The OS takes a port above 65535 modulo 65536: `--port 99999` listened on 34463."""
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", flag, value])
    assert info.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


async def test_runs_prints_more_runs_than_one_page_of_a_real_gateway(
    gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    h = await gateway_factory()
    for i in range(1005):  # the default page holds 1,000
        await h.gateway.store.record_step(f"r-{i:04d}", "bot", {}, 1_000.0 + i)
    code, out, err = await run_cli(capsys, "runs", "--admin", h.admin_url)
    assert code == 0, err
    assert table_ids(out) == [f"r-{i:04d}" for i in reversed(range(1005))]


# -- tollgate ledger verify ------------------------------------------------------------------------------


def ledger_file(path: Path, rows: int = 2) -> Path:
    ledger = Ledger.open(path)
    for i in range(rows):
        ledger.append_nowait(LedgerEntry(agent="bot", run_id="r", operation="chat", model="m",
                                         input_hash=input_hash(str(i)), decision="allow", reason=None, detail=""))
    ledger.close_sync()
    return path


def test_verify_calls_a_file_it_cannot_read_an_error_never_a_tampered_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("this is not a ledger\n" * 50)
    assert cli_main(["ledger", "verify", "--db", str(notes)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: cannot read the ledger {notes}: file is not a database\n"


def test_verify_names_the_first_tampered_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = ledger_file(tmp_path / "t.db", 3)
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER ledger_no_update")
        conn.execute("UPDATE ledger SET model = 'x' WHERE id = 2")
    assert cli_main(["ledger", "verify", "--db", str(db)]) == 1
    assert capsys.readouterr().err.startswith("TAMPERED: first bad row id 2: entry_hash mismatch")


def test_verify_finds_the_ledger_of_a_config_whose_secrets_are_not_in_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger_file(tmp_path / "audit.db")
    config = {"providers": {"openai": {"type": "openai", "base_url": "https://api.openai.com/v1",
                                       "api_key": "${TOLLGATE_TEST_UNSET_KEY}"}},
              "state": {"backend": "memory"}, "ledger": {"path": "${TOLLGATE_TEST_LEDGER:-audit.db}"}}
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOLLGATE_TEST_UNSET_KEY", raising=False)
    monkeypatch.delenv("TOLLGATE_TEST_LEDGER", raising=False)
    assert cli_main(["ledger", "verify"]) == 0
    assert capsys.readouterr().out.startswith("ok: 2 ledger rows, chain intact")
    assert cli_main(["check-config", "tollgate.yaml"]) == 1  # the config as a whole still needs its key
    assert "TOLLGATE_TEST_UNSET_KEY is not set" in capsys.readouterr().err
    config["ledger"] = {"path": "${TOLLGATE_TEST_LEDGER}"}
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["ledger", "verify"]) == 1
    assert capsys.readouterr().err == "error: ledger.path: environment variable TOLLGATE_TEST_LEDGER is not set\n"


# -- tollgate serve: SIGTERM while starting -------------------------------------------------------------

SERVE = """
import os, signal, sys
{setup}
from gateway.cli import main
sys.exit(main(["serve", "--config", "tollgate.yaml", "--port", "0", "--admin-port", "0"]))
"""
# the signal lands while the gateway's modules are imported (orjson's, the first extension, included)
DURING_IMPORTS = """
import builtins
real_import = builtins.__import__
def hook(name, *args, **kwargs):
    if name == "orjson" and not hasattr(builtins, "signalled"):
        builtins.signalled = True
        os.kill(os.getpid(), signal.SIGTERM)
    return real_import(name, *args, **kwargs)
builtins.__import__ = hook
"""
# the signal lands in the event loop, with the apps and stores set up, before the gateway listens
DURING_THE_LOOP = """
from aiohttp import web
real_start = web.TCPSite.start
async def start(self):
    if not hasattr(web, "signalled"):
        web.signalled = True
        os.kill(os.getpid(), signal.SIGTERM)
    await real_start(self)
web.TCPSite.start = start
"""


@pytest.mark.parametrize("setup, said", [
    (DURING_IMPORTS, "tollgate: SIGTERM while starting: stopped"), (DURING_THE_LOOP, "draining in-flight"),
], ids=["during the imports", "in the event loop"])
def test_sigterm_while_starting_exits_0_without_a_traceback(tmp_path: Path, setup: str, said: str) -> None:
    """README: SIGTERM exits 0; also before the gateway listens, and wherever the start is, never by
    dying of the signal (143) or of an exception raised in the middle of the start."""
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump({"state": {"backend": "sqlite", "path": "s.db"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    script = SERVE.format(setup=textwrap.dedent(setup))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert said in done.stdout + done.stderr and "Traceback" not in done.stderr, (done.stdout, done.stderr)


# -- what a newcomer trips over (README walkthrough) --------------------------------------------------------


def test_check_config_warns_of_a_config_that_serves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tollgate.yaml"
    path.write_text("state: {backend: memory}\n")
    assert cli_main(["check-config", str(path)]) == 0  # valid: a warning, not an error
    out, err = capsys.readouterr()
    assert out.startswith("ok: 0 providers") and "warning: no provider is configured" in err


async def test_runs_takes_an_admin_address_without_a_scheme(gateway_factory: GatewayFactory,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    h = await gateway_factory()
    async with h.session.post(f"{h.url}/v1/chat/completions", headers={"x-tollgate-run-id": "plain"},
                              json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
    code, out, err = await run_cli(capsys, "runs", "--admin", h.admin_url.removeprefix("http://"))
    assert code == 0, err
    assert "plain" in out


async def test_runs_without_the_admin_token_says_which_variable_to_set(gateway_factory: GatewayFactory,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    h = await gateway_factory(admin={"token": "admin-secret-token-123"})
    code, _, err = await run_cli(capsys, "runs", "--admin", h.admin_url)
    assert code == 1 and "401" in err and "TOLLGATE_ADMIN_TOKEN" in err
