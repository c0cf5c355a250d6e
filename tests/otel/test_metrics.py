"""Prometheus exposition: names, labels, semconv buckets, cardinality bound, promtool-clean."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from otel.metrics import DURATION_BUCKETS, MCP_BUCKETS, TOKEN_BUCKETS, Metrics


def exercised() -> Metrics:
    metrics = Metrics(spans_dropped=lambda: 7, budget_reserved=lambda: 1.25, label_limit=3)
    common: dict[str, Any] = {
        "operation": "chat",
        "provider": "openai",
        "request_model": "gpt-4o-mini",
        "server_address": "api.openai.com",
        "server_port": 443,
    }
    metrics.observe_inference(
        **common,
        response_model="gpt-4o-mini-2024-07-18",
        error_type=None,
        duration_s=0.3,
        input_tokens=120,
        output_tokens=30,
    )
    metrics.observe_inference(**common, response_model=None, error_type="upstream_timeout", duration_s=120.0)
    gaps = metrics.chunk_gaps()
    gaps.observe(0.01)
    metrics.observe_chunks(**common, response_model="gpt-4o-mini-2024-07-18", seconds=0.05, gaps=gaps)
    metrics.observe_mcp(
        method="tools/call",
        tool_name="read_file",
        prompt_name=None,
        operation="execute_tool",
        protocol_version="2025-06-18",
        server_address="127.0.0.1",
        server_port=3001,
        rpc_status_code=None,
        error_type="tool_error",
        duration_s=0.02,
    )
    metrics.guard_decision("budget", "stop", "budget_exhausted")
    metrics.guard_decision("loop", "continue")
    metrics.guard_error("loop")
    metrics.run_stopped("budget_exhausted")
    metrics.tool_call("allowed")
    metrics.tool_call("rejected")
    metrics.output_check("json_schema", "fail")
    metrics.reask()
    metrics.cost("support-bot", "openai", "gpt-4o-mini", 0.0123)
    metrics.cost("support-bot", "openai", "gpt-4o-mini", 0.0)  # nothing to add
    metrics.upstream_request("openai", 200)
    metrics.upstream_request("openai", "timeout")
    return metrics


def samples(metrics: Metrics) -> dict[str, list[Sample]]:
    payload, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {f.name: list(f.samples) for f in text_string_to_metric_families(payload.decode())}


def test_exposition_names_and_labels() -> None:
    families = samples(exercised())
    assert {
        "gen_ai_client_operation_duration_seconds",
        "gen_ai_client_token_usage",
        "gen_ai_client_operation_time_to_first_chunk_seconds",
        "gen_ai_client_operation_time_per_output_chunk_seconds",
        "mcp_client_operation_duration_seconds",
        "tollgate_guard_decisions",
        "tollgate_guard_errors",
        "tollgate_runs_stopped",
        "tollgate_tool_calls",
        "tollgate_output_checks",
        "tollgate_reasks",
        "tollgate_cost_usd",
        "tollgate_upstream_requests",
        "tollgate_budget_reserved_usd",
        "tollgate_spans_dropped",
        "tollgate_telemetry_errors",
    } <= set(families)
    assert not [s for f in families.values() for s in f if s.name.endswith("_created")]
    counts = {
        s.labels["error_type"]: s.value
        for s in families["gen_ai_client_operation_duration_seconds"]
        if s.name.endswith("_count")
    }
    assert counts == {"": 1.0, "upstream_timeout": 1.0}
    ok = next(
        s
        for s in families["gen_ai_client_operation_duration_seconds"]
        if s.name.endswith("_count") and s.labels["error_type"] == ""
    )
    assert ok.labels == {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "gpt-4o-mini",
        "gen_ai_response_model": "gpt-4o-mini-2024-07-18",
        "server_address": "api.openai.com",
        "server_port": "443",
        "error_type": "",
    }
    tokens = {
        s.labels["gen_ai_token_type"]: s.value
        for s in families["gen_ai_client_token_usage"]
        if s.name.endswith("_sum")
    }
    assert tokens == {"input": 120.0, "output": 30.0}
    assert [s.value for s in families["tollgate_spans_dropped"]] == [7.0]
    assert [s.value for s in families["tollgate_budget_reserved_usd"]] == [1.25]
    cost = families["tollgate_cost_usd"]
    assert [(s.labels, s.value) for s in cost] == [
        ({"agent": "support-bot", "provider": "openai", "model": "gpt-4o-mini"}, 0.0123)
    ]
    assert {s.labels["status"] for s in families["tollgate_upstream_requests"]} == {"200", "timeout"}
    assert {
        (s.labels["guard"], s.labels["decision"], s.labels["reason"])
        for s in families["tollgate_guard_decisions"]
    } == {("budget", "stop", "budget_exhausted"), ("loop", "continue", "")}
    mcp = next(s for s in families["mcp_client_operation_duration_seconds"] if s.name.endswith("_count"))
    assert mcp.labels["mcp_method_name"] == "tools/call" and mcp.labels["error_type"] == "tool_error"
    for chunked in ("time_to_first_chunk", "time_per_output_chunk"):  # the stream's response model too
        [count] = [s for s in families[f"gen_ai_client_operation_{chunked}_seconds"] if s.name.endswith("_count")]
        assert count.labels["gen_ai_response_model"] == "gpt-4o-mini-2024-07-18" and count.value == 1


@pytest.mark.parametrize(
    ("family", "bounds"),
    [
        ("gen_ai_client_operation_duration_seconds", DURATION_BUCKETS),
        ("gen_ai_client_token_usage", TOKEN_BUCKETS),
        ("mcp_client_operation_duration_seconds", MCP_BUCKETS),
    ],
)
def test_semconv_bucket_boundaries(family: str, bounds: tuple[float, ...]) -> None:
    buckets = samples(exercised())[family]
    first_series = buckets[0].labels | {"le": ""}
    les = [
        s.labels["le"]
        for s in buckets
        if s.name.endswith("_bucket") and (s.labels | {"le": ""}) == first_series
    ]
    assert [float(le) for le in les] == [*map(float, bounds), float("inf")]


def test_semconv_bucket_values() -> None:
    assert DURATION_BUCKETS[0] == 0.01 and DURATION_BUCKETS[-1] == 81.92 and len(DURATION_BUCKETS) == 14
    assert TOKEN_BUCKETS[:3] == (1.0, 4.0, 16.0) and TOKEN_BUCKETS[-1] == 67108864.0
    assert MCP_BUCKETS[-1] == 300


def test_agent_controlled_labels_are_bounded() -> None:
    metrics = Metrics(label_limit=2)
    for model in ("m1", "m2", "m3", "m4", "m1"):
        metrics.cost("agent", "openai", model, 1.0)
    models = {s.labels["model"]: s.value for s in samples(metrics)["tollgate_cost_usd"]}
    assert models == {"m1": 2.0, "m2": 1.0, "_OTHER": 2.0}


def test_memoised_inference_label_sets_stay_bounded_and_counted() -> None:
    """More distinct (agent-controlled) models than the memo holds: every observation still lands in
    its series, models past the label limit in `_OTHER`, and token series exist only once counted."""
    metrics = Metrics(label_limit=2)
    models = [f"m{i}" for i in range(1500)] + ["m0", "m1", "m0"]
    for model in models:
        metrics.observe_inference(operation="chat", provider="openai", request_model=model, response_model=None,
                                  server_address="h", server_port=1, error_type=None, duration_s=0.1,
                                  input_tokens=1 if model == "m0" else None)
    assert len(metrics._inference_plans) <= 1024
    family = samples(metrics)["gen_ai_client_operation_duration_seconds"]
    counts = {s.labels["gen_ai_request_model"]: s.value for s in family if s.name.endswith("_count")}
    assert counts == {"m0": 3.0, "m1": 2.0, "_OTHER": 1498.0}
    tokens = samples(metrics)["gen_ai_client_token_usage"]
    assert {(s.labels["gen_ai_request_model"], s.labels["gen_ai_token_type"], s.value)
            for s in tokens if s.name.endswith("_count")} == {("m0", "input", 3.0)}


def test_mcp_protocol_version_label_is_bounded() -> None:
    """The `MCP-Protocol-Version` header is the agent's to write: its label is bounded like model names."""
    metrics = Metrics(label_limit=2)
    for version in ("2025-06-18", "2026-07-28", "x-1", "x-2", "2025-06-18", None):
        metrics.observe_mcp(method="tools/call", tool_name="read_file", prompt_name=None, operation="execute_tool",
                            protocol_version=version, server_address="127.0.0.1", server_port=3001,
                            rpc_status_code=None, error_type=None, duration_s=0.01)
    family = samples(metrics)["mcp_client_operation_duration_seconds"]
    counts = {s.labels["mcp_protocol_version"]: s.value for s in family if s.name.endswith("_count")}
    assert counts == {"2025-06-18": 2.0, "2026-07-28": 1.0, "_OTHER": 2.0, "": 1.0}


def test_never_a_run_id_label() -> None:
    families = samples(exercised())
    labels = {k for f in families.values() for s in f for k in s.labels}
    assert not [k for k in labels if "run" in k]


def test_metric_errors_are_swallowed_and_counted() -> None:
    metrics = Metrics()
    metrics.observe_inference(
        operation="chat",
        provider="p",
        request_model="m",
        response_model=None,
        server_address=None,
        server_port=None,
        error_type=None,
        duration_s="slow",  # type: ignore[arg-type]  # a caller bug must not raise
    )
    errors = {s.labels["component"]: s.value for s in samples(metrics)["tollgate_telemetry_errors"]}
    assert errors == {"metrics.observe_inference": 1.0}


def test_promtool_check_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is required in CI (Debian package `prometheus`)")
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    payload, _ = exercised().render()
    result = subprocess.run(
        [promtool, "check", "metrics"], input=payload, capture_output=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.decode().strip() == "" and result.stderr.decode().strip() == ""


def test_mcp_method_and_prompt_labels_are_bounded() -> None:
    """The method and the prompt name of an MCP request are the client's to write (any string): their
    labels are bounded like tool names, and a prompt has its own series (semconv `gen_ai.prompt.name`)."""
    metrics = Metrics(label_limit=2)
    for method, prompt in (("prompts/get", "alpha"), ("prompts/get", "beta"), ("prompts/get", "gamma"),
                           ("x/one", None), ("x/two", None)):
        metrics.observe_mcp(method=method, tool_name=None, prompt_name=prompt, operation=None,
                            protocol_version=None, server_address="127.0.0.1", server_port=3001,
                            rpc_status_code=None, error_type=None, duration_s=0.01)
    family = samples(metrics)["mcp_client_operation_duration_seconds"]
    counts = {(s.labels["mcp_method_name"], s.labels["gen_ai_prompt_name"]): s.value
              for s in family if s.name.endswith("_count")}
    assert counts == {("prompts/get", "alpha"): 1.0, ("prompts/get", "beta"): 1.0, ("prompts/get", "_OTHER"): 1.0,
                      ("x/one", ""): 1.0, ("_OTHER", ""): 1.0}
