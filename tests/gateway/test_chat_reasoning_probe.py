"""Chat Completions with current OpenAI models and parameters, as production agents send them, under a budget.

Defects found (each test below failed on e6bf210 and passes since its fix):

- An `allowed_tools` `tool_choice` (OpenAI Chat Completions, introduced with gpt-5: constrain the model to
  a subset of the offered tools while keeping the full `tools` list for prompt caching; the openai SDK types
  it as `ChatCompletionAllowedToolChoiceParam`) is refused with a 400 "tool_choice must name a function"
  before anything goes upstream. The README does not list it among the deliberate refusals; it even describes
  filtering an `allowed_tools` choice on the Responses API. Expected: forwarded (filtered by the allow-list
  like the Responses API's), the answer relayed.
- Custom tools (`{"type": "custom", "custom": {"name", "description", "format"}}`, the gpt-5 free-text tools,
  `ChatCompletionCustomToolParam` in the SDK) are refused with a 400 "tools[0] must be {type: function, ...}",
  and so is a `tool_choice` naming one (`{"type": "custom", "custom": {"name": ...}}`). The README says custom
  tools take free text and are allowed by name (written for the Responses API, but nothing says Chat
  Completions refuses them). Expected: forwarded, judged by name, the custom call relayed to the agent.

Checked and working (not kept here): gpt-5 / o3 / o4-mini / gpt-5-mini with `reasoning_effort`, `verbosity`,
`developer` messages, `prompt_cache_key`, `store: false`, `service_tier` passed through untouched; the output
limit tollgate adds is `max_completion_tokens` (never `max_tokens`, which reasoning models reject); settlement
of `reasoning_tokens` / cached tokens / accepted+rejected prediction tokens equals genai-prices on
`completion_tokens`; priority/flex/standard worst cases on o3 stay under the budget; `n` = 2, 3 grants times
`n` stay under the budget; `logprobs` / `top_logprobs` untouched; `gpt-5-search-api` with
`web_search_options` charged tokens + $10 per 1,000 calls, annotations relayed; `chat.completions.parse`
(strict json_schema) and the `chat.completions.stream` helper with a hidden usage chunk; streamed parallel
tool calls with `include_usage`; streamed `n` = 2 on flex with the usage chunk hidden; malformed optional
parameters give 4xx or pass through, never 5xx, no reservation left open.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, openai_completion, tool_call

MODELS = {"gpt-*": "openai", "o1*": "openai", "o3*": "openai", "o4*": "openai", "claude-*": "anthropic"}
MSG: list[Any] = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]
FN = {"type": "function", "function": {"name": "get_weather",
                                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
FN2 = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CUSTOM = {"type": "custom", "custom": {"name": "code_exec", "description": "run python", "format": {"type": "text"}}}


def client(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


async def test_an_allowed_tools_tool_choice_is_forwarded_not_refused(gateway_factory: GatewayFactory) -> None:
    """Defect: `tool_choice: {"type": "allowed_tools", ...}` on Chat Completions is a 400 from tollgate.
    Why it matters: it is how gpt-5 agents restrict a turn to some tools while keeping the tool list stable
    for prompt caching; every such call of the agent fails. Expected: forwarded, answer relayed."""
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 5.0}}})
    h.fake.queue(Reply(body=openai_completion("", model="gpt-5",
                                              tool_calls=[tool_call("get_weather", '{"city":"Paris"}')])))
    choice: Any = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    async with client(h, "allowed") as c:
        answer = await c.chat.completions.create(model="gpt-5", messages=MSG, tools=[FN, FN2],  # type: ignore[call-overload]
                                                 tool_choice=choice, max_completion_tokens=500,
                                                 reasoning_effort="low")
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert h.fake.seen[-1].json["tool_choice"]["type"] == "allowed_tools"
    view = await h.settled("allowed")
    assert view["reserved_usd"] == 0


@pytest.mark.parametrize("forced", [False, True])
async def test_a_custom_tool_is_forwarded_and_its_call_relayed(gateway_factory: GatewayFactory, forced: bool) -> None:
    """Defect: a Chat Completions custom tool (`{"type": "custom", "custom": {...}}`), and a `tool_choice`
    forcing one, are 400s from tollgate. Why it matters: gpt-5 agents use free-text custom tools (code,
    patches, grammars); the request is legitimate and OpenAI serves it. Expected: forwarded, the custom call
    (`{"type": "custom", "custom": {"name", "input"}}`) relayed so the SDK parses it."""
    h = await gateway_factory(models=MODELS, agents={"bot": {"budget": {"usd": 5.0}}})
    body = openai_completion("", model="gpt-5", tool_calls=[
        {"id": "call_1", "type": "custom", "custom": {"name": "code_exec", "input": "print(1)"}}])
    h.fake.queue(Reply(body=body))
    extra: dict[str, Any] = {"tool_choice": {"type": "custom", "custom": {"name": "code_exec"}}} if forced else {}
    async with client(h, "custom") as c:
        answer = await c.chat.completions.create(model="gpt-5", messages=MSG, tools=[CUSTOM],  # type: ignore[list-item]
                                                 max_completion_tokens=500, **extra)
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.type == "custom" and call.custom.input == "print(1)"  # type: ignore[union-attr]
    view = await h.settled("custom")
    assert view["reserved_usd"] == 0
