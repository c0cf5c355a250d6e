"""Operator-facing probes: the admin API, the CLI, the decision ledger, approvals and SIGTERM.

Written from the contract (DESIGN.md sections 1, 2, 4, 5; README "Commands", "Tools and MCP",
"Traces, metrics, ledger"), against real `tollgate serve` processes where the contract is about
processes. Loopback only: a fake provider (tests/fakes/upstream.py) and a real MCP server
(tests/fakes/mcp_server.py); clients are the official `openai` and `mcp` SDKs or plain HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import IO, Any

import aiohttp
import httpx2
import openai
import orjson
import pytest
import yaml
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client

from gateway.cli import main as cli_main
from gateway.ledger import verify
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.ports import free_port
from tests.fakes.served import clean_env, tollgate_command, wait_for
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, openai_stream

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "gpt-4o-mini", "messages": USER}
POLICY_REFUSED = -32003
TOOLS = {
    "allow": ["files/read_file", "files/write_note", "files/delete_*"],
    "approval": ["files/delete_*"],
    "tiers": {"files/write_*": "write", "files/delete_*": "dangerous"},
    "approval_timeout_s": 60,
}


# -- helpers ---------------------------------------------------------------------------------------


async def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 30.0) -> tuple[int, str, str]:
    """The `tollgate` console script as a subprocess, without blocking the loop."""
    proc = await asyncio.create_subprocess_exec(
        *tollgate_command(), *args, cwd=cwd, env=env or clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def ledger_rows(db: Path, run_id: str | None = None) -> list[dict[str, Any]]:
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        if run_id is None:
            rows = conn.execute("SELECT * FROM ledger ORDER BY id").fetchall()
        else:
            rows = conn.execute("SELECT * FROM ledger WHERE run_id = ? ORDER BY id", (run_id,)).fetchall()
        return [dict(r) for r in rows]


class Served:
    """One `tollgate serve` process on loopback ports, from a config file in `home`."""

    def __init__(self, home: Path, log: IO[bytes]) -> None:
        self.home = home
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> Served:
        self.proc = await asyncio.create_subprocess_exec(
            *tollgate_command(), "serve", "--config", str(self.home / "tollgate.yaml"),
            "--port", str(self.port), "--admin-port", str(self.admin_port),
            cwd=self.home, env=clean_env(), stdout=self.log, stderr=subprocess.STDOUT)
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                assert self.proc is not None
                if self.proc.returncode is not None:
                    self.log.flush()
                    logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.home.glob("serve-*.log")))
                    raise AssertionError(f"tollgate exited with {self.proc.returncode}: {logs}")
                try:
                    async with session.get(f"{self.admin_url}/readyz") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await wait_for(ready, 15.0, "/readyz")
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def admin(self, method: str, path: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.request(method, f"{self.admin_url}{path}", json=body, headers=headers) as resp:
                raw = await resp.read()
                try:
                    return resp.status, orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return resp.status, raw.decode(errors="replace")


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start(slow_s=2.0)
    yield server
    server.stop()


@pytest.fixture
async def serve(fake: tuple[FakeProvider, str], tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await serve(**config_overrides)`: writes tmp_path/tollgate.yaml (SQLite state in state.db) and
    starts `tollgate serve`; every process is killed at the end."""
    started: list[Served] = []
    logs: list[IO[bytes]] = []

    def write_config(**overrides: Any) -> None:
        _, fake_url = fake
        config: dict[str, Any] = {
            "providers": {"openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"}},
            "models": {"gpt-*": "openai"},
            "pricing": {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
            "state": {"backend": "sqlite", "path": "state.db"},
            "shutdown_grace_s": 10,
            **overrides,
        }
        (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump(config))

    async def start(**overrides: Any) -> Served:
        write_config(**overrides)
        log = (tmp_path / f"serve-{len(started)}.log").open("wb")
        logs.append(log)
        served = Served(tmp_path, log)
        started.append(served)
        return await served.start()

    yield start
    for served in started:
        if served.proc is not None and served.proc.returncode is None:
            served.proc.kill()
            await served.proc.wait()
    for log in logs:
        log.close()


@contextlib.asynccontextmanager
async def mcp_session(base_url: str, *, run: str, agent: str = "bot", server_goes_away: bool = False
                      ) -> AsyncIterator[Client]:
    """The official SDK's client on `/mcp/files`. `server_goes_away`: the gateway exits meanwhile, so
    the client's own goodbye on a new connection (refused, as the README says) is not an error here."""
    hdrs = {"x-tollgate-agent": agent, "x-tollgate-run-id": run}
    stack = contextlib.AsyncExitStack()
    http = await stack.enter_async_context(httpx2.AsyncClient(headers=hdrs, timeout=httpx2.Timeout(30, read=60)))
    client = await stack.enter_async_context(
        Client(streamable_http_client(f"{base_url}/mcp/files", http_client=http), mode="auto"))
    try:
        yield client
    finally:
        try:
            await stack.aclose()
        except Exception:
            if not server_goes_away:
                raise


async def pending_approvals(admin: Callable[..., Any], count: int = 1) -> list[dict[str, Any]]:
    async def found() -> list[dict[str, Any]] | None:
        status, data = await admin("GET", "/admin/approvals?status=pending")
        assert status == 200, data
        return data["approvals"] if len(data["approvals"]) >= count else None

    return await wait_for(found, 10.0, "a pending approval")  # type: ignore[no-any-return]


def result_text(result: Any) -> str:
    assert not result.is_error, result
    return str(result.content[0].text)


async def mcp_gateway(factory: GatewayFactory, files: mcp_server.RunningServer, **extra: Any) -> Harness:
    tools = {**TOOLS, **extra.pop("tools", {})}
    return await factory(mcp_servers={"files": {"url": files.url}}, agents={"bot": {"tools": tools}}, **extra)


def harness_admin(h: Harness) -> Callable[..., Any]:
    async def admin(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        async with h.session.request(method, f"{h.admin_url}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    return admin


MODERN_META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
               "io.modelcontextprotocol/clientInfo": {"name": "probe", "version": "0"},
               "io.modelcontextprotocol/clientCapabilities": {}}


def tools_call(name: str, arguments: dict[str, Any], rpc_id: int = 7) -> dict[str, Any]:
    """A `tools/call` of the 2026-07-28 protocol era (JSON answers, no session), as an SDK sends it."""
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": name, "arguments": arguments, "_meta": MODERN_META}}


def mcp_headers(run: str, agent: str = "bot") -> dict[str, str]:
    return {"x-tollgate-agent": agent, "x-tollgate-run-id": run, "content-type": "application/json",
            "accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28"}


def routing_headers(body: dict[str, Any]) -> dict[str, str]:
    """The 2026-07-28 era's `Mcp-Method` / `Mcp-Name` headers for a message."""
    out = {"mcp-method": body["method"]}
    if body["method"] == "tools/call":
        out["mcp-name"] = body["params"]["name"]
    return out


async def mcp_post(h: Harness, body: dict[str, Any], *, run: str, agent: str = "bot") -> tuple[int, Any]:
    headers = {**mcp_headers(run, agent), **routing_headers(body)}
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body), headers=headers) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw else None


async def park_then_leave(h: Harness, admin: Callable[..., Any], run: str, path: str) -> dict[str, Any]:
    """A tools/call parked for approval whose HTTP client goes away; returns its approval once denied."""
    task = asyncio.create_task(mcp_post(h, tools_call("delete_file", {"path": path}), run=run))
    [item] = await pending_approvals(admin)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def decided() -> dict[str, Any] | None:
        _, listed = await admin("GET", "/admin/approvals")
        found = next(a for a in listed["approvals"] if a["id"] == item["id"])
        return found if found["status"] != "pending" else None

    return await wait_for(decided, 5.0, "the abandoned approval to be decided")  # type: ignore[no-any-return]


# -- SIGTERM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_sigterm_past_the_grace_settles_the_cut_call_in_full_and_records_it(
    serve: Callable[..., Any], fake: tuple[FakeProvider, str], tmp_path: Path, stream: bool
) -> None:
    """README: SIGTERM lets requests and streams finish within `shutdown_grace_s` and exits 0; a call
    that broke, or that the upstream may have received, is settled at the full reservation, never at $0;
    every step is a ledger row. A call still running when the grace ends is cut: after a restart the run
    has no open reservation, is charged the output it reserved, the step has its one ledger row and the
    chain verifies."""
    provider, _ = fake
    served: Served = await serve(shutdown_grace_s=1)
    if stream:
        provider.queue(Reply(chunks=openai_stream(["tok "] * 60), chunk_delay=0.2))
    else:
        provider.queue(Reply(body=openai_completion("late"), delay=12))
    received = b""
    client_error: BaseException | None = None
    async with aiohttp.ClientSession() as session:
        body = {**CHAT, "stream": stream, "max_tokens": 1000}
        request = session.post(f"{served.url}/v1/chat/completions", json=body,
                               headers={"x-tollgate-run-id": "cut-by-shutdown"})
        if stream:
            async with request as resp:
                assert resp.status == 200
                received += await resp.content.readany()
                started = time.monotonic()
                served.signal(signal.SIGTERM)
                try:
                    async for chunk in resp.content.iter_any():
                        received += chunk
                except aiohttp.ClientError as exc:
                    client_error = exc
        else:
            task = asyncio.create_task(request)
            await asyncio.wait_for(provider.wait_seen(1), 10)
            started = time.monotonic()
            served.signal(signal.SIGTERM)
            try:
                resp = await task
                received = await resp.read()
            except aiohttp.ClientError as exc:
                client_error = exc
    assert await served.wait(15) == 0
    took = time.monotonic() - started
    assert took < 8, f"exit took {took:.1f}s with a 1s grace"
    # the client can tell the answer is incomplete: no normal end of the answer
    assert b"[DONE]" not in received and b"late" not in received
    assert client_error is not None or b'"error"' in received, received[-300:]

    restarted = await serve(shutdown_grace_s=1)
    status, run = await restarted.admin("GET", "/admin/runs/cut-by-shutdown")
    assert status == 200, run
    assert run["reserved_usd"] == 0 and run["reserved_tokens"] == 0, run
    assert run["output_tokens"] >= 1000, run  # charged at its reservation, never at what streamed so far
    restarted.signal(signal.SIGTERM)
    assert await restarted.wait(15) == 0
    db = tmp_path / "state.db"
    assert verify(db).ok
    rows = ledger_rows(db, "cut-by-shutdown")
    assert len(rows) == 1, rows


async def test_sigterm_lets_a_slow_mcp_tool_call_finish_and_the_client_gets_its_result(
    serve: Callable[..., Any], files: mcp_server.RunningServer, tmp_path: Path
) -> None:
    """README: SIGTERM lets in-flight requests finish within the grace (MCP calls are requests)."""
    served: Served = await serve(mcp_servers={"files": {"url": files.url}}, agents={"bot": {"tools": TOOLS}})
    async with mcp_session(served.url, run="mcp-drain", server_goes_away=True) as client:
        await client.list_tools()  # the SDK lists tools itself after a call unless it knows them
        task = asyncio.create_task(client.call_tool("write_note", {"text": "draining"}))
        await wait_for(lambda: files.seen.calls(), 10.0, "the call to reach the server")
        served.signal(signal.SIGTERM)
        result = await asyncio.wait_for(task, 15)
    assert "draining" in result_text(result)
    assert await served.wait(15) == 0
    rows = [r for r in ledger_rows(tmp_path / "state.db", "mcp-drain") if r["operation"].startswith("tools/call")]
    assert [(r["operation"], r["decision"]) for r in rows] == [("tools/call write_note", "executed")]


async def test_an_approval_decided_during_the_drain_runs_the_parked_call(
    serve: Callable[..., Any], files: mcp_server.RunningServer, tmp_path: Path
) -> None:
    """README: SIGTERM lets in-flight requests finish within the grace; a parked call waits for
    `POST /admin/approvals/{id}`. While the proxy drains, the admin port still decides: the human's
    approval runs the call and the agent gets its result; /readyz says 503 meanwhile."""
    served: Served = await serve(mcp_servers={"files": {"url": files.url}}, agents={"bot": {"tools": TOOLS}},
                                 shutdown_grace_s=20)
    async with mcp_session(served.url, run="approve-in-drain", server_goes_away=True) as client:
        await client.list_tools()  # the SDK lists tools itself after a call unless it knows them
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "old.txt"}))
        [item] = await pending_approvals(served.admin)
        served.signal(signal.SIGTERM)

        async def not_ready() -> bool:
            status, _ = await served.admin("GET", "/readyz")
            return status == 503

        await wait_for(not_ready, 5.0, "/readyz 503")
        status, view = await served.admin("GET", "/admin/runs/approve-in-drain")  # the operator still sees runs
        assert status == 200 and view["run_id"] == "approve-in-drain", view
        status, decided = await served.admin("POST", f"/admin/approvals/{item['id']}",
                                             {"decision": "approve", "by": "alice"})
        assert status == 200 and decided["status"] == "approved", decided
        result = await asyncio.wait_for(task, 15)
    assert result_text(result) == "deleted old.txt"
    assert files.seen.calls() == [("delete_file", {"path": "old.txt"})]
    assert await served.wait(15) == 0
    rows = [r for r in ledger_rows(tmp_path / "state.db", "approve-in-drain") if r["operation"].startswith("tools/call")]
    assert len(rows) == 1 and "alice" in rows[0]["detail"], rows


async def test_a_call_still_parked_when_the_grace_ends_is_denied_and_answered(
    serve: Callable[..., Any], files: mcp_server.RunningServer, tmp_path: Path
) -> None:
    """README: SIGTERM lets in-flight requests finish within `shutdown_grace_s` and exits 0; a parked
    call nobody decides is denied (gateway/approvals.py: "at shutdown, after the grace period in which
    humans can still decide"). The waiting agent gets that denial as a JSON-RPC answer it can act on,
    not a dropped connection (which clients retry against the next process), the tool never runs, and
    the denial is a ledger row."""
    served: Served = await serve(mcp_servers={"files": {"url": files.url}}, agents={"bot": {"tools": TOOLS}},
                                 shutdown_grace_s=1)
    got: Any
    async with aiohttp.ClientSession() as session:

        async def call() -> tuple[int, Any]:
            body = tools_call("delete_file", {"path": "x"})
            async with session.post(f"{served.url}/mcp/files", data=orjson.dumps(body),
                                    headers={**mcp_headers("parked-at-exit"), **routing_headers(body)}) as resp:
                return resp.status, orjson.loads(await resp.read())

        task = asyncio.create_task(call())
        await pending_approvals(served.admin)
        served.signal(signal.SIGTERM)
        try:
            got = await asyncio.wait_for(task, 15)
        except aiohttp.ClientError as exc:
            got = exc
    assert await served.wait(15) == 0
    assert files.seen.calls() == []
    rows = [r for r in ledger_rows(tmp_path / "state.db", "parked-at-exit") if r["operation"].startswith("tools/call")]
    problems = []
    if not (isinstance(got, tuple) and got[1].get("error", {}).get("code") == POLICY_REFUSED):
        problems.append(f"the agent got {got!r}")
    if len(rows) != 1:
        problems.append(f"ledger rows of the call: {rows}")
    assert not problems, problems


async def test_sigterm_with_nothing_in_flight_exits_at_once(serve: Callable[..., Any]) -> None:
    """README: SIGTERM ... exits 0; an idle gateway (its SDK client's keep-alive connection idle in the
    pool) does not sit out its grace period."""
    served: Served = await serve(shutdown_grace_s=30)
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="agent-key", max_retries=0) as client:
        answer = await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
        assert answer.choices[0].message.content == "Hello!"
        started = time.monotonic()
        served.signal(signal.SIGTERM)
        assert await served.wait(10) == 0
    assert time.monotonic() - started < 5


async def test_sigterm_while_the_gateway_is_still_starting_exits_0(fake: tuple[FakeProvider, str], tmp_path: Path) -> None:
    """README: "SIGTERM stops accepting connections, lets in-flight requests and streams finish ... and
    exits 0." An orchestrator that stops a pod which is still starting sends the same SIGTERM; the
    process should still end with 0, not die of the signal (exit 143 reads as a crash)."""
    _, fake_url = fake
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump({
        "providers": {"openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"}},
        "state": {"backend": "sqlite", "path": "state.db"}}))
    proc = await asyncio.create_subprocess_exec(
        *tollgate_command(), "serve", "--config", str(tmp_path / "tollgate.yaml"), "--port", str(free_port()),
        "--admin-port", str(free_port()), cwd=tmp_path, env=clean_env(),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await asyncio.sleep(0.3)  # the interpreter is importing the gateway: not yet listening
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, f"exit {code}"


# -- ledger ----------------------------------------------------------------------------------------


async def test_ledger_survives_kill9_and_a_restart_appends_to_one_chain_the_cli_verifies(
    serve: Callable[..., Any], fake: tuple[FakeProvider, str], tmp_path: Path
) -> None:
    """README: the ledger is append-only and hash-chained in the SQLite state file; `tollgate ledger
    verify` (no --db: the file of ./tollgate.yaml) re-hashes it and prints the row count and head hash.
    A kill -9 under load and a restart leave one unbroken chain with contiguous ids."""
    provider, _ = fake
    provider.default = Reply(body=openai_completion(), delay=0.01)
    served: Served = await serve()
    current = [served]
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            async with session.post(f"{current[0].url}/v1/chat/completions", json=CHAT,
                                    headers={"x-tollgate-run-id": f"k9-{i % 4}"}) as resp:
                await resp.read()
                return resp.status

        assert set(await asyncio.gather(*(one(i) for i in range(40)))) == {200}
        # and kill it while more are in flight
        flying = [asyncio.create_task(one(i)) for i in range(40, 80)]
        await asyncio.sleep(0.05)
        served.signal(signal.SIGKILL)
        await served.wait(10)
        await asyncio.gather(*flying, return_exceptions=True)
        restarted = current[0] = await serve()
        assert set(await asyncio.gather(*(one(i) for i in range(100, 110)))) == {200}
        restarted.signal(signal.SIGTERM)
        assert await restarted.wait(15) == 0
    code, out, err = await cli("ledger", "verify", cwd=tmp_path)
    assert code == 0, (out, err)
    rows = ledger_rows(tmp_path / "state.db")
    assert [r["id"] for r in rows] == list(range(1, len(rows) + 1))
    assert f"{len(rows)} ledger rows" in out and rows[-1]["entry_hash"] in out, out


async def test_a_stop_the_run_store_kept_through_a_crash_is_also_in_the_ledger(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    """DESIGN 4: "A stop is never silent: every stop carries its reason in the body, in the
    x-tollgate-stop-reason header, on the span and in the ledger"; README: stops are in the run store's
    file before the call goes on. The host dies right after the agent got its 403: after a restart the
    run is stopped (the store kept it) and the ledger, the audit trail, must hold that stop too."""
    served: Served = await serve(agents={"default": {"caps": {"llm_calls": 5}}})
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="agent-key", max_retries=0,
                                  default_headers={"x-tollgate-run-id": "crash-audit"}) as client:
        for _ in range(5):
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
        await wait_for(lambda: len(ledger_rows(tmp_path / "state.db", "crash-audit")) == 5, 10.0,
                       "the five allowed steps' rows")
        with pytest.raises(openai.PermissionDeniedError) as stopped:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
        assert stopped.value.response.headers["x-tollgate-stop-reason"] == "llm_call_cap"
        served.signal(signal.SIGKILL)  # the host dies right after the stop was answered
        await served.wait(10)
    restarted = await serve()
    status, run = await restarted.admin("GET", "/admin/runs/crash-audit")
    assert status == 200
    restarted.signal(signal.SIGTERM)
    assert await restarted.wait(15) == 0
    assert (run["status"], run["stop_reason"], run["llm_calls"]) == ("stopped", "llm_call_cap", 5), run
    rows = ledger_rows(tmp_path / "state.db", "crash-audit")
    decisions = [(r["decision"], r["reason"]) for r in rows]
    assert decisions == [("allow", None)] * 5 + [("stop", "llm_call_cap")], decisions


async def test_a_tampered_row_is_still_named_after_the_gateway_restarts_and_appends(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    """DESIGN 1: `tollgate ledger verify` exits 1 and names the first bad row if tampered; rows the
    gateway appends after a restart must not hide it."""
    served: Served = await serve()
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(f"{served.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
        served.signal(signal.SIGTERM)
        assert await served.wait(15) == 0
        db = tmp_path / "state.db"
        with closing(sqlite3.connect(db, isolation_level=None)) as conn:
            conn.execute("DROP TRIGGER IF EXISTS ledger_no_update")
            conn.execute("UPDATE ledger SET detail = 'nothing to see' WHERE id = 2")
        restarted = await serve()
        for _ in range(2):
            async with session.post(f"{restarted.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
        restarted.signal(signal.SIGTERM)
        assert await restarted.wait(15) == 0
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 1, (out, err)
    assert "first bad row id 2" in err, err
    assert "Traceback" not in err


async def test_ledger_verify_while_the_gateway_serves_sees_the_rows_and_disturbs_nothing(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    """`tollgate ledger verify` on the live state file (WAL, locked by the gateway) reads it."""
    served: Served = await serve()
    async with aiohttp.ClientSession() as session:
        for _ in range(4):
            async with session.post(f"{served.url}/v1/chat/completions", json=CHAT,
                                    headers={"x-tollgate-run-id": "live"}) as resp:
                assert resp.status == 200

        async def four() -> tuple[int, str, str] | None:
            code, out, err = await cli("ledger", "verify", cwd=tmp_path)
            return (code, out, err) if "4 ledger rows" in out else None

        code, out, err = await wait_for(four, 20.0, "the live ledger to show 4 rows")
        assert code == 0, err
        async with session.post(f"{served.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
    served.signal(signal.SIGTERM)
    assert await served.wait(15) == 0
    assert verify(tmp_path / "state.db").rows == 5


async def test_two_sidecars_with_memory_state_append_to_one_ledger_chain(
    fake: tuple[FakeProvider, str], tmp_path: Path
) -> None:
    """README: with the memory backend the ledger is `tollgate-ledger.db` beside the config; two sidecars
    started from one config write one file. Under concurrent load every step is one row of one chain."""
    provider, fake_url = fake
    provider.default = Reply(body=openai_completion(), delay=0.005)
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump({
        "providers": {"openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"}},
        "models": {"gpt-*": "openai"}, "state": {"backend": "memory"}, "shutdown_grace_s": 10}))
    with (tmp_path / "serve-a.log").open("wb") as log_a, (tmp_path / "serve-b.log").open("wb") as log_b:
        sidecars = [Served(tmp_path, log_a), Served(tmp_path, log_b)]
        try:
            for sidecar in sidecars:
                await sidecar.start()
            async with aiohttp.ClientSession() as session:

                async def one(i: int) -> int:
                    url = sidecars[i % 2].url
                    async with session.post(f"{url}/v1/chat/completions", json=CHAT,
                                            headers={"x-tollgate-run-id": f"pair-{i % 2}"}) as resp:
                        await resp.read()
                        return resp.status

                assert set(await asyncio.gather(*(one(i) for i in range(200)))) == {200}
            for sidecar in sidecars:
                sidecar.signal(signal.SIGTERM)
            assert [await s.wait(15) for s in sidecars] == [0, 0]
        finally:
            for sidecar in sidecars:
                if sidecar.proc is not None and sidecar.proc.returncode is None:
                    sidecar.proc.kill()
                    await sidecar.proc.wait()
    db = tmp_path / "tollgate-ledger.db"
    result = verify(db)
    assert result.ok and result.rows == 200, result
    rows = ledger_rows(db)
    assert sorted(r["run_id"] for r in rows) == sorted(f"pair-{i % 2}" for i in range(200))


async def test_ledger_verify_on_a_file_that_is_not_a_database_does_not_call_it_a_tampered_row(tmp_path: Path) -> None:
    """DESIGN 1: verify names the first bad row if tampered. A file that is no SQLite database at all
    has no row to name: the message must say what is wrong with the file, not 'first bad row id None'."""
    db = tmp_path / "notes.txt"
    db.write_text("this is not a ledger\n" * 50)
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 1
    assert "None" not in err, err
    assert "Traceback" not in err


async def test_ledger_verify_on_a_busy_file_is_not_reported_as_tampering(serve: Callable[..., Any], tmp_path: Path) -> None:
    """DESIGN 1: verify "exit 1 and name the first bad row if tampered". A ledger it cannot read for the
    moment (another program holds an exclusive lock, e.g. a backup tool on a rollback-journal copy) is not
    a tampered ledger: the operator must not be told TAMPERED."""
    served: Served = await serve()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{served.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
    served.signal(signal.SIGTERM)
    assert await served.wait(15) == 0
    copy = tmp_path / "backup.db"
    with closing(sqlite3.connect(tmp_path / "state.db")) as src, closing(sqlite3.connect(copy)) as dst:
        src.backup(dst)
    with closing(sqlite3.connect(copy, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    holder = sqlite3.connect(copy, isolation_level=None, check_same_thread=False)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        code, out, err = await cli("ledger", "verify", "--db", str(copy), cwd=tmp_path, timeout=40)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert code != 0
    assert "TAMPERED" not in err and "bad row" not in err, err
    code, out, err = await cli("ledger", "verify", "--db", str(copy), cwd=tmp_path)
    assert code == 0 and "1 ledger rows" in out, (out, err)


async def test_ledger_verify_does_not_need_the_provider_secrets_of_the_config(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    """DESIGN 1 / README: `tollgate ledger verify` re-hashes the ledger of the config's file (./tollgate.yaml).
    An auditor's shell does not hold the provider keys the config references; re-hashing a file needs
    none of them."""
    served: Served = await serve()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{served.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
    served.signal(signal.SIGTERM)
    assert await served.wait(15) == 0
    config = yaml.safe_load((tmp_path / "tollgate.yaml").read_text())
    config["providers"]["openai"]["api_key"] = "${TOLLGATE_PROBE_OPENAI_KEY}"
    (tmp_path / "tollgate.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in clean_env().items() if k != "TOLLGATE_PROBE_OPENAI_KEY"}
    code, out, err = await cli("ledger", "verify", cwd=tmp_path, env=env)
    assert code == 0 and "1 ledger rows" in out, (out, err)


# -- admin API and `tollgate runs` -----------------------------------------------------------------


async def test_admin_runs_and_the_runs_cli_list_every_run(
    gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN 2: `GET /admin/runs` answers `{"runs": [...]}`; DESIGN 1: `tollgate runs` is the table of
    runs. With 130 runs, none is left out silently (the oldest, still active run included)."""
    h = await gateway_factory()
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        async with sem, h.session.post(f"{h.url}/v1/chat/completions", json=CHAT,
                                       headers={"x-tollgate-run-id": f"many-{i:03d}"}) as resp:
            assert resp.status == 200

    await one(0)
    await asyncio.gather(*(one(i) for i in range(1, 130)))
    async with h.session.get(f"{h.admin_url}/admin/runs") as resp:
        listed = {r["run_id"] for r in (await resp.json())["runs"]}
    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    code = await asyncio.to_thread(cli_main, ["runs", "--admin", h.admin_url])
    out, err = capsys.readouterr()
    assert code == 0, err
    in_table = {line.split()[0] for line in out.splitlines()[1:]}
    expected = {f"many-{i:03d}" for i in range(130)}
    assert expected - listed == set(), f"{len(expected - listed)} runs missing from GET /admin/runs"
    assert expected - in_table == set(), f"{len(expected - in_table)} runs missing from `tollgate runs`"


async def test_reset_while_a_stream_is_in_flight_leaves_no_reservation_behind(gateway_factory: GatewayFactory) -> None:
    """DESIGN 5: reset starts the run afresh (spend, counters cleared); README: a step in flight while its
    run is reset does not stop the fresh run. When that step ends, nothing of it stays reserved on the
    fresh run (a reservation that never settles would hold the budget forever)."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}},
                              pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
                              state={"backend": "sqlite", "path": "st.db"})
    h.fake.queue(Reply(chunks=openai_stream(["a "] * 10), chunk_delay=0.05))
    body = {**CHAT, "stream": True, "max_tokens": 5000}
    async with h.session.post(f"{h.url}/v1/chat/completions", json=body,
                              headers={"x-tollgate-run-id": "reset-mid"}) as resp:
        assert resp.status == 200
        await resp.content.readany()
        during = await h.run("reset-mid")
        assert during["reserved_usd"] > 0
        async with h.session.post(f"{h.admin_url}/admin/runs/reset-mid/reset") as reset:
            assert reset.status == 200
        await resp.read()

    async def settled() -> dict[str, Any] | None:
        run = await h.run("reset-mid")
        return run if run["reserved_usd"] == 0 and run["reserved_tokens"] == 0 else None

    run = await wait_for(settled, 5.0, "the reservation of the step in flight to be released")
    assert run["status"] == "active"


async def test_a_call_in_flight_during_a_reset_does_not_use_up_the_fresh_runs_call_cap(
    gateway_factory: GatewayFactory
) -> None:
    """DESIGN 5: reset starts the run afresh (counters cleared); README: a step in flight while its run
    is reset does not stop the fresh run. With `caps.llm_calls: 1`: one slow call in flight, reset, one
    call on the fresh run: it is allowed, and when the old call ends the fresh run is still active."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    h.fake.queue(Reply(body=openai_completion("old"), delay=0.5))
    old = asyncio.create_task(h.session.post(f"{h.url}/v1/chat/completions", json=CHAT,
                                             headers={"x-tollgate-run-id": "reset-cap"}))
    await asyncio.wait_for(h.fake.wait_seen(1), 5)
    async with h.session.post(f"{h.admin_url}/admin/runs/reset-cap/reset") as resp:
        assert resp.status == 200
    async with h.session.post(f"{h.url}/v1/chat/completions", json=CHAT,
                              headers={"x-tollgate-run-id": "reset-cap"}) as resp:
        assert resp.status == 200, await resp.text()
    old_resp = await old
    assert old_resp.status == 200
    old_resp.release()
    run = await h.run("reset-cap")
    assert (run["status"], run["stop_reason"], run["llm_calls"]) == ("active", None, 1), run


async def test_run_ids_with_slashes_and_url_characters_work_in_the_admin_api(gateway_factory: GatewayFactory) -> None:
    """DESIGN 2: `GET /admin/runs/{run_id}` and `POST /admin/runs/{run_id}/reset` for any run id an
    agent can send (`A-Z a-z 0-9 . _ : @ / + = -`: a workflow path, one that ends in `/reset`)."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    run_ids = ["team/ticket-4711", "a/reset", "x+y=z@h:1", "dir/"]
    for run_id in run_ids:
        for expected in (200, 403):
            async with h.session.post(f"{h.url}/v1/chat/completions", json=CHAT,
                                      headers={"x-tollgate-run-id": run_id}) as resp:
                assert resp.status == expected, run_id
                assert resp.headers["x-tollgate-run-id"] == run_id
    from urllib.parse import quote

    for run_id in run_ids:
        async with h.session.get(f"{h.admin_url}/admin/runs/{quote(run_id, safe='')}") as resp:
            assert resp.status == 200, run_id
            view = await resp.json()
            assert view["run_id"] == run_id and view["status"] == "stopped", view
        async with h.session.post(f"{h.admin_url}/admin/runs/{quote(run_id, safe='')}/reset") as resp:
            assert resp.status == 200, run_id
            assert (await resp.json())["status"] == "active"
        async with h.session.post(f"{h.url}/v1/chat/completions", json=CHAT,
                                  headers={"x-tollgate-run-id": run_id}) as resp:
            assert resp.status == 200, run_id


async def test_runs_cli_with_a_wrong_admin_token_is_a_clear_error(
    gateway_factory: GatewayFactory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: `tollgate runs` sends TOLLGATE_ADMIN_TOKEN when admin.token is set."""
    h = await gateway_factory(admin={"token": "adm-token-right-0001"})
    async with h.session.post(f"{h.url}/v1/chat/completions", json=CHAT,
                              headers={"x-tollgate-run-id": "tok-run"}) as resp:
        assert resp.status == 200
    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOLLGATE_ADMIN_TOKEN", "adm-token-wrong-0002")
    code = await asyncio.to_thread(cli_main, ["runs", "--admin", h.admin_url])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert "401" in err and "Traceback" not in err and "adm-token" not in err, err
    monkeypatch.setenv("TOLLGATE_ADMIN_TOKEN", "adm-token-right-0001")
    code = await asyncio.to_thread(cli_main, ["runs", "--admin", h.admin_url])
    out, err = capsys.readouterr()
    assert code == 0 and "tok-run" in out, err


# -- approvals -------------------------------------------------------------------------------------


async def test_approve_and_deny_racing_have_one_winner_and_the_tool_runs_only_if_it_approved(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await mcp_gateway(gateway_factory, files)
    admin = harness_admin(h)
    async with mcp_session(h.url, run="race") as client:
        for round_ in range(6):
            task = asyncio.create_task(client.call_tool("delete_file", {"path": f"f{round_}"}))
            [item] = await pending_approvals(admin)
            url = f"/admin/approvals/{item['id']}"
            answers = await asyncio.gather(admin("POST", url, {"decision": "approve", "by": "alice"}),
                                           admin("POST", url, {"decision": "deny", "by": "bob"}))
            winners = [body for status, body in answers if status == 200]
            assert len(winners) == 1, answers
            losers = [(status, body) for status, body in answers if status != 200]
            assert losers[0][0] in (400, 409) and losers[0][1]["error"]["code"] == "already_decided"
            try:
                result: Any = await task
            except MCPError as exc:
                result = exc
            if winners[0]["status"] == "approved":
                assert result_text(result) == f"deleted f{round_}"
            else:
                assert isinstance(result, MCPError) and result.error.data == {"code": "approval_denied"}
            _, listed = await admin("GET", "/admin/approvals")
            final = next(a for a in listed["approvals"] if a["id"] == item["id"])
            assert final["status"] == winners[0]["status"] and final["decided_by"] == winners[0]["decided_by"]
    ran = {args["path"] for _, args in files.seen.calls()}
    _, listed = await admin("GET", "/admin/approvals")
    assert ran == {a["arguments"]["path"] for a in listed["approvals"] if a["status"] == "approved"}


async def test_a_call_parked_when_its_run_is_reset_is_judged_on_the_fresh_run(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: a parked call is judged again when it is approved; a step in flight while its run is reset
    does not stop the fresh run. Parked, the run stopped (tool_not_allowed) and then reset by the
    operator, then approved: the call runs on the fresh run, which stays active."""
    h = await mcp_gateway(gateway_factory, files)
    admin = harness_admin(h)
    async with mcp_session(h.url, run="parked-reset") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "a"}))
        [item] = await pending_approvals(admin)
        with pytest.raises(MCPError):
            await client.call_tool("admin_reset", {"confirm": True})  # not allowed: the run stops
        assert (await h.run("parked-reset"))["status"] == "stopped"
        status, _ = await admin("POST", "/admin/runs/parked-reset/reset")
        assert status == 200
        status, _ = await admin("POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
        assert status == 200
        assert result_text(await asyncio.wait_for(task, 10)) == "deleted a"
    run = await h.run("parked-reset")
    assert run["status"] == "active" and run["stop_reason"] is None, run


async def test_a_call_approved_after_the_time_cap_passed_is_refused_with_time_cap(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: "a call parked for approval is judged again when it is approved (the time cap may have
    passed meanwhile)"."""
    h = await gateway_factory(mcp_servers={"files": {"url": files.url}},
                              agents={"bot": {"tools": TOOLS, "caps": {"seconds": 1}}})
    admin = harness_admin(h)
    task = asyncio.create_task(mcp_post(h, tools_call("delete_file", {"path": "slow"}), run="timecap"))
    [item] = await pending_approvals(admin)
    await asyncio.sleep(max(0.0, item["requested_at"] + 1.3 - time.time()))  # the cap is wall time itself
    status, _ = await admin("POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
    assert status == 200
    _, answer = await asyncio.wait_for(task, 10)
    assert answer["error"]["data"] == {"code": "time_cap"}, answer
    assert files.seen.calls() == []
    run = await h.run("timecap")
    assert (run["status"], run["stop_reason"]) == ("stopped", "time_cap")


async def test_an_expired_approval_cannot_be_approved_later_and_is_listed_as_timed_out(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    h = await mcp_gateway(gateway_factory, files, tools={"approval_timeout_s": 0.3})
    admin = harness_admin(h)
    async with mcp_session(h.url, run="expired") as client:
        with pytest.raises(MCPError) as info:
            await client.call_tool("delete_file", {"path": "late"})
    assert info.value.error.data == {"code": "approval_timeout"}
    _, listed = await admin("GET", "/admin/approvals")
    [item] = listed["approvals"]
    assert item["status"] == "timed_out"
    status, body = await admin("POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "late-alice"})
    assert 400 <= status < 500 and status != 404 and body["error"]["code"] == "already_decided"
    _, listed = await admin("GET", "/admin/approvals?status=timed_out")
    assert [a["id"] for a in listed["approvals"]] == [item["id"]]
    assert files.seen.calls() == []
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = [r for r in ledger.rows("expired") if r["operation"].startswith("tools/call")]
    assert [r["reason"] for r in rows] == ["approval_timeout"]


async def test_deciding_an_approval_needs_the_admin_token_and_an_unauthorised_try_changes_nothing(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: `admin: {token}` makes every admin endpoint but /healthz and /readyz require it."""
    h = await mcp_gateway(gateway_factory, files, admin={"token": "adm-approvals-77"})
    auth = {"Authorization": "Bearer adm-approvals-77"}
    admin = harness_admin(h)

    async def authed(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return await admin(method, path, body, auth)  # type: ignore[no-any-return]

    async with mcp_session(h.url, run="tok") as client:
        task = asyncio.create_task(client.call_tool("delete_file", {"path": "t"}))
        [item] = await pending_approvals(authed)
        for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": "adm-approvals-77"}):
            status, body = await admin("POST", f"/admin/approvals/{item['id']}",
                                       {"decision": "approve", "by": "mallory"}, headers)
            assert status == 401, (headers, body)
        [still] = await pending_approvals(authed)
        assert still["status"] == "pending"
        status, _ = await authed("POST", f"/admin/approvals/{item['id']}", {"decision": "deny", "by": "alice"})
        assert status == 200
        with pytest.raises(MCPError):
            await task
    assert files.seen.calls() == []


async def test_a_retry_of_a_parked_call_whose_client_left_does_not_count_again(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README (Tools and MCP): "A counted call whose tool did not run (approval denied or timed out, ...)
    carries its count to an identical retry, which does not count again." An agent whose HTTP client
    gave up while a human had not decided yet (its approval is then `denied`) retries the same call: with
    `caps.tool_calls: 1` the retry must be parked again, not stop the run with tool_call_cap."""
    h = await gateway_factory(mcp_servers={"files": {"url": files.url}},
                              agents={"bot": {"tools": TOOLS, "caps": {"tool_calls": 1}}})
    admin = harness_admin(h)
    gone = await park_then_leave(h, admin, "carry", "a")
    assert gone["status"] == "denied"
    retry = asyncio.create_task(mcp_post(h, tools_call("delete_file", {"path": "a"}), run="carry"))
    done, _ = await asyncio.wait([retry, asyncio.create_task(pending_approvals(admin))],
                                 return_when=asyncio.FIRST_COMPLETED, timeout=10)
    if retry in done:
        status, answer = retry.result()
        pytest.fail(f"the retry was refused instead of parked: {answer}; run: {await h.run('carry')}")
    [item] = await pending_approvals(admin)
    status, _ = await admin("POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
    assert status == 200
    status, answer = await asyncio.wait_for(retry, 10)
    assert "result" in answer, answer
    run = await h.run("carry")
    assert (run["status"], run["tool_calls"]) == ("active", 1), run


async def test_a_parked_call_whose_client_left_is_a_ledger_row(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: every step decision is a row of the ledger (decision, reason). A tools/call that was
    parked and then denied because its client went away is a decision like a human's denial."""
    h = await mcp_gateway(gateway_factory, files)
    admin = harness_admin(h)
    await park_then_leave(h, admin, "left-ledger", "a")
    ledger = h.gateway.services["ledger"]

    async def rows() -> list[dict[str, Any]] | None:
        await ledger.flush()
        found = [r for r in ledger.rows("left-ledger") if r["operation"].startswith("tools/call")]
        return found or None

    try:
        found = await wait_for(rows, 3.0, "a ledger row of the abandoned call")
    except AssertionError:
        found = []
    assert len(found) == 1, "no ledger row for a parked call denied because its client left"
    assert found[0]["reason"] == "approval_denied", found


async def test_another_agents_cancel_notification_does_not_deny_my_parked_call(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: "A `notifications/cancelled` denies the call it cancels if it is still parked" — the
    call it cancels, no other. Two agents share a run (README: a run id names one run whoever sends
    it); JSON-RPC ids are per client, so both use id 1. Agent B cancelling its own request 1 must not
    deny agent A's parked call 1."""
    h = await gateway_factory(mcp_servers={"files": {"url": files.url}},
                              agents={"bot": {"tools": TOOLS}, "helper": {"tools": TOOLS}})
    admin = harness_admin(h)
    mine = asyncio.create_task(mcp_post(h, tools_call("delete_file", {"path": "mine"}, rpc_id=1), run="shared"))
    [item] = await pending_approvals(admin)
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1, "reason": "timeout"}}
    status, _ = await mcp_post(h, cancel, run="shared", agent="helper")
    assert status in (200, 202)
    _, listed = await admin("GET", "/admin/approvals")
    assert [a["status"] for a in listed["approvals"] if a["id"] == item["id"]] == ["pending"], listed
    status, _ = await admin("POST", f"/admin/approvals/{item['id']}", {"decision": "approve", "by": "alice"})
    assert status == 200
    status, answer = await asyncio.wait_for(mine, 10)
    assert "result" in answer, answer


async def test_a_tool_call_whose_client_left_while_the_tool_ran_is_a_ledger_row_and_never_runs_twice(
    gateway_factory: GatewayFactory, files: mcp_server.RunningServer
) -> None:
    """README: every step decision is a ledger row; `write` tools are idempotent within a run (the same
    tool with the same arguments gets the recorded result; it never runs twice). The agent's HTTP client
    gives up while a slow write runs on the server, then retries the identical call."""
    h = await mcp_gateway(gateway_factory, files)
    task = asyncio.create_task(mcp_post(h, tools_call("write_note", {"text": "once"}), run="left-mid-tool"))
    await wait_for(lambda: files.seen.calls(), 5.0, "the call to reach the server")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ledger = h.gateway.services["ledger"]

    async def rows() -> list[dict[str, Any]] | None:
        await ledger.flush()
        found = [r for r in ledger.rows("left-mid-tool") if r["operation"].startswith("tools/call")]
        return found or None

    try:
        found = await wait_for(rows, 4.0, "a ledger row of the call")
    except AssertionError:
        found = []
    with contextlib.suppress(AssertionError):  # let the server's slow write (2 s) finish, if it goes on
        await wait_for(lambda: files.notes, 4.0, "the server's write")
    status, answer = await mcp_post(h, tools_call("write_note", {"text": "once"}), run="left-mid-tool")
    problems = []
    if len(found) != 1:
        problems.append(f"ledger rows of the abandoned call: {found}")
    if files.notes.count("once") > 1:
        problems.append(f"the write ran {files.notes.count('once')} times: {files.notes}")
    assert not problems, (problems, answer)
