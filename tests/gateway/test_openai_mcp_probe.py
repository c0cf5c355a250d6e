"""Hostile probes of the OpenAI Responses / Chat Completions surfaces the installed `openai` SDK (3.57)
types know, of the MCP proxy and of the metered paths, against a running gateway whose upstream is the
loopback fake.

The promise under test (README "Runs, identity, decisions", "How budgets are held", "Tools and MCP"):
the worst case of every billed call is reserved before it goes upstream and a run's budget is never
overspent; what tollgate cannot bound is refused (400) rather than forwarded unguarded; the tools
OpenAI runs itself are offered only when allowed, held to `caps.tool_calls` by `max_tool_calls`, and
billed-apart ones refused under a USD budget; caller mistakes are 4xx in the caller's wire format.

Every test here failed on the code it was written against (each a defect, since fixed); each docstring
says what must hold.
"""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from tests.conftest import GatewayFactory, Harness
from tests.fakes.responses import message_item, response_body
from tests.fakes.upstream import Reply

MODELS = {"gpt-*": "openai", "o*": "openai"}
HEADERS = {"Content-Type": "application/json", "x-tollgate-agent": "bot"}


def oa(h: Harness, run: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": "bot"})


async def bot(factory: GatewayFactory, **policy: Any) -> Harness:
    return await factory(models=MODELS, agents={"bot": policy})


async def post_raw(h: Harness, body: dict[str, Any], run: str, path: str = "/v1/responses") -> tuple[int, bytes]:
    async with h.session.post(f"{h.url}{path}", data=orjson.dumps(body),
                              headers={**HEADERS, "x-tollgate-run-id": run}) as resp:
        return resp.status, await resp.read()




def with_output(output: list[Any], usage: tuple[int, int] = (10, 5)) -> dict[str, Any]:
    return {**response_body("", usage=usage), "output": output}


def web_search_call(n: int) -> dict[str, Any]:
    return {"id": f"ws_{n}", "type": "web_search_call", "status": "completed",
            "action": {"type": "search", "query": f"q{n}"}}


def shell_call(n: int) -> dict[str, Any]:
    return {"id": f"sh_{n}", "type": "shell_call", "call_id": f"c{n}", "status": "completed",
            "action": {"commands": [f"echo {n}"], "timeout_ms": 1000, "max_output_length": 100}}


# == Responses API: tools OpenAI runs itself ===========================================================


HOSTED_SHELL = {"type": "shell", "environment": {"type": "container_auto", "memory_limit": "64g"}}


async def test_hosted_shell_container_is_forwarded_under_a_usd_budget(gateway_factory: GatewayFactory) -> None:
    """The `shell` tool (openai SDK `FunctionShellToolParam`) takes an `environment`; with
    `{"type": "container_auto"}` (`ContainerAutoParam`: "Automatically creates a container for this
    request", `memory_limit` up to 64g) OpenAI runs the commands itself, in a container it bills per
    session exactly like Code Interpreter's (the reason `UNPRICED_TOOLS` refuses `code_interpreter` under
    a USD budget). tollgate treats every `shell` as agent-run, so on a $0.002 budget it forwards a 64 GB
    container that costs many times the whole budget and appears in no `usage`. Expected: a hosted
    shell environment (`container_auto`, `container_reference`) is refused under a USD budget (400) like
    `code_interpreter`, or taken out of the request; never forwarded."""
    h = await bot(gateway_factory, budget={"usd": 0.002})
    h.fake.queue(Reply(body=response_body("done")))
    async with oa(h, "shell-usd") as client:
        try:
            await client.responses.create(model="gpt-4o-mini", input="build the repo",
                                          tools=[HOSTED_SHELL], max_output_tokens=64)  # type: ignore[list-item]
        except (openai.BadRequestError, openai.PermissionDeniedError):
            return
    sent = h.fake.seen[-1].json
    assert not any(t.get("type") == "shell" and (t.get("environment") or {}).get("type") != "local"
                   for t in sent.get("tools") or ()), f"a billed hosted container went upstream: {sent['tools']}"


async def test_hosted_shell_calls_are_not_held_to_the_tool_call_cap(gateway_factory: GatewayFactory) -> None:
    """A hosted shell (`environment: container_auto`) runs its commands upstream before any answer comes
    back, as web search or Code Interpreter do. README: calls the provider runs itself "count toward
    `caps.tool_calls` ... and a request may ask for no more of them than the cap leaves (the Responses
    API's `max_tool_calls`)". `limit_hosted_calls` skips `shell` (it is in `_AGENT_RUN_TOOLS`), so with
    one tool call left tollgate sends no `max_tool_calls` and OpenAI may run any number of commands in
    the container (each billed as input when its output is fed back) before tollgate stops the run after
    the fact. Expected: `max_tool_calls` <= the calls the cap leaves whenever a hosted shell is offered."""
    h = await bot(gateway_factory, caps={"tool_calls": 1})
    h.fake.queue(Reply(body=with_output([message_item("done")])))
    status, raw = await post_raw(h, {"model": "gpt-4o-mini", "input": "clean the disk",
                                     "tools": [HOSTED_SHELL]}, "shell-cap")
    assert status == 200, raw
    sent = h.fake.seen[-1].json
    assert isinstance(sent.get("max_tool_calls"), int) and sent["max_tool_calls"] <= 1, (
        f"a hosted shell went upstream with no max_tool_calls under caps.tool_calls=1: {sent}")


# -- tools offered in input items (`additional_tools`) -------------------------------------------------


def additional(*tools: dict[str, Any]) -> dict[str, Any]:
    return {"type": "additional_tools", "role": "developer", "tools": list(tools)}


async def test_web_search_offered_in_additional_tools_is_not_reserved(gateway_factory: GatewayFactory) -> None:
    """The SDK's `AdditionalTools` input item (`type: additional_tools`, "A list of additional tools made
    available at this item") offers tools as `tools` does; tollgate filters them for the allow-list
    (`responses_wire.filter_offers`) but its budget reads the top-level `tools` only
    (`OpenAIResponses.search_limits`, `limit_hosted_calls`, `offers_preview_search`). A `web_search`
    offered there is neither reserved (fee + 8,000 input tokens per search) nor limited by
    `max_tool_calls`: on a $0.02 budget the answer's 5 searches ($10/1,000 each, README) are settled
    at $0.05+, 2.5x the budget. Expected: searches offered in input items are reserved and limited
    exactly like top-level ones, so the run never spends more than its budget."""
    budget = 0.02
    h = await bot(gateway_factory, budget={"usd": budget})
    h.fake.queue(Reply(body=with_output([web_search_call(0), message_item("news")], usage=(2_000, 50))))
    body = {"model": "gpt-4o-mini", "max_output_tokens": 64,
            "input": [additional({"type": "web_search"}), {"role": "user", "content": "latest news?"}]}
    status, _raw = await post_raw(h, body, "search-extra")
    if status != 200:
        return
    sent = h.fake.seen[-1].json
    # OpenAI runs at most `max_tool_calls` searches: the limit must be sent, and be one the budget pays for
    assert isinstance(sent.get("max_tool_calls"), int) and sent["max_tool_calls"] <= 1, sent.get("max_tool_calls")
    view = await h.settled("search-extra")
    assert view["spent_usd"] <= budget, f"spent ${view['spent_usd']:.4f} of a ${budget} budget"


@pytest.mark.parametrize("tool", [{"type": "code_interpreter", "container": {"type": "auto"}},
                                  {"type": "image_generation"}], ids=["code_interpreter", "image_generation"])
async def test_unpriced_tool_offered_in_additional_tools_is_forwarded_under_a_usd_budget(
    gateway_factory: GatewayFactory, tool: dict[str, Any]
) -> None:
    """`unpriced_tools` (the USD-budget refusal of Code Interpreter containers and image generation,
    billed apart and absent from `usage`) reads the top-level `tools` only. The same tool offered in an
    `additional_tools` input item (openai SDK `ResponseInputItemParam.AdditionalTools`, whose `tools` are
    `ToolParam`s) goes upstream on a $0.002 budget. Expected: a 400 as for the top-level tool (or the
    tool taken out), never forwarded."""
    h = await bot(gateway_factory, budget={"usd": 0.002})
    h.fake.queue(Reply(body=response_body("ok")))
    body = {"model": "gpt-4o-mini", "max_output_tokens": 64,
            "input": [additional(tool), {"role": "user", "content": "plot y=x^2"}]}
    status, _raw = await post_raw(h, body, f"extra-{tool['type']}")
    if status in (400, 403):
        return
    sent = orjson.dumps(h.fake.seen[-1].json["input"]).decode()
    assert tool["type"] not in sent, f"{tool['type']} went upstream on a $0.002 budget: {sent}"


# == Responses API: inputs whose size lives upstream or in pixels ======================================


async def test_computer_screenshots_are_not_bounded_as_images(gateway_factory: GatewayFactory) -> None:
    """A `computer_call_output` carries its screenshot as `output: {"type": "computer_screenshot",
    "image_url" | "file_id"}` (openai SDK `ResponseComputerToolCallOutputScreenshotParam`): an image,
    billed by its pixels. `gateway.providers.common.IMAGE_PARTS` knows `image_url`, `input_image` and
    `image` only, so a screenshot by URL is bounded by its few bytes: three screenshots on gpt-4o-mini
    (up to 48,169 tokens each, `IMAGE_TOKENS_BY_MODEL`) are reserved ~1,000 tokens on a 20,000-token
    budget, and the run is settled far past it. Expected: each screenshot is bounded like an image part
    (here: the step cannot be paid, nothing goes upstream), so the budget holds."""
    budget = 20_000
    h = await bot(gateway_factory, budget={"tokens": budget})
    h.fake.queue(Reply(body=response_body("clicked", usage=(3 * 25_000, 20))))
    items: list[Any] = [{"role": "user", "content": "book the flight"}]
    for n in range(3):
        items.append({"type": "computer_call", "id": f"cu_{n}", "call_id": f"c{n}", "status": "completed",
                      "action": {"type": "screenshot"}, "pending_safety_checks": []})
        items.append({"type": "computer_call_output", "call_id": f"c{n}",
                      "output": {"type": "computer_screenshot", "image_url": f"https://example.com/s{n}.png"}})
    body = {"model": "gpt-4o-mini", "max_output_tokens": 32, "input": items,
            "tools": [{"type": "computer_use_preview", "display_width": 1920, "display_height": 1080,
                       "environment": "browser"}]}
    status, _raw = await post_raw(h, body, "screens")
    if status != 200:
        return
    view = await h.settled("screens")
    spent = view["input_tokens"] + view["output_tokens"]
    assert spent <= budget, f"{spent} tokens spent on a {budget}-token budget (screenshots were not bounded)"


async def test_reasoning_item_by_id_is_input_stored_upstream(gateway_factory: GatewayFactory) -> None:
    """A `reasoning` input item (openai SDK `ResponseReasoningItemParam`: `id` and `summary` required,
    `encrypted_content` optional, "especially important when `store` is `false`") sent without its
    `encrypted_content` is resolved by OpenAI from the stored response by its `id`: its reasoning tokens
    (tens of thousands for one item) are billed as input, though the item is 50 bytes in the body. It is
    the same unbounded input as an `item_reference`, which tollgate refuses; this one passes. Expected:
    under a budget, a reasoning item without `encrypted_content` (or `content`) is a 400 like
    `item_reference` ("send the item itself"), never forwarded."""
    h = await bot(gateway_factory, budget={"tokens": 5_000})
    h.fake.queue(Reply(body=response_body("ok", usage=(90_000, 10))))
    body = {"model": "o3", "max_output_tokens": 64,
            "input": [{"role": "user", "content": "continue"},
                      {"type": "reasoning", "id": "rs_68af0c1d", "summary": []},
                      {"role": "user", "content": "and?"}]}
    status, raw = await post_raw(h, body, "rs-by-id")
    assert status == 400 and h.fake.seen == [], (status, raw[:300])


@pytest.mark.parametrize("extra", [
    {"context_management": [{"type": "compaction", "compact_threshold": 100}]},
    {"input": [{"role": "user", "content": "hello " * 200}, {"type": "compaction_trigger"}]},
], ids=["context_management", "compaction_trigger"])
async def test_compaction_inside_a_response_is_reserved_like_a_compact_call(
    gateway_factory: GatewayFactory, extra: dict[str, Any]
) -> None:
    """`/v1/responses` can compact in-line: `context_management: [{type: compaction, compact_threshold}]`
    (SDK `ResponseCreateParams.context_management`) or a final `compaction_trigger` input item (SDK:
    "Compacts the current context"). tollgate itself holds that a compaction takes no output limit
    (`gateway.metered`: `/v1/responses/compact` reserves the model's whole output limit, granted whole or
    refused), yet the same compaction requested through `/v1/responses` is reserved only the request's
    `max_output_tokens` (16 here) and forwarded. Expected: either reserve the model's output limit as for
    `/v1/responses/compact`, or refuse (400) what cannot be bounded; here the 2,000-token budget cannot
    hold a compaction, so nothing must go upstream with a 16-token reservation."""
    h = await bot(gateway_factory, budget={"tokens": 2_000})
    h.fake.queue(Reply(body=response_body("ok")))
    body = {"model": "gpt-4o-mini", "max_output_tokens": 16, "input": "hello " * 200, **extra}
    status, raw = await post_raw(h, body, "compaction-inline")
    assert h.fake.seen == [], f"a compaction went upstream on a 16-token reservation: {status} {raw[:200]!r}"


# == Chat Completions ==================================================================================


async def test_chat_assistant_audio_by_id_is_input_stored_upstream(gateway_factory: GatewayFactory) -> None:
    """An assistant message may carry `audio: {"id": ...}` (openai SDK
    `ChatCompletionAssistantMessageParam.Audio`: "Data about a previous audio response from the model"):
    OpenAI puts that stored audio back into the context and bills it as input audio tokens, though the
    reference is a few bytes of the body. It is a document named instead of sent, which tollgate refuses
    under a budget for `file` parts by `file_id`; this one passes, so three references on a 5,000-token
    budget are settled at 30,000+ tokens. Expected: a 400 (`input_unbounded` / `invalid_request`) under a
    budget, nothing upstream."""
    budget = 5_000
    h = await bot(gateway_factory, budget={"tokens": budget})
    usage = {"prompt_tokens": 30_000, "completion_tokens": 10, "total_tokens": 30_010,
             "prompt_tokens_details": {"audio_tokens": 29_900, "cached_tokens": 0}}
    h.fake.queue(Reply(body={"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-audio",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "ok"}}],
                             "usage": usage}))
    messages: list[Any] = [{"role": "user", "content": "tell me a long story"}]
    for n in range(3):
        messages += [{"role": "assistant", "audio": {"id": f"audio_{n}"}}, {"role": "user", "content": "go on"}]
    status, raw = await post_raw(h, {"model": "gpt-audio", "messages": messages, "max_completion_tokens": 32},
                                 "audio-ref", path="/v1/chat/completions")
    if status != 200:
        assert status == 400 and h.fake.seen == [], (status, raw[:300])
        return
    view = await h.settled("audio-ref")
    spent = view["input_tokens"] + view["output_tokens"]
    assert spent <= budget, f"{spent} tokens spent on a {budget}-token budget (stored audio was not bounded)"
