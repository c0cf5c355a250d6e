"""Realistic agents built with the official frameworks (OpenAI Agents SDK, openai, anthropic, mcp), run
through tollgate with several guards at once. Each test here failed on the code it was written against for
the defect its docstring states, and passes since its fix."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, anthropic_message, anthropic_stream
from tests.gateway.anthropic_runner import (  # noqa: F401 - runner_clients: a fixture
    CLAUDE,
    PRICING,
    RAN,
    an,
    delete_all,
    get_weather,
    runner_clients,
)


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_runner_default_thread_cannot_recover_from_tollgates_refusal(
    gateway_factory: GatewayFactory, stream: bool
) -> None:
    """Defect: the anthropic SDK's tool runner (`client.beta.messages.tool_runner`, the SDK's own tool
    loop) runs over a message thread by default: its first turn sends `thread: {"type": "create"}` (tollgate
    forwards it), every later turn only the new messages with `thread: {"type": "continue", ...}`. Under a
    budget tollgate refuses the continuation with a 400 (README: it cannot bound input Anthropic holds),
    which is deliberate; but the refusal is a plain `invalid_request`, so the runner dies on its second
    turn, after the tool already ran. The SDK has a documented way out: a 400 whose
    `error.details.error_code` is `thread_unsupported_request` ("the server cannot thread this request")
    makes the runner (`unsupported_request_behavior="continue_unthreaded"`) re-send the same turn with the
    whole history and no `thread`, which tollgate forwards and budgets (checked against the fake provider
    directly). Why it matters: the default Anthropic tool loop cannot run under any tollgate budget at
    all, although the refusal only needs the shape the SDK recovers from. Expected: the refusal carries
    `details: {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}` (still a 400, never
    forwarded), the runner goes on unthreaded, the loop finishes, and no continuation reaches Anthropic."""
    h = await gateway_factory(pricing=PRICING, agents={"default": {
        "budget": {"usd": 0.5}, "caps": {"tool_calls": 3}, "tools": {"allow": ["get_weather"]}}})
    client = an(h, f"runner-{stream}")
    first = anthropic_message("", model=CLAUDE, tool_uses=[{"id": "tu_1", "name": "get_weather",
                                                             "input": {"city": "Oslo"}}])
    if stream:
        h.fake.queue(Reply(chunks=anthropic_stream([], model=CLAUDE, tool_uses=[
            {"id": "tu_1", "name": "get_weather", "input": {"city": "Oslo"}}])),
            Reply(chunks=anthropic_stream(["Sunny ", "in Oslo."], model=CLAUDE)))
    else:
        h.fake.queue(Reply(body=first), Reply(body=anthropic_message("Sunny in Oslo.", model=CLAUDE)))
    runner = client.beta.messages.tool_runner(model=CLAUDE, max_tokens=1000, tools=[get_weather, delete_all],
                                              messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                              stream=stream)
    texts: list[str] = []
    async for item in runner:
        message: Any = await item.get_final_message() if stream else item  # type: ignore[union-attr]
        texts += [b.text for b in message.content if b.type == "text"]
    assert "".join(texts) == "Sunny in Oslo."
    assert RAN == ["get_weather:Oslo"]
    bodies: list[dict[str, Any]] = [s.json for s in h.fake.seen]
    assert all((b.get("thread") or {}).get("type") != "continue" for b in bodies)
    assert [t["name"] for t in bodies[0]["tools"]] == ["get_weather"]
    view = await h.settled(f"runner-{stream}", 2)
    assert (view["llm_calls"], view["tool_calls"], view["reserved_usd"]) == (2, 1, 0)
