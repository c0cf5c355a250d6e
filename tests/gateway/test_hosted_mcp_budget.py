"""MCP servers the provider calls itself (the Responses API's hosted `mcp` tool, Anthropic's MCP connector)
under a budget, with the official SDKs through a running gateway: their tool lists and results are read
into the context as input of any size, which no reservation can hold, so a budget refuses them (a 400, the
run goes on) unless the allow-list removes them; without a budget they are forwarded. Before this they
were forwarded under any budget, and a large result settled above it."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import response_body
from tests.fakes.upstream import Reply, anthropic_message

MCP = {"type": "mcp", "server_label": "wiki", "server_url": "https://mcp.example/mcp", "require_approval": "never"}
LOOKUP = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
SERVERS = [{"type": "url", "url": "https://mcp.example/mcp", "name": "wiki"}]
MSG = [{"role": "user", "content": "hello"}]
CLAUDE = "claude-sonnet-4-5"


def oa(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


def an(h: Harness, run: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                    default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


@pytest.mark.parametrize("budget", [{"usd": 5.0}, {"tokens": 1_000_000}])
async def test_a_hosted_mcp_tool_is_refused_under_a_budget(gateway_factory: GatewayFactory,
                                                           budget: dict[str, Any]) -> None:
    h = await gateway_factory(agents={"bot": {"budget": budget}})
    async with oa(h, "hosted") as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=50,
                                          tools=[MCP, LOOKUP])  # type: ignore[list-item]
    assert raised.value.code == "invalid_request", raised.value.message
    assert "offers mcp," in raised.value.message and "MCP proxy" in raised.value.message, raised.value.message
    assert not h.fake.seen
    h.fake.queue(Reply(body=response_body("ok", usage=(12, 3))))
    async with oa(h, "hosted") as client:  # the run goes on: the refusal stopped nothing
        answer = await client.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=50,
                                               tools=[LOOKUP])  # type: ignore[list-item]
    assert answer.output_text == "ok"


async def test_a_hosted_mcp_tool_the_allow_list_removes_is_not_refused(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 5.0}, "tools": {"allow": ["lookup"]}}})
    h.fake.queue(Reply(body=response_body("ok", usage=(12, 3))))
    async with oa(h, "removed") as client:
        await client.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=50,
                                      tools=[MCP, LOOKUP])  # type: ignore[list-item]
    assert [t["name"] for t in h.fake.seen[-1].json["tools"]] == ["lookup"]


async def test_a_hosted_mcp_tool_goes_without_a_budget(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {"caps": {"llm_calls": 10}}})
    h.fake.queue(Reply(body=response_body("ok", usage=(12, 3))))
    async with oa(h, "free") as client:
        await client.responses.create(model="gpt-4o-mini", input="hi", tools=[MCP])  # type: ignore[list-item]
    assert h.fake.seen[-1].json["tools"][0]["type"] == "mcp"


@pytest.mark.parametrize("budget", [{"usd": 5.0}, {"tokens": 1_000_000}])
async def test_the_mcp_connector_is_refused_under_a_budget(gateway_factory: GatewayFactory,
                                                           budget: dict[str, Any]) -> None:
    h = await gateway_factory(agents={"bot": {"budget": budget, "tools": {"allow": ["mcp", "lookup"]}}})
    async with an(h, "connector") as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.beta.messages.create(model=CLAUDE, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                              mcp_servers=SERVERS, betas=["mcp-client-2025-04-04"])  # type: ignore[arg-type]
    assert "mcp_servers" in str(raised.value)
    assert not h.fake.seen


async def test_the_mcp_connector_the_allow_list_removes_is_not_refused(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 5.0}, "tools": {"allow": ["lookup"]}}})
    h.fake.queue(Reply(body=anthropic_message("ok", model=CLAUDE)))
    async with an(h, "no-connector") as client:
        await client.beta.messages.create(model=CLAUDE, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                          mcp_servers=SERVERS, betas=["mcp-client-2025-04-04"])  # type: ignore[arg-type]
    assert "mcp_servers" not in h.fake.seen[-1].json


async def test_the_mcp_connector_goes_without_a_budget(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(agents={"bot": {"tools": {"allow": ["mcp"]}}})
    h.fake.queue(Reply(body=anthropic_message("ok", model=CLAUDE)))
    async with an(h, "free-connector") as client:
        await client.beta.messages.create(model=CLAUDE, max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                                          mcp_servers=SERVERS, betas=["mcp-client-2025-04-04"])  # type: ignore[arg-type]
    assert h.fake.seen[-1].json["mcp_servers"] == SERVERS
