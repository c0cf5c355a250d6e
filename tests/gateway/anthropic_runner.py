"""What the tests of the anthropic SDK's tool runner share: a client per test closed after it, two tools
that record their runs, a model and its prices. Import `runner_clients` (an autouse fixture) with them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import pytest
from anthropic import beta_async_tool

from tests.conftest import Harness

PRICING = {"claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 5.0}}
CLAUDE = "claude-sonnet-4-5"
RAN: list[str] = []
CLIENTS: list[anthropic.AsyncAnthropic] = []


def an(h: Harness, run: str) -> anthropic.AsyncAnthropic:
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                      default_headers={"x-tollgate-run-id": run})
    CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
async def runner_clients() -> AsyncIterator[None]:
    RAN.clear()
    yield
    while CLIENTS:
        await CLIENTS.pop().close()


@beta_async_tool
async def get_weather(city: str) -> str:
    """The weather in a city."""
    RAN.append(f"get_weather:{city}")
    return f"sunny in {city}"


@beta_async_tool
async def delete_all() -> str:
    """Delete everything."""
    RAN.append("delete_all")
    return "deleted"
