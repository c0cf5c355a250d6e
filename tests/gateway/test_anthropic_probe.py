"""Hostile probes of the Anthropic Messages path (`POST /v1/messages`) and its sibling paths, driven by the
official `anthropic` SDK through a running gateway against the loopback fake upstream (README "How budgets
are held", "Structured outputs", "Tools and MCP", "Runs, identity, decisions"; DESIGN sections 3-6;
Anthropic's documented Messages API).

Every test here fails on the current code because of a defect; each docstring says what must hold.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import anthropic
import orjson

from tests.conftest import GatewayFactory, Harness
from tests.fakes.upstream import FakeProvider, Reply, anthropic_message

CLAUDE = "claude-3-5-haiku-latest"
MSG = [{"role": "user", "content": "go"}]
PRICING = {"claude-*": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}}  # $1e-6 a token


def an(h: Harness, run: str, agent: str | None = None, **headers: str) -> anthropic.AsyncAnthropic:
    extra = {"x-tollgate-run-id": run, **headers}
    if agent:
        extra["x-tollgate-agent"] = agent
    return anthropic.AsyncAnthropic(base_url=h.url, api_key="agent-key", max_retries=0, default_headers=extra)


def header(headers: Mapping[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


async def post_raw(h: Harness, raw: bytes, run: str, agent: str) -> tuple[int, bytes]:
    """A body the SDK would not write (JSON escapes), posted as an agent could."""
    async with h.session.post(f"{h.url}/v1/messages", data=raw,
                              headers={"content-type": "application/json", "x-tollgate-run-id": run,
                                       "x-tollgate-agent": agent, "anthropic-version": "2023-06-01"}) as resp:
        return resp.status, await resp.read()


# -- extended thinking ---------------------------------------------------------------------------------


async def test_thinking_budget_tokens_left_above_a_clamped_max_tokens(gateway_factory: GatewayFactory) -> None:
    """A `max_tokens` the budget cannot pay is lowered, "never an error" (DESIGN section 5). With extended
    thinking Anthropic requires `thinking.budget_tokens` < `max_tokens` (and >= 1024) and answers 400
    otherwise, so a clamp must keep the request valid: lower `budget_tokens` below the granted limit (or
    refuse clearly if even 1024 + 1 cannot be paid). Here the agent asks max_tokens 16000 with an 8000-token
    thinking budget and the USD budget pays ~5850 tokens: tollgate sends max_tokens 5851 with
    budget_tokens 8000, which the real API refuses with 400 `invalid_request_error`."""
    h = await gateway_factory(pricing=PRICING, agents={"a": {"budget": {"usd": 0.006}}})
    h.fake.queue(Reply(body=anthropic_message("ok")))
    async with an(h, "think-1", "a") as client:
        await client.messages.create(model=CLAUDE, max_tokens=16000, messages=MSG,
                                     thinking={"type": "enabled", "budget_tokens": 8000})
    sent = h.fake.seen[-1].json
    assert sent["max_tokens"] < 16000  # clamped by the budget (x-tollgate-max-tokens)
    assert sent["thinking"]["budget_tokens"] < sent["max_tokens"], sent


async def test_drop_leaving_only_a_thinking_block_reasks(gateway_factory: GatewayFactory) -> None:
    """`on_violation: drop` "removes the call from the answer, and if nothing else is left, re-asks the
    model once saying the tool is unavailable" (README "Tools and MCP"). With extended thinking every
    answer starts with a `thinking` block: after the disallowed `tool_use` is dropped the agent would get
    only the model's private reasoning, no text and no call (its loop has nothing to act on), with
    stop_reason rewritten to end_turn. A thinking (or redacted_thinking) block is not an answer: it must
    be re-asked as if nothing were left."""
    h = await gateway_factory(agents={"a": {"tools": {"allow": ["search_kb"], "on_violation": "drop"}}})
    first = anthropic_message("", tool_uses=[{"id": "tu_1", "name": "delete_db", "input": {}}])
    first["content"].insert(0, {"type": "thinking", "thinking": "I should delete it", "signature": "sig"})
    h.fake.queue(Reply(body=first), Reply(body=anthropic_message("done without tools")))
    async with an(h, "drop-1", "a") as client:
        msg = await client.messages.create(model=CLAUDE, max_tokens=2000, messages=MSG,
                                           thinking={"type": "enabled", "budget_tokens": 1024},
                                           tools=[{"name": "search_kb", "input_schema": {"type": "object"}},
                                                  {"name": "delete_db", "input_schema": {"type": "object"}}])
    assert len(h.fake.seen) == 2, [b.type for b in msg.content]
    assert [b.text for b in msg.content if b.type == "text"] == ["done without tools"]


# -- input the reservation does not bound ----------------------------------------------------------------


async def test_web_fetch_content_is_not_reserved(gateway_factory: GatewayFactory) -> None:
    """A run's budget "is reserved before each call and can never be overspent"; searches the provider
    runs are reserved per allowed use, and their limit lowered to what the budget pays (README "How budgets
    are held"). Anthropic's web fetch tool pulls whole pages/PDFs into the context, billed as input tokens
    (`max_content_tokens` each, up to `max_uses` fetches) — yet tollgate reserves nothing for it and sends
    its limits unchanged. Here a 30,000-token budget lets through a request that may bill 5 x 20,000 fetched
    tokens; the fake bills exactly that (100,000 input tokens) and the run ends 3x over its budget. The
    fetched content must be held like search results (lower `max_uses`/set `max_content_tokens` to what the
    budget pays, or refuse)."""
    h = await gateway_factory(pricing=PRICING, agents={"a": {"budget": {"tokens": 30000}}})
    h.fake.queue(Reply(body=anthropic_message("done", input_tokens=100_000, output_tokens=50)))
    tool = {"type": "web_fetch_20250910", "name": "web_fetch", "max_uses": 5, "max_content_tokens": 20000}
    async with an(h, "fetch-1", "a", **{"anthropic-beta": "web-fetch-2025-09-10"}) as client:
        try:
            await client.messages.create(model=CLAUDE, max_tokens=100, messages=MSG, tools=[tool])
        except anthropic.APIStatusError as exc:
            assert exc.status_code in (400, 403)
            assert not h.fake.seen
            return
    seen = h.fake.seen[-1]
    fetch = next((t for t in seen.json.get("tools", ()) if t.get("type", "").startswith("web_fetch_")), None)
    if fetch is None:
        return  # not offered: the budget pays for no fetch
    unbounded = 10**9
    worst = fetch.get("max_uses", unbounded) * fetch.get("max_content_tokens", unbounded)
    assert len(seen.body) + seen.json["max_tokens"] + worst <= 30000, fetch


def tiny_pdf(pages: int) -> bytes:
    """A valid PDF of `pages` blank US-letter pages, ~100 bytes a page."""
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>"]
    kids = " ".join(f"{3 + i} 0 R" for i in range(pages)).encode()
    objs.append(b"<< /Type /Pages /Kids [" + kids + b"] /Count " + str(pages).encode() + b" >>")
    objs += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"] * pages
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, obj in enumerate(objs, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + obj + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{off:010d} 00000 n \n".encode() for off in offsets)
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


async def test_base64_pdf_pages_escape_the_input_bound(gateway_factory: GatewayFactory) -> None:
    """The input bound is the body's bytes plus 8,192 per image, "whose tokens follow its pixels, not its
    bytes" (README "How budgets are held"). A base64 PDF `document` is the same case: Anthropic renders every
    page as an image and extracts its text ("1,500-3,000 tokens per page" plus the page image, per its PDF
    support docs), so a 100-page PDF of 13 KB bills ~100k+ input tokens while tollgate bounds it at ~13k.
    Here a 50,000-token budget lets it through and the run is charged 100,000 tokens (1,000 a page, below
    Anthropic's own estimate). A PDF must be bounded per page (or refused under a budget like a document
    named by URL)."""
    h = await gateway_factory(pricing=PRICING, agents={"a": {"budget": {"tokens": 50000}}})
    data = base64.b64encode(tiny_pdf(100)).decode()
    h.fake.queue(Reply(body=anthropic_message("summary", input_tokens=100_000, output_tokens=50)))
    content = [{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}},
               {"type": "text", "text": "summarise"}]
    async with an(h, "pdf-1", "a") as client:
        try:
            await client.messages.create(model=CLAUDE, max_tokens=100, messages=[{"role": "user", "content": content}])
        except anthropic.APIStatusError as exc:
            assert exc.status_code in (400, 403)
            return
    run = await h.run("pdf-1")
    assert run["input_tokens"] + run["output_tokens"] <= 50000, run


async def test_unicode_escaped_image_type_escapes_the_image_bound(gateway_factory: GatewayFactory) -> None:
    """Each image part is bounded at 8,192 tokens (README "How budgets are held"). `count_images` skips
    its walk when the raw bytes lack `image`, but JSON may spell the same string `"\\u0069mage"`, which
    Anthropic parses as `image`: three URL images then reserve nothing. With a 20,000-token budget, three
    images (24,576 tokens bound) cannot be paid and the run must stop (403 `token_budget_exhausted`) before
    anything goes upstream; tollgate sends them."""
    h = await gateway_factory(pricing=PRICING, agents={"a": {"budget": {"tokens": 20000}}})
    h.fake.queue(Reply(body=anthropic_message("ok")))
    img = {"type": "IMG", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"model": CLAUDE, "max_tokens": 10, "messages": [{"role": "user", "content": [img] * 3}]}
    raw = orjson.dumps(body).replace(b'"IMG"', b'"\\u0069mage"')
    status, answer = await post_raw(h, raw, "esc-img", "a")
    assert orjson.loads(raw)["messages"][0]["content"][0]["type"] == "image"
    assert status == 403, answer
    assert not h.fake.seen


async def test_unicode_escaped_document_url_escapes_the_unbounded_refusal(gateway_factory: GatewayFactory) -> None:
    """"For an agent with a budget, ... an Anthropic `document` from a URL or a file, is a 400: its size
    cannot be bounded" (README "How budgets are held"). `count_referenced_documents` skips its walk when
    the raw bytes lack `document`/`file`; spelled `"\\u0064ocument"` (the same JSON string) the URL
    document goes upstream unbounded with a 200."""
    h = await gateway_factory(pricing=PRICING, agents={"a": {"budget": {"tokens": 100000}}})
    h.fake.queue(Reply(body=anthropic_message("ok")))
    doc = {"type": "DOC", "source": {"type": "url", "url": "https://example.com/big.pdf"}}
    body = {"model": CLAUDE, "max_tokens": 10, "messages": [{"role": "user", "content": [doc]}]}
    raw = orjson.dumps(body).replace(b'"DOC"', b'"\\u0064ocument"')
    status, answer = await post_raw(h, raw, "esc-doc", "a")
    assert status == 400, answer
    assert not h.fake.seen


# -- stop reasons and grammars ---------------------------------------------------------------------------


async def test_pause_turn_answer_is_reasked_against_the_grammar(gateway_factory: GatewayFactory) -> None:
    """`stop_reason: pause_turn` means a long server-tool turn was paused, not finished: Anthropic's docs
    say to send the response back as-is so Claude continues its turn. Its text is a fragment ("Let me
    search"), so judging it against the output grammar is wrong: tollgate re-asks from the original
    request (discarding the server tool call and the search the provider already billed) and the agent
    never sees `pause_turn`, or gets 422 once retries are spent. A paused answer must reach the agent
    unjudged (the grammar applies to the turn's final answer)."""
    h = await gateway_factory(agents={"a": {"output": {"grammar": 'json_schema:{"type": "object"}', "retries": 1}}})
    paused = anthropic_message("Let me search")
    paused["content"].append({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                              "input": {"query": "x"}})
    paused["stop_reason"] = "pause_turn"
    h.fake.queue(Reply(body=paused), Reply(body=anthropic_message('{"a": 1}')))
    async with an(h, "pause-1", "a") as client:
        msg = await client.messages.create(model=CLAUDE, max_tokens=200, messages=MSG,
                                           tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert len(h.fake.seen) == 1
    assert msg.stop_reason == "pause_turn"


# -- batches ---------------------------------------------------------------------------------------------


def _batch(results_url: str | None, status: str = "ended") -> dict[str, Any]:
    return {"id": "msgbatch_1", "type": "message_batch", "processing_status": status,
            "request_counts": {"processing": 0, "succeeded": 1, "errored": 0, "canceled": 0, "expired": 0},
            "ended_at": None, "created_at": "2024-08-20T18:37:24Z", "expires_at": "2024-08-21T18:37:24Z",
            "archived_at": None, "cancel_initiated_at": None, "results_url": results_url}


async def test_batch_results_url_sends_the_agent_around_the_gateway(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]
) -> None:
    """Agents change only their base URL and the provider key stays in tollgate (DESIGN sections 1, 3).
    `client.messages.batches.results(id)` retrieves the batch, then GETs its absolute `results_url`,
    which the provider points at itself (https://api.anthropic.com/...). tollgate relays it unchanged, so
    the SDK calls the provider directly with the agent's tollgate key (`Authorization: Bearer agent-key`:
    the agent's credential leaks to the provider, which answers 401; no span, no run id honoured):
    batch results are unreachable through the gateway. The URL must be rewritten to the gateway's own
    origin (and that path forwarded with the provider key)."""
    h = await gateway_factory()
    _, fake_url = fake
    line = orjson.dumps({"custom_id": "r1", "result": {"type": "succeeded", "message": anthropic_message("hi")}})
    h.fake.queue(Reply(body=_batch(f"{fake_url}/v1/messages/batches/msgbatch_1/results")),
                 Reply(body=line + b"\n", headers={"Content-Type": "application/x-jsonl"}))
    async with an(h, "batch-1") as client:
        results = [r async for r in await client.messages.batches.results("msgbatch_1")]
    assert [r.custom_id for r in results] == ["r1"]
    assert "agent-key" not in str(h.fake.seen[-1].headers)  # the SDK sent `Authorization: Bearer agent-key`
    keys = [header(s.headers, "x-api-key") for s in h.fake.seen]
    assert keys == ["sk-ant-provider", "sk-ant-provider"], keys  # the second came straight from the SDK


async def test_batch_create_spends_around_the_budget(gateway_factory: GatewayFactory) -> None:
    """"What tollgate cannot bound is a 400, not an unguarded call" — the README's rule for the Responses
    API's `background: true` ("billed after the answer returned"). `POST /v1/messages/batches` is that case
    for Anthropic: every request in it is a billed model call (budget, caps, allow-list and grammars all
    skipped) and it is billed after the answer. An agent with a $0.001 budget submits 1,000 calls of up to
    4,096 output tokens each and tollgate forwards them; the run is not even created. Under a budget a
    batch must be refused (or reserved and metered like model calls)."""
    h = await gateway_factory(pricing=PRICING, agents={"a": {"budget": {"usd": 0.001}}})
    h.fake.queue(Reply(body=_batch(None, "in_progress")))
    reqs = [{"custom_id": f"r{i}", "params": {"model": CLAUDE, "max_tokens": 4096, "messages": MSG}}
            for i in range(1000)]
    async with an(h, "batch-2", "a") as client:
        try:
            await client.messages.batches.create(requests=reqs)  # type: ignore[arg-type]
        except anthropic.APIStatusError as exc:
            assert exc.status_code in (400, 403)
            assert not h.fake.seen
            return
    raise AssertionError(f"a batch of 1,000 calls went upstream unbudgeted ({len(h.fake.seen)} request)")
