"""Hostile probes: billed work an agent with a budget (or caps, a tool allow-list, a grammar) gets the
provider to do that tollgate does not reserve for, reserves too little for, or lets through unguarded.

The contract (README "Runs, identity, decisions" and "How budgets are held"): the worst case of every
billed call is reserved before it goes upstream and the run's budget is never overspent; what tollgate
cannot bound is a 400, never an unguarded call; calls the provider bills outside a run's steps are refused
for an agent whose guards they would go around (`gateway/unguarded.py`). The oracle for prices is
genai-prices itself (the package tollgate prices from), and for the wire surfaces the official `openai`
and `anthropic` SDKs installed with tollgate (their resources, parameters and documented usage fields).

Every test here failed on the code it was written against (each a defect, since fixed); each docstring
says what must hold.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from genai_prices import Usage as GPUsage
from genai_prices import calc_price

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import Reply, anthropic_message, openai_completion

MSG = [{"role": "user", "content": "hello"}]
OPENAI_MODELS = {"gpt-*": "openai", "o*": "openai"}
GUARDED = {"budget": {"usd": 0.05}, "caps": {"llm_calls": 5, "tool_calls": 5}, "tools": {"allow": ["lookup"]}}


def genai(model: str, provider: str, ctx: dict[str, str] | None = None, **usage: int) -> float:
    return float(calc_price(GPUsage(**usage), model_ref=model, provider_id=provider, price_context=ctx).total_price)


def oa(h: Harness, run: str, agent: str = "bot") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="k", max_retries=0,
                              default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": agent})


def an(h: Harness, run: str, agent: str = "bot") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0,
                                    default_headers={"x-tollgate-run-id": run, "x-tollgate-agent": agent})




# -- billed /v1 paths the registry of `gateway/unguarded.py` misses -------------------------------------------

# Each is a POST the installed SDKs make (openai 3.57: `client.decisions.create`,
# `client.beta.agents.sessions.create/events`, `client.live.sessions.create/accept/fork`,
# `client.realtime.calls.accept`, `client.realtime.translations.client_secrets.create`,
# `client.beta.chatkit.sessions.create`, `client.videos.edit/extend`, `client.fine_tuning.jobs.resume`;
# anthropic 2.15: `client.beta.sessions.events.send`, `client.beta.deployments.run`,
# `client.beta.dreams.create`), each making the provider run (and bill) model calls or media generation
# that no step of the run holds.
MISSED: list[tuple[str, str, dict[str, Any], dict[str, str]]] = [
    ("openai-decisions", "/v1/decisions",
     {"model": "gpt-6-luna", "input": "x" * 100, "questions": [{"type": "score", "question": "q"}] * 400}, {}),
    ("openai-agent-session", "/v1/agents/sessions",
     {"agent": {"model": "gpt-5", "instructions": "work for hours"}, "environment": {"type": "cloud"},
      "input": "refactor the monorepo"}, {}),
    ("openai-agent-session-events", "/v1/agents/sessions/sess_1/events",
     {"events": [{"type": "user_message", "content": "go on"}]}, {}),
    ("openai-agent-automation-invoke", "/v1/agents/automations/auto_1/invocations", {}, {}),
    ("openai-live-session", "/v1/live/sessions",
     {"session": {"model": "gpt-live"}, "transport": {"type": "webrtc", "sdp": "v=0"}}, {}),
    ("openai-live-accept", "/v1/live/sessions/ls_1/accept", {"type": "live", "model": "gpt-live"}, {}),
    ("openai-live-fork", "/v1/live/sessions/ls_1/fork", {"transport": {"type": "webrtc", "sdp": "v=0"}}, {}),
    ("openai-realtime-call-accept", "/v1/realtime/calls/rtc_1/accept",
     {"type": "realtime", "model": "gpt-realtime", "instructions": "talk for an hour"}, {}),
    ("openai-realtime-translation-secret", "/v1/realtime/translations/client_secrets",
     {"session": {"model": "gpt-realtime-translate"}}, {}),
    ("openai-chatkit-session", "/v1/chatkit/sessions", {"user": "u", "workflow": {"id": "wf_1"}},
     {"OpenAI-Beta": "chatkit_beta=v1"}),
    ("openai-video-edit", "/v1/videos/edits", {"prompt": "p", "video": {"id": "video_1"}}, {}),
    ("openai-video-extend", "/v1/videos/extensions", {"prompt": "p", "seconds": "20", "video": {"id": "video_1"}}, {}),
    ("openai-fine-tune-resume", "/v1/fine_tuning/jobs/ftjob_1/resume", {}, {}),
    ("anthropic-session-events", "/v1/sessions/sesn_1/events",
     {"events": [{"type": "user.message", "content": [{"type": "text", "text": "go"}]}]},
     {"anthropic-version": "2023-06-01", "anthropic-beta": "managed-agents-2026-04-01"}),
    ("anthropic-session-create", "/v1/sessions", {"agent": "agent_1", "environment_id": "env_1"},
     {"anthropic-version": "2023-06-01", "anthropic-beta": "managed-agents-2026-04-01"}),
    ("anthropic-deployment-run", "/v1/deployments/dep_1/run", {},
     {"anthropic-version": "2023-06-01", "anthropic-beta": "managed-agents-2026-04-01"}),
    ("anthropic-dream", "/v1/dreams",
     {"model": "claude-opus-4-8", "inputs": [{"type": "memory_store", "memory_store_id": "m"},
                                             {"type": "sessions", "session_ids": ["s"]}]},
     {"anthropic-version": "2023-06-01", "anthropic-beta": "dreaming-2026-04-21"}),
]


@pytest.mark.parametrize(("path", "body", "extra"), [m[1:] for m in MISSED], ids=[m[0] for m in MISSED])
async def test_billed_path_missing_from_the_unguarded_registry(gateway_factory: GatewayFactory, path: str,
                                                               body: dict[str, Any], extra: dict[str, str]) -> None:
    """README: "Calls the provider bills outside a run's steps are refused (a 400 naming the guards they
    would go around) for an agent with those guards" — batches, Assistants runs, eval and grader runs,
    Realtime sessions and client secrets, `/v1/complete`, images, audio, videos, fine-tuning, containers.
    `gateway/unguarded.py`'s `BYPASSES` lists exact paths, and misses the same kinds of calls on paths the
    installed SDKs make every day:

    - OpenAI `POST /v1/decisions` (`client.decisions.create`): a model call (up to 400 questions each
      answered by the model) billed per token, forwarded with no reservation and no step at all;
    - OpenAI managed agents (`/v1/agents/sessions`, `.../events`, automation invocations) and Anthropic
      Managed Agents (`/v1/sessions`, `/v1/sessions/{id}/events`, `/v1/deployments/{id}/run`) and
      Dreams (`/v1/dreams`): the provider runs a whole agent loop of model and tool calls and bills it,
      around the budget, the caps, the allow-list and every other guard;
    - OpenAI Live sessions and their accept/fork, a Realtime SIP call's `accept`
      (`/v1/realtime/calls/{id}/accept`; only the bare `/v1/realtime/calls` is listed), the Realtime
      translation client secret and a ChatKit session (an ephemeral key the client calls the model with):
      the same hole as the Realtime client secret tollgate already refuses;
    - video edits and extensions (`/v1/videos/edits`, `/v1/videos/extensions`: billed per second like the
      listed `/v1/videos` and `.../remix`) and a fine-tuning job's `resume` (its training is billed).

    A $0.05-budget agent with caps and an allow-list gets each of them forwarded. Each must be a 400
    before anything goes upstream (add them to `BYPASSES`; better, refuse for a guarded agent any POST
    path not known to be free, so the next new endpoint fails closed instead of open)."""
    h = await gateway_factory(models={**OPENAI_MODELS, "claude-*": "anthropic"},
                              pricing={"gpt-6-luna": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}},
                              agents={"bot": GUARDED})
    h.fake.queue(Reply(body={"id": "obj_1", "object": "thing", "status": "in_progress"}))
    headers = {"content-type": "application/json", "x-tollgate-run-id": "reg", "x-tollgate-agent": "bot",
               "authorization": "Bearer k", **extra}
    async with h.session.post(f"{h.url}{path}", json=body, headers=headers) as resp:
        status = resp.status
    assert status == 400 and not h.fake.seen, (
        f"POST {path} by a guarded agent answered {status} and reached the provider "
        f"({[(s.method, s.path) for s in h.fake.seen]})")


# -- OpenAI: service_tier "fast" --------------------------------------------------------------------------------


async def test_fast_service_tier_is_reserved_at_the_standard_rate(gateway_factory: GatewayFactory) -> None:
    """OpenAI's Fast mode is asked for with `service_tier: "fast"` (openai SDK 3.57: "include the
    `service_tier=fast` or `service_tier=priority` parameter ... The response will show
    `service_tier=priority`"), billed at the priority rates (genai-prices lists a `fast` tier: gpt-4.1 $3.50
    / $14 per MTok against $2 / $8). `gateway.pricing._REQUESTED_TIERS` knows only `priority` and `flex`,
    so a `fast` request is reserved at the standard rate and its `max_completion_tokens` is clamped as if
    output cost $8/MTok: on a $0.01 budget the agent's 1,000-token limit goes upstream untouched ($0.014 of
    priority output alone, 40% over the whole budget) and the run is settled at $0.0145 for one call.
    `reserved_tier` must treat `fast` as `priority` (or price it from genai-prices' `fast` tier)."""
    h = await gateway_factory(models=OPENAI_MODELS, agents={"bot": {"budget": {"usd": 0.01}}})
    body = {**openai_completion("hi", model="gpt-4.1", prompt_tokens=10, completion_tokens=1000),
            "service_tier": "priority"}
    h.fake.queue(Reply(body=body))
    async with oa(h, "fast-tier") as client:
        await client.chat.completions.create(model="gpt-4.1", messages=MSG,  # type: ignore[arg-type]
                                             max_completion_tokens=1000, service_tier="fast")
    sent = h.fake.seen[-1].json
    limit = max(v for k, v in sent.items() if k in ("max_tokens", "max_completion_tokens") and v is not None)
    worst = genai("gpt-4.1", "openai", {"service_tier": "fast"}, input_tokens=0, output_tokens=limit)
    assert worst <= 0.01, f"a fast-tier call may bill {limit} output tokens = ${worst:.4f} on a $0.01 budget"


# -- Anthropic Messages: parameters that change what is billed ----------------------------------------------


async def test_anthropic_fast_speed_is_reserved_and_settled_at_the_standard_rate(
    gateway_factory: GatewayFactory,
) -> None:
    """Anthropic's `speed: "fast"` (anthropic SDK 2.15 `messages.create(speed=...)`; the answer's
    `usage.speed` says "fast") bills fast-mode rates: genai-prices prices claude-opus-4-8 at $10/$50 per
    MTok in fast mode against $5/$25 (`price_context={"speed": "fast"}`). tollgate ignores `speed`: it
    reserves and settles at the standard rates, so the `max_tokens` it lets through on a $0.10 budget may
    bill twice what it reserved, and each fast call is charged half its price (1,000 + 1,000 tokens:
    charged $0.03, billed $0.06). The reservation and the settlement must use the fast rates when the
    request (or the answer's `usage.speed`) says fast."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 0.10}}})
    body = anthropic_message("hi", model="claude-opus-4-8", input_tokens=1000, output_tokens=1000)
    body["usage"]["speed"] = "fast"
    h.fake.queue(Reply(body=body))
    async with an(h, "fast-speed") as client:
        await client.beta.messages.create(model="claude-opus-4-8", max_tokens=3000, messages=MSG,  # type: ignore[arg-type]
                                          speed="fast")
    sent = h.fake.seen[-1].json
    worst = genai("claude-opus-4-8", "anthropic", {"speed": "fast"}, input_tokens=0, output_tokens=sent["max_tokens"])
    view = await h.settled("fast-speed")
    billed = genai("claude-opus-4-8", "anthropic", {"speed": "fast"}, input_tokens=1000, output_tokens=1000)
    assert worst <= 0.10 and view["spent_usd"] == pytest.approx(billed, rel=1e-6), (
        f"sent max_tokens {sent['max_tokens']} (worst ${worst:.4f} at the fast rate on a $0.10 budget); "
        f"charged ${view['spent_usd']:.4f} for a call billed ${billed:.4f}")


async def test_anthropic_fallbacks_run_an_unreserved_model_and_limit(gateway_factory: GatewayFactory) -> None:
    """Anthropic's `fallbacks` (anthropic SDK 2.15, "server-side retry on one or more substitute models
    when the requested model declines"): each entry names its own `model` and may override `max_tokens`
    for that attempt. tollgate prices and clamps only the top-level `model` / `max_tokens`: an agent with
    a $0.05 budget asks claude-3-5-haiku (clamped to what $0.05 pays at Haiku's rates) with
    `fallbacks: [{"model": "claude-opus-4-8", "max_tokens": 64000}]`, and the body goes upstream with the
    fallback's 64,000-token Opus limit untouched: one declined turn can bill $1.60 of Opus output, 32 times
    the whole budget (and the settlement prices the served Opus tokens at Haiku's rates). Under a budget a
    request with `fallbacks` must be refused, or every entry's limit clamped and reserved at the dearest
    model's price."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 0.05}}})
    h.fake.queue(Reply(body=anthropic_message("hi")))
    async with an(h, "fallbacks") as client:
        try:
            await client.beta.messages.create(
                model="claude-3-5-haiku-latest", max_tokens=1000, messages=MSG,  # type: ignore[arg-type]
                fallbacks=[{"model": "claude-opus-4-8", "max_tokens": 64000}])  # type: ignore[typeddict-item]
        except anthropic.BadRequestError:
            assert not h.fake.seen
            return
    sent = h.fake.seen[-1].json
    limits = [f.get("max_tokens") or sent["max_tokens"] for f in sent.get("fallbacks") or ()]
    worst = max(genai("claude-opus-4-8", "anthropic", input_tokens=0, output_tokens=n) for n in limits)
    assert worst <= 0.05, f"fallback limits {limits} sent upstream: up to ${worst:.2f} of Opus output on a $0.05 budget"


async def test_anthropic_thread_continue_is_unbounded_input(gateway_factory: GatewayFactory) -> None:
    """README: "What tollgate cannot bound is a 400, not an unguarded call: `previous_response_id`,
    `conversation`, a stored `prompt` ... (their content lives upstream, unseen, so a reservation could be
    exceeded)". Anthropic's Messages API has the same thing (anthropic SDK 2.15 `thread`: "Server-held
    conversation state ... `{"type": "continue", "previous_message_id": ...}` resumes from a previous
    response so only the new turn's messages are sent"): the whole held conversation is billed as input
    while the body tollgate bounds holds only the new turn. A budgeted agent sends a 5-byte turn that
    continues a 900,000-token thread and tollgate forwards it with a few hundred tokens reserved. It must
    be a 400 under a budget, like `previous_response_id`."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 0.05}}})
    h.fake.queue(Reply(body=anthropic_message("hi")))
    async with an(h, "thread") as client:
        try:
            await client.beta.messages.create(
                model="claude-3-5-haiku-latest", max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                thread={"type": "continue", "previous_message_id": "msg_01"})  # type: ignore[typeddict-item]
        except anthropic.BadRequestError:
            assert not h.fake.seen
            return
    raise AssertionError(f"a thread continuation went upstream with its held input unreserved: {h.fake.seen[-1].json}")


@pytest.mark.parametrize("kind", ["compaction", "advisor_message"])
async def test_anthropic_usage_iterations_are_not_charged(gateway_factory: GatewayFactory, kind: str) -> None:
    """Anthropic reports some billed sub-inferences of a request only in `usage.iterations` (anthropic
    SDK 2.15 `BetaUsage.iterations`): "A `compaction` entry's tokens are not included in the top-level
    `usage` fields", and an `advisor_message` entry is the advisor tool's sub-inference on its own `model`
    (an Opus model reading the whole transcript), billed at that model's rates. `usage_from` in
    `gateway/providers/anthropic_messages.py` reads the top-level fields only, so the run is charged for
    10 + 5 tokens while the provider bills 150,000 + 4,000 more: the run's spend stops counting what is
    spent (here $0.85 billed, $0.0001 charged on a $10 budget) and the budget is overspent without limit.
    Settle every iteration the top-level counts leave out, each at its own model's price."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 10.0}}})
    body = anthropic_message("hi", model="claude-opus-4-8", input_tokens=10, output_tokens=5)
    extra = {"type": kind, "input_tokens": 150_000, "output_tokens": 4_000, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0}
    if kind == "advisor_message":
        extra["model"] = "claude-opus-4-8"
    body["usage"]["iterations"] = [extra, {"type": "message", "input_tokens": 10, "output_tokens": 5,
                                           "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}]
    h.fake.queue(Reply(body=body))
    async with an(h, f"iter-{kind}") as client:
        await client.messages.create(model="claude-opus-4-8", max_tokens=100, messages=MSG)  # type: ignore[arg-type]
    view = await h.settled(f"iter-{kind}")
    billed = genai("claude-opus-4-8", "anthropic", input_tokens=150_010, output_tokens=4_005)
    assert view["spent_usd"] >= billed * 0.99, f"charged ${view['spent_usd']:.5f}, billed ${billed:.4f}"


async def test_anthropic_advisor_tool_sub_inferences_are_not_reserved(gateway_factory: GatewayFactory) -> None:
    """The advisor tool (`advisor_20260301`, anthropic SDK 2.15) makes Anthropic run a separate
    sub-inference on the tool's own `model` (Opus) over the whole transcript, up to `max_uses` times per
    request, each writing up to its `max_tokens` (or the advisor model's default cap) — billed model calls
    inside one step. tollgate holds `max_uses` to the tool-call cap but reserves nothing for them
    (`search_limits` holds web search and fetch only): a $0.02-budget agent on Haiku offers an advisor with
    `max_uses: 10` and `max_tokens: 32000` and it goes upstream as sent, 10 x 32,000 Opus output tokens =
    $8 of possible spend on a $0.02 budget. Under a budget each advisor use must be reserved at the advisor
    model's price (its input bound plus its `max_tokens`, which tollgate must then set), or the tool
    refused."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 0.02}}})
    h.fake.queue(Reply(body=anthropic_message("hi")))
    tool = {"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-4-8", "max_uses": 10,
            "max_tokens": 32000}
    async with an(h, "advisor") as client:
        try:
            await client.beta.messages.create(model="claude-3-5-haiku-latest", max_tokens=100,  # type: ignore[arg-type]
                                              messages=MSG, tools=[tool])  # type: ignore[list-item]
        except (anthropic.BadRequestError, anthropic.PermissionDeniedError):
            assert not h.fake.seen
            return
    sent = h.fake.seen[-1].json
    advisor = next(t for t in sent.get("tools") or () if t.get("type", "").startswith("advisor_"))
    uses, limit = advisor.get("max_uses") or 10, advisor.get("max_tokens") or 32000
    worst = uses * genai("claude-opus-4-8", "anthropic", input_tokens=0, output_tokens=limit)
    assert worst <= 0.02, f"advisor sent as {advisor}: up to ${worst:.2f} of Opus output on a $0.02 budget"


# -- images: tokens above the per-image bound ---------------------------------------------------------------


async def test_gpt_4o_mini_image_tokens_exceed_the_image_bound(gateway_factory: GatewayFactory) -> None:
    """`guards.bounds.IMAGE_TOKENS` holds 8,192 input tokens per image ("OpenAI bills a high-detail image
    ~1.5-2.5k"). gpt-4o-mini — the README's quick-start model — bills images at 2,833 base tokens plus
    5,667 per 512-px tile (so that they cost what they cost on gpt-4o): a tiny 128x64 image is already 8,500
    tokens, a 768x2048 high-detail one 2,833 + 8 x 5,667 = 48,169. An image passed by URL is ~80 bytes of
    body. An agent with a $0.05 budget sends 20 such URLs in one call: tollgate reserves 20 x 8,192 tokens
    (~$0.025) and lets it through; the provider bills 963,380 input tokens = $0.145, three times the whole
    budget, from one step tollgate judged affordable.
    The per-image bound must be per model (at least 2,833 + 8 x 5,667 for gpt-4o-mini), or images refused
    where the bound is unknown."""
    h = await gateway_factory(models=OPENAI_MODELS, agents={"bot": {"budget": {"usd": 0.05}}})
    images = 20
    billed_in = images * (2833 + 8 * 5667) + 20
    h.fake.queue(Reply(body=openai_completion("a cat", model="gpt-4o-mini", prompt_tokens=billed_in,
                                              completion_tokens=16)))
    content: list[dict[str, Any]] = [{"type": "text", "text": "describe"}]
    content += [{"type": "image_url", "image_url": {"url": f"https://example.com/tall{i}.png", "detail": "high"}}
                for i in range(images)]
    async with oa(h, "mini-images") as client:
        try:
            await client.chat.completions.create(model="gpt-4o-mini", max_tokens=16,  # type: ignore[arg-type]
                                                 messages=[{"role": "user", "content": content}])
        except openai.PermissionDeniedError:
            assert not h.fake.seen
            return
    view = await h.settled("mini-images")
    assert view["spent_usd"] <= 0.05, f"spent ${view['spent_usd']:.4f} of a $0.05 budget in one reserved call"


# -- Anthropic: input billed that the body does not carry ---------------------------------------------------


async def test_anthropic_code_execution_is_not_refused_under_a_usd_budget(gateway_factory: GatewayFactory) -> None:
    """README: "The Responses API's `code_interpreter` and `image_generation` tools, billed apart (a
    container, an image) and absent from `usage`, are a 400 under a USD budget unless the allow-list
    removes them." Anthropic's code execution tool (`code_execution_20250825`, anthropic SDK 2.15) is the
    same thing: billed per container-hour apart from the tokens (nothing in `usage` says how long), and
    every output it prints is billed as input to the next sampling of the same request, which no
    `max_uses` or reservation bounds. tollgate only counts it toward the tool-call cap and forwards it for a
    $0.05-budget agent without an allow-list. It must be refused under a USD budget like `code_interpreter`."""
    h = await gateway_factory(agents={"bot": {"budget": {"usd": 0.05}}})
    h.fake.queue(Reply(body=anthropic_message("done")))
    async with an(h, "code-exec") as client:
        try:
            await client.beta.messages.create(
                model="claude-3-5-haiku-latest", max_tokens=100, messages=MSG,  # type: ignore[arg-type]
                tools=[{"type": "code_execution_20250825", "name": "code_execution"}])
        except anthropic.BadRequestError:
            assert not h.fake.seen
            return
    raise AssertionError(f"code execution went upstream under a USD budget: {h.fake.seen[-1].json.get('tools')}")


async def test_anthropic_tool_overhead_escapes_the_body_size_bound(gateway_factory: GatewayFactory) -> None:
    """README: the input bound is "the UTF-8 size of the request body (byte-level BPE tokenizers never emit
    more tokens than bytes)". Anthropic bills input the body does not carry: with tools, a tool-use system
    prompt (346 tokens on current models) and, per Anthropic-defined client tool, a fixed cost (bash 245
    tokens, text editor 700, computer use 735 plus ~500 of system prompt). A ~350-byte body offering the
    three bills ~2,500 input tokens. An agent with a 1,000-token budget is let through with ~400 reserved and
    the run ends at 2,530 tokens, two and a half times its budget, in one call. The bound must add each
    tool's documented overhead (or a per-provider constant per tool)."""
    h = await gateway_factory(agents={"bot": {"budget": {"tokens": 1000}}})
    h.fake.queue(Reply(body=anthropic_message("ok", model="claude-sonnet-4-5", input_tokens=2514, output_tokens=16)))
    tools = [{"type": "bash_20250124", "name": "bash"},
             {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
             {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768}]
    async with an(h, "tool-overhead") as client:
        try:
            await client.beta.messages.create(model="claude-sonnet-4-5", max_tokens=16, messages=MSG,  # type: ignore[arg-type]
                                              tools=tools)  # type: ignore[arg-type]
        except anthropic.PermissionDeniedError:
            assert not h.fake.seen
            return
    view = await h.settled("tool-overhead")
    used = view["input_tokens"] + view["output_tokens"]
    assert used <= 1000, f"body of {len(h.fake.seen[-1].body)} bytes; the run used {used} tokens of a 1,000-token budget"
