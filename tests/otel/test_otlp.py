"""The wire encoding: real OTLP/HTTP protobuf export into a loopback receiver, decoded and checked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from gateway.call import Answer
from otel.mcp_attributes import McpOperation
from otel.redact import Redactor
from otel.runs import RunTotals, context_from_headers, path_fingerprint, run_ids
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.otel.otlp_sink import OtlpSink, WireSpan, running_sink
from tests.otel.samples import (
    AGENT_BEARER,
    ANTHROPIC_ANSWER,
    MCP_OK,
    MCP_TOOL_ERROR,
    OPENAI_ANSWER,
    OPENAI_BODY,
    PROVIDER_KEY,
    anthropic_call,
    mcp_call,
    openai_call,
)

CLIENT, INTERNAL = 3, 1
UNSET, ERROR = 0, 2
AGENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AGENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
async def sink() -> AsyncIterator[OtlpSink]:
    async with running_sink() as sink:
        yield sink


def run_scenario(telemetry: Telemetry) -> None:
    """One agent run without trace context (5 steps, then its end), one step in the agent's trace."""
    redactor = Redactor(secrets=(PROVIDER_KEY,))
    parent = telemetry.run_parent("run-42", "support-bot")
    body = {
        **OPENAI_BODY,
        "messages": [{"role": "user", "content": f"my key is {PROVIDER_KEY}; Bearer {AGENT_BEARER}"}],
    }

    chat = telemetry.start_inference(
        openai_call(body, stream=True),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=parent,
        attempt=0,
    )
    chat.guard_event("budget", "continue", None, "reserved 0.02")
    chat.capture_input(openai_call(body), redactor)
    chat.chunk()
    chat.capture_output(Answer(text=f"noted {PROVIDER_KEY}", finish_reasons=("stop",)), redactor)
    chat.finish(OPENAI_ANSWER, cost_usd=0.02)

    tool = telemetry.start_mcp(McpOperation(
        "tools/call", tool_name="search_kb", request_id=3, session_id="s-9", protocol_version="2025-06-18",
        server_address="127.0.0.1", server_port=3001,
    ), parent=parent)
    tool.capture_input(mcp_call("search_kb", '{"q": "refund"}'), redactor)
    tool.finish(MCP_OK)

    claude = telemetry.start_inference(
        anthropic_call(),
        provider_name="anthropic",
        server_address="api.anthropic.com",
        server_port=443,
        parent=parent,
        attempt=0,
    )
    claude.capture_input(anthropic_call(), redactor)
    claude.finish(ANTHROPIC_ANSWER, cost_usd=0.01)

    limited = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=parent,
        attempt=0,
    )
    limited.fail("429", "rate limited upstream")

    stopped = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=parent,
        attempt=0,
    )
    stopped.guard_event("budget", "stop", "budget_exhausted", "spent 2.00 of 2.00")
    stopped.stop("budget_exhausted", "budget of 2.00 USD exhausted")
    stopped.end()

    broken = telemetry.start_mcp(McpOperation("tools/call", tool_name="delete_all", request_id="r-1"), parent=parent)
    broken.finish(MCP_TOOL_ERROR)

    telemetry.end_run(
        "run-42",
        "support-bot",
        started_at=1_750_000_000.0,
        totals=RunTotals(
            cost_usd=0.03,
            input_tokens=270,
            output_tokens=70,
            llm_calls=4,
            tool_calls=2,
            stop_reason="budget_exhausted",
            path_fingerprint=path_fingerprint(["llm", "tool", "llm", "stop"]),
        ),
    )

    agent_ctx = context_from_headers({"traceparent": f"00-{AGENT_TRACE}-{AGENT_SPAN}-01"})
    joined = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=agent_ctx,
        attempt=0,
    )
    joined.finish(OPENAI_ANSWER)


async def test_otlp_protobuf_payload(sink: OtlpSink) -> None:
    telemetry = setup_telemetry(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY",
        }
    )
    run_scenario(telemetry)
    assert await asyncio.to_thread(telemetry.force_flush, 10)
    assert await asyncio.to_thread(telemetry.shutdown, 5)
    assert telemetry.spans_dropped() == 0 and telemetry.errors() == {}

    by_name: dict[str, list[WireSpan]] = {}
    for span in sink.spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted((name, len(spans)) for name, spans in by_name.items()) == [
        ("chat claude-sonnet-4-5", 1),
        ("chat gpt-4o-mini", 4),
        ("invoke_agent support-bot", 1),
        ("tools/call delete_all", 1),
        ("tools/call search_kb", 1),
    ]
    for span in sink.spans:
        assert span.schema_url == "https://opentelemetry.io/schemas/1.41.0" and span.scope == "tollgate"
        assert span.resource["service.name"] == ("string_value", "tollgate")
        assert span.resource["deployment.environment"] == ("string_value", "test")

    # one trace per run: every step of run-42 is a child of the derived invoke_agent root
    (root,) = by_name["invoke_agent support-bot"]
    trace_id, span_id = run_ids("run-42")
    assert (root.trace_id, root.span_id, root.parent_span_id) == (f"{trace_id:032x}", f"{span_id:016x}", "")
    assert root.kind == INTERNAL and root.status_code == ERROR
    run_steps = [s for s in sink.spans if s.trace_id == root.trace_id and s is not root]
    assert len(run_steps) == 6 and {s.parent_span_id for s in run_steps} == {root.span_id}
    assert {s.kind for s in run_steps} == {CLIENT}
    assert root.attributes["tollgate.cost_usd"] == ("double_value", 0.03)
    assert root.attributes["tollgate.llm_calls"] == ("int_value", 4)
    assert root.attributes["error.type"] == ("string_value", "budget_exhausted")

    # the agent's own trace context is honoured
    (joined,) = [s for s in sink.spans if s.trace_id == AGENT_TRACE]
    assert joined.parent_span_id == AGENT_SPAN and joined.name == "chat gpt-4o-mini"

    stream = next(s for s in by_name["chat gpt-4o-mini"] if "gen_ai.request.stream" in s.attributes)
    assert {
        k: stream.attributes[k]
        for k in (
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.request.model",
            "server.address",
            "server.port",
            "gen_ai.request.max_tokens",
            "gen_ai.request.temperature",
            "gen_ai.request.seed",
            "gen_ai.request.choice.count",
            "gen_ai.request.stream",
            "gen_ai.usage.input_tokens",
            "gen_ai.response.id",
            "tollgate.cost_usd",
            "tollgate.attempt",
        )
    } == {
        "gen_ai.operation.name": ("string_value", "chat"),
        "gen_ai.provider.name": ("string_value", "openai"),
        "gen_ai.request.model": ("string_value", "gpt-4o-mini"),
        "server.address": ("string_value", "api.openai.com"),
        "server.port": ("int_value", 443),
        "gen_ai.request.max_tokens": ("int_value", 256),
        "gen_ai.request.temperature": ("double_value", 0.2),
        "gen_ai.request.seed": ("int_value", 7),
        "gen_ai.request.choice.count": ("int_value", 2),
        "gen_ai.request.stream": ("bool_value", True),
        "gen_ai.usage.input_tokens": ("int_value", 120),
        "gen_ai.response.id": ("string_value", "chatcmpl-123"),
        "tollgate.cost_usd": ("double_value", 0.02),
        "tollgate.attempt": ("int_value", 0),
    }
    assert stream.attributes["gen_ai.response.finish_reasons"] == (
        "array_value",
        [("string_value", "stop"), ("string_value", "length")],
    )
    assert stream.attributes["gen_ai.request.stop_sequences"] == ("array_value", [("string_value", "END")])
    assert stream.attributes["gen_ai.response.time_to_first_chunk"][0] == "double_value"
    assert stream.events == [
        (
            "tollgate.guard",
            {
                "tollgate.guard.name": ("string_value", "budget"),
                "tollgate.guard.decision": ("string_value", "continue"),
                "tollgate.guard.detail": ("string_value", "reserved 0.02"),
            },
        )
    ]
    messages = json.loads(stream.value("gen_ai.input.messages"))
    assert messages[0]["parts"][0]["content"] == "my key is [REDACTED]; Bearer [REDACTED]"

    (claude,) = by_name["chat claude-sonnet-4-5"]
    assert claude.attributes["gen_ai.provider.name"] == ("string_value", "anthropic")
    assert claude.attributes["gen_ai.usage.input_tokens"] == ("int_value", 150)
    assert claude.attributes["gen_ai.request.top_k"] == ("double_value", 40.0)
    assert json.loads(claude.value("gen_ai.system_instructions")) == [
        {"type": "text", "content": "You are terse."}
    ]

    failed = next(
        s for s in by_name["chat gpt-4o-mini"] if s.attributes.get("error.type") == ("string_value", "429")
    )
    assert (failed.status_code, failed.status_message) == (ERROR, "rate limited upstream")
    stopped = next(s for s in by_name["chat gpt-4o-mini"] if "tollgate.stop_reason" in s.attributes)
    assert (
        stopped.attributes["error.type"] == ("string_value", "budget_exhausted")
        and stopped.status_code == ERROR
    )
    assert "gen_ai.response.id" not in stopped.attributes  # never reached upstream

    (tool,) = by_name["tools/call search_kb"]
    assert tool.kind == CLIENT and tool.status_code == UNSET
    assert {
        k: tool.attributes[k]
        for k in (
            "mcp.method.name",
            "gen_ai.operation.name",
            "gen_ai.tool.name",
            "jsonrpc.request.id",
            "mcp.session.id",
            "server.port",
        )
    } == {
        "mcp.method.name": ("string_value", "tools/call"),
        "gen_ai.operation.name": ("string_value", "execute_tool"),
        "gen_ai.tool.name": ("string_value", "search_kb"),
        "jsonrpc.request.id": ("string_value", "3"),
        "mcp.session.id": ("string_value", "s-9"),
        "server.port": ("int_value", 3001),
    }
    assert tool.attributes["gen_ai.tool.call.arguments"] == ("string_value", '{"q":"refund"}')
    (broken,) = by_name["tools/call delete_all"]
    assert broken.attributes["error.type"] == ("string_value", "tool_error") and broken.status_code == ERROR

    # redaction: neither the provider key nor the agent's bearer token ever left the process
    wire = b"".join(sink.payloads)
    assert PROVIDER_KEY.encode() not in wire and AGENT_BEARER.encode() not in wire
    assert b"[REDACTED]" in wire


async def test_otlp_gzip(sink: OtlpSink) -> None:
    telemetry = setup_telemetry(
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{sink.url}/v1/traces",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        }
    )
    telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=None,
        attempt=0,
    ).finish(OPENAI_ANSWER)
    assert await asyncio.to_thread(telemetry.force_flush, 10)
    assert await asyncio.to_thread(telemetry.shutdown, 5)
    assert [s.name for s in sink.spans] == ["chat gpt-4o-mini"]
    assert sink.gzipped == 1 and telemetry.spans_dropped() == 0
