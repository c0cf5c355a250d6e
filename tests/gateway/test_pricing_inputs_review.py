"""Review of the pricing/inputs commits (07f7dcb, c50cc9e, 2ad2c6d, 1b1ed58, 3d13c24): failing tests only."""

from __future__ import annotations

import base64
import tracemalloc
import zlib
from typing import Any

import anthropic
import orjson
import pytest

from gateway.config import Limits
from gateway.providers.common import pdf_pages
from gateway.providers.openai_chat import OpenAIChat
from tests.conftest import GatewayFactory
from tests.fakes.upstream import Reply, anthropic_message

MB = 1 << 20


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _objstm_overflow_pdf(repeats: int, raw_len: int, flate: bytes) -> bytes:
    """`repeats` `/Type /ObjStm` markers in one dictionary (each one finds the same uncompressed stream of
    `raw_len` bytes), then one Flate object stream holding `flate`."""
    head = b"%PDF-1.5\n1 0 obj\n<< /Type /Page >>\nendobj\n"
    many = (b"5 0 obj\n<< " + b"/Type /ObjStm " * repeats + b">>\nstream\n" + b"x" * (raw_len - 1)
            + b"\nendstream\nendobj\n")
    last = b"9 0 obj\n<< /Type /ObjStm /Filter /FlateDecode >>\nstream\n" + flate + b"\nendstream\nendobj\n"
    return head + many + last + b"%%EOF\n"


def test_pdf_pages_inflated_past_the_cap_raises_value_error() -> None:
    """Uncompressed object streams add to `inflated` without any check, so it can pass
    `_PDF_INFLATED_MAX`; the next Flate stream then calls `decompress(stream, <negative>)`, a ValueError
    nobody catches. A PDF that cannot be counted must come back as None (uncounted), never raise."""
    pdf = _objstm_overflow_pdf(65, MB, zlib.compress(b"<< /Type /Page >>"))
    assert pdf_pages(_b64(pdf)) == 2  # the stream 65 markers share is read once: no overflow, two pages
    distinct = b"%PDF-1.5\n" + b"".join(  # 65 object streams of 1 MiB each: past the cap, uncounted
        b"%d 0 obj\n<< /Type /ObjStm >>\nstream\n" % i + b"x" * MB + b"\nendstream\nendobj\n" for i in range(65))
    assert pdf_pages(_b64(distinct + zlib.compress(b"<< /Type /Page >>") + b"%%EOF\n")) is None


def test_pdf_pages_bomb_after_exactly_the_cap_is_inflated_whole() -> None:
    """When uncompressed object streams bring `inflated` to exactly `_PDF_INFLATED_MAX`, the next Flate
    stream is decompressed with `max_length=0`, which zlib reads as *unlimited*: a decompression bomb
    (here 200 MiB from ~200 KB; 24 MiB of deflate inside a 32 MiB body is ~24 GiB) is inflated whole on the
    event loop. The cap must hold: past it the PDF is uncounted (None)."""
    bomb = zlib.compress(b" " * (200 * MB), 9)
    pdf = _objstm_overflow_pdf(64, MB, bomb)
    assert pdf_pages(_b64(pdf)) is None


def test_pdf_pages_memory_is_bounded_for_many_object_stream_markers() -> None:
    """Each `/Type /ObjStm` marker slices (copies) from its `stream` keyword to the next `endstream`, and
    uncompressed slices are never held to `_PDF_INFLATED_MAX`: N markers before one `endstream` keep
    ~N*size/2 bytes alive. A 108 KB PDF makes the request parser hold >200 MB (quadratic: a 32 MiB body
    would need terabytes). Counting pages must stay within the inflated cap (64 MiB)."""
    pdf = b"%PDF-1.5\n1 0 obj\n<< /Type /Page >>\nendobj\n" + b"<< /Type /ObjStm >>\nstream\n" * 4000
    pdf += b"endstream\n%%EOF\n"
    tracemalloc.start()
    try:
        pdf_pages(_b64(pdf))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MB, f"{len(pdf)} byte PDF held {peak / MB:.0f} MiB"


async def test_anthropic_pdf_that_breaks_the_counter_is_a_400_not_a_500(gateway_factory: GatewayFactory) -> None:
    """A hostile PDF must get a clear 4xx in Anthropic's format (DESIGN section 4: never a 500). The
    ValueError of `pdf_pages` escapes `AnthropicMessages.parse_request` and the gateway answers 500 (which
    the SDK would even retry)."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 5.0}}})
    h.fake.queue(Reply(body=anthropic_message("ok")))
    pdf = _objstm_overflow_pdf(65, MB, zlib.compress(b"<< /Type /Page >>"))
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0)
    doc: Any = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": _b64(pdf)}}
    async with client:  # counted (the shared stream is read once) and within the budget: it goes through
        message = await client.messages.create(model="claude-3-5-haiku-latest", max_tokens=100, messages=[
            {"role": "user", "content": [doc, {"type": "text", "text": "sum"}]}])
    assert message.content[0].type == "text"


async def test_batch_results_url_off_the_configured_origin_still_points_the_sdk_around_the_gateway(
    gateway_factory: GatewayFactory,
) -> None:
    """`with_gateway_urls` moves a `results_url` only when it starts with the configured provider base
    spelling. An upstream that answers with its canonical origin (a relay or regional endpoint in
    `base_url`, `:443` or a different host spelling) leaves the provider URL in place, and the Anthropic
    SDK then fetches it directly with the agent's tollgate key: the agent leaves the gateway (the very
    bypass 1b1ed58 meant to close). Any absolute `results_url` in a batch answer must point at the gateway."""
    h = await gateway_factory()
    batch = {"id": "msgbatch_1", "type": "message_batch", "processing_status": "ended",
             "request_counts": {"processing": 0, "succeeded": 1, "errored": 0, "canceled": 0, "expired": 0},
             "ended_at": "2026-01-01T00:00:00Z", "created_at": "2026-01-01T00:00:00Z",
             "expires_at": "2026-01-02T00:00:00Z", "archived_at": None, "cancel_initiated_at": None,
             "results_url": "https://api.anthropic.com/v1/messages/batches/msgbatch_1/results"}
    h.fake.queue(Reply(body=batch))
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="agent-key", max_retries=0)
    async with client:
        got = await client.messages.batches.retrieve("msgbatch_1")
    assert got.results_url is not None and got.results_url.startswith(h.url), got.results_url


async def test_speaking_request_to_an_audio_model_without_audio_rates_is_reserved_as_text(
    gateway_factory: GatewayFactory,
) -> None:
    """genai-prices lists gpt-4o-audio-preview (OpenAI's main Chat Completions audio model) without audio
    rates, so `ModelPrice.input_audio/output_audio` are None and a request with `modalities: ["audio"]` is
    reserved and settled at the text rate ($10/M output) while OpenAI bills its audio tokens at $80/M (input
    $40/M): an 8x undercharge, so a USD budget can be overspent. Under a USD budget a request that lets the
    model speak must not be priced as text when no audio rate is known: refuse it (as for tools tollgate
    cannot price) or charge at least the audio rate."""
    h = await gateway_factory(agents={"default": {"budget": {"usd": 1.0}}})
    answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "gpt-4o-audio-preview",
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": None,
                                       "audio": {"id": "a1", "data": "AAAA", "expires_at": 2, "transcript": "hi"}}}],
              "usage": {"prompt_tokens": 10, "completion_tokens": 10000, "total_tokens": 10010,
                        "completion_tokens_details": {"audio_tokens": 10000}}}
    h.fake.queue(Reply(body=answer))
    async with h.session.post(f"{h.url}/v1/chat/completions", headers={"x-tollgate-run-id": "audio"}, json={
        "model": "gpt-4o-audio-preview", "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
        "max_tokens": 10000, "messages": [{"role": "user", "content": "say hi"}],
    }) as resp:
        status = resp.status
    if status == 200:
        run = await h.run("audio")
        assert run["spent_usd"] >= 10000 * 80e-6 * 0.99, run["spent_usd"]  # what OpenAI bills
    else:
        assert status == 400


async def test_a_prefill_before_a_provider_tool_is_not_judged_with_the_final_answer(
    gateway_factory: GatewayFactory,
) -> None:
    """3d13c24: with Anthropic's server tools the answer held to the grammar is the text after the last
    provider-run block. `outputs.judge` still prepends the assistant prefill (`call.prefill + answer.text`,
    gateway/outputs.py:227) to that text, although the prefill started the preamble, not the answer after
    the search: a conforming answer ("found it!") is judged as "Let me search.found it!", re-asked and
    finally refused 422. (The same turn streamed is accepted: `relay_stream` resets its checkers, prefill
    and all, when the provider's tool starts, so the two paths disagree.) Correct: judge the text after the
    last provider-run block alone."""
    h = await gateway_factory(agents={"default": {"output": {"grammar": "regex:[a-z ]+!", "retries": 0}}})
    h.fake.queue(Reply(body={
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-3-5-haiku-latest",
        "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "q"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": "found it!"},
        ],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5, "server_tool_use": {"web_search_requests": 1}},
    }))
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key="k", max_retries=0)
    tools: Any = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]
    async with client:
        message = await client.messages.create(
            model="claude-3-5-haiku-latest", max_tokens=64, tools=tools,
            messages=[{"role": "user", "content": "search it"}, {"role": "assistant", "content": "Let me search."}])
    assert [b.text for b in message.content if b.type == "text"] == ["found it!"]


def _tiny_pdf(pages: int) -> bytes:
    out = b"%PDF-1.5\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
    out += b"2 0 obj\n<< /Type /Pages /Count " + str(pages).encode() + b" >>\nendobj\n"
    out += b"".join(b"%d 0 obj\n<< /Type /Page /Parent 2 0 R >>\nendobj\n" % (3 + i) for i in range(pages))
    return out + b"trailer\n<< /Root 1 0 R >>\n%%EOF\n"


@pytest.mark.parametrize("prefix", [
    "data:application/pdf;name=report.pdf;base64,",  # RFC 2397 parameters before ;base64
    "data:application/pdf ;base64,",
])
def test_inline_pdf_data_url_with_parameters_is_bounded_per_page_or_unbounded(prefix: str) -> None:
    """`_inline_pdf` recognises only the exact prefix `data:application/pdf;base64,`. A data URL with a
    parameter (RFC 2397 `;name=...`, which data-URL builders add) or a blank is neither counted per page
    nor reported as unbounded: the PDF is bounded by its bytes alone (a 100-page PDF of ~5 KB is held at
    ~7 KB of input while billed ~100 pages). Every `file_data` that is a PDF must be counted per page, and
    one tollgate cannot read must be unbounded (refused under a budget), never bounded by its bytes."""
    part = {"type": "file", "file": {"filename": "report.pdf", "file_data": prefix + _b64(_tiny_pdf(100))}}
    body: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": [part]}]}
    call = OpenAIChat().parse_request(body, orjson.dumps(body), Limits())
    assert call.input_images >= 200 or call.referenced_documents >= 1, (call.input_images, call.referenced_documents)
