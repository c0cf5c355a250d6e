"""Hostile probe: shared state and fault tolerance (Redis outages, SQLite crashes, shutdown).

Every test asserts the contract (README "Many sidecars, one budget", "How budgets are held", SIGTERM
in "Commands"); a failing one is a bug of the product, not of the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis
import yaml

from tests.conftest import GatewayFactory
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, openai_stream
from tests.redis_fixture import RedisServer, free_port, own_redis, redis_server, start_server  # noqa: F401

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
PER_CALL = len(orjson.dumps(BODY)) + 20  # token reservation of one call: input bytes + max_tokens
ZERO_PRICES = {"gpt-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0}}


# -- helpers -----------------------------------------------------------------------------------------


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)


def open_fields(server: RedisServer, run_id: str) -> dict[str, str]:
    """The open reservations (`o:<id>` fields) of a run, read straight from Redis."""
    with raw_client(server) as client:
        fields = client.hgetall(f"tollgate:run:{run_id}")
    return {k.decode(): v.decode() for k, v in fields.items() if k.startswith(b"o:")}


async def post(
    session: aiohttp.ClientSession, url: str, run_id: str, body: dict[str, Any] = BODY, **kw: Any
) -> tuple[int, Any]:
    headers = {"x-tollgate-run-id": run_id, "content-type": "application/json"}
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body), headers=headers, **kw) as resp:
        raw = await resp.read()
        try:
            return resp.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return resp.status, raw


async def redis_gateway(gateway_factory: GatewayFactory, server: RedisServer, agent: dict[str, Any]) -> Any:
    return await gateway_factory(
        state={"backend": "redis", "url": server.url}, pricing=ZERO_PRICES, agents={"default": agent}
    )


class Served:
    """One `python -m gateway serve` subprocess; stderr goes to a file (never a pipe nobody reads)."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.port, self.admin = free_port(), free_port()
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}"

    async def start(self, session: aiohttp.ClientSession) -> None:
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(self.config),
                "--port", str(self.port), "--admin-port", str(self.admin),
                stdout=asyncio.subprocess.DEVNULL, stderr=log, cwd=str(self.config.parent),
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{self.admin_url}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if self.proc.returncode is not None:
                raise AssertionError(f"gateway exited: {self.log.read_text()}")
            await asyncio.sleep(0.05)
        raise AssertionError("gateway did not become ready")

    async def run(self, session: aiohttp.ClientSession, run_id: str) -> dict[str, Any]:
        async with session.get(f"{self.admin_url}/admin/runs/{run_id}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()  # type: ignore[no-any-return]

    async def signal(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), 15)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def write_config(path: Path, upstream: str, state: dict[str, Any], agent: dict[str, Any], **extra: Any) -> Path:
    path.write_text(yaml.safe_dump({
        "providers": {"openai": {"type": "openai", "base_url": f"{upstream}/v1", "api_key": "sk-x"}},
        "models": {"gpt-*": "openai"},
        "pricing": ZERO_PRICES,
        "state": state,
        "agents": {"default": agent},
        **extra,
    }))
    return path


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        yield client


@pytest.fixture
async def served_list() -> AsyncIterator[list[Served]]:
    started: list[Served] = []
    try:
        yield started
    finally:
        for served in started:
            await served.kill()


# -- Redis: settles lost to an outage ----------------------------------------------------------------


async def test_settle_lost_to_a_write_refusing_redis_is_settled_once_redis_accepts_writes_again(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], own_redis: RedisServer  # noqa: F811
) -> None:
    """Redis refuses writes for a while (NOREPLICAS: `min-replicas-to-write` unmet; READONLY after a
    failover and MISCONF on a full disk behave alike). The settle of a call in flight fails and is kept
    for replay; the replay meets the same refusal on the next call and is DROPPED (`_replay` treats any
    non-connection RedisError as permanent), so the reservation stays held forever and the real usage
    is never counted."""
    provider, _ = fake
    gw = await redis_gateway(gateway_factory, own_redis, {"budget": {"tokens": 100_000}})
    provider.queue(Reply(body=openai_completion(prompt_tokens=10, completion_tokens=5), delay=0.5))
    raw = raw_client(own_redis)
    try:
        task = asyncio.create_task(post(gw.session, gw.url, "noreplicas"))
        await asyncio.wait_for(provider.wait_seen(1), 5)
        raw.config_set("min-replicas-to-write", "1")  # writes refused from now on
        status, body = await task
        assert status == 503 and body["error"]["code"] == "state_unavailable"
        status, body = await post(gw.session, gw.url, "noreplicas")  # still refused: fails closed
        assert status == 503 and body["error"]["code"] == "state_unavailable"
        raw.config_set("min-replicas-to-write", "0")  # Redis accepts writes again
        status, _ = await post(gw.session, gw.url, "noreplicas")
        assert status == 200
        run = await gw.run("noreplicas")
        assert open_fields(own_redis, "noreplicas") == {}, "a reservation made before the outage is still open"
        assert run["reserved_tokens"] == 0
        assert run["input_tokens"] + run["output_tokens"] == 2 * 15  # both answered calls, at real usage
    finally:
        raw.close()


async def test_sigterm_settles_what_a_redis_outage_left_unsettled(
    fake: tuple[FakeProvider, str], session: aiohttp.ClientSession, served_list: list[Served],
    tmp_path: Path,
) -> None:
    """Redis dies while a call is in flight and comes back (with its data: AOF). The gateway gets no
    other request, then SIGTERM: the settle it kept for replay is never sent, so the run keeps a
    reservation open in the shared Redis (visible to every replica) until it expires (30 days)."""
    provider, upstream = fake
    server = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always")
    server.start()
    try:
        config = write_config(tmp_path / "gw.yaml", upstream, {"backend": "redis", "url": server.url},
                              {"budget": {"tokens": 100_000}}, ledger={"path": "ledger.db"})
        served = Served(config, tmp_path / "gw.log")
        served_list.append(served)
        await served.start(session)
        provider.queue(Reply(body=openai_completion(prompt_tokens=10, completion_tokens=5), delay=0.5))
        task = asyncio.create_task(post(session, served.url, "drained"))
        await asyncio.wait_for(provider.wait_seen(1), 5)
        server.stop(kill=True)
        status, body = await task
        assert status == 503 and body["error"]["code"] == "state_unavailable"
        server.start()  # back, with the run as it was (one open reservation)
        assert len(open_fields(server, "drained")) == 1
        assert await served.signal(signal.SIGTERM) == 0
        assert open_fields(server, "drained") == {}, "shutdown left a reservation held in the shared Redis"
    finally:
        server.stop()


async def test_fail_open_agent_gets_its_answer_when_redis_dies_during_the_call(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], own_redis: RedisServer  # noqa: F811
) -> None:
    """`state_failure: fail_open`: steps go through unguarded while the store is unreachable. Redis
    dying while the upstream answers must not turn the (already paid) answer into a 503."""
    provider, _ = fake
    gw = await redis_gateway(
        gateway_factory, own_redis, {"budget": {"tokens": 100_000}, "state_failure": "fail_open"}
    )
    # the same agent with Redis down from the start: answered (the documented fail-open behaviour)
    provider.queue(Reply(body=openai_completion(), delay=0.5))
    task = asyncio.create_task(post(gw.session, gw.url, "open-mid"))
    await asyncio.wait_for(provider.wait_seen(1), 5)
    own_redis.stop(kill=True)
    status, body = await task
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "Hello!"


async def test_fail_open_agent_stream_is_not_cut_when_redis_dies_during_it(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], own_redis: RedisServer  # noqa: F811
) -> None:
    provider, _ = fake
    gw = await redis_gateway(
        gateway_factory, own_redis, {"budget": {"tokens": 100_000}, "state_failure": "fail_open"}
    )
    chunks = openai_stream(["a", "b", "c"])
    provider.queue(Reply(chunks=chunks, chunk_delay=0.2))
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-tollgate-run-id": "open-stream"}
    async with gw.session.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        assert first
        own_redis.stop(kill=True)
        data = first + await resp.content.read()
    assert b"state_unavailable" not in data
    assert data.rstrip().endswith(b"data: [DONE]")


async def test_admin_run_during_a_redis_outage_is_a_clear_503(
    gateway_factory: GatewayFactory, own_redis: RedisServer  # noqa: F811
) -> None:
    """The admin API during an outage: a JSON 503 naming the state store, not an unhandled 500."""
    gw = await redis_gateway(gateway_factory, own_redis, {"budget": {"tokens": 100_000}})
    assert (await post(gw.session, gw.url, "admin-outage"))[0] == 200
    own_redis.stop(kill=True)
    for path in ("/admin/runs/admin-outage", "/admin/runs"):
        async with gw.session.get(gw.admin_url + path) as resp:
            assert resp.status == 503, (path, resp.status, await resp.text())
            assert resp.content_type == "application/json"
            assert "state_unavailable" in await resp.text()


async def test_reservation_of_a_killed_replica_does_not_hold_the_run_forever(
    fake: tuple[FakeProvider, str], session: aiohttp.ClientSession, served_list: list[Served], tmp_path: Path,
) -> None:
    """Replica A is SIGKILLed with a call in flight; it is restarted. Its reservation is held (B is told
    to retry) only until its lease (`state.reservation_lease_s`) runs out; then B's next reserve charges
    it in full, as SQLite's recovery does, and the run goes on or stops for its budget, never 'held'."""
    provider, upstream = fake
    server = start_server(tmp_path / "redis")
    try:
        agent = {"budget": {"tokens": PER_CALL * 3 // 2}}
        replicas = []
        state = {"backend": "redis", "url": server.url, "reservation_lease_s": 1}
        for name in ("a", "b"):
            config = write_config(tmp_path / f"{name}.yaml", upstream, state, agent,
                                  ledger={"path": f"ledger-{name}.db"})
            replicas.append(Served(config, tmp_path / f"{name}.log"))
        served_list.extend(replicas)
        a, b = replicas
        await asyncio.gather(a.start(session), b.start(session))
        provider.queue(Reply(body=openai_completion(), delay=30))
        task = asyncio.create_task(post(session, a.url, "orphan"))
        await asyncio.wait_for(provider.wait_seen(1), 5)
        await a.kill()  # SIGKILL with the reservation open
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await a.start(session)  # the crashed replica is back
        await asyncio.sleep(1.1)  # the lease is time itself: nothing to await but its end
        status, body = await post(session, b.url, "orphan")
        assert status in (200, 403), body
        if status == 403:
            assert "in flight" not in body["error"]["message"], body["error"]["message"]
    finally:
        server.stop()


async def test_redis_paused_answers_503_within_the_deadline_then_recovers_settled(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], own_redis: RedisServer  # noqa: F811
) -> None:
    provider, _ = fake
    gw = await redis_gateway(gateway_factory, own_redis, {"budget": {"tokens": 100_000}})
    assert (await post(gw.session, gw.url, "paused"))[0] == 200
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        status, body = await post(gw.session, gw.url, "paused")
        elapsed = time.monotonic() - started
        assert status == 503 and body["error"]["code"] == "state_unavailable"
        assert elapsed < 3.0, elapsed
        assert len(provider.seen) == 1  # failed closed
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert (await post(gw.session, gw.url, "paused"))[0] == 200
    run = await gw.run("paused")
    assert run["reserved_tokens"] == 0 and open_fields(own_redis, "paused") == {}
    assert run["llm_calls"] == 2 and len(provider.seen) == 2


async def test_reset_and_stop_on_one_replica_are_seen_by_the_other(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str], redis_server: RedisServer  # noqa: F811
) -> None:
    agent = {"caps": {"llm_calls": 2}}
    one = await redis_gateway(gateway_factory, redis_server, agent)
    two = await redis_gateway(gateway_factory, redis_server, agent)
    run_id = f"replicas-{os.getpid()}-{time.monotonic_ns()}"
    assert (await post(one.session, one.url, run_id))[0] == 200
    assert (await post(two.session, two.url, run_id))[0] == 200
    status, body = await post(one.session, one.url, run_id)
    assert (status, body["error"]["code"]) == (403, "llm_call_cap")
    status, body = await post(two.session, two.url, run_id)  # stopped everywhere
    assert (status, body["error"]["code"]) == (403, "llm_call_cap")
    assert (await two.run(run_id))["status"] == "stopped"
    async with one.session.post(f"{one.admin_url}/admin/runs/{run_id}/reset") as resp:
        assert resp.status == 200
    seen = await two.run(run_id)
    assert (seen["status"], seen["llm_calls"], seen["stop_reason"]) == ("active", 0, None)
    assert (await post(two.session, two.url, run_id))[0] == 200


# -- SQLite: SIGKILL mid-stream, restart, `tollgate runs`, `tollgate ledger verify` ---------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], check=False, cwd=str(cwd), capture_output=True,
                          text=True, timeout=30)


async def test_sqlite_kill9_mid_stream_charges_the_reservation_and_keeps_the_ledger_chain(
    fake: tuple[FakeProvider, str], session: aiohttp.ClientSession, served_list: list[Served], tmp_path: Path,
) -> None:
    provider, upstream = fake
    config = write_config(tmp_path / "tollgate.yaml", upstream, {"backend": "sqlite", "path": "state.db"},
                          {"budget": {"tokens": 100_000}})
    served = Served(config, tmp_path / "gw.log")
    served_list.append(served)
    await served.start(session)
    assert (await post(session, served.url, "crash"))[0] == 200  # settled at 10 + 5
    provider.queue(Reply(chunks=openai_stream(["a"] * 20), chunk_delay=0.2))
    body = {**BODY, "stream": True}
    async with session.post(f"{served.url}/v1/chat/completions", json=body,
                            headers={"x-tollgate-run-id": "crash"}) as resp:
        assert resp.status == 200
        assert await resp.content.readany()
        await asyncio.sleep(0.1)  # anything written behind is on file by now
        await served.kill()
    stream_reservation = len(orjson.dumps(body)) + 20  # at least: tollgate adds stream_options to the body
    verified = cli("ledger", "verify", "--db", str(tmp_path / "state.db"), cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    await served.start(session)
    crashed = await served.run(session, "crash")
    assert crashed["reserved_tokens"] == 0 and crashed["llm_calls"] == 2 and crashed["status"] == "active"
    assert (await post(session, served.url, "crash"))[0] == 200
    listed = cli("runs", "--admin", served.admin_url, cwd=tmp_path)
    assert listed.returncode == 0 and "crash" in listed.stdout, listed.stderr
    assert await served.signal(signal.SIGTERM) == 0
    verified = cli("ledger", "verify", "--db", str(tmp_path / "state.db"), cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "ok:" in verified.stdout
    # the crashed stream is charged in full on recovery, as a broken stream is (guards.budget.settlement
    # books its tokens as input + output): the run shows them, as `tollgate runs` TOKENS does
    assert crashed["input_tokens"] + crashed["output_tokens"] >= 15 + stream_reservation, crashed


# -- SIGTERM during a stream, state in Redis ------------------------------------------------------------


async def test_sigterm_during_a_stream_finishes_it_and_settles_in_redis(
    fake: tuple[FakeProvider, str], session: aiohttp.ClientSession, served_list: list[Served], tmp_path: Path,
) -> None:
    provider, upstream = fake
    server = start_server(tmp_path / "redis")
    try:
        config = write_config(tmp_path / "gw.yaml", upstream, {"backend": "redis", "url": server.url},
                              {"budget": {"tokens": 100_000}}, ledger={"path": "ledger.db"})
        served = Served(config, tmp_path / "gw.log")
        served_list.append(served)
        await served.start(session)
        chunks = openai_stream(["one ", "two ", "three"], usage=(7, 3))
        provider.queue(Reply(chunks=chunks, chunk_delay=0.2))
        body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{served.url}/v1/chat/completions", json=body,
                                headers={"x-tollgate-run-id": "draining"}) as resp:
            assert resp.status == 200
            received = await resp.content.readany()
            assert served.proc is not None
            served.proc.send_signal(signal.SIGTERM)
            received += await resp.content.read()
        assert received == b"".join(chunks)
        assert await asyncio.wait_for(served.proc.wait(), 10) == 0
        with raw_client(server) as client:
            fields = {k.decode(): v.decode() for k, v in client.hgetall("tollgate:run:draining").items()}
        assert not any(k.startswith("o:") for k in fields)
        assert float(fields["u:input_tokens"]) + float(fields["u:output_tokens"]) == 10
        assert float(fields.get("r:tokens", "0")) == 0.0
    finally:
        server.stop()


# -- MCP tool calls of a fail_open agent during an outage ------------------------------------------------


async def test_fail_open_agent_mcp_tool_call_goes_through_while_redis_is_down(
    gateway_factory: GatewayFactory, own_redis: RedisServer  # noqa: F811
) -> None:
    """`agents.<name>.state_failure: fail_open` lets that agent's steps through unguarded while the run
    store is unreachable; a `tools/call` through the MCP proxy is a step of the run like a model call."""
    from tests.fakes import mcp_server
    from tests.gateway.test_mcp import mcp_client

    files = mcp_server.start()
    try:
        h = await gateway_factory(
            state={"backend": "redis", "url": own_redis.url},
            mcp_servers={"files": {"url": files.url}},
            agents={"bot": {"tools": {"allow": ["files/read_file"]}, "caps": {"tool_calls": 10},
                            "state_failure": "fail_open"}},
        )
        own_redis.stop(kill=True)
        async with mcp_client(h, run="mcp-open") as client:
            result = await client.call_tool("read_file", {"path": "a.txt"})
        assert not result.is_error, result
        assert result.content[0].text == "contents of a.txt"
    finally:
        files.stop()
