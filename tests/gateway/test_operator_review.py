"""Review of 739f3b1 (operator surface): defects found in `GET /admin/runs` paging, `tollgate runs`,
`tollgate ledger verify` and `tollgate serve`'s signal handling. Each test fails on that commit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from gateway.cli import main as cli_main
from gateway.ledger_chain import verify
from gateway.store.base import RunsCursor, RunStore
from tests.conftest import GatewayFactory
from tests.gateway.test_cli import ledger_file, table_ids
from tests.redis_fixture import RedisServer, redis_server  # noqa: F401  (fixture)

T = TypeVar("T")
NOW = 1_000.0


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TOLLGATE_ADMIN_TOKEN", raising=False)


async def rest_of_listing(store: RunStore, after: RunsCursor | None, limit: int) -> list[str]:
    """Run ids of every page of `runs_page` from `after` on."""
    ids: list[str] = []
    while True:
        page = await store.runs_page(after, limit)
        ids.extend(r.run_id for r in page.runs)
        if page.next is None:
            return ids
        after = page.next


# -- 1. ledger verify: a tampered row SQLite cannot decode is called an unreadable file ----------------


def test_verify_names_a_row_whose_text_was_changed_to_bytes_that_are_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: verify names the first tampered row; "a file it cannot read" is an `error:`. A raw edit
    that leaves bytes that are not UTF-8 in a text column (the gateway only ever writes UTF-8) is a
    tampered row, and rows before it were read fine: the file is readable. 739f3b1 lets sqlite3's
    decode error reach the `except sqlite3.Error` meant for unreadable files, so the tampering is
    reported as "cannot read the ledger" and no row is named."""
    db = ledger_file(tmp_path / "t.db", 3)
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER ledger_no_update")
        conn.execute("UPDATE ledger SET decision = CAST(x'616c6c6f77ff' AS TEXT) WHERE id = 2")  # 'allow\xff'
    result = verify(db)
    assert result.tampered and not result.unreadable, result
    assert (result.first_bad_id, result.rows) == (2, 1), result
    assert cli_main(["ledger", "verify", "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("TAMPERED: first bad row id 2"), err


# -- 4. `tollgate runs` never ends while runs change faster than it pages -------------------------------


@contextlib.asynccontextmanager
async def busy_fleet(h_admin_url: str, touch: Any) -> AsyncIterator[tuple[str, list[str]]]:
    """The real admin API behind a pass-through that lets `touch()` (runs taking steps) run before each
    page is read, as on a fleet where that many runs take a step during a page's round trip."""
    seen: list[str] = []
    session = ClientSession()

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        await touch()
        async with session.get(f"{h_admin_url}{request.path_qs}") as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/admin/runs", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), seen
    finally:
        await server.close()
        await session.close()


async def test_runs_cli_ends_on_a_gateway_whose_runs_keep_taking_steps(
    gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run updated while `tollgate runs` pages moves behind its cursor; when more than a page of runs
    take a step per page read, every page says `next`, each a new cursor, and the command (which only
    stops on a repeated cursor) pages forever, printing nothing. It should end after a bounded number
    of pages (printing what it has and saying the listing kept changing)."""
    h = await gateway_factory()
    ids = [f"busy-{i:04d}" for i in range(1001)]  # one more than the CLI's page
    for i, run_id in enumerate(ids):
        await h.gateway.store.record_step(run_id, "bot", {}, NOW + i)

    async def touch() -> None:
        now = time.time()
        for run_id in ids:
            await h.gateway.store.record_step(run_id, "bot", {}, now)

    finished = threading.Event()
    outcome: list[int] = []

    def run() -> None:
        try:
            outcome.append(cli_main(["runs", "--admin", url]))
        finally:
            finished.set()

    async with busy_fleet(h.admin_url, touch) as (url, seen):
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        deadline = time.monotonic() + 20
        while not finished.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        pages = len(seen)
    # the server is closed now: a CLI still paging fails its next request and ends
    await asyncio.to_thread(finished.wait, 10)
    capsys.readouterr()
    assert outcome == [0] and pages < 50, f"`tollgate runs` still paging after 20 s ({pages} pages)"


async def test_the_busy_fleet_harness_lists_every_run_when_nothing_changes(
    gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Control for the test above (passes): without steps while paging, the same pass-through gives the
    whole table in two pages."""
    h = await gateway_factory()
    ids = [f"calm-{i:04d}" for i in range(1001)]
    for i, run_id in enumerate(ids):
        await h.gateway.store.record_step(run_id, "bot", {}, NOW + i)

    async def touch() -> None:
        return None

    async with busy_fleet(h.admin_url, touch) as (url, seen):
        code = await asyncio.to_thread(cli_main, ["runs", "--admin", url])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert table_ids(out) == list(reversed(ids)) and len(seen) == 2


# -- 5. SIGINT while starting: a traceback and 130, where SIGINT once listening drains and exits 0 ------

SERVE = """
import os, signal, sys
{setup}
from gateway.cli import main
sys.exit(main(["serve", "--config", "tollgate.yaml", "--port", "0", "--admin-port", "0"]))
"""
SIGINT_DURING_IMPORTS = """
import builtins
real_import = builtins.__import__
def hook(name, *args, **kwargs):
    if name == "orjson" and not hasattr(builtins, "signalled"):
        builtins.signalled = True
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = hook
"""
SIGINT_DURING_THE_LOOP = """
from aiohttp import web
real_start = web.TCPSite.start
async def start(self):
    if not hasattr(web, "signalled"):
        web.signalled = True
        os.kill(os.getpid(), signal.SIGINT)
    await real_start(self)
web.TCPSite.start = start
"""


@pytest.mark.parametrize("setup", [SIGINT_DURING_IMPORTS, SIGINT_DURING_THE_LOOP],
                         ids=["during the imports", "in the event loop"])
def test_sigint_while_starting_exits_0_without_a_traceback(tmp_path: Path, setup: str) -> None:
    """`cmd_serve`: "exit 0 after SIGTERM or SIGINT"; once listening, SIGINT drains and exits 0 like
    SIGTERM. While starting, only SIGTERM is caught: SIGINT (Ctrl-C in `make run`, a supervisor's
    stop signal) raises KeyboardInterrupt wherever the start is, the very hazard `_StartupSignal`'s
    docstring says a raising handler is (inside orjson's or uvloop's setup), and exits 130 with a
    traceback."""
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump({"state": {"backend": "sqlite", "path": "s.db"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    script = SERVE.format(setup=textwrap.dedent(setup))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert "Traceback" not in done.stderr and done.returncode == 0, (done.returncode, done.stderr[-600:])
