"""`tollgate serve` and `tollgate check-config` as a user runs them (DESIGN section 1).

The real console script runs as a subprocess from a config file against the fake provider on loopback:
readiness on the admin port, the official SDKs through it, time from process start to the first proxied
answer, a client disconnect closing the upstream, and SIGTERM draining an in-flight stream before exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import anthropic
import openai
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway import server
from gateway.cli import main as cli_main
from gateway.config import parse_config
from tests.fakes import mcp_server
from tests.fakes.ports import free_port
from tests.fakes.served import tollgate_command, wait_for
from tests.fakes.upstream import (
    FakeProvider,
    Reply,
    anthropic_message,
    openai_completion,
    openai_stream,
    tool_call,
)

USER = [{"role": "user", "content": "hi"}]


@dataclass
class Served:
    proc: asyncio.subprocess.Process
    url: str
    admin_url: str
    started_at: float
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
async def serve(fake: tuple[FakeProvider, str], tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    procs: list[asyncio.subprocess.Process] = []
    logs: list[IO[bytes]] = []

    async def start(**overrides: Any) -> Served:
        _, fake_url = fake
        config: dict[str, Any] = {
            "providers": {
                "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "${SERVE_TEST_OPENAI_KEY}"},
                "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-provider"},
            },
            "models": {"gpt-*": "openai", "claude-*": "anthropic"},
            "state": {"backend": "sqlite", "path": "state.db"},
            "shutdown_grace_s": 10,
            **overrides,
        }
        path = tmp_path / "tollgate.yaml"
        path.write_text(yaml.safe_dump(config))
        port, admin_port = free_port(), free_port()
        log_path = tmp_path / f"serve-{len(procs)}.log"
        log = log_path.open("wb")
        logs.append(log)
        env = {**os.environ, "SERVE_TEST_OPENAI_KEY": "sk-provider-openai", "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *tollgate_command(), "serve", "--config", str(path), "--port", str(port), "--admin-port", str(admin_port),
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        served = Served(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", started, log_path)
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                if proc.returncode is not None:
                    raise AssertionError(f"tollgate exited with {proc.returncode}: {served.output()}")
                try:
                    async with session.get(f"{served.admin_url}/readyz") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await wait_for(ready, 10.0, "/readyz")
        return served

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    for log in logs:
        log.close()


# -- serve ---------------------------------------------------------------------------------------------


async def test_serve_answers_sdks_and_first_answer_is_fast(serve: Callable[..., Any], fake: tuple[FakeProvider, str]) -> None:
    provider, _ = fake
    provider.queue(Reply(body=openai_completion("first answer")))
    served: Served = await serve()
    async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="agent-key", max_retries=0) as client:
        result = await client.chat.completions.create(model="gpt-4o-mini", messages=USER)  # type: ignore[arg-type]
    elapsed = time.monotonic() - served.started_at
    print(f"\ntollgate serve: process start to first proxied answer {elapsed:.3f}s")
    assert result.choices[0].message.content == "first answer"
    assert elapsed < 5.0
    assert provider.seen[-1].headers["Authorization"] == "Bearer sk-provider-openai"  # ${VAR} from the env

    provider.queue(Reply(body=anthropic_message("bonjour")))
    async with anthropic.AsyncAnthropic(base_url=served.url, api_key="agent-key", max_retries=0) as aclient:
        message = await aclient.messages.create(model="claude-3-5-haiku-latest", max_tokens=16, messages=USER)  # type: ignore[arg-type]
    assert message.content[0].text == "bonjour"  # type: ignore[union-attr]

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{served.admin_url}/healthz") as resp:
            assert resp.status == 200
        async with session.get(f"{served.admin_url}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
        async with session.get(f"{served.admin_url}/admin/runs/default:default") as resp:
            assert resp.status == 200
            assert (await resp.json())["llm_calls"] == 2

    served.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(served.proc.wait(), 5.0) == 0


async def test_serve_client_disconnect_closes_upstream(serve: Callable[..., Any], fake: tuple[FakeProvider, str]) -> None:
    """Without handler cancellation (the production server), the relay notices on its next write."""
    provider, _ = fake
    served: Served = await serve()
    provider.queue(Reply(chunks=openai_stream(["p"] * 80), chunk_delay=0.03))
    async with aiohttp.ClientSession() as session:
        body = {"model": "gpt-4o-mini", "messages": USER, "stream": True}
        resp = await session.post(f"{served.url}/v1/chat/completions", json=body)
        try:
            assert resp.status == 200
            assert await resp.content.readany()
        finally:
            resp.close()
    await wait_for(lambda: provider.disconnects == 1 and provider.in_flight == 0, 3.0, "upstream disconnect")
    served.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(served.proc.wait(), 5.0) == 0


async def test_sigterm_lets_the_stream_finish_then_exits_0(serve: Callable[..., Any], fake: tuple[FakeProvider, str]) -> None:
    provider, _ = fake
    served: Served = await serve()
    chunks = openai_stream(["one ", "two ", "three"])
    kept = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
    streaming = aiohttp.ClientSession()
    try:
        # a kept-alive connection, idle in the pool when the signal comes
        async with kept.post(f"{served.url}/v1/chat/completions", json={"model": "gpt-4o-mini", "messages": USER}) as r:
            assert r.status == 200
            await r.read()
        provider.queue(Reply(chunks=chunks, chunk_delay=0.2))
        body = {"model": "gpt-4o-mini", "messages": USER, "stream": True,
                "stream_options": {"include_usage": True}}
        async with streaming.post(f"{served.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            received = await resp.content.readany()
            assert received
            served.proc.send_signal(signal.SIGTERM)

            async def not_ready() -> bool:
                async with streaming.get(f"{served.admin_url}/readyz") as ready:
                    return ready.status == 503

            await wait_for(not_ready, 3.0, "/readyz to report shutting down")
            # a new request on the kept-alive connection: 503 shutting_down, or the connection is gone
            try:
                async with kept.post(f"{served.url}/v1/chat/completions",
                                     json={"model": "gpt-4o-mini", "messages": USER}) as late:
                    assert late.status == 503
                    assert (await late.json())["error"]["code"] == "shutting_down"
            except aiohttp.ClientConnectionError:
                pass
            # a new connection is refused: the listening socket is closed
            with pytest.raises(aiohttp.ClientConnectionError):
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.get(f"{served.url}/v1/models"):
                        pass
            assert served.proc.returncode is None  # still draining the stream
            async for chunk in resp.content.iter_any():
                received += chunk
        assert received == b"".join(chunks)
    finally:
        await kept.close()
        await streaming.close()
    assert await asyncio.wait_for(served.proc.wait(), 5.0) == 0
    assert "draining" in served.output()


async def test_a_write_still_running_when_the_grace_ends_is_recorded_and_never_run_again(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    """README: a tool call cut at the end of the grace is still recorded (`shutting_down`); a sent write
    is never run again: after a restart, the identical call is refused `duplicate_tool_call`."""
    files = mcp_server.start(slow_s=30.0)
    try:
        config = {"mcp_servers": {"files": {"url": files.url}}, "shutdown_grace_s": 1,
                  "agents": {"bot": {"tools": {"allow": ["files/write_note"], "tiers": {"files/write_*": "write"}}}}}
        served: Served = await serve(**config)
        body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": {"name": "write_note", "arguments": {"text": "cut"},
                           "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                                     "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "0"},
                                     "io.modelcontextprotocol/clientCapabilities": {}}}}
        headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "cut-write",
                   "accept": "application/json, text/event-stream",
                   "mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "write_note"}
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(session.post(f"{served.url}/mcp/files", json=body, headers=headers))
            await wait_for(lambda: files.seen.calls(), 10.0, "the call to reach the server")
            served.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(aiohttp.ClientError):
                (await call).close()
        assert await asyncio.wait_for(served.proc.wait(), 15.0) == 0
        ledger = sqlite3.connect(tmp_path / "state.db")
        try:
            rows = ledger.execute("SELECT decision, reason FROM ledger WHERE run_id = 'cut-write'").fetchall()
        finally:
            ledger.close()
        assert rows == [("error", "shutting_down")], rows
        restarted: Served = await serve(**config)
        async with (aiohttp.ClientSession() as session,
                    session.post(f"{restarted.url}/mcp/files", json={**body, "id": 8}, headers=headers) as resp):
            answer = await resp.json()
        assert answer["error"]["data"] == {"code": "duplicate_tool_call"}, answer
        assert len(files.seen.calls()) == 1
    finally:
        files.stop()


# -- check-config ---------------------------------------------------------------------------------------

GOOD = """
listen: {host: 127.0.0.1, port: 8080}
admin: {host: 127.0.0.1, port: 9464}
providers:
  openai:    {type: openai,    base_url: https://api.openai.com/v1, api_key: "${OPENAI_API_KEY}",
              timeouts: {connect: 10, first_byte: 120, idle: 60}}
  anthropic: {type: anthropic, base_url: https://api.anthropic.com, api_key: "${ANTHROPIC_API_KEY}"}
  local:     {type: openai, base_url: "http://127.0.0.1:8000/v1", structured_outputs: vllm}
models: {"gpt-*": openai, "claude-*": anthropic, "my-local-*": local}
mcp_servers:
  files: {url: "http://127.0.0.1:3001/mcp"}
pricing:
  "my-local-*": {input_per_mtok: 0.0, output_per_mtok: 0.0}
state: {backend: sqlite, path: tollgate.db}
limits: {max_body_bytes: 33554432, max_json_depth: 64}
grammars: {dir: grammars}
ledger: {path: tollgate.db}
otel: {capture_content: false}
agents:
  support-bot:
    keys: ["${SUPPORT_BOT_KEY}"]
    budget: {usd: 2.00, tokens: 200000}
    caps: {llm_calls: 40, tool_calls: 60, seconds: 600}
    loop: {window: 6, max_distinct: 3, stall_steps: 3}
    tools:
      allow: [search_kb, fetch_record, "files/read_*", "files/delete_*"]
      on_violation: reject
      approval: ["files/delete_*"]
      tiers: {"files/write_*": write, "files/delete_*": dangerous}
      approval_timeout_s: 300
    output: {grammar: ticket, retries: 2}
    on_stop: error
"""
GOOD_ENV = {"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a", "SUPPORT_BOT_KEY": "bot-key"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_TEST_")}
    full_env.update(env or {})
    return subprocess.run([*tollgate_command(), *args], capture_output=True, text=True, env=full_env, timeout=20)


def test_check_config_good_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "tollgate.yaml"
    path.write_text(GOOD)
    result = run_cli("check-config", str(path), env=GOOD_ENV)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ok:"), result.stdout
    assert "3 providers" in lines[0] and "1 agents" in lines[0]
    assert result.stderr == ""


def test_check_config_broken_subprocess_lists_every_error(tmp_path: Path) -> None:
    path = tmp_path / "tollgate.yaml"
    path.write_text(
        "listen: {port: eighty}\n"
        "providers:\n  openai: {type: openai, base_url: 'http://x/v1', api_kye: k}\n"
        "agents:\n  bot: {budget: {usd: -1}}\n"
    )
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    paths = {line.split(": ")[1] for line in result.stderr.splitlines()}
    assert paths == {"listen.port", "providers.openai.api_kye", "agents.bot.budget.usd"}, result.stderr


BROKEN: list[tuple[str, str, str]] = [
    ("unknown top-level key", "listn: {port: 1}\n", "listn"),
    ("unknown nested key", "providers:\n  openai: {type: openai, base_url: 'http://x/v1', api_kye: k}\n",
     "providers.openai.api_kye"),
    ("unknown agent key", "agents:\n  bot: {budgett: {usd: 1}}\n", "agents.bot.budgett"),
    ("wrong type", "listen: {port: eighty}\n", "listen.port"),
    ("wrong type deep", "agents:\n  bot: {caps: {llm_calls: many}}\n", "agents.bot.caps.llm_calls"),
    ("wrong section type", "providers: [openai]\n", "providers"),
    ("bad enum", "state: {backend: mongo}\n", "state.backend"),
    ("bad provider type", "providers:\n  p: {type: gemini, base_url: 'http://x'}\n", "providers.p.type"),
    ("dangling model route", "providers: {}\nmodels: {'gpt-*': nosuch}\n", "models.gpt-*"),
    ("unset variable", "providers:\n  openai: {type: openai, base_url: 'http://x/v1', api_key: '${TOLLGATE_TEST_UNSET}'}\n",
     "providers.openai.api_key"),
    ("negative budget", "agents:\n  bot: {budget: {usd: -1}}\n", "agents.bot.budget.usd"),
    ("zero token budget", "agents:\n  bot: {budget: {tokens: 0}}\n", "agents.bot.budget.tokens"),
    ("unknown guard", "agents:\n  x: {guards: [{use: no_such_guard}]}\n", "agents.x.guards.0.use"),
    ("unimportable guard", "agents:\n  x: {guards: [{use: 'no_such_module:Guard'}]}\n", "agents.x.guards.0.use"),
    ("duplicate agent key", "agents:\n  a: {keys: [k1]}\n  b: {keys: [k1]}\n", "agents.b.keys.0"),
    ("approval not allowed", "agents:\n  a: {tools: {allow: [x], approval: [y]}}\n", "agents.a.tools.approval.0"),
    ("bad base_url", "providers:\n  p: {type: openai, base_url: 'api.openai.com'}\n", "providers.p.base_url"),
    ("invalid yaml", "providers: {openai: [\n", "<file>"),
    ("root not a mapping", "- a\n- b\n", "<root>"),
]


@pytest.mark.parametrize(("text", "key_path"), [(t, p) for _, t, p in BROKEN], ids=[n for n, _, _ in BROKEN])
def test_check_config_broken_names_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str, key_path: str
) -> None:
    monkeypatch.delenv("TOLLGATE_TEST_UNSET", raising=False)
    path = tmp_path / "tollgate.yaml"
    path.write_text(text)
    assert cli_main(["check-config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines, "no error printed"
    assert any(line.startswith(f"error: {key_path}: ") for line in lines), err
    if key_path == "providers.openai.api_key":
        assert "TOLLGATE_TEST_UNSET" in err


def test_check_config_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check-config", str(tmp_path / "nope.yaml")]) == 1
    assert capsys.readouterr().err.startswith("error: <file>: ")


async def test_a_second_gateway_on_the_same_state_file_exits_with_a_clear_error(
    serve: Callable[..., Any], tmp_path: Path
) -> None:
    await serve()
    env = {"SERVE_TEST_OPENAI_KEY": "sk-provider-openai"}
    config = str(tmp_path / "tollgate.yaml")
    result = await asyncio.to_thread(run_cli, "serve", "--config", config, "--port", str(free_port()),
                                     "--admin-port", str(free_port()), env=env)
    assert result.returncode == 1
    assert "state.db is already in use by another run store" in result.stderr
    assert "share Redis" in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_broken_config(tmp_path: Path) -> None:
    path = tmp_path / "tollgate.yaml"
    path.write_text("listen: {port: eighty}\n")
    result = run_cli("serve", "--config", str(path))
    assert result.returncode == 1
    assert "listen.port" in result.stderr


SECRET_KEY = "sk-cli-probe-5be1c0de9a7f3d21"


@pytest.mark.parametrize(("text", "named"), [
    (f"providers:\n  o:\n    type: openai\n    base_url: http://x/v1\n    api_key: {SECRET_KEY}\t# prod\n",
     "error: <file>: invalid YAML: found character '\\t' that cannot start any token at line 5, column 43"),
    (f"providers:\n  o: {{type: openai, base_url: 'http://x/v1', api_key: [{SECRET_KEY}]}}\n",
     "error: providers.o.api_key: Input should be a valid string"),
], ids=["yaml slip on the key's line", "wrong-typed key"])
@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_a_broken_config_never_prints_a_literal_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    text: str, named: str, command: str) -> None:
    """The error names where the config is wrong, not what the file says there."""
    path = tmp_path / "tollgate.yaml"
    path.write_text(text)
    argv = ["check-config", str(path)] if command == "check-config" else ["serve", "--config", str(path)]
    try:
        assert cli_main(argv) == 1
    finally:
        gc.enable()  # `serve` turns the collector off until it listens, and this one never does
    out, err = capsys.readouterr()
    assert err.startswith(named), err
    assert SECRET_KEY not in out + err and SECRET_KEY[-12:] not in out + err, err


# -- CLI: runs -----------------------------------------------------------------------------------------

ADMIN_TOKEN = "adm-cli-token-0c4f2e8a61"


@contextlib.asynccontextmanager
async def recording_server(answer: Callable[[web.Request], web.StreamResponse],
                           seen: list[web.Request]) -> AsyncIterator[str]:
    """An HTTP server answering every GET with `answer`, recording each request; yields its base URL."""

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        return answer(request)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    try:
        yield str(test_server.make_url("")).rstrip("/")
    finally:
        await test_server.close()


def runs_answer(request: web.Request) -> web.StreamResponse:
    row = {"run_id": "r1", "agent": "bot", "status": "active", "spent_usd": 0.25, "llm_calls": 2}
    return web.json_response({"runs": [row]})


async def runs_cli(admin_url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`tollgate runs --admin URL` in a thread, so the servers on this loop can answer it."""
    code = await asyncio.to_thread(cli_main, ["runs", "--admin", admin_url])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def admin_token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TOLLGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
                 "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return ADMIN_TOKEN


async def test_runs_sends_the_admin_token_and_prints_the_table(admin_token: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[web.Request] = []
    async with recording_server(runs_answer, seen) as admin_url:
        code, out, err = await runs_cli(admin_url, capsys)
    assert code == 0, err
    assert [r.path for r in seen] == ["/admin/runs"]
    assert seen[0].headers["Authorization"] == f"Bearer {admin_token}"
    assert out.splitlines()[1].split()[:3] == ["r1", "bot", "active"]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("same_host", [False, True], ids=["other host", "same host"])
async def test_runs_refuses_a_redirect_and_the_token_goes_nowhere_else(
        admin_token: str, capsys: pytest.CaptureFixture[str], status: int, same_host: bool) -> None:
    """The admin token reads every run and resets budgets: a redirecting admin URL (a proxy, a mistyped
    or hostile host) is an error, never a reason to send the token to the URL it names."""
    elsewhere: list[web.Request] = []
    first: list[web.Request] = []
    async with recording_server(runs_answer, elsewhere) as other_url:
        other_host = other_url.replace("127.0.0.1", "localhost")
        target = "/admin/runs/moved" if same_host else f"{other_host}/admin/runs"

        def redirect(request: web.Request) -> web.StreamResponse:
            return web.Response(status=status, headers={"Location": target})

        async with recording_server(redirect, first) as admin_url:
            code, out, err = await runs_cli(admin_url, capsys)
    assert code == 1 and out == ""
    assert len(first) == 1 and elsewhere == []  # asked once, and only the URL given
    assert err.count("\n") == 1 and err.startswith("error: ") and "redirect" in err, err
    assert target in err and "Traceback" not in err and admin_token not in err


async def test_runs_never_sends_the_token_through_an_environment_proxy(admin_token: str,
                                                                       tmp_path: Path) -> None:
    """An `http_proxy` set for the agent's outbound traffic must not receive the admin token in clear:
    the admin API is called directly, at the URL given. A fresh process: urllib caches its default
    opener, with the proxies of the moment, on first use."""
    proxied: list[web.Request] = []
    direct: list[web.Request] = []
    async with (recording_server(runs_answer, proxied) as proxy_url,
                recording_server(runs_answer, direct) as admin_url):
        proc = await asyncio.create_subprocess_exec(
            *tollgate_command(), "runs", "--admin", admin_url, env={**os.environ, "http_proxy": proxy_url},
            cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert proxied == [] and [r.headers["Authorization"] for r in direct] == [f"Bearer {admin_token}"]


async def test_serve_client_disconnect_while_events_are_held_closes_upstream(
    serve: Callable[..., Any], fake: tuple[FakeProvider, str]
) -> None:
    """From the first tool-call event on the relay holds events and writes nothing until the answer
    is judged; a client that leaves meanwhile must still cancel the upstream request."""
    provider, _ = fake
    served: Served = await serve()
    chunks = openai_stream(["thinking"], tool_calls=[tool_call("search", '{"q": "x"}')])
    chunks = chunks[:3] + [b": keep-alive\n\n"] * 40 + chunks[3:]
    provider.queue(Reply(chunks=chunks, chunk_delay=0.05))
    async with aiohttp.ClientSession() as session:
        body = {"model": "gpt-4o-mini", "messages": USER, "stream": True}
        resp = await session.post(f"{served.url}/v1/chat/completions", json=body)
        try:
            assert resp.status == 200
            seen = b""
            while b"thinking" not in seen:
                chunk = await resp.content.readany()
                assert chunk, "stream ended early"
                seen += chunk
        finally:
            resp.close()
    await wait_for(lambda: provider.in_flight == 0, 4.0, "upstream request to end")
    assert provider.disconnects == 1, "the upstream streamed to the end for a client that had gone"
    async with aiohttp.ClientSession() as session:

        async def recorded() -> bool:
            async with session.get(f"{served.admin_url}/admin/runs/default:default") as run:
                return run.status == 200 and len((await run.json())["steps"]) == 1

        await wait_for(recorded, 3.0, "the abandoned step to be recorded")  # cancellation still records
    served.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(served.proc.wait(), 5.0) == 0


async def test_serve_freezes_the_startup_heap_once_it_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection under load must not walk the startup heap, and the collector that `tollgate
    serve` turned off for its start runs again once it listens (server.freeze_startup_heap)."""
    config = parse_config({"state": {"backend": "memory"}, "ledger": {"path": str(tmp_path / "ledger.db")}})
    frozen = asyncio.Event()
    counts: list[int] = []
    real = server.freeze_startup_heap

    def freeze() -> None:
        real()
        counts.append(gc.get_freeze_count())
        frozen.set()

    monkeypatch.setattr(server, "freeze_startup_heap", freeze)
    gc.unfreeze()
    gc.disable()  # as `tollgate serve` starts (gateway.cli.cmd_serve)
    task = asyncio.create_task(server.serve(config, host="127.0.0.1", port=0, admin_host="127.0.0.1", admin_port=0))
    try:
        await asyncio.wait_for(frozen.wait(), 10.0)
        assert counts[0] > 10_000  # the modules, the config and the apps, not an empty freeze
        assert gc.isenabled()  # and the collector runs again from then on
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.unfreeze()
        gc.enable()


@pytest.mark.parametrize(("raised", "said"), [
    (server.LostAtShutdown("ledger: 2 entries could not be written"),
     "tollgate: stopped, but not everything was saved: ledger: 2 entries could not be written"),
    (server.StateUnavailable("the state file is another gateway's"),
     "tollgate: cannot start: the state file is another gateway's"),
])
def test_what_serve_lost_at_shutdown_is_not_called_a_failed_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raised: Exception, said: str
) -> None:
    """Rows the ledger could not write when a gateway that served stops (its file locked by a backup, say)
    exit 1 as before, but said "cannot start", sending an operator to look at the config."""
    async def failing(*args: Any, **kwargs: Any) -> None:
        raise raised

    monkeypatch.setattr(server, "serve", failing)
    config = parse_config({"state": {"backend": "memory"}}, env={})
    assert server.run(config, host="127.0.0.1", port=0, admin_host="127.0.0.1", admin_port=0) == 1
    assert capsys.readouterr().err.strip() == said


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n", b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"])
async def test_a_connection_with_no_request_under_way_is_closed_after_body_idle_s(
    gateway_factory: Any, sent: bytes
) -> None:
    """Nothing sent, half a request head, or an answered request then silence: the connection is closed
    once `limits.body_idle_s` passes with no request under way (aiohttp's default held it an hour, so a
    few hundred silent connections used up the gateway's file descriptors)."""
    h = await gateway_factory(limits={"body_idle_s": 0.3})
    host, port = h.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(sent)
        await writer.drain()
        started = time.monotonic()
        data = await asyncio.wait_for(reader.read(), 10)  # EOF once the gateway closes it
        assert time.monotonic() - started < 5
        assert data == b"" or data.startswith(b"HTTP/1.1 200 ")  # the answered request's response only
    finally:
        writer.close()
