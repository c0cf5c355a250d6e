"""Issue 6's "Show" list through a running gateway: real requests in, real OTLP/HTTP protobuf out.

The gateway (proxy + admin on loopback, scriptable fake provider) reads the standard `OTEL_*`
variables at startup; `OTEL_EXPORTER_OTLP_ENDPOINT` points at the decoding receiver of
`tests/otel/otlp_sink.py`. Every assertion is on what the receiver decoded, after
`Telemetry.force_flush()` (run off the loop, which serves the receiver). Attribute names come from
the semconv v1.41 constants; the wire type of each value is asserted with it (`int_value`, ...).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI
from opentelemetry.semconv._incubating.attributes import jsonrpc_attributes as JsonRpc
from opentelemetry.semconv._incubating.attributes import mcp_attributes as Mcp
from opentelemetry.semconv._incubating.attributes import openai_attributes as OpenAI
from opentelemetry.semconv.attributes import error_attributes as Error
from opentelemetry.semconv.attributes import network_attributes as Network
from opentelemetry.semconv.attributes import server_attributes as Server
from opentelemetry.semconv.attributes import service_attributes as Service
from prometheus_client.parser import text_string_to_metric_families

from gateway.store.logic import MAX_STEPS
from otel.attributes import (
    TOLLGATE_ATTEMPT,
    TOLLGATE_COST_USD,
    TOLLGATE_GUARD_DECISION,
    TOLLGATE_GUARD_EVENT,
    TOLLGATE_GUARD_NAME,
    TOLLGATE_GUARD_REASON,
    TOLLGATE_LLM_CALLS,
    TOLLGATE_RUN_ID,
    TOLLGATE_STOP_REASON,
)
from otel.runs import GATEWAY_PROVIDER, TOLLGATE_CHARGED_INPUT_TOKENS, TOLLGATE_CHARGED_OUTPUT_TOKENS, run_ids
from otel.setup import SCHEMA_URL
from tests.conftest import GatewayFactory, Harness
from tests.fakes import mcp_server
from tests.fakes.upstream import (
    FakeProvider,
    Reply,
    anthropic_message,
    openai_completion,
    openai_stream,
    tool_call,
)
from tests.otel.otlp_sink import OtlpSink, WireSpan, running_sink

INTERNAL, CLIENT = 1, 3
UNSET, ERROR = 0, 2
MSG = [{"role": "user", "content": "hello"}]
AGENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AGENT_SPAN = "00f067aa0ba902b7"
AGENT_TRACEPARENT = f"00-{AGENT_TRACE}-{AGENT_SPAN}-01"
S, I, D, B, A = "string_value", "int_value", "double_value", "bool_value", "array_value"


# -- fixtures and helpers ----------------------------------------------------------------------------


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `OTEL_*` variable of the outer environment leaks into the gateway under test."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)


@pytest.fixture
async def sink(otel_env: None, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OtlpSink]:
    async with running_sink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        yield sink


@pytest.fixture
def traced(sink: OtlpSink, gateway_factory: GatewayFactory) -> GatewayFactory:
    """Gateways exporting to `sink` (set up after the sink, so they shut down, flushing, before it)."""
    return gateway_factory


@pytest.fixture
def fake_url(fake: tuple[FakeProvider, str]) -> str:
    return fake[1]


async def flushed(h: Harness, sink: OtlpSink) -> list[WireSpan]:
    assert await asyncio.to_thread(h.gateway.services["telemetry"].force_flush)
    return list(sink.spans)


async def post(
    h: Harness,
    body: dict[str, Any],
    *,
    run: str,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    hdrs = {"x-tollgate-run-id": run, **(headers or {})}
    async with h.session.post(
        f"{h.url}{path}", data=orjson.dumps(body), headers={"content-type": "application/json", **hdrs}
    ) as resp:
        return resp.status, await resp.read()


async def metrics_text(h: Harness) -> str:
    async with h.session.get(f"{h.admin_url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def of_run(spans: list[WireSpan], run: str, name: str | None = None) -> list[WireSpan]:
    return [
        s for s in spans if s.attributes.get(TOLLGATE_RUN_ID) == (S, run) and (name is None or s.name == name)
    ]


def root_ids(run: str, epoch: int = 1) -> tuple[str, str]:
    trace_id, span_id = run_ids(run, epoch)
    return f"{trace_id:032x}", f"{span_id:016x}"


def guard_events(span: WireSpan) -> list[dict[str, Any]]:
    return [
        {k: v[1] for k, v in attrs.items()} for name, attrs in span.events if name == TOLLGATE_GUARD_EVENT
    ]


def traceparent_of(span: WireSpan) -> str:
    return f"00-{span.trace_id}-{span.span_id}-"


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def providers(fake_url: str, **more: dict[str, Any]) -> dict[str, Any]:
    return {
        "openai": {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "sk-provider-openai"},
        "anthropic": {"type": "anthropic", "base_url": fake_url, "api_key": "sk-ant-provider"},
        **more,
    }


# -- OpenAI ----------------------------------------------------------------------------------------


async def test_openai_chat_span_names_kinds_links_and_typed_attributes(
    traced: GatewayFactory, sink: OtlpSink, fake_url: str
) -> None:
    h = await traced()
    answer = openai_completion('{"greeting": "hi"}', prompt_tokens=40, completion_tokens=9)
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 32}
    answer["usage"]["completion_tokens_details"] = {"reasoning_tokens": 4}
    h.fake.queue(Reply(body=answer))
    body = {
        "model": "gpt-4o-mini",
        "messages": MSG,
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 100,
        "seed": 7,
        "stop": ["END"],
        "frequency_penalty": 0.1,
        "presence_penalty": 0.3,
        "n": 2,
        "response_format": {"type": "json_object"},
        "service_tier": "flex",
    }
    status, _ = await post(h, body, run="r-openai")
    assert status == 200

    [span] = of_run(await flushed(h, sink), "r-openai")
    trace_id, root = root_ids("r-openai")
    assert (span.name, span.kind, span.status_code) == ("chat gpt-4o-mini", CLIENT, UNSET)
    assert (span.trace_id, span.parent_span_id) == (trace_id, root)  # under the run's future root span
    assert (span.scope, span.schema_url) == ("tollgate", SCHEMA_URL)
    assert span.resource[Service.SERVICE_NAME] == (S, "tollgate")
    port = int(fake_url.rsplit(":", 1)[1])
    expected = {
        GenAI.GEN_AI_OPERATION_NAME: (S, "chat"),
        GenAI.GEN_AI_PROVIDER_NAME: (S, "openai"),
        GenAI.GEN_AI_REQUEST_MODEL: (S, "gpt-4o-mini"),
        Server.SERVER_ADDRESS: (S, "127.0.0.1"),
        Server.SERVER_PORT: (I, port),
        GenAI.GEN_AI_REQUEST_MAX_TOKENS: (I, 100),
        GenAI.GEN_AI_REQUEST_TEMPERATURE: (D, 0.2),
        GenAI.GEN_AI_REQUEST_TOP_P: (D, 0.9),
        GenAI.GEN_AI_REQUEST_FREQUENCY_PENALTY: (D, 0.1),
        GenAI.GEN_AI_REQUEST_PRESENCE_PENALTY: (D, 0.3),
        GenAI.GEN_AI_REQUEST_SEED: (I, 7),
        GenAI.GEN_AI_REQUEST_STOP_SEQUENCES: (A, [(S, "END")]),
        GenAI.GEN_AI_REQUEST_CHOICE_COUNT: (I, 2),
        GenAI.GEN_AI_OUTPUT_TYPE: (S, "json"),
        OpenAI.OPENAI_API_TYPE: (S, "chat_completions"),
        OpenAI.OPENAI_REQUEST_SERVICE_TIER: (S, "flex"),
        GenAI.GEN_AI_RESPONSE_ID: (S, "chatcmpl-fake"),
        GenAI.GEN_AI_RESPONSE_MODEL: (S, "gpt-4o-mini"),
        GenAI.GEN_AI_RESPONSE_FINISH_REASONS: (A, [(S, "stop")]),
        GenAI.GEN_AI_USAGE_INPUT_TOKENS: (I, 40),  # includes the cached ones
        GenAI.GEN_AI_USAGE_OUTPUT_TOKENS: (I, 9),
        GenAI.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: (I, 32),
        GenAI.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: (I, 4),
        TOLLGATE_ATTEMPT: (I, 0),
    }
    assert {k: span.attributes.get(k) for k in expected} == expected
    assert span.attributes[TOLLGATE_COST_USD][0] == D
    for absent in (
        GenAI.GEN_AI_REQUEST_STREAM,
        GenAI.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK,
        Error.ERROR_TYPE,
        GenAI.GEN_AI_INPUT_MESSAGES,
        GenAI.GEN_AI_OUTPUT_MESSAGES,
        GenAI.GEN_AI_SYSTEM_INSTRUCTIONS,
    ):
        assert absent not in span.attributes  # no stream, no error, content capture off by default
    # the upstream was called as a child of this span
    assert h.fake.seen[-1].headers["traceparent"].startswith(traceparent_of(span))


async def test_openai_stream_span_has_stream_flag_time_to_first_chunk_and_cached_usage(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    h = await traced()
    chunks = openai_stream(["Hel", "lo"], usage=None, done=False)
    usage = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-4o-mini",
        "choices": [],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 3,
            "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
    chunks += [b"data: " + orjson.dumps(usage) + b"\n\n", b"data: [DONE]\n\n"]
    h.fake.queue(Reply(chunks=chunks, chunk_delay=0.002))
    status, data = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, run="r-stream")
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")

    [span] = of_run(await flushed(h, sink), "r-stream")
    assert (span.name, span.kind, span.status_code) == ("chat gpt-4o-mini", CLIENT, UNSET)
    assert span.attributes[GenAI.GEN_AI_REQUEST_STREAM] == (B, True)
    kind, ttfc = span.attributes[GenAI.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    assert kind == D and 0 < ttfc < 5
    assert span.attributes[GenAI.GEN_AI_USAGE_INPUT_TOKENS] == (I, 12)
    assert span.attributes[GenAI.GEN_AI_USAGE_OUTPUT_TOKENS] == (I, 3)
    assert span.attributes[GenAI.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == (I, 8)
    assert span.attributes[GenAI.GEN_AI_RESPONSE_FINISH_REASONS] == (A, [(S, "stop")])
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    ttfc_count = [
        s.value
        for s in families["gen_ai_client_operation_time_to_first_chunk_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert ttfc_count == [1]


# -- Anthropic -------------------------------------------------------------------------------------

ANTHROPIC_BODY = {
    "model": "claude-3-5-haiku-latest",
    "max_tokens": 64,
    "system": "You are terse.",
    "messages": MSG,
    "temperature": 0.5,
    "top_k": 5,
}


def anthropic_answer() -> dict[str, Any]:
    answer = anthropic_message("Hi")
    answer["usage"] = {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 20,
    }
    return answer


async def test_anthropic_span_sums_input_tokens_and_keeps_content_out_unless_captured(
    traced: GatewayFactory, sink: OtlpSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = await traced()
    plain.fake.queue(Reply(body=anthropic_answer()))
    status, _ = await post(plain, ANTHROPIC_BODY, run="r-claude", path="/v1/messages")
    assert status == 200
    [span] = of_run(await flushed(plain, sink), "r-claude")
    assert (span.name, span.kind, span.status_code) == ("chat claude-3-5-haiku-latest", CLIENT, UNSET)
    expected = {
        GenAI.GEN_AI_OPERATION_NAME: (S, "chat"),
        GenAI.GEN_AI_PROVIDER_NAME: (S, "anthropic"),
        GenAI.GEN_AI_REQUEST_MAX_TOKENS: (I, 64),
        GenAI.GEN_AI_REQUEST_TEMPERATURE: (D, 0.5),
        GenAI.GEN_AI_REQUEST_TOP_K: (D, 5.0),  # a double in v1.41
        GenAI.GEN_AI_RESPONSE_ID: (S, "msg_fake"),
        GenAI.GEN_AI_RESPONSE_FINISH_REASONS: (A, [(S, "end_turn")]),
        GenAI.GEN_AI_USAGE_INPUT_TOKENS: (I, 130),  # 10 + cache read 100 + cache creation 20
        GenAI.GEN_AI_USAGE_OUTPUT_TOKENS: (I, 5),
        GenAI.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: (I, 100),
        GenAI.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: (I, 20),
    }
    assert {k: span.attributes.get(k) for k in expected} == expected
    assert not any(k.startswith("openai.") for k in span.attributes)
    assert GenAI.GEN_AI_SYSTEM_INSTRUCTIONS not in span.attributes
    assert GenAI.GEN_AI_INPUT_MESSAGES not in span.attributes

    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    captured = await traced()
    captured.fake.queue(Reply(body=anthropic_answer()))
    status, _ = await post(captured, ANTHROPIC_BODY, run="r-claude-content", path="/v1/messages")
    assert status == 200
    [span] = of_run(await flushed(captured, sink), "r-claude-content")
    kind, system = span.attributes[GenAI.GEN_AI_SYSTEM_INSTRUCTIONS]
    assert kind == S and json.loads(system) == [{"type": "text", "content": "You are terse."}]
    [message] = json.loads(span.value(GenAI.GEN_AI_INPUT_MESSAGES))
    assert message["role"] == "user" and message["parts"] == [{"type": "text", "content": "hello"}]
    [output] = json.loads(span.value(GenAI.GEN_AI_OUTPUT_MESSAGES))
    assert output["role"] == "assistant" and output["finish_reason"] == "stop"  # the convention's enum


# -- upstream errors -------------------------------------------------------------------------------


async def test_upstream_errors_set_error_type_and_status(
    traced: GatewayFactory, sink: OtlpSink, fake_url: str
) -> None:
    dead = {"type": "openai", "base_url": f"http://127.0.0.1:{closed_port()}/v1", "api_key": "x"}
    slow = {"type": "openai", "base_url": f"{fake_url}/v1", "api_key": "x", "timeouts": {"first_byte": 0.2}}
    h = await traced(
        providers=providers(fake_url, dead=dead, slow=slow),
        models={"gpt-*": "openai", "dead-*": "dead", "slow-*": "slow"},
    )
    h.fake.queue(
        Reply(status=500, body={"error": {"message": "boom", "type": "server_error"}}),
        Reply(status=429, body={"error": {"message": "slow down", "type": "rate_limit"}}),
        Reply(delay=1.0, body=openai_completion()),
    )
    cases = [
        ("gpt-4o-mini", "e-500", 500, "500"),
        ("gpt-4o-mini", "e-429", 429, "429"),
        ("slow-model", "e-timeout", 504, "upstream_timeout"),
        ("dead-model", "e-dead", 502, "upstream_unavailable"),
    ]
    for model, run, status, _ in cases:
        got, _ = await post(h, {"model": model, "messages": MSG}, run=run)
        assert got == status
    spans = await flushed(h, sink)
    for model, run, _, error_type in cases:
        [span] = of_run(spans, run)
        assert (span.name, span.kind) == (f"chat {model}", CLIENT)
        assert span.status_code == ERROR
        assert span.attributes[Error.ERROR_TYPE] == (S, error_type)
        assert GenAI.GEN_AI_USAGE_INPUT_TOKENS not in span.attributes
        assert TOLLGATE_STOP_REASON not in span.attributes  # an error, not a stop
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    errors = {
        s.labels.get("error_type")
        for s in families["gen_ai_client_operation_duration_seconds"].samples
        if s.name.endswith("_count")
    }
    assert {"500", "429", "upstream_timeout", "upstream_unavailable"} <= errors


# -- guard stops -----------------------------------------------------------------------------------


async def test_a_stopped_step_still_has_a_span_with_the_stop_code_and_a_guard_event(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    h = await traced(agents={"default": {"caps": {"llm_calls": 1}}})
    statuses = [(await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-cap"))[0] for _ in range(3)]
    assert statuses == [200, 403, 403]
    assert len(h.fake.seen) == 1

    spans = await flushed(h, sink)
    trace_id, root_id = root_ids("r-cap")
    answered, *stopped = of_run(spans, "r-cap", "chat gpt-4o-mini")
    assert answered.status_code == UNSET and Error.ERROR_TYPE not in answered.attributes
    assert len(stopped) == 2  # the step that stopped the run, and one refused by the stopped run
    for span in stopped:
        assert (span.kind, span.trace_id, span.parent_span_id) == (CLIENT, trace_id, root_id)
        assert span.status_code == ERROR
        assert span.attributes[Error.ERROR_TYPE] == (S, "llm_call_cap")
        assert span.attributes[TOLLGATE_STOP_REASON] == (S, "llm_call_cap")
        assert GenAI.GEN_AI_USAGE_INPUT_TOKENS not in span.attributes  # it never reached the upstream
        [event] = guard_events(span)
        assert event[TOLLGATE_GUARD_NAME] == "caps"
        assert event[TOLLGATE_GUARD_DECISION] == "stop"
        assert event[TOLLGATE_GUARD_REASON] == "llm_call_cap"
    # the run ended with the stop: its root span is exported, and is the parent of every step
    [root] = of_run(spans, "r-cap", "invoke_agent default")
    assert (root.kind, root.trace_id, root.span_id, root.parent_span_id) == (INTERNAL, trace_id, root_id, "")
    assert root.status_code == ERROR and root.attributes[Error.ERROR_TYPE] == (S, "llm_call_cap")
    assert root.attributes[TOLLGATE_LLM_CALLS] == (I, 1)
    assert root.attributes[GenAI.GEN_AI_PROVIDER_NAME] == (S, "openai")

    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    stops = [
        s.value
        for s in families["tollgate_runs_stopped"].samples
        if s.labels.get("reason") == "llm_call_cap" and s.name.endswith("_total")
    ]
    assert stops == [1]  # one run stopped; the step refused afterwards does not count again
    calls = [
        s.value
        for s in families["gen_ai_client_operation_duration_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert sum(calls) == 1  # stopped steps made no client operation


async def test_a_stop_after_the_answer_keeps_the_answer_on_the_span(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    h = await traced(agents={"default": {"tools": {"allow": ["search_kb"], "on_violation": "reject"}}})
    h.fake.queue(Reply(body=openai_completion("", tool_calls=[tool_call("drop_tables")], prompt_tokens=21)))
    status, data = await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-tool")
    assert status == 403 and b"tool_not_allowed" in data

    [span] = of_run(await flushed(h, sink), "r-tool", "chat gpt-4o-mini")
    assert span.status_code == ERROR and span.attributes[Error.ERROR_TYPE] == (S, "tool_not_allowed")
    assert span.attributes[GenAI.GEN_AI_USAGE_INPUT_TOKENS] == (I, 21)  # the upstream did answer
    assert span.attributes[GenAI.GEN_AI_RESPONSE_FINISH_REASONS] == (A, [(S, "tool_calls")])
    [event] = guard_events(span)
    assert (event[TOLLGATE_GUARD_NAME], event[TOLLGATE_GUARD_DECISION]) == ("tools", "stop")
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    tokens = [
        s
        for s in families["gen_ai_client_token_usage"].samples
        if s.name.endswith("_sum") and s.labels.get("gen_ai_token_type") == "input"
    ]
    assert [s.value for s in tokens] == [21]  # the client operation is measured, without error.type
    assert tokens[0].labels.get("error_type", "") == ""


async def test_a_refused_step_and_a_broken_stream_have_spans_with_their_error_codes(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    h = await traced(
        models={"gpt-*": "openai", "claude-*": "anthropic", "house-*": "openai"},
        agents={"default": {"budget": {"usd": 1.0}}},
    )
    status, data = await post(h, {"model": "house-model", "messages": MSG}, run="r-unpriced")
    assert status == 400 and b"invalid_request" in data  # a USD budget cannot hold an unpriced model
    h.fake.queue(Reply(chunks=openai_stream(["a", "b", "c"]), cut_after=3))
    status, data = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, run="r-cut")
    assert status == 200 and b"upstream_unavailable" in data  # the stream's final error event

    spans = await flushed(h, sink)
    [refused] = of_run(spans, "r-unpriced")
    assert (refused.name, refused.kind, refused.status_code) == ("chat house-model", CLIENT, ERROR)
    assert refused.attributes[Error.ERROR_TYPE] == (S, "invalid_request")
    assert TOLLGATE_STOP_REASON not in refused.attributes  # refused, the run goes on
    [event] = guard_events(refused)
    assert (event[TOLLGATE_GUARD_NAME], event[TOLLGATE_GUARD_DECISION]) == ("budget", "reject")
    assert refused.parent_span_id == root_ids("r-unpriced")[1]
    [cut] = of_run(spans, "r-cut")
    assert cut.status_code == ERROR and cut.attributes[Error.ERROR_TYPE] == (S, "upstream_unavailable")
    assert cut.attributes[GenAI.GEN_AI_REQUEST_STREAM] == (B, True)
    assert cut.attributes[GenAI.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK][0] == D
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    counts = {
        s.labels["error_type"]: s.value
        for s in families["gen_ai_client_operation_duration_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts == {"upstream_unavailable": 1}  # the refused step made no client operation


async def test_reasks_are_attempts_and_a_reask_stopped_before_the_upstream_gets_its_own_span(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "a",
            "schema": {
                "type": "object",
                "properties": {"answer": {"type": "integer"}},
                "required": ["answer"],
            },
        },
    }
    h = await traced(agents={"default": {"output": {"retries": 1}}, "capped": {"caps": {"llm_calls": 1}}})
    h.fake.queue(Reply(body=openai_completion("four")), Reply(body=openai_completion('{"answer": 4}')))
    status, _ = await post(
        h, {"model": "gpt-4o-mini", "messages": MSG, "response_format": schema}, run="r-reask"
    )
    assert status == 200
    h.fake.queue(Reply(body=openai_completion("four")))
    status, data = await post(
        h,
        {"model": "gpt-4o-mini", "messages": MSG, "response_format": schema},
        run="r-reask-cap",
        headers={"x-tollgate-agent": "capped"},
    )
    assert status == 403 and b"llm_call_cap" in data
    spans = await flushed(h, sink)

    # a re-ask that reached the upstream: one span per attempt once proxy.run_step calls start_span
    # on every attempt (see gateway/observe.py); today's single call gives one span for the step
    reasked = sorted(of_run(spans, "r-reask"), key=lambda s: s.value(TOLLGATE_ATTEMPT))
    assert [s.value(TOLLGATE_ATTEMPT) for s in reasked] in ([0], [0, 1])
    assert [e[TOLLGATE_GUARD_DECISION] for e in guard_events(reasked[0])] == ["reask"]
    assert all(s.status_code == UNSET for s in reasked)

    # a re-ask the caps stopped before it reached the upstream: the answered attempt, then the stopped one
    first, second = sorted(
        of_run(spans, "r-reask-cap", "chat gpt-4o-mini"), key=lambda s: s.value(TOLLGATE_ATTEMPT)
    )
    assert (first.value(TOLLGATE_ATTEMPT), second.value(TOLLGATE_ATTEMPT)) == (0, 1)
    assert first.status_code == UNSET and first.attributes[GenAI.GEN_AI_USAGE_INPUT_TOKENS] == (I, 10)
    assert [(e[TOLLGATE_GUARD_NAME], e[TOLLGATE_GUARD_DECISION]) for e in guard_events(first)] == [
        ("output", "reask")
    ]
    assert second.status_code == ERROR and second.attributes[Error.ERROR_TYPE] == (S, "llm_call_cap")
    assert GenAI.GEN_AI_USAGE_INPUT_TOKENS not in second.attributes
    assert first.parent_span_id == second.parent_span_id == root_ids("r-reask-cap")[1]


# -- trace shape -----------------------------------------------------------------------------------


async def test_one_trace_per_run_with_its_root_exported_on_reset(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    h = await traced()
    h.fake.queue(
        Reply(body=openai_completion()),
        Reply(body=anthropic_message()),
        Reply(chunks=openai_stream(["a"])),
        Reply(body=openai_completion()),
    )
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-one"))[0] == 200
    assert (await post(h, {**ANTHROPIC_BODY}, run="r-one", path="/v1/messages"))[0] == 200
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, run="r-one"))[0] == 200
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-other"))[0] == 200

    spans = await flushed(h, sink)
    trace_id, root_id = root_ids("r-one")
    steps = of_run(spans, "r-one")
    assert len(steps) == 3 and {(s.trace_id, s.parent_span_id) for s in steps} == {(trace_id, root_id)}
    assert not of_run(spans, "r-one", "invoke_agent default")  # the run is still going
    [other] = of_run(spans, "r-other")
    assert other.trace_id == root_ids("r-other")[0] != trace_id
    upstream_traces = {seen.headers["traceparent"].split("-")[1] for seen in h.fake.seen[:3]}
    assert upstream_traces == {trace_id}

    async with h.session.post(f"{h.admin_url}/admin/runs/r-one/reset") as resp:
        assert resp.status == 200
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-one"))[0] == 200
    spans = await flushed(h, sink)
    [root] = of_run(spans, "r-one", "invoke_agent default")
    assert (root.trace_id, root.span_id, root.parent_span_id, root.kind) == (trace_id, root_id, "", INTERNAL)
    assert root.status_code == UNSET and Error.ERROR_TYPE not in root.attributes
    assert root.attributes[TOLLGATE_LLM_CALLS] == (I, 3)
    assert root.attributes[GenAI.GEN_AI_PROVIDER_NAME] == (S, GATEWAY_PROVIDER)  # two providers
    assert root.attributes[GenAI.GEN_AI_AGENT_NAME] == (S, "default")
    # after the reset the run starts afresh, in a trace of its own
    [after] = [s for s in of_run(spans, "r-one") if s.kind == CLIENT and s.trace_id != trace_id]
    assert (after.trace_id, after.parent_span_id) == root_ids("r-one", 2)
    # a step refused before it reads the run (no such model) is in the fresh epoch's trace too
    assert (await post(h, {"model": "no-such-model", "messages": MSG}, run="r-one"))[0] == 404
    [refused] = of_run(await flushed(h, sink), "r-one", "chat no-such-model")
    assert (refused.trace_id, refused.parent_span_id) == root_ids("r-one", 2)


async def test_agent_traceparent_is_honoured_and_propagated_upstream(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    h = await traced()
    headers = {"traceparent": AGENT_TRACEPARENT, "tracestate": "vendor=1"}
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-agent", headers=headers))[
        0
    ] == 200
    assert (await post(h, {**ANTHROPIC_BODY}, run="r-agent", path="/v1/messages", headers=headers))[0] == 200

    spans = of_run(await flushed(h, sink), "r-agent")
    assert len(spans) == 2
    for span, seen in zip(spans, h.fake.seen, strict=True):
        assert (span.trace_id, span.parent_span_id) == (AGENT_TRACE, AGENT_SPAN)  # joins the agent's trace
        assert seen.headers["traceparent"] == f"00-{AGENT_TRACE}-{span.span_id}-01"  # and passes it on
        assert seen.headers["tracestate"] == "vendor=1"


# -- MCP -------------------------------------------------------------------------------------------


@pytest.fixture
def files() -> Iterator[mcp_server.RunningServer]:
    server = mcp_server.start()
    yield server
    server.stop()


MODERN = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call"}
MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


async def tools_call(
    h: Harness,
    tool: str,
    arguments: dict[str, Any],
    *,
    rpc_id: int,
    run: str,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body = {
        "jsonrpc": "2.0",
        "id": rpc_id,
        "method": "tools/call",
        "params": {"name": tool, "arguments": arguments, "_meta": {**MODERN_META, **(meta or {})}},
    }
    headers = {
        "x-tollgate-agent": "bot",
        "x-tollgate-run-id": run,
        "content-type": "application/json",
        "accept": "application/json, text/event-stream",
        **MODERN,
        "mcp-name": tool,
    }
    async with h.session.post(f"{h.url}/mcp/files", data=orjson.dumps(body), headers=headers) as resp:
        return orjson.loads(await resp.read())  # type: ignore[no-any-return]


async def test_mcp_tools_call_spans_with_meta_context_in_and_out(
    traced: GatewayFactory, sink: OtlpSink, files: mcp_server.RunningServer
) -> None:
    h = await traced(
        mcp_servers={"files": {"url": files.url}},
        agents={"bot": {"tools": {"allow": ["files/read_file"], "on_violation": "reject"}}},
    )
    ok = await tools_call(
        h, "read_file", {"path": "a"}, rpc_id=7, run="m1", meta={"traceparent": AGENT_TRACEPARENT}
    )
    assert ok["result"]["content"][0]["text"] == "contents of a"
    tool_error = await tools_call(h, "read_file", {"wrong": 1}, rpc_id=8, run="m1")
    assert tool_error["result"]["isError"] is True
    denied = await tools_call(h, "admin_reset", {"confirm": True}, rpc_id=9, run="m1")
    assert denied["error"]["data"] == {"code": "tool_not_allowed"}

    spans = await flushed(h, sink)
    first, second = of_run(spans, "m1", "tools/call read_file")
    port = int(files.url.rsplit(":", 1)[1].split("/")[0])
    expected = {
        Mcp.MCP_METHOD_NAME: (S, "tools/call"),
        GenAI.GEN_AI_OPERATION_NAME: (S, "execute_tool"),
        GenAI.GEN_AI_TOOL_NAME: (S, "read_file"),
        JsonRpc.JSONRPC_REQUEST_ID: (S, "7"),
        Mcp.MCP_PROTOCOL_VERSION: (S, "2026-07-28"),
        Server.SERVER_ADDRESS: (S, "127.0.0.1"),
        Server.SERVER_PORT: (I, port),
        Network.NETWORK_TRANSPORT: (S, "tcp"),
    }
    assert {k: first.attributes.get(k) for k in expected} == expected
    assert (first.kind, first.status_code) == (CLIENT, UNSET) and Error.ERROR_TYPE not in first.attributes
    # parent from params._meta, and the span's own context injected into the forwarded params._meta
    assert (first.trace_id, first.parent_span_id) == (AGENT_TRACE, AGENT_SPAN)
    forwarded = [m for _, m in files.seen.requests if m is not None and m.get("method") == "tools/call"]
    assert forwarded[0]["params"]["_meta"]["traceparent"] == f"00-{AGENT_TRACE}-{first.span_id}-01"
    assert forwarded[0]["params"]["arguments"] == {"path": "a"}
    # no context from the agent: the run's trace, and the server still gets the span's context
    trace_id, root_id = root_ids("m1")
    assert (second.trace_id, second.parent_span_id) == (trace_id, root_id)
    assert forwarded[1]["params"]["_meta"]["traceparent"].startswith(traceparent_of(second))
    assert second.status_code == ERROR and second.attributes[Error.ERROR_TYPE] == (S, "tool_error")
    # refused before the server: a span with the stop code and the guard event; the run's root is exported
    [refused] = of_run(spans, "m1", "tools/call admin_reset")
    assert (refused.trace_id, refused.parent_span_id) == (trace_id, root_id)
    assert refused.status_code == ERROR and refused.attributes[Error.ERROR_TYPE] == (S, "tool_not_allowed")
    assert [(e[TOLLGATE_GUARD_NAME], e[TOLLGATE_GUARD_DECISION]) for e in guard_events(refused)] == [
        ("tools", "stop")
    ]
    assert len(forwarded) == 2
    [root] = of_run(spans, "m1", "invoke_agent bot")
    assert root.span_id == root_id and root.attributes[Error.ERROR_TYPE] == (S, "tool_not_allowed")

    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    durations = {
        s.labels["error_type"]: s.value
        for s in families["mcp_client_operation_duration_seconds"].samples
        if s.name.endswith("_count")
    }
    assert durations == {"": 1, "tool_error": 1}
    decisions = {
        s.labels["decision"]: s.value
        for s in families["tollgate_tool_calls"].samples
        if s.name.endswith("_total")
    }
    assert decisions == {"executed": 2, "rejected": 1}


# -- collector down --------------------------------------------------------------------------------


async def p50_latency_ms(h: Harness, run: str, count: int = 50) -> float:
    loop = asyncio.get_running_loop()
    for _ in range(5):  # warm the pools
        await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run=run)
    times: list[float] = []
    for _ in range(count):
        start = loop.time()
        status, _ = await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run=run)
        times.append((loop.time() - start) * 1000)
        assert status == 200
    return sorted(times)[len(times) // 2]


async def test_collector_down_costs_requests_nothing_and_drops_are_counted(
    otel_env: None, gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    disabled = await gateway_factory()
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "300")  # ms: give up on the dead collector quickly
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # export (and fail) while requests run
    down = await gateway_factory()
    assert down.gateway.services["telemetry"].tracing
    assert not disabled.gateway.services["telemetry"].tracing

    base = await p50_latency_ms(disabled, "lat-off")
    slow = await p50_latency_ms(down, "lat-down")
    assert slow < 2 * base + 2.0, (slow, base)

    assert await asyncio.to_thread(down.gateway.services["telemetry"].force_flush)
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(down))}
    [dropped] = [s.value for s in families["tollgate_spans_dropped"].samples if s.name.endswith("_total")]
    assert dropped > 0
    # with tracing disabled the agent's trace context still reaches the upstream unchanged
    await post(
        disabled,
        {"model": "gpt-4o-mini", "messages": MSG},
        run="lat-off",
        headers={"traceparent": AGENT_TRACEPARENT},
    )
    assert disabled.fake.seen[-1].headers["traceparent"] == AGENT_TRACEPARENT


# -- redaction -------------------------------------------------------------------------------------

PROVIDER_KEY = "prov-Zq81xWv4LmTt"  # not shaped like any known key: only the configured value finds it
AGENT_KEY = "tgk-bot-7Hq2Lp9Xw"
BEARER = "eyJhbGciOiJub25lIn0-opaque-9f8e7d6c5b4a"


async def test_keys_and_bearer_tokens_in_prompts_never_leave_the_process(
    traced: GatewayFactory, sink: OtlpSink, fake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    provs = providers(fake_url)
    provs["openai"]["api_key"] = PROVIDER_KEY
    h = await traced(providers=provs, agents={"bot": {"keys": [AGENT_KEY]}})
    prompt = f"debug: key {PROVIDER_KEY}, my key is {AGENT_KEY}, header Authorization: Bearer {BEARER}"
    h.fake.queue(Reply(body=openai_completion(f"I saw {PROVIDER_KEY} and Bearer {BEARER}")))
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": prompt}],
        "tools": [{"type": "function", "function": {"name": "t", "description": prompt, "parameters": {}}}],
    }
    status, data = await post(h, body, run="r-secret", headers={"authorization": f"Bearer {AGENT_KEY}"})
    # the answer as it came, but the provider key tollgate sent, which is never shown to the agent (DESIGN 3)
    assert status == 200 and PROVIDER_KEY.encode() not in data and b"[redacted by tollgate]" in data
    assert BEARER.encode() in data

    spans = await flushed(h, sink)
    [span] = of_run(spans, "r-secret")
    assert GenAI.GEN_AI_INPUT_MESSAGES in span.attributes and GenAI.GEN_AI_OUTPUT_MESSAGES in span.attributes
    assert "[REDACTED]" in span.value(GenAI.GEN_AI_INPUT_MESSAGES)

    def strings(value: Any) -> Iterator[str]:
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
            yield from strings(value[1])
        elif isinstance(value, list | tuple):
            for item in value:
                yield from strings(item)
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        else:
            yield str(value)

    exported = (
        [
            v
            for s in spans
            for attrs in (s.attributes, s.resource, *(e for _, e in s.events))
            for v in strings(attrs)
        ]
        + [s.name for s in spans]
        + [s.status_message for s in spans]
    )
    for secret in (PROVIDER_KEY, AGENT_KEY, BEARER):
        assert not [v for v in exported if secret in v], secret
        assert all(secret.encode() not in payload for payload in sink.payloads)  # nor anywhere on the wire


# -- /metrics ----------------------------------------------------------------------------------------


async def test_metrics_parse_and_pass_promtool_after_real_traffic(
    traced: GatewayFactory, sink: OtlpSink, fake_url: str
) -> None:
    pricing = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
    h = await traced(pricing=pricing, agents={"default": {"caps": {"llm_calls": 3}, "budget": {"usd": 1.0}}})
    h.fake.queue(
        Reply(body=openai_completion()),
        Reply(chunks=openai_stream(["a", "b"])),
        Reply(status=500, body={"error": {"message": "boom"}}),
        Reply(body=openai_completion()),
        Reply(body=anthropic_message()),
    )
    await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="run-m1")
    await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, run="run-m1")
    await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="run-m1")  # a 5xx: no model call of the run
    await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="run-m1")
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="run-m1"))[0] == 403  # llm_call_cap
    await post(h, {**ANTHROPIC_BODY}, run="run-m2", path="/v1/messages")

    text = await metrics_text(h)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "gen_ai_client_operation_duration_seconds",
        "gen_ai_client_token_usage",
        "gen_ai_client_operation_time_to_first_chunk_seconds",
        "tollgate_guard_decisions",
        "tollgate_runs_stopped",
        "tollgate_upstream_requests",
        "tollgate_cost_usd",
        "tollgate_budget_reserved_usd",
        "tollgate_spans_dropped",
    ):
        assert name in families, name
    assert families["gen_ai_client_operation_duration_seconds"].type == "histogram"
    upstream = {
        (s.labels["provider"], s.labels["status"]): s.value
        for s in families["tollgate_upstream_requests"].samples
        if s.name.endswith("_total")
    }
    assert upstream == {("openai", "200"): 3, ("openai", "500"): 1, ("anthropic", "200"): 1}
    [reserved] = families["tollgate_budget_reserved_usd"].samples
    assert reserved.value == 0  # nothing in flight
    assert "run-m1" not in text and "run-m2" not in text  # never a run id in a label

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (Debian package prometheus)")
        pytest.skip("promtool not installed")
    proc = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(text.encode()), 30)
    assert proc.returncode == 0 and not out.strip() and not err.strip(), (out, err)


async def test_budget_reserved_gauge_follows_steps_in_flight(traced: GatewayFactory, sink: OtlpSink) -> None:
    pricing = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
    h = await traced(pricing=pricing, agents={"default": {"budget": {"usd": 1.0}}})
    h.fake.queue(Reply(body=openai_completion(), delay=0.3))
    request = asyncio.create_task(
        post(h, {"model": "gpt-4o-mini", "messages": MSG, "max_tokens": 1000}, run="g1")
    )
    for _ in range(400):
        if h.fake.in_flight:
            break
        await asyncio.sleep(0.005)
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    [during] = families["tollgate_budget_reserved_usd"].samples
    assert (await request)[0] == 200
    families = {f.name: f for f in text_string_to_metric_families(await metrics_text(h))}
    [after] = families["tollgate_budget_reserved_usd"].samples
    assert during.value >= 1000 * 2.0 / 1e6  # at least the output tokens it may use
    assert after.value == 0


async def test_a_run_root_whose_usage_was_partly_unreported_says_charged_not_used(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """A stream cut before its usage is charged its reservation (up to the provider's 32,768 output
    tokens); the root reported that as `gen_ai.usage.*`, a completion no provider counted. Such a root
    names it `tollgate.charged.*`; a run whose every usage was reported keeps `gen_ai.usage.*`."""
    h = await traced()
    h.fake.queue(Reply(body=openai_completion()), Reply(chunks=openai_stream(["a"], usage=None, done=False)),
                 Reply(body=openai_completion()))
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-cut"))[0] == 200
    await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True, "max_tokens": 200}, run="r-cut")
    assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-whole"))[0] == 200
    for run in ("r-cut", "r-whole"):
        async with h.session.post(f"{h.admin_url}/admin/runs/{run}/reset") as resp:
            assert resp.status == 200
    spans = await flushed(h, sink)
    [cut] = of_run(spans, "r-cut", "invoke_agent default")
    assert GenAI.GEN_AI_USAGE_OUTPUT_TOKENS not in cut.attributes
    assert GenAI.GEN_AI_USAGE_INPUT_TOKENS not in cut.attributes
    assert cut.attributes[TOLLGATE_CHARGED_OUTPUT_TOKENS] == (I, 5 + 200)  # the answer's 5, the cut's reservation
    assert cut.attributes[TOLLGATE_CHARGED_INPUT_TOKENS][1] > 10
    [whole] = of_run(spans, "r-whole", "invoke_agent default")
    assert (whole.attributes[GenAI.GEN_AI_USAGE_INPUT_TOKENS], whole.attributes[GenAI.GEN_AI_USAGE_OUTPUT_TOKENS]) == (
        (I, 10), (I, 5))
    assert TOLLGATE_CHARGED_OUTPUT_TOKENS not in whole.attributes


async def test_a_buffered_stream_has_a_time_to_first_chunk_for_each_attempt(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """semconv times the first chunk as the client receives it: a stream tollgate buffers
    (`stream_check: buffer`, or several choices under a constraint) had none, on the span or the metric."""
    h = await traced(agents={"default": {"output": {"grammar": "regex:[a-z]+", "stream_check": "buffer",
                                                    "retries": 1}}})
    h.fake.queue(Reply(chunks=openai_stream(["NO"])), Reply(chunks=openai_stream(["yes"])))
    status, data = await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True}, run="r-buffered")
    assert status == 200 and b"yes" in data
    attempts = of_run(await flushed(h, sink), "r-buffered")
    assert len(attempts) == 2  # the re-ask is an attempt of its own
    for span in attempts:
        kind, ttfc = span.attributes[GenAI.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
        assert kind == D and 0 < ttfc < 5


async def test_a_run_root_says_charged_however_long_ago_its_usage_went_unreported(
    traced: GatewayFactory, sink: OtlpSink
) -> None:
    """The mark came from the run's kept step summaries, the last 50: a cut stream followed by 50 steps
    reported its 20,000 charged tokens as usage again. The store counts such settlements instead."""
    h = await traced()
    h.fake.queue(Reply(chunks=openai_stream(["a"], usage=None, done=False)))
    await post(h, {"model": "gpt-4o-mini", "messages": MSG, "stream": True, "max_tokens": 2000}, run="r-long")
    h.fake.default = Reply(body=openai_completion())
    for _ in range(MAX_STEPS):
        assert (await post(h, {"model": "gpt-4o-mini", "messages": MSG}, run="r-long"))[0] == 200
    async with h.session.post(f"{h.admin_url}/admin/runs/r-long/reset") as resp:
        assert resp.status == 200
    [root] = of_run(await flushed(h, sink), "r-long", "invoke_agent default")
    assert GenAI.GEN_AI_USAGE_OUTPUT_TOKENS not in root.attributes
    assert root.attributes[TOLLGATE_CHARGED_OUTPUT_TOKENS] == (I, 2000 + 5 * MAX_STEPS)
