"""gateway/runtime.py: the Gateway's own decisions (why a handler was cut, which transport a provider
uses)."""

from __future__ import annotations

import asyncio

from tests.conftest import GatewayFactory


async def test_a_handler_cut_once_the_shutdown_s_grace_ended_was_cut_by_the_shutdown(
    gateway_factory: GatewayFactory,
) -> None:
    """aiohttp cancels a handler when its client leaves, and when the shutdown's grace ends: the ledger
    row and the step said `client_disconnected` for both, telling an auditor the agent left."""
    h = await gateway_factory()
    gw = h.gateway
    assert gw.cut_reason() == "client_disconnected"  # not shutting down
    now = asyncio.get_running_loop().time()
    gw.grace_ends = now + 60
    assert gw.cut_reason() == "client_disconnected"  # draining: a client may still leave
    gw.grace_ends = now
    assert gw.cut_reason() == "shutting_down"


async def test_a_provider_s_transport_is_the_pooled_client_unless_one_is_registered(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory()
    gw = h.gateway
    assert gw.transport("openai") is gw.upstream
    local = object()
    gw.transports["local"] = local  # type: ignore[assignment]
    assert gw.transport("local") is local and gw.transport("openai") is gw.upstream
