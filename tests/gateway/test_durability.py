"""Durability: spend and stops survive `kill -9` of a real `tollgate serve` on the same SQLite file."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.fakes.served import Served
from tests.fakes.upstream import FakeProvider, Reply, openai_completion


@pytest.fixture
def provider(fake: tuple[FakeProvider, str]) -> tuple[FakeProvider, str]:
    """The shared fake provider (tests/conftest.py), under the name these tests give it."""
    return fake


async def call(session: aiohttp.ClientSession, served: Served, run: str) -> int:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    async with session.post(f"{served.url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"x-tollgate-run-id": run, "content-type": "application/json"}) as resp:
        await resp.read()
        return resp.status


async def test_kill9_keeps_spend_and_stops(provider: tuple[FakeProvider, str], tmp_path: Path) -> None:
    fake, url = provider
    fake.default = Reply(body=openai_completion(prompt_tokens=100, completion_tokens=100))
    served = Served(tmp_path, {
        "providers": {"openai": {"type": "openai", "base_url": f"{url}/v1", "api_key": "sk-x"}},
        "models": {"gpt-*": "openai"},
        "pricing": {"gpt-*": {"input_per_mtok": 0.0, "output_per_mtok": 0.0}},
        "state": {"backend": "sqlite", "path": "state.db"},
        "agents": {"default": {"budget": {"tokens": 1000}, "caps": {"llm_calls": 3}}},
    })
    await served.start()
    async with aiohttp.ClientSession() as session:
        assert await call(session, served, "spend") == 200
        assert await call(session, served, "capped") == 200
        assert await call(session, served, "capped") == 200
        assert await call(session, served, "capped") == 200
        assert await call(session, served, "capped") == 403
        await served.kill9()
        assert (tmp_path / "state.db").exists()
        await served.start()
        async with session.get(f"{served.admin_url}/admin/runs/spend") as resp:
            run = await resp.json()
        assert run["input_tokens"] + run["output_tokens"] == 200 and run["reserved_tokens"] == 0
        async with session.get(f"{served.admin_url}/admin/runs/capped") as resp:
            run = await resp.json()
        assert (run["status"], run["stop_reason"], run["llm_calls"]) == ("stopped", "llm_call_cap", 3)
        assert await call(session, served, "capped") == 403
        # the token budget still holds across the restart: 200 spent, each call needs ~300 worst case
        statuses = [await call(session, served, "spend") for _ in range(6)]
        assert statuses.count(403) >= 1
        async with session.get(f"{served.admin_url}/admin/runs/spend") as resp:
            run = await resp.json()
        assert run["input_tokens"] + run["output_tokens"] <= 1000
        served.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert await served.proc.wait() == 0  # type: ignore[union-attr]
    assert os.path.exists(tmp_path / "state.db")
