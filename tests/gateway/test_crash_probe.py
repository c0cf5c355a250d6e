"""Crash, restart and shutdown consistency of a real `tollgate serve` on its embedded SQLite state.

Probed and found to hold (no test kept): kill -9 with 40 OpenAI/Anthropic calls, streamed and not, in
flight on one budgeted run (restart charges each reservation in full, nothing stays reserved, the chain
verifies); SIGTERM past the grace on Anthropic, chat, legacy-completion and Responses streams (exit 0
in ~grace, reservation charged, one ledger row); SIGTERM draining 40 mixed calls; SIGINT; a restart with
a smaller budget; garbage, empty or directory state files (clear `cannot start`, exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.fakes.served import Served, wait_for
from tests.fakes.upstream import FakeProvider, Reply, openai_completion

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
CLAUDE = {"model": "claude-3-5-haiku-latest", "messages": [{"role": "user", "content": "hi"}]}
ZERO_PRICES = {"gpt-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0},
               "claude-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0}}


@pytest.fixture
def provider(fake: tuple[FakeProvider, str]) -> tuple[FakeProvider, str]:
    """The shared fake provider (tests/conftest.py), under the name these tests give it."""
    return fake


@pytest.fixture
async def gateways() -> AsyncIterator[list[Served]]:
    made: list[Served] = []
    yield made
    for served in made:
        served.cleanup()
        if served.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(served.proc.wait(), 10)


def base_config(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "providers": {"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-provider-openai"},
                      "anthropic": {"type": "anthropic", "base_url": url, "api_key": "sk-ant-provider"}},
        "models": {"gpt-*": "openai", "claude-*": "anthropic"},
        "pricing": ZERO_PRICES,
        "state": {"backend": "sqlite", "path": "state.db"},
        "shutdown_grace_s": 2,
        **extra,
    }


def ledger_rows(db: Path, run_id: str | None = None) -> list[dict[str, Any]]:
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        sql = "SELECT * FROM ledger" + (" WHERE run_id = ?" if run_id else "") + " ORDER BY id"
        return [dict(r) for r in conn.execute(sql, (run_id,) if run_id else ())]


async def test_a_second_gateway_on_a_hard_link_of_the_state_file_is_refused(
    provider: tuple[FakeProvider, str], tmp_path: Path, gateways: list[Served]
) -> None:
    """README ("Many sidecars, one budget"): "The embedded default, SQLite, belongs to one gateway
    process: `serve` takes a lock on `<state file>.runs.lock` and a second gateway on the same file exits
    with a clear error (share Redis instead)." gateway/store/sqlite.py: "One process owns a state file".

    The lock file is named after the path (`lock_path` resolves symlinks only), so the same file reached
    through a hard link (another directory, a second name for one inode) gets another lock file: the
    second gateway starts and serves on the file the first one owns. Both keep the runs in memory as
    the authority and write them through over each other: one run's budget is spent twice.
    """
    fake, url = provider
    first_home, second_home = tmp_path / "a", tmp_path / "b"
    first_home.mkdir()
    second_home.mkdir()
    fake.default = Reply(body=openai_completion(prompt_tokens=100, completion_tokens=100))
    config = base_config(url, agents={"default": {"budget": {"tokens": 500}}})
    first = await Served(first_home, config).start()
    gateways.append(first)
    os.link(first_home / "state.db", second_home / "state.db")  # one file, two names
    second = Served(second_home, config)
    gateways.append(second)
    await second.spawn()
    assert second.proc is not None

    async def second_up() -> bool:
        if second.proc is not None and second.proc.returncode is not None:
            return True
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{second.admin_url}/readyz") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await wait_for(second_up, 15.0, "the second gateway to exit or listen")
    if second.proc.returncode is None:
        # it serves: each gateway grants the same run its whole budget
        async with aiohttp.ClientSession() as session:
            granted = 0
            for served in (first, second, first, second):
                status, _ = await fire(session, served, "openai", "shared", max_tokens=150)
                granted += status == 200
        _, run_first = await first.run("shared")
        _, run_second = await second.run("shared")
        spent = [run["input_tokens"] + run["output_tokens"] for run in (run_first, run_second)]
        pytest.fail(f"a second gateway serves on the same state file (hard link): {granted} calls of 200 "
                    f"tokens granted on one run with a 500-token budget; each gateway's run view counts "
                    f"only its own spend {spent}, {sum(spent)} tokens in all")
    assert second.proc.returncode != 0
    assert "already in use" in second.output(), second.output()


async def test_a_run_stopped_by_an_mcp_tool_call_keeps_its_stop_in_the_ledger_through_a_crash(
    provider: tuple[FakeProvider, str], tmp_path: Path, gateways: list[Served]
) -> None:
    """README (Traces, metrics, ledger): "Rows are written in batches a few milliseconds after their
    answers, except a model call's stop, whose row is written before the stop is answered (2 s at most),
    so a crash cannot leave a stop the run store holds out of the ledger." DESIGN 4: "A stop is never
    silent: every stop carries its reason ... and in the ledger." README: `tool_not_allowed` with
    `on_violation: reject` stops the run (sticky), and stops are in the state file before the call goes on.

    An MCP `tools/call` outside the allow-list stops the run: the stop is written through to the run
    store, but its ledger row only goes into the writer's batch (`observe_mcp` uses `append_nowait`,
    no `ledger_stop_now`). The host dies right after the agent got the refusal: after the restart the run
    is stopped `tool_not_allowed`, and the ledger has no row of that stop.
    """
    from tests.fakes import mcp_server

    _, url = provider
    files = mcp_server.start()
    try:
        config = base_config(url, mcp_servers={"files": {"url": files.url}}, agents={
            "bot": {"tools": {"allow": ["files/read_*"], "on_violation": "reject"}}})
        served = await Served(tmp_path, config).start()
        gateways.append(served)
        meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientInfo": {"name": "probe", "version": "0"},
                "io.modelcontextprotocol/clientCapabilities": {}}
        body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": {"name": "write_note", "arguments": {"text": "x"}, "_meta": meta}}
        headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "mcp-stop", "content-type": "application/json",
                   "accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
                   "mcp-method": "tools/call", "mcp-name": "write_note"}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{served.url}/mcp/files", data=orjson.dumps(body), headers=headers) as resp:
                answer = await resp.json()
                assert resp.headers.get("x-tollgate-stop-reason") == "tool_not_allowed", (resp.headers, answer)
            served.signal(signal.SIGKILL)  # the host dies right after the agent heard of the stop
        await served.wait(10)
        assert answer["error"]["data"]["code"] == "tool_not_allowed", answer
        restarted = await Served(tmp_path, config).start()
        gateways.append(restarted)
        status, run = await restarted.run("mcp-stop")
        assert await restarted.stop() == 0
    finally:
        files.stop()
    assert status == 200, run
    assert (run["status"], run["stop_reason"]) == ("stopped", "tool_not_allowed"), run  # the store kept it
    rows = [(r["decision"], r["reason"]) for r in ledger_rows(tmp_path / "state.db", "mcp-stop")]
    assert ("rejected", "tool_not_allowed") in rows, f"the run store holds the stop, the ledger does not: {rows}"


async def fire(session: aiohttp.ClientSession, served: Served, kind: str, run_id: str,
               max_tokens: int = 100) -> tuple[int, bytes]:
    """One model call of `kind` (openai / anthropic, `_stream` for a stream) on `run_id`: (status, body),
    status -1 when the connection broke."""
    headers = {"x-tollgate-run-id": run_id}
    if kind.startswith("openai"):
        body: dict[str, Any] = {**CHAT, "max_tokens": max_tokens}
        path = "/v1/chat/completions"
    else:
        body = {**CLAUDE, "max_tokens": max_tokens}
        path = "/v1/messages"
        headers["anthropic-version"] = "2023-06-01"
    if kind.endswith("stream"):
        body["stream"] = True
        if kind.startswith("openai"):
            body["stream_options"] = {"include_usage": True}
    try:
        async with session.post(f"{served.url}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.read()
    except aiohttp.ClientError as exc:
        return -1, repr(exc).encode()

