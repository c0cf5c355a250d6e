"""Trace shape: one trace per run under a derived `invoke_agent` root, or the agent's own trace."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, get_current_span

from otel.mcp_attributes import McpOperation
from otel.runs import RunTotals, context_from_headers, inject_headers, path_fingerprint, run_ids
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.otel.conftest import Spans
from tests.otel.samples import ANTHROPIC_ANSWER, MCP_OK, OPENAI_ANSWER, anthropic_call, openai_call

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_run_ids_are_stable_distinct_and_non_zero() -> None:
    assert run_ids("run-1") == run_ids("run-1", 0)
    assert run_ids("run-1") != run_ids("run-2")
    assert run_ids("run-1", 1) != run_ids("run-1", 0)
    trace_id, span_id = run_ids("run-1")
    assert 0 < trace_id < 2**128 and 0 < span_id < 2**64
    # pinned: every sidecar process (and every release) must derive the same ids for a run
    assert (f"{trace_id:032x}", f"{span_id:016x}") == ("c32c7bb69e8cae65bba32d4f03cb669e", "aa17d5fe4125a63c")


def test_path_fingerprint() -> None:
    a = path_fingerprint(["llm:continue", "tool:search_kb:allowed", "llm:stop:loop_detected"])
    assert a == path_fingerprint(("llm:continue", "tool:search_kb:allowed", "llm:stop:loop_detected"))
    assert a != path_fingerprint(["tool:search_kb:allowed", "llm:continue", "llm:stop:loop_detected"])
    assert path_fingerprint(["ab", "c"]) != path_fingerprint(["a", "bc"])  # boundaries matter
    assert len(a) == 32 and int(a, 16) >= 0


def test_steps_of_a_run_share_one_trace_under_the_derived_root(telemetry: Telemetry, spans: Spans) -> None:
    parent = telemetry.run_parent("run-1", "support-bot")
    llm = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=parent,
        attempt=0,
    )
    llm.finish(OPENAI_ANSWER, cost_usd=0.01)
    tool = telemetry.start_mcp(McpOperation(
        "tools/call", tool_name="search_kb"
    ), parent=telemetry.run_parent("run-1", "support-bot"))
    tool.finish(MCP_OK)
    other = telemetry.start_inference(
        anthropic_call(),
        provider_name="anthropic",
        server_address="api.anthropic.com",
        server_port=443,
        parent=telemetry.run_parent("run-2", "support-bot"),
        attempt=0,
    )
    other.finish(ANTHROPIC_ANSWER)
    totals = RunTotals(
        cost_usd=0.01,
        input_tokens=120,
        output_tokens=30,
        llm_calls=1,
        tool_calls=1,
        stop_reason="loop_detected",
        path_fingerprint="abc",
        provider_name="openai",
    )
    assert telemetry.end_run("run-1", "support-bot", started_at=1_700_000_000.5, totals=totals)

    llm_span, tool_span, other_span, root = spans()
    trace_id, span_id = run_ids("run-1")
    assert root.context is not None and (root.context.trace_id, root.context.span_id) == (trace_id, span_id)
    assert root.parent is None and root.name == "invoke_agent support-bot" and root.kind is SpanKind.INTERNAL
    assert root.start_time == 1_700_000_000_500_000_000
    for step in (llm_span, tool_span):
        assert step.context is not None and step.context.trace_id == trace_id
        assert step.parent is not None and step.parent.span_id == span_id
    assert other_span.context is not None and other_span.context.trace_id == run_ids("run-2")[0]
    assert dict(root.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "openai",
        "gen_ai.agent.name": "support-bot",
        "tollgate.agent": "support-bot",
        "tollgate.run_id": "run-1",
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 30,
        "tollgate.cost_usd": 0.01,
        "tollgate.llm_calls": 1,
        "tollgate.tool_calls": 1,
        "tollgate.stop_reason": "loop_detected",
        "error.type": "loop_detected",
        "tollgate.path_fingerprint": "abc",
    }
    assert root.status.status_code is StatusCode.ERROR


def test_each_epoch_gets_its_own_root(telemetry: Telemetry, spans: Spans) -> None:
    assert telemetry.end_run("run-1", "bot", started_at=1.0, totals=RunTotals())
    step = telemetry.start_inference(
        openai_call(),
        provider_name="openai",
        server_address="h",
        server_port=1,
        parent=telemetry.run_parent("run-1", "bot", epoch=1),
        attempt=0,
    )
    step.end()
    assert telemetry.end_run("run-1", "bot", started_at=2.0, totals=RunTotals(), epoch=1)
    first, step_span, second = spans()
    assert first.context is not None and second.context is not None and step_span.parent is not None
    assert first.context.trace_id != second.context.trace_id
    assert step_span.parent.span_id == second.context.span_id
    assert dict(second.attributes or {})["tollgate.run.epoch"] == 1
    assert dict(first.attributes or {})["gen_ai.provider.name"] == "tollgate"  # mixed / unknown provider
    assert first.status.status_code is StatusCode.UNSET


def step_under(telemetry: Telemetry, run_id: str, segment: int = 0) -> None:
    telemetry.start_inference(openai_call(), provider_name="openai", server_address="h", server_port=1,
                              parent=telemetry.run_parent(run_id, "bot", segment=segment), attempt=0).end()


def test_a_later_segment_of_a_run_is_another_root_of_the_same_trace(telemetry: Telemetry, spans: Spans) -> None:
    """After an idle export the run store hands out the epoch's next segment (`RunStore.claim_root`): the
    steps after it go under another root of the same trace, which starts where the previous one ended
    and carries the run's totals then, its stop reason included."""
    step_under(telemetry, "run-1")
    assert telemetry.end_run("run-1", "bot", started_at=1.0, totals=RunTotals(llm_calls=1))
    step_under(telemetry, "run-1", segment=1)
    assert telemetry.end_run("run-1", "bot", started_at=1.0, totals=RunTotals(llm_calls=2, stop_reason="llm_call_cap"),
                             segment=1, start=5.0)
    first_step, idle_root, second_step, stop_root = spans()
    trace_id, span_id = run_ids("run-1")
    assert idle_root.context is not None and stop_root.context is not None
    assert (idle_root.context.trace_id, idle_root.context.span_id) == (trace_id, span_id)
    assert (stop_root.context.trace_id, stop_root.context.span_id) == run_ids("run-1", 0, 1) != (trace_id, span_id)
    assert first_step.parent is not None and first_step.parent.span_id == span_id
    assert second_step.parent is not None and second_step.parent.span_id == stop_root.context.span_id
    assert idle_root.status.status_code is StatusCode.UNSET and stop_root.status.status_code is StatusCode.ERROR
    attrs = dict(stop_root.attributes or {})
    assert (attrs["error.type"], attrs["tollgate.llm_calls"], attrs["tollgate.run.segment"]) == ("llm_call_cap", 2, 1)
    assert idle_root.start_time == 1_000_000_000 and stop_root.start_time == 5_000_000_000
    assert "tollgate.run.segment" not in dict(idle_root.attributes or {})


def test_agent_traceparent_is_honoured(telemetry: Telemetry, spans: Spans) -> None:
    parent = context_from_headers({"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    assert parent is not None
    step = telemetry.start_inference(
        openai_call(), provider_name="openai", server_address="h", server_port=1, parent=parent, attempt=0
    )
    upstream = inject_headers(step.context)
    step.end()
    (span,) = spans()
    assert span.context is not None and span.parent is not None
    assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert span.parent.span_id == 0xB7AD6B7169203331 and span.parent.is_remote
    assert upstream == {
        "traceparent": f"00-0af7651916cd43dd8448eb211c80319c-{span.context.span_id:016x}-01",
        "tracestate": "vendor=1",
    }


def test_context_from_headers_edge_cases() -> None:
    assert context_from_headers({}) is None
    assert (
        context_from_headers({"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"})
        is None
    )
    assert context_from_headers({"traceparent": "nonsense"}) is None
    ctx = context_from_headers({"TraceParent": TRACEPARENT})
    assert ctx is not None and get_current_span(ctx).get_span_context().span_id == 0xB7AD6B7169203331
    assert inject_headers(None) == {}


def test_sampled_out_runs_stay_consistent(exporter: InMemorySpanExporter) -> None:
    telemetry = setup_telemetry(
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, exporter=exporter
    )
    parent = telemetry.run_parent("run-x", "bot")
    assert not get_current_span(parent).get_span_context().trace_flags.sampled
    step = telemetry.start_inference(
        openai_call(), provider_name="openai", server_address="h", server_port=1, parent=parent, attempt=0
    )
    assert not step.is_recording
    step.end()
    telemetry.end_run("run-x", "bot", started_at=1.0, totals=RunTotals())
    assert telemetry.force_flush() and exporter.get_finished_spans() == ()
    assert telemetry.shutdown()
