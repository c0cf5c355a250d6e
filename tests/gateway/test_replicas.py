"""Many sidecars, one budget (issue 7's show case): real `tollgate serve` processes sharing one real
redis-server hold a run's limits exactly, and fail closed (503 `state_unavailable`, in the caller's
wire format) while Redis is down, then carry on where they were once it is back."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp.test_utils import TestServer

from tests.fakes.upstream import FakeProvider, Reply, anthropic_message, openai_completion, openai_stream
from tests.redis_fixture import RedisServer, free_port, start_server

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
PER_CALL = len(orjson.dumps(BODY)) + 20  # the token budget's reservation: input bytes + max_tokens
ANTHROPIC_BODY = {
    "model": "claude-3-5-haiku-latest",
    "max_tokens": 20,
    "messages": [{"role": "user", "content": "hi"}],
}


READY_TIMEOUT_S = 60.0  # generous: four interpreters start at once on a possibly busy CI machine


class Gateway:
    """One `python -m gateway serve` process, ready when its admin port answers /readyz."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.port, self.admin = free_port(), free_port()
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, session: aiohttp.ClientSession) -> None:
        with self.log.open("ab") as log:  # a file, not a pipe nobody reads: a full pipe would block it
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--config",
                str(self.config),
                "--port",
                str(self.port),
                "--admin-port",
                str(self.admin),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                async with session.get(f"http://127.0.0.1:{self.admin}/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if self.proc.returncode is not None:
                raise AssertionError(f"gateway exited: {self.log.read_text()}")
            await asyncio.sleep(0.05)
        raise AssertionError("gateway did not become ready")

    async def run(self, session: aiohttp.ClientSession, run_id: str) -> dict[str, Any]:
        async with session.get(f"http://127.0.0.1:{self.admin}/admin/runs/{run_id}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()  # type: ignore[no-any-return]

    async def stop(self, kill: bool = False) -> None:
        """SIGTERM (a drain, up to 10 s), or SIGKILL."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@pytest.fixture
async def provider() -> AsyncIterator[tuple[FakeProvider, str]]:
    fake = FakeProvider()
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        yield client


async def start_gateways(
    count: int,
    tmp_path: Path,
    upstream: str,
    redis: RedisServer,
    agent: dict[str, Any],
    session: aiohttp.ClientSession,
) -> list[Gateway]:
    gateways = []
    for i in range(count):
        config = tmp_path / f"gw{i}.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "providers": {
                        "openai": {"type": "openai", "base_url": f"{upstream}/v1", "api_key": "sk-x"},
                        "anthropic": {"type": "anthropic", "base_url": upstream, "api_key": "sk-ant-x"},
                    },
                    "models": {"gpt-*": "openai", "claude-*": "anthropic"},
                    "pricing": {
                        "gpt-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0},
                        "claude-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0},
                    },
                    "state": {"backend": "redis", "url": redis.url},
                    "ledger": {"path": f"ledger{i}.db"},  # each sidecar keeps its own ledger
                    "agents": {"default": agent},
                }
            )
        )
        gateways.append(Gateway(config, tmp_path / f"gw{i}.log"))
    await asyncio.gather(*(g.start(session) for g in gateways))
    return gateways


async def call(
    session: aiohttp.ClientSession, gateway: Gateway, run_id: str, *, anthropic: bool = False
) -> tuple[int, dict[str, Any]]:
    path, body = ("/v1/messages", ANTHROPIC_BODY) if anthropic else ("/v1/chat/completions", BODY)
    headers = {"x-tollgate-run-id": run_id, "content-type": "application/json"}
    async with session.post(gateway.url + path, data=orjson.dumps(body), headers=headers) as resp:
        raw = await resp.read()
        try:
            return resp.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return resp.status, {"raw": raw.decode(errors="replace")}


async def test_four_gateways_400_requests_one_run_budget_for_20(
    provider: tuple[FakeProvider, str], session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fake, upstream = provider
    fake.default = Reply(
        body=openai_completion(prompt_tokens=PER_CALL - 20, completion_tokens=20), delay=0.05
    )
    redis = start_server(tmp_path / "redis")
    gateways: list[Gateway] = []
    try:
        gateways = await start_gateways(
            4, tmp_path, upstream, redis, {"budget": {"tokens": PER_CALL * 20}}, session
        )
        started = time.monotonic()
        results = await asyncio.gather(*(call(session, gateways[i % 4], "shared") for i in range(400)))
        elapsed = time.monotonic() - started
        statuses = [status for status, _ in results]
        assert set(statuses) <= {200, 403}, statuses
        assert statuses.count(200) == len(fake.seen) == 20  # the budget pays for exactly 20, no more, no less
        codes = {body["error"]["code"] for status, body in results if status == 403}
        assert codes == {"token_budget_exhausted"}
        # those were refused while the 20 held the budget in flight; it is spent now, and the run stops
        status, body = await call(session, gateways[1], "shared")
        assert (status, body["error"]["code"]) == (403, "token_budget_exhausted")
        assert len(fake.seen) == 20
        for gateway in gateways:  # every sidecar sees the one shared run
            run = await gateway.run(session, "shared")
            assert run["input_tokens"] + run["output_tokens"] <= PER_CALL * 20
            assert run["reserved_tokens"] == 0 and run["reserved_usd"] == 0.0
            assert (run["status"], run["stop_reason"]) == ("stopped", "token_budget_exhausted")
        assert run["input_tokens"] + run["output_tokens"] == PER_CALL * 20
        print(f"\n400 requests through 4 gateways on one Redis: {elapsed:.2f} s")
    finally:
        await asyncio.gather(*(g.stop() for g in gateways))
        redis.stop()


async def test_redis_killed_mid_run_fails_closed_then_recovers(
    provider: tuple[FakeProvider, str], session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fake, upstream = provider
    fake.default = None
    # a persistent Redis (AOF, fsync always): the run must carry on where it was after the restart
    redis = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always")
    gateways: list[Gateway] = []
    try:
        # the gateways start (and are ready) while Redis is not there yet: the store connects lazily
        gateways = await start_gateways(2, tmp_path, upstream, redis, {"caps": {"llm_calls": 100}}, session)
        status, body = await call(session, gateways[0], "outage")
        assert status == 503 and body["error"]["code"] == "state_unavailable" and fake.seen == []
        redis.start()
        for gateway in gateways:
            assert (await call(session, gateway, "outage"))[0] == 200
        reached = len(fake.seen)
        redis.stop(kill=True)
        for gateway in gateways:
            started = time.monotonic()
            status, body = await call(session, gateway, "outage")
            assert time.monotonic() - started < 3.0
            assert status == 503 and body["error"]["code"] == "state_unavailable"
            assert body["error"]["type"] == "server_error" and "redis" in body["error"]["message"]
            status, body = await call(session, gateway, "outage", anthropic=True)
            assert status == 503 and body["type"] == "error"
            assert (body["error"]["type"], body["error"]["code"]) == ("api_error", "state_unavailable")
        assert len(fake.seen) == reached  # failed closed: nothing went upstream
        redis.start()
        fake.default = Reply(body=anthropic_message())
        assert (await call(session, gateways[0], "outage", anthropic=True))[0] == 200
        fake.default = None
        assert (await call(session, gateways[1], "outage"))[0] == 200
        run = await gateways[0].run(session, "outage")
        assert (run["status"], run["llm_calls"], run["reserved_tokens"]) == ("active", 4, 0)
    finally:
        await asyncio.gather(*(g.stop() for g in gateways))
        redis.stop()


async def test_redis_killed_while_a_stream_is_in_flight_ends_it_with_an_error_event(
    provider: tuple[FakeProvider, str], session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fake, upstream = provider
    fake.queue(Reply(chunks=openai_stream(["a"] * 5), chunk_delay=0.3))
    redis = start_server(tmp_path / "redis")
    gateways: list[Gateway] = []
    try:
        gateways = await start_gateways(
            1, tmp_path, upstream, redis, {"budget": {"tokens": 100_000}}, session
        )
        body = {**BODY, "stream": True}

        async def stream() -> tuple[int, bytes]:
            async with session.post(
                gateways[0].url + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"x-tollgate-run-id": "streaming"},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                return resp.status, await resp.read()

        task = asyncio.create_task(stream())
        await asyncio.sleep(0.5)  # the first chunks are out; the settle at the end finds Redis gone
        redis.stop(kill=True)
        status, data = await task
        assert status == 200 and b"state_unavailable" in data.rsplit(b"data:", 1)[-1]
    finally:
        await asyncio.gather(*(g.stop(kill=True) for g in gateways))  # its handler hangs: no drain
        redis.stop()
