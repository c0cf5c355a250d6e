"""Hostile probes of telemetry (spans, /metrics) and the decision ledger through a running gateway.

Each test asserts documented behaviour (README "Traces, metrics, ledger", DESIGN sections 1-6,
/work/shared/notes/semconv.md) that the existing suites do not cover. Spans are asserted on what an
OTLP/HTTP receiver decoded (tests/otel/otlp_sink.py), after `Telemetry.force_flush()` run off the loop.
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import sys
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv._incubating.attributes import openai_attributes as OpenAI
from opentelemetry.semconv.attributes import error_attributes as Error
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_apps
from gateway.call import digest
from gateway.config import parse_config
from gateway.ledger import verify
from gateway.ledger_chain import GENESIS
from otel.attributes import TOLLGATE_RUN_ID, TOLLGATE_STOP_REASON
from otel.runs import run_ids
from tests.conftest import GatewayFactory, Harness, base_config
from tests.fakes.gateway_server import GatewayTestServer
from tests.fakes.responses import response_body, response_stream
from tests.fakes.upstream import (
    FakeProvider,
    Reply,
    anthropic_message,
    anthropic_stream,
    openai_completion,
    openai_stream,
    tool_call,
)
from tests.otel.otlp_sink import OtlpSink, WireSpan, running_sink

CLIENT, ERROR = 3, 2  # OTLP SpanKind.CLIENT, Status.ERROR
S, I, D, B, A = "string_value", "int_value", "double_value", "bool_value", "array_value"
MSG = [{"role": "user", "content": "hello"}]
CHAT = {"model": "gpt-4o-mini", "messages": MSG}
PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
           "claude-*": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}
REPO = Path(__file__).resolve().parents[2]
MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


# -- fixtures and helpers ----------------------------------------------------------------------------


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)


@pytest.fixture
async def sink(otel_env: None, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OtlpSink]:
    async with running_sink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        yield sink


@pytest.fixture
def traced(sink: OtlpSink, gateway_factory: GatewayFactory) -> GatewayFactory:
    return gateway_factory


async def flushed(h: Harness, sink: OtlpSink) -> list[WireSpan]:
    assert await asyncio.to_thread(h.gateway.services["telemetry"].force_flush)
    return list(sink.spans)


async def post(h: Harness, body: dict[str, Any], *, run: str, path: str = "/v1/chat/completions",
               headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    hdrs = {"x-tollgate-run-id": run, "content-type": "application/json", **(headers or {})}
    async with h.session.post(f"{h.url}{path}", data=orjson.dumps(body), headers=hdrs) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


async def families(h: Harness) -> dict[str, Any]:
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fams: dict[str, Any], family: str, suffix: str) -> list[Any]:
    fam = fams.get(family)
    return [s for s in fam.samples if s.name.endswith(suffix)] if fam is not None else []


def of_run(spans: list[WireSpan], run: str, name: str | None = None) -> list[WireSpan]:
    return [s for s in spans if s.attributes.get(TOLLGATE_RUN_ID) == (S, run) and (name is None or s.name == name)]


def all_strings(span: WireSpan) -> list[str]:
    out: list[str] = [span.name, span.status_message]

    def walk(value: Any) -> None:
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            walk(value[1])
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        else:
            out.append(str(value))

    walk(span.attributes)
    for _, attrs in span.events:
        walk(attrs)
    return out


async def ledger_rows(h: Harness, run: str) -> list[dict[str, Any]]:
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    return ledger.rows(run)  # type: ignore[no-any-return]


async def cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args, cwd=str(cwd), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def tamper(db: Path, *statements: str) -> None:
    with closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER IF EXISTS ledger_no_update")
        conn.execute("DROP TRIGGER IF EXISTS ledger_no_delete")
        for statement in statements:
            conn.execute(statement)


# -- content never on spans or in the ledger unless captured ------------------------------------------

SECRET_ANSWER = "PLAINTEXT-MODEL-SECRET-7731"
INT_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}


async def test_nonconforming_output_text_is_not_on_spans_or_ledger_without_capture(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """README: content is captured only with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT; the
    ledger stores a hash of the inputs, never content; semconv.md 2.1: content attributes are Opt-In.
    otel/attributes.py TOLLGATE_GUARD_DETAIL: "never user or model content". A model answer that
    breaks the grammar must not be copied into guard events, span status or the ledger's detail."""
    h = await traced(agents={"default": {"output": {"retries": 1}}})
    bad = f'{{"answer": "{SECRET_ANSWER}"}}'
    h.fake.queue(Reply(body=openai_completion(bad)), Reply(body=openai_completion(bad)))
    status, data, _ = await post(h, {**CHAT, "response_format": INT_SCHEMA}, run="leak-1")
    assert status == 422 and b"output_nonconforming" in data
    rows = await ledger_rows(h, "leak-1")
    assert rows and not [r for r in rows if SECRET_ANSWER in orjson.dumps(r).decode()], rows
    spans = of_run(await flushed(h, sink), "leak-1")
    assert spans
    leaked = [(s.name, v) for s in spans for v in all_strings(s) if SECRET_ANSWER in v]
    assert not leaked, f"model output copied into span telemetry without capture: {leaked[:2]}"


async def test_invalid_tool_arguments_are_not_on_spans_without_capture(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """Same contract (README content capture; semconv.md 2.1: gen_ai.tool.call.arguments is Opt-In):
    the arguments a model proposed are content; a schema violation must not echo them into spans."""
    h = await traced(agents={"default": {"output": {"retries": 0}}})
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}
    answer = openai_completion("", tool_calls=[tool_call("lookup", orjson.dumps({"id": SECRET_ANSWER}).decode())])
    h.fake.queue(Reply(body=answer))
    status, _data, _ = await post(h, {**CHAT, "tools": [tool]}, run="leak-2")
    assert status == 422
    spans = of_run(await flushed(h, sink), "leak-2")
    leaked = [(s.name, v) for s in spans for v in all_strings(s) if SECRET_ANSWER in v]
    assert not leaked, f"tool arguments copied into span telemetry without capture: {leaked[:2]}"


# -- streams ---------------------------------------------------------------------------------------


async def test_stream_without_usage_reports_no_token_usage(traced: GatewayFactory, sink: OtlpSink) -> None:
    """semconv.md 3.2 and section 8: "Streaming without usage in the stream: do not estimate silently.
    MUST NOT report token metrics unless counted". README: such a stream is *settled* at the full
    reservation, which is billing, not a count the provider reported."""
    h = await traced(pricing=PRICING, agents={"default": {"budget": {"usd": 1.0}}})
    h.fake.queue(Reply(chunks=openai_stream(["a", "b"], usage=None)))
    status, data, _ = await post(h, {**CHAT, "stream": True, "max_tokens": 50}, run="nousage")
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    [span] = of_run(await flushed(h, sink), "nousage")
    assert GenAI.GEN_AI_USAGE_INPUT_TOKENS not in span.attributes, span.attributes
    assert GenAI.GEN_AI_USAGE_OUTPUT_TOKENS not in span.attributes, span.attributes
    fams = await families(h)
    assert samples(fams, "gen_ai_client_token_usage", "_count") == [] or all(
        s.value == 0 for s in samples(fams, "gen_ai_client_token_usage", "_count"))
    [count] = [s.value for s in samples(fams, "gen_ai_client_operation_duration_seconds", "_count")]
    assert count == 1


async def test_anthropic_stream_span_sums_cache_tokens_and_has_finish_reason(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """semconv.md 1.2 (Anthropic): gen_ai.usage.input_tokens = input + cache_read + cache_creation;
    cache_read / cache_creation attributes; finish reasons; gen_ai.request.stream true; and the
    token-usage histogram records that same input count (3.2: use the usage in the stream)."""
    h = await traced()
    chunks = anthropic_stream(["Hi", " there"], usage=(7, 4))
    start = orjson.loads(chunks[0].split(b"data: ", 1)[1])
    start["message"]["usage"].update({"cache_read_input_tokens": 50, "cache_creation_input_tokens": 20})
    chunks[0] = b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n"
    h.fake.queue(Reply(chunks=chunks))
    body = {"model": "claude-3-5-haiku-latest", "max_tokens": 64, "messages": MSG, "stream": True}
    status, _data, _ = await post(h, body, run="a-stream", path="/v1/messages")
    assert status == 200
    [span] = of_run(await flushed(h, sink), "a-stream")
    expected = {
        GenAI.GEN_AI_PROVIDER_NAME: (S, "anthropic"),
        GenAI.GEN_AI_REQUEST_STREAM: (B, True),
        GenAI.GEN_AI_RESPONSE_ID: (S, "msg_fake"),
        GenAI.GEN_AI_RESPONSE_FINISH_REASONS: (A, [(S, "end_turn")]),
        GenAI.GEN_AI_USAGE_INPUT_TOKENS: (I, 77),
        GenAI.GEN_AI_USAGE_OUTPUT_TOKENS: (I, 4),
        GenAI.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: (I, 50),
        GenAI.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: (I, 20),
    }
    assert {k: span.attributes.get(k) for k in expected} == expected
    fams = await families(h)
    sums = {s.labels["gen_ai_token_type"]: s.value for s in samples(fams, "gen_ai_client_token_usage", "_sum")}
    assert sums == {"input": 77, "output": 4}


async def test_stream_stopped_mid_way_is_one_span_one_ledger_row_and_counted_once(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """DESIGN 4: a stop in a stream after bytes were sent ends it with a final error event, and every
    stop carries its reason on the span and in the ledger. README metrics: runs stopped counted once;
    the client operation that did happen measured once (no error.type: it succeeded upstream)."""
    h = await traced(agents={"default": {"tools": {"allow": ["search_kb"], "on_violation": "reject"}}})
    h.fake.queue(Reply(chunks=openai_stream(["thinking "], tool_calls=[tool_call("drop_tables")])))
    status, data, _ = await post(h, {**CHAT, "stream": True}, run="s-stop")
    assert status == 200 and b"tool_not_allowed" in data
    [span] = of_run(await flushed(h, sink), "s-stop", "chat gpt-4o-mini")
    assert span.status_code == ERROR
    assert span.attributes[Error.ERROR_TYPE] == (S, "tool_not_allowed")
    assert span.attributes[TOLLGATE_STOP_REASON] == (S, "tool_not_allowed")
    rows = await ledger_rows(h, "s-stop")
    assert [(r["decision"], r["reason"]) for r in rows] == [("stop", "tool_not_allowed")]
    fams = await families(h)
    stops = [s.value for s in samples(fams, "tollgate_runs_stopped", "_total")
             if s.labels["reason"] == "tool_not_allowed"]
    assert stops == [1]
    durations = {s.labels["error_type"]: s.value for s in samples(fams, "gen_ai_client_operation_duration_seconds", "_count")}
    assert durations == {"": 1}


# -- on_stop: message ------------------------------------------------------------------------------


async def test_on_stop_message_still_marks_span_ledger_and_metrics(traced: GatewayFactory, sink: OtlpSink) -> None:
    """DESIGN 4: with `on_stop: message` a stop answers 200, but "a stop is never silent: every stop
    carries its reason in the body, in the x-tollgate-stop-reason header, on the span and in the
    ledger". README: a step stopped before the upstream has a span with error.type = the stop code."""
    h = await traced(agents={"default": {"caps": {"llm_calls": 1}, "on_stop": "message"}})
    assert (await post(h, CHAT, run="msg-stop"))[0] == 200
    status, _data, headers = await post(h, CHAT, run="msg-stop")
    assert status == 200 and headers.get("x-tollgate-stop-reason") == "llm_call_cap"
    spans = of_run(await flushed(h, sink), "msg-stop", "chat gpt-4o-mini")
    assert len(spans) == 2
    stopped = spans[1]
    assert stopped.status_code == ERROR and stopped.attributes[Error.ERROR_TYPE] == (S, "llm_call_cap")
    rows = await ledger_rows(h, "msg-stop")
    assert [(r["decision"], r["reason"]) for r in rows] == [("allow", None), ("stop", "llm_call_cap")]
    [root] = of_run(await flushed(h, sink), "msg-stop", "invoke_agent default")
    assert root.attributes[Error.ERROR_TYPE] == (S, "llm_call_cap")


# -- cost counter equals settled spend ---------------------------------------------------------------


async def test_cost_counter_equals_settled_spend_of_every_run(traced: GatewayFactory, sink: OtlpSink) -> None:
    """README: `tollgate_cost_usd_total` is "Settled spend"; the admin API's `spent_usd` is the run's
    settled spend. Across answers, streams (with and without usage), re-asks, a stop after the answer
    and an upstream error, the counter must equal the sum of the runs' spend."""
    h = await traced(pricing=PRICING, agents={"default": {"budget": {"usd": 5.0}, "output": {"retries": 1},
                                                          "tools": {"allow": ["ok_tool"], "on_violation": "reject"}}})
    h.fake.queue(
        Reply(body=openai_completion(prompt_tokens=100, completion_tokens=20)),
        Reply(chunks=openai_stream(["a"], usage=(30, 3))),
        Reply(chunks=openai_stream(["a"], usage=None)),
        Reply(body=openai_completion("four")), Reply(body=openai_completion('{"answer": 4}')),
        Reply(body=openai_completion("", tool_calls=[tool_call("bad_tool")], prompt_tokens=40)),
        Reply(status=500, body={"error": {"message": "boom"}}),
        Reply(body=anthropic_message(input_tokens=11, output_tokens=2)),
    )
    runs = ["c1", "c2", "c3", "c4", "c5", "c6"]
    await post(h, {**CHAT, "max_tokens": 100}, run="c1")
    await post(h, {**CHAT, "stream": True, "max_tokens": 100}, run="c2")
    await post(h, {**CHAT, "stream": True, "max_tokens": 100}, run="c3")
    await post(h, {**CHAT, "max_tokens": 100, "response_format": INT_SCHEMA}, run="c4")
    await post(h, {**CHAT, "max_tokens": 100}, run="c5")
    await post(h, {**CHAT, "max_tokens": 100}, run="c6")
    await post(h, {"model": "claude-3-5-haiku-latest", "max_tokens": 100, "messages": MSG}, run="c6",
               path="/v1/messages")
    spent = 0.0
    for run in runs:
        spent += (await h.run(run))["spent_usd"]
    fams = await families(h)
    counted = sum(s.value for s in samples(fams, "tollgate_cost_usd", "_total"))
    assert spent > 0
    assert counted == pytest.approx(spent, rel=1e-9, abs=1e-12), (counted, spent)


# -- Responses API ---------------------------------------------------------------------------------


async def test_responses_api_span_is_a_chat_span_with_api_type_and_usage(traced: GatewayFactory, sink: OtlpSink) -> None:
    """README: one CLIENT span `chat {model}` per upstream attempt; the Responses API is a model call
    like Chat Completions. semconv.md 1.2: OpenAI spans carry openai.api.type (`responses`),
    response id/model, finish reasons, usage; gen_ai.request.max_tokens from max_output_tokens."""
    h = await traced()
    h.fake.queue(Reply(body=response_body("hello", usage=(12, 7))),
                 Reply(chunks=response_stream(["he", "llo"], usage=(9, 3))))
    body = {"model": "gpt-4o-mini", "input": "hi", "max_output_tokens": 50, "temperature": 0.5}
    assert (await post(h, body, run="resp-1", path="/v1/responses"))[0] == 200
    assert (await post(h, {**body, "stream": True}, run="resp-2", path="/v1/responses"))[0] == 200
    spans = await flushed(h, sink)
    for run, (inp, out), stream in (("resp-1", (12, 7), False), ("resp-2", (9, 3), True)):
        [span] = of_run(spans, run)
        assert (span.name, span.kind) == ("chat gpt-4o-mini", CLIENT)
        expected = {
            GenAI.GEN_AI_OPERATION_NAME: (S, "chat"),
            OpenAI.OPENAI_API_TYPE: (S, "responses"),
            GenAI.GEN_AI_REQUEST_MAX_TOKENS: (I, 50),
            GenAI.GEN_AI_REQUEST_TEMPERATURE: (D, 0.5),
            GenAI.GEN_AI_RESPONSE_ID: (S, "resp_fake"),
            GenAI.GEN_AI_RESPONSE_MODEL: (S, "gpt-4o-mini"),
            GenAI.GEN_AI_USAGE_INPUT_TOKENS: (I, inp),
            GenAI.GEN_AI_USAGE_OUTPUT_TOKENS: (I, out),
        }
        assert {k: span.attributes.get(k) for k in expected} == expected, run
        assert (GenAI.GEN_AI_REQUEST_STREAM in span.attributes) == stream
        assert GenAI.GEN_AI_RESPONSE_FINISH_REASONS in span.attributes, run


# -- the span says what went upstream ----------------------------------------------------------------


async def test_span_max_tokens_is_the_clamped_value_sent_upstream(traced: GatewayFactory, sink: OtlpSink) -> None:
    """DESIGN 5: max_tokens absent under a budget is clamped and reported in x-tollgate-max-tokens.
    otel/attributes.py inference_start_attributes: "Pass the call as forwarded (after the shape
    stage), so max_tokens is what the upstream was given" (semconv gen_ai.request.max_tokens)."""
    h = await traced(pricing=PRICING, agents={"default": {"budget": {"usd": 0.001}}})
    status, _data, headers = await post(h, CHAT, run="clamp")
    assert status == 200
    granted = int(headers["x-tollgate-max-tokens"])
    sent = h.fake.seen[-1].json
    assert sent.get("max_tokens", sent.get("max_completion_tokens")) == granted
    status, _data, headers = await post(h, {**CHAT, "max_tokens": 100_000}, run="clamp-explicit")
    assert status == 200
    granted_explicit = int(headers["x-tollgate-max-tokens"])
    assert granted_explicit < 100_000
    spans = await flushed(h, sink)
    [span] = of_run(spans, "clamp")
    assert span.attributes.get(GenAI.GEN_AI_REQUEST_MAX_TOKENS) == (I, granted), "absent max_tokens, clamped"
    [span] = of_run(spans, "clamp-explicit")
    assert span.attributes.get(GenAI.GEN_AI_REQUEST_MAX_TOKENS) == (I, granted_explicit), "too-large max_tokens"


# -- label cardinality -----------------------------------------------------------------------------


async def test_a_thousand_model_names_keep_metric_series_bounded(gateway_factory: GatewayFactory) -> None:
    """README: "never a run id in a label"; otel/metrics.py: a label fed by something an agent controls
    (model names, agent names, tool names) keeps at most `label_limit` (200) distinct values, then
    `_OTHER`. 1000 distinct model names (and agent names) must not make 1000 series of any family."""
    h = await gateway_factory(pricing={"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}})
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> int:
        async with sem:
            model = f"gpt-probe-{i:04d}"
            h.fake.default = Reply(body=openai_completion(model="gpt-4o-mini"))
            status, _d, _h = await post(h, {"model": model, "messages": MSG, "stream": i % 2 == 0},
                                        run=f"card-{i}", headers={"x-tollgate-agent": f"agent-{i}"})
            return status

    statuses = await asyncio.gather(*(one(i) for i in range(1000)))
    assert set(statuses) == {200}
    fams = await families(h)
    for name, fam in fams.items():
        for label in ("gen_ai_request_model", "gen_ai_response_model", "model", "agent"):
            values = {s.labels[label] for s in fam.samples if label in s.labels}
            assert len(values) <= 201, (name, label, len(values))
        series = {tuple(sorted(s.labels.items())) for s in fam.samples}
        assert len(series) <= 201 * 20, (name, len(series))
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        text = await resp.text()
    assert "card-1" not in text


async def test_mcp_protocol_version_header_does_not_grow_metric_series(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """otel/metrics.py: labels fed by what an agent controls are bounded (`label_limit`, then
    `_OTHER`); README: bounded Prometheus labels. The `MCP-Protocol-Version` request header is agent
    input and becomes the `mcp_protocol_version` label of mcp_client_operation_duration_seconds."""
    from tests.fakes import mcp_server

    files = mcp_server.start()
    try:
        h = await traced(mcp_servers={"files": {"url": files.url}},
                         agents={"bot": {"tools": {"allow": ["files/read_file"]}}})
        for i in range(300):
            body = {"jsonrpc": "2.0", "id": i, "method": "tools/call",
                    "params": {"name": "read_file", "arguments": {"path": f"p{i}"}, "_meta": MODERN_META}}
            headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": f"mv-{i}",
                       "content-type": "application/json", "accept": "application/json, text/event-stream",
                       "mcp-protocol-version": f"2026-07-{i:04d}", "mcp-method": "tools/call",
                       "mcp-name": "read_file"}
            async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body), headers=headers) as resp:
                await resp.read()
        fams = await families(h)
        versions = {s.labels.get("mcp_protocol_version") for s in samples(
            fams, "mcp_client_operation_duration_seconds", "_count")}
        assert len(versions) <= 201, f"{len(versions)} distinct mcp_protocol_version label values"
    finally:
        files.stop()


# -- trace context in and out ----------------------------------------------------------------------

AGENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AGENT_SPAN = "00f067aa0ba902b7"


async def test_unsampled_agent_traceparent_is_respected(traced: GatewayFactory, sink: OtlpSink) -> None:
    """README: "An agent's W3C traceparent is honoured instead (tollgate's spans join the agent's
    trace)"; setup.py: default sampler parentbased_always_on. An agent that sampled its trace out
    (flags 00) gets no tollgate span exported, and the upstream sees the agent's trace, unsampled."""
    h = await traced()
    tp = f"00-{AGENT_TRACE}-{AGENT_SPAN}-00"
    assert (await post(h, CHAT, run="unsampled", headers={"traceparent": tp}))[0] == 200
    sent = h.fake.seen[-1].headers["traceparent"]
    assert sent.startswith(f"00-{AGENT_TRACE}-") and sent.endswith("-00"), sent
    assert of_run(await flushed(h, sink), "unsampled") == []


async def test_malformed_traceparent_falls_back_to_the_run_trace(traced: GatewayFactory, sink: OtlpSink) -> None:
    """W3C trace context: an invalid traceparent (all-zero trace id, version ff) is ignored; README:
    without the agent's context, every step of a run is in one trace under its invoke_agent root."""
    h = await traced()
    for i, tp in enumerate((f"00-{'0' * 32}-{AGENT_SPAN}-01", f"ff-{AGENT_TRACE}-{AGENT_SPAN}-01",
                            "00-xyz-abc-01")):
        assert (await post(h, CHAT, run="bad-tp", headers={"traceparent": tp}))[0] == 200, i
    trace_id, root = (f"{x:0{w}x}" for x, w in zip(run_ids("bad-tp", 1), (32, 16), strict=True))
    spans = of_run(await flushed(h, sink), "bad-tp")
    assert len(spans) == 3
    assert {(s.trace_id, s.parent_span_id) for s in spans} == {(trace_id, root)}
    for seen, span in zip(h.fake.seen, spans, strict=True):
        assert seen.headers["traceparent"].startswith(f"00-{span.trace_id}-{span.span_id}-")


async def test_baggage_run_id_names_the_run_on_spans_and_is_not_sent_upstream(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """DESIGN 3: run id from the W3C `baggage` entry `tollgate.run_id`; README: every answer echoes
    x-tollgate-run-id; the run's steps share its trace. propagation.py: baggage is deliberately not
    forwarded to model providers."""
    h = await traced()
    headers = {"content-type": "application/json", "baggage": "other=1,tollgate.run_id=bag-run"}
    async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps(CHAT), headers=headers) as resp:
        assert resp.status == 200 and resp.headers["x-tollgate-run-id"] == "bag-run"
    assert "baggage" not in {k.lower() for k in h.fake.seen[-1].headers}
    [span] = of_run(await flushed(h, sink), "bag-run")
    assert span.trace_id == f"{run_ids('bag-run', 1)[0]:032x}"


async def test_every_reask_attempt_is_its_own_span_with_its_own_upstream_traceparent(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """README: "one CLIENT span `chat {model}` per upstream attempt (re-asks are attempts)";
    observe.py: start_span is called on every pass of the re-ask loop. Each upstream request must
    carry the traceparent of its own attempt's span, and the GenAI duration histogram counts both
    client operations (semconv.md 3.2: one record per operation)."""
    h = await traced(agents={"default": {"output": {"retries": 1}}})
    h.fake.queue(Reply(body=openai_completion("four")), Reply(body=openai_completion('{"answer": 4}')))
    assert (await post(h, {**CHAT, "response_format": INT_SCHEMA}, run="reask-2"))[0] == 200
    assert len(h.fake.seen) == 2
    spans = sorted(of_run(await flushed(h, sink), "reask-2"), key=lambda s: s.value("tollgate.attempt"))
    assert [s.value("tollgate.attempt") for s in spans] == [0, 1]
    sent = [seen.headers["traceparent"].split("-")[2] for seen in h.fake.seen]
    assert sent == [s.span_id for s in spans]
    fams = await families(h)
    assert sum(s.value for s in samples(fams, "gen_ai_client_operation_duration_seconds", "_count")) == 2
    assert sum(s.value for s in samples(fams, "tollgate_upstream_requests", "_total")) == 2
    assert sum(s.value for s in samples(fams, "tollgate_reasks", "_total")) == 1


async def test_mcp_call_with_http_traceparent_and_meta_baggage(traced: GatewayFactory, sink: OtlpSink) -> None:
    """observe_mcp.py / semconv.md 1.8: the MCP span's parent comes from params._meta, else the HTTP
    traceparent; tollgate injects traceparent (and baggage) of its MCP CLIENT span into the forwarded
    params._meta."""
    from tests.fakes import mcp_server

    files = mcp_server.start()
    try:
        h = await traced(mcp_servers={"files": {"url": files.url}},
                         agents={"bot": {"tools": {"allow": ["files/read_file"]}}})
        body = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                "params": {"name": "read_file", "arguments": {"path": "x"},
                           "_meta": {**MODERN_META, "baggage": "k=v"}}}
        headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": "mcp-tp", "content-type": "application/json",
                   "accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
                   "mcp-method": "tools/call", "mcp-name": "read_file",
                   "traceparent": f"00-{AGENT_TRACE}-{AGENT_SPAN}-01"}
        async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body), headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        [span] = of_run(await flushed(h, sink), "mcp-tp", "tools/call read_file")
        assert (span.trace_id, span.parent_span_id) == (AGENT_TRACE, AGENT_SPAN)
        [forwarded] = [m for _, m in files.seen.requests if m is not None and m.get("method") == "tools/call"]
        assert forwarded["params"]["_meta"]["traceparent"] == f"00-{AGENT_TRACE}-{span.span_id}-01"
        rows = await ledger_rows(h, "mcp-tp")
        assert [(r["operation"], r["decision"]) for r in rows] == [("tools/call read_file", "executed")]
    finally:
        files.stop()


# -- root span ---------------------------------------------------------------------------------------


async def test_root_span_totals_match_the_admin_run(traced: GatewayFactory, sink: OtlpSink) -> None:
    """README: the invoke_agent root span is exported when the run stops "with the run's totals";
    DESIGN 2: the admin run shows spent_usd, input/output tokens, llm_calls. They must agree."""
    h = await traced(pricing=PRICING, agents={"default": {"caps": {"llm_calls": 3}, "budget": {"usd": 1.0}}})
    h.fake.queue(Reply(body=openai_completion(prompt_tokens=100, completion_tokens=10)),
                 Reply(chunks=openai_stream(["x"], usage=(50, 5))),
                 Reply(body=anthropic_message(input_tokens=20, output_tokens=2)))
    await post(h, {**CHAT, "max_tokens": 50}, run="tot")
    await post(h, {**CHAT, "stream": True, "max_tokens": 50}, run="tot")
    await post(h, {"model": "claude-3-5-haiku-latest", "max_tokens": 50, "messages": MSG}, run="tot",
               path="/v1/messages")
    assert (await post(h, CHAT, run="tot"))[0] == 403
    run = await h.run("tot")
    [root] = of_run(await flushed(h, sink), "tot", "invoke_agent default")
    assert root.value(GenAI.GEN_AI_USAGE_INPUT_TOKENS) == run["input_tokens"] == 170
    assert root.value(GenAI.GEN_AI_USAGE_OUTPUT_TOKENS) == run["output_tokens"] == 17
    assert root.value("tollgate.llm_calls") == run["llm_calls"] == 3
    assert root.value("tollgate.cost_usd") == pytest.approx(run["spent_usd"])


# -- ledger ----------------------------------------------------------------------------------------


async def _start(config_data: dict[str, Any], tmp_path: Path) -> tuple[Any, Any, str, Any]:
    config = parse_config(config_data, env={}, base_dir=str(tmp_path))
    proxy, _admin = create_apps(config)
    server = GatewayTestServer(proxy, config.limits)
    await server.start_server()
    return server, proxy, str(server.make_url("")).rstrip("/"), config


async def test_ledger_chain_continues_across_a_restart_on_the_sqlite_state_file(
    fake: tuple[FakeProvider, str], tmp_path: Path
) -> None:
    """README: the ledger lives in the SQLite state file; `tollgate ledger verify` re-hashes the chain.
    A restart continues one chain: ids keep counting, every row verifies, nothing is lost."""
    _provider, url = fake
    data = base_config(url, state={"backend": "sqlite", "path": "state.db"})
    total = 0
    async with ClientSession() as session:
        for life in range(3):
            server, _proxy, base, _config = await _start(data, tmp_path)
            try:
                for i in range(7):
                    async with session.post(f"{base}/v1/chat/completions", json=CHAT,
                                            headers={"x-tollgate-run-id": f"life-{life}-{i % 2}"}) as resp:
                        assert resp.status == 200
                        total += 1
            finally:
                await server.close()
    db = tmp_path / "state.db"
    result = verify(db)
    assert result.ok and result.rows == total, result
    with closing(sqlite3.connect(db)) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM ledger ORDER BY id")]
    assert ids == list(range(1, total + 1))
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 0 and f"{total} ledger rows" in out, (out, err)


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_concurrent_steps_write_exactly_one_row_each(gateway_factory: GatewayFactory, backend: str) -> None:
    """README: "Every step decision is a row of the append-only, hash-chained ledger table"; under
    concurrency (80 requests at once, streams and errors mixed) each step is exactly one row and the
    chain verifies."""
    state = {"backend": "sqlite", "path": "st.db"} if backend == "sqlite" else {"backend": "memory"}
    h = await gateway_factory(state=state)
    h.fake.default = Reply(body=openai_completion(), delay=0.01)

    async def one(i: int) -> int:
        if i == 40:  # the second half streams
            h.fake.default = Reply(chunks=openai_stream(["a", "b"]), chunk_delay=0.002)
        body = {**CHAT, "stream": i >= 40}
        return (await post(h, body, run=f"cc-{i % 5}", headers={"x-tollgate-agent": "a"}))[0]

    statuses = [*await asyncio.gather(*(one(i) for i in range(40)))]
    statuses += await asyncio.gather(*(one(i) for i in range(40, 80)))
    assert set(statuses) == {200}
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    rows = ledger.rows(limit=10_000)
    assert len(rows) == 80
    assert sorted(r["run_id"] for r in rows) == sorted(f"cc-{i % 5}" for i in range(80))
    path = h.config.ledger_file
    assert verify(path).ok


async def test_client_disconnect_mid_stream_is_one_ledger_row_and_one_span(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """README: every step decision is a ledger row (exactly one), and every step a span; an agent
    that goes away mid-stream is a step that ended (charged at its reservation)."""
    h = await traced()
    h.fake.queue(Reply(chunks=openai_stream(["a"] * 50), chunk_delay=0.02))
    async with h.session.post(f"{h.url}/v1/chat/completions", data=orjson.dumps({**CHAT, "stream": True}),
                              headers={"x-tollgate-run-id": "gone", "content-type": "application/json"}) as resp:
        await resp.content.readline()
        resp.close()
    for _ in range(200):
        await h.gateway.services["ledger"].flush()
        if h.gateway.services["ledger"].rows("gone"):
            break
        await asyncio.sleep(0.01)
    rows = await ledger_rows(h, "gone")
    assert len(rows) == 1 and rows[0]["decision"] == "error", rows
    spans = of_run(await flushed(h, sink), "gone")
    assert len(spans) == 1 and spans[0].status_code == ERROR


async def test_refused_forward_of_a_stopped_run_has_a_real_ledger_row(gateway_factory: GatewayFactory) -> None:
    """README: a stopped run's other /v1 calls are refused, "that refusal is a span and a ledger row
    with the stop's reason"; ledger rows carry "agent, run, operation, model, a hash of the inputs".
    The row must name the model the request named and a hash of its inputs, not empty strings: the
    hash every other row of the ledger carries (`gateway.call.digest` of the body, as a model call's
    `request_hash`; this probe first asked for a sha256, which no row of the ledger holds)."""
    h = await gateway_factory(agents={"default": {"caps": {"llm_calls": 1}}})
    assert (await post(h, CHAT, run="emb"))[0] == 200
    assert (await post(h, CHAT, run="emb"))[0] == 403
    body = {"model": "text-embedding-3-small", "input": "secret text"}
    status, _data, _ = await post(h, body, run="emb", path="/v1/embeddings")
    assert status == 403
    rows = await ledger_rows(h, "emb")
    row = rows[-1]
    assert (row["decision"], row["reason"]) == ("stop", "llm_call_cap")
    assert row["model"] == "text-embedding-3-small", row
    assert row["input_hash"] == digest(orjson.dumps(body)), row


async def test_ledger_verify_cli_on_a_corrupted_file_is_a_clear_failure(tmp_path: Path) -> None:
    """DESIGN 1: `tollgate ledger verify` exits 1 when the ledger cannot be trusted, with a message,
    not a traceback."""
    db = tmp_path / "garbage.db"
    db.write_bytes(b"SQLite format 3\x00" + os.urandom(4000))
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 1 and "Traceback" not in err and err.strip(), (code, out, err)


async def test_a_dropped_ledger_table_shows_only_against_the_printed_head_hash(
    fake: tuple[FakeProvider, str], tmp_path: Path
) -> None:
    """README ledger: `ledger verify` proves the rows present are unaltered and unbroken; deleting the
    whole table or the newest rows needs an external anchor such as the head hash it prints. A state file
    without a `ledger` table is also what a `ledger.path` elsewhere leaves (test_ledger.py
    test_verify_edge_files), so no check of the file alone can call a dropped table tampering without
    false alarms: verify says "ok, 0 rows", and its head hash (the empty chain's) differs from the one
    printed before. (This probe first asked for exit 1, which the file cannot soundly give.)"""
    _provider, url = fake
    data = base_config(url, state={"backend": "sqlite", "path": "state.db"})
    server, _proxy, base, _config = await _start(data, tmp_path)
    try:
        async with ClientSession() as session:
            for _ in range(3):
                async with session.post(f"{base}/v1/chat/completions", json=CHAT,
                                        headers={"x-tollgate-run-id": "dropme"}) as resp:
                    assert resp.status == 200
    finally:
        await server.close()
    db = tmp_path / "state.db"
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 0 and "3 ledger rows" in out, (code, out, err)
    [anchor] = re.findall(r"head hash ([0-9a-f]{64})", out)
    assert anchor == verify(db).head != GENESIS
    tamper(db, "DROP TABLE ledger")
    code, out, err = await cli("ledger", "verify", "--db", str(db), cwd=tmp_path)
    assert code == 0 and "0 ledger rows" in out, (code, out, err)
    assert re.findall(r"head hash ([0-9a-f]{64})", out) == [GENESIS] != [anchor]


# -- MCP: arguments are content --------------------------------------------------------------------


async def _mcp(h: Harness, body: dict[str, Any], run: str, method: str, name: str | None = None) -> dict[str, Any]:
    headers = {"x-tollgate-agent": "bot", "x-tollgate-run-id": run, "content-type": "application/json",
               "accept": "application/json, text/event-stream", "mcp-protocol-version": "2026-07-28",
               "mcp-method": method}
    if name:
        headers["mcp-name"] = name
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body), headers=headers) as resp:
        return orjson.loads(await resp.read())  # type: ignore[no-any-return]


async def test_mcp_invalid_arguments_do_not_put_argument_values_on_spans_or_ledger(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """README: the ledger holds "a hash of the inputs (never content)"; content capture is opt-in
    (semconv.md 2.1: gen_ai.tool.call.arguments is Opt-In). A tools/call refused for its arguments
    must not copy the argument values into the span (status, events, attributes) or the ledger."""
    from tests.fakes import mcp_server

    files = mcp_server.start()
    try:
        h = await traced(mcp_servers={"files": {"url": files.url}},
                         agents={"bot": {"tools": {"allow": ["files/read_file"]}}})
        listed = await _mcp(h, {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                "params": {"_meta": MODERN_META}}, "mcp-arg", "tools/list")
        assert "result" in listed, listed
        bad = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
               "params": {"name": "read_file", "arguments": {"path": [SECRET_ANSWER]}, "_meta": MODERN_META}}
        answer = await _mcp(h, bad, "mcp-arg", "tools/call", "read_file")
        assert answer["error"]["data"] == {"code": "invalid_arguments"}, answer
        rows = await ledger_rows(h, "mcp-arg")
        assert rows, "a refused tools/call is a decision: a ledger row"
        in_ledger = [r["detail"] for r in rows if SECRET_ANSWER in orjson.dumps(r).decode()]
        spans = of_run(await flushed(h, sink), "mcp-arg")
        on_spans = [(s.name, v) for s in spans for v in all_strings(s) if SECRET_ANSWER in v]
        assert not in_ledger and not on_spans, f"ledger: {in_ledger}; spans: {on_spans}"
    finally:
        files.stop()


# -- ledger: guard decisions -----------------------------------------------------------------------


async def test_a_dropped_tool_call_is_recorded_as_such_in_the_ledger(gateway_factory: GatewayFactory) -> None:
    """gateway/ledger.py: one row per step decision, decision in (allow, stop, reask, drop, approve,
    deny, ...); README: `on_violation: drop` removes the disallowed call from the answer. The row of
    a step whose answer tollgate altered must say so (decision `drop` or reason tool_not_allowed),
    not read as a plain `allow`."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["search_kb"], "on_violation": "drop"}}})
    h.fake.queue(Reply(body=openai_completion("here you go", tool_calls=[tool_call("drop_tables")])))
    status, data, _ = await post(h, CHAT, run="drop-1")
    assert status == 200 and b"drop_tables" not in data
    [row] = await ledger_rows(h, "drop-1")
    assert row["decision"] == "drop" or row["reason"] == "tool_not_allowed", row


# -- telemetry never slows or fails a request --------------------------------------------------------


async def _p50(h: Harness, run: str, count: int = 40) -> float:
    loop = asyncio.get_running_loop()
    for _ in range(5):
        await post(h, CHAT, run=run)
    times: list[float] = []
    for _ in range(count):
        start = loop.time()
        status, _d, _h = await post(h, CHAT, run=run)
        times.append((loop.time() - start) * 1000)
        assert status == 200
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("mode", ["500", "hang"])
async def test_a_failing_or_hanging_collector_costs_requests_nothing(
    otel_env: None, gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """README: "an unreachable collector costs requests nothing and dropped spans are counted in
    tollgate_spans_dropped_total"; DESIGN: telemetry never changes behaviour. A collector answering
    500, or one that accepts and never answers, must not slow requests; the loss is counted."""
    from aiohttp import web

    hung: list[asyncio.Event] = []

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        if mode == "hang":
            ev = asyncio.Event()
            hung.append(ev)
            await ev.wait()
        return web.Response(status=500, text="collector broken")

    app = web.Application()
    app.router.add_post("/v1/traces", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
        disabled = await gateway_factory()
        monkeypatch.delenv("OTEL_SDK_DISABLED")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
        broken = await gateway_factory()
        assert broken.gateway.services["telemetry"].tracing
        base = await _p50(disabled, "base")
        slow = await _p50(broken, "broken")
        assert slow < 2 * base + 2.0, (slow, base)
        await asyncio.to_thread(broken.gateway.services["telemetry"].force_flush, 3.0)
        fams = await families(broken)
        [dropped] = [s.value for s in samples(fams, "tollgate_spans_dropped", "_total")]
        assert dropped > 0
    finally:
        for ev in hung:
            ev.set()
        await runner.cleanup()


# -- /metrics shape ------------------------------------------------------------------------------------


async def test_genai_histograms_have_the_semconv_labels_and_buckets(gateway_factory: GatewayFactory) -> None:
    """semconv.md 3.1/3.2: gen_ai.client.operation.duration (s) and gen_ai.client.token.usage
    ({token}) with the required gen_ai.operation.name, gen_ai.provider.name, cond. required
    gen_ai.request.model and server.port, error.type; token type label; advisory buckets. README:
    exposed as gen_ai_client_operation_duration_seconds / gen_ai_client_token_usage. Time to first
    chunk only for streams ("SHOULD NOT be reported otherwise")."""
    h = await gateway_factory()
    h.fake.queue(Reply(body=openai_completion()), Reply(body=anthropic_message()))
    await post(h, CHAT, run="shape")
    await post(h, {"model": "claude-3-5-haiku-latest", "max_tokens": 10, "messages": MSG}, run="shape",
               path="/v1/messages")
    fams = await families(h)
    common = {"gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model",
              "server_address", "server_port"}
    [dur] = [fams["gen_ai_client_operation_duration_seconds"]]
    buckets = sorted({float(s.labels["le"]) for s in dur.samples if s.name.endswith("_bucket")})
    assert buckets == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
                       float("inf")]
    for s in samples(fams, "gen_ai_client_operation_duration_seconds", "_count"):
        assert set(s.labels) == common | {"error_type"}, s.labels
        assert s.labels["gen_ai_operation_name"] == "chat" and s.labels["server_port"].isdigit()
    providers = {s.labels["gen_ai_provider_name"]: s.value
                 for s in samples(fams, "gen_ai_client_operation_duration_seconds", "_count")}
    assert providers == {"openai": 1, "anthropic": 1}
    for s in samples(fams, "gen_ai_client_token_usage", "_count"):
        assert set(s.labels) == common | {"gen_ai_token_type"}, s.labels
    tok = fams["gen_ai_client_token_usage"]
    tb = sorted({float(s.labels["le"]) for s in tok.samples if s.name.endswith("_bucket")})
    assert tb == [float(4**i) for i in range(14)] + [float("inf")]
    assert sum(s.value for s in samples(fams, "gen_ai_client_operation_time_to_first_chunk_seconds", "_count")) == 0


# -- refusals before the pipeline are still steps --------------------------------------------------


async def test_a_model_call_refused_for_an_unknown_model_leaves_a_span_and_a_ledger_row(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """DESIGN (intro): "Every model call and tool call the agent makes is a step of a run ... Every
    step becomes a span ... and a row of an append-only ledger"; README: "a step stopped before the
    upstream still has a span with error.type = the ... code"; "Every step decision is a row"."""
    h = await traced()
    code = "model_not_found"
    got, data, _ = await post(h, {"model": "nobody-serves-this", "messages": MSG}, run="ref-404")
    assert got == 404 and code.encode() in data
    rows = [r["reason"] for r in await ledger_rows(h, "ref-404")]
    spans = [s.attributes.get(Error.ERROR_TYPE) for s in of_run(await flushed(h, sink), "ref-404")]
    assert (rows, spans) == ([code], [(S, code)]), f"ledger reasons {rows}, span error types {spans}"


# -- idle runs -------------------------------------------------------------------------------------


async def test_every_idle_run_gets_its_root_span_however_many_runs_there_are(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """README: the invoke_agent root span is "exported when the run stops, is reset, or has been idle
    for otel.run_idle_s". A gateway that saw more than a thousand runs must still end the oldest idle
    one, whatever the number of newer runs (sweeps by gateway/observe.py end_idle_runs)."""
    import time

    from gateway.observe_runs import end_idle_runs

    h = await traced(otel={"run_idle_s": 60})
    assert (await post(h, CHAT, run="oldest-run"))[0] == 200
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with sem:
            assert (await post(h, CHAT, run=f"newer-{i}"))[0] == 200

    await asyncio.gather(*(one(i) for i in range(1000)))
    later = time.time() + 61
    for _ in range(3):  # several sweeps, as the background task makes them
        await end_idle_runs(h.gateway, 60, later)
    roots = of_run(await flushed(h, sink), "oldest-run", "invoke_agent default")
    assert len(roots) == 1, "the oldest idle run never got its root span"
