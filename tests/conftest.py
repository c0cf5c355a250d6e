"""Shared fixtures: a fake provider and a running gateway (proxy + admin) on loopback ports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvloop
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.app import create_apps
from gateway.config import Config, parse_config
from gateway.proxy import GATEWAY
from gateway.runtime import Gateway
from tests.fakes.gateway_server import GatewayTestServer
from tests.fakes.upstream import FakeProvider


@dataclass
class Harness:
    url: str  # proxy base, e.g. http://127.0.0.1:PORT
    admin_url: str
    fake: FakeProvider
    gateway: Gateway
    config: Config
    session: ClientSession

    async def run(self, run_id: str) -> dict[str, Any]:
        async with self.session.get(f"{self.admin_url}/admin/runs/{run_id}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()  # type: ignore[no-any-return]

    async def settled(self, run_id: str, steps: int = 1, timeout: float = 5.0) -> dict[str, Any]:
        """The run once `steps` steps are recorded and no reservation is open (a streamed step is recorded
        after its last byte, which no client can await: poll the admin API)."""
        deadline = time.monotonic() + timeout
        while True:
            view = await self.run(run_id)
            if len(view.get("steps") or []) >= steps and not view["reserved_usd"] and not view["reserved_tokens"]:
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} never settled {steps} step(s): {view}")
            await asyncio.sleep(0.02)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Async tests of a module with `BOTH_LOOPS = True` run on asyncio's loop and on uvloop (the
    one `tollgate serve` uses); others on asyncio's only."""
    module = getattr(item, "module", None)
    if getattr(module, "BOTH_LOOPS", False):
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


def base_config(fake_url: str, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "providers": {
            "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"},
            "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-provider"},
        },
        "models": {"gpt-*": "openai", "claude-*": "anthropic"},
        "state": {"backend": "memory"},
    }
    data.update(overrides)
    return data


GatewayFactory = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeProvider, str]]:
    provider = FakeProvider()
    server = TestServer(provider.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield provider, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def gateway_factory(fake: tuple[FakeProvider, str], tmp_path: Path) -> AsyncIterator[GatewayFactory]:
    servers: list[TestServer] = []
    sessions: list[ClientSession] = []
    provider, fake_url = fake

    async def make(**overrides: Any) -> Harness:
        data = base_config(fake_url, **overrides)
        config = parse_config(data, env={}, base_dir=str(tmp_path))
        proxy, admin = create_apps(config)
        proxy_server = GatewayTestServer(proxy, config.limits)
        await proxy_server.start_server()
        servers.append(proxy_server)
        admin_server = GatewayTestServer(admin, config.limits)
        await admin_server.start_server()
        servers.append(admin_server)
        session = ClientSession()
        sessions.append(session)
        return Harness(
            url=str(proxy_server.make_url("")).rstrip("/"),
            admin_url=str(admin_server.make_url("")).rstrip("/"),
            fake=provider,
            gateway=proxy[GATEWAY],
            config=config,
            session=session,
        )

    yield make
    for session in sessions:
        await session.close()
    for server in reversed(servers):
        await server.close()


@pytest.fixture
async def gw(gateway_factory: GatewayFactory) -> Harness:
    return await gateway_factory()
