"""`tollgate demo` as a user runs it (DESIGN section 1): offline, exits 0, shows three guards tripping;
`--otlp-json` writes traces that are valid OTLP JSON (what Jaeger's UI loads)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import ParseDict  # type: ignore[import-untyped]  # protobuf has no stubs
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.demo import run_demo, tour
from gateway.demo.report import render_run
from gateway.demo.scenarios import scenarios

STOPS = ("budget_exhausted", "loop_detected", "tool_not_allowed")
HEX = re.compile(r"^[0-9a-f]+$")


def demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "tollgate"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([*command, "demo", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_demo_runs_offline_and_shows_each_guard_tripping(tmp_path: Path) -> None:
    result = demo(cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for stop in STOPS:
        assert f"[stopped: {stop}]" in out  # the run, as the admin API reports it
        assert f"STOP {stop}" in out  # the step that tripped it, in the step tree
    assert "tools/list via tollgate: search_docs, read_file\n" in out  # delete_file hidden from ops
    assert "tools/call delete_file REFUSED by tollgate: JSON-RPC -32003 tool_not_allowed" in out
    assert "tools/call workspace/read_file" in out  # MCP steps are in the trees
    assert "hash chain verified" in out
    assert list(tmp_path.iterdir()) == []  # nothing left behind in the working directory


def test_otlp_json_is_an_export_request_jaeger_can_load(tmp_path: Path) -> None:
    target = tmp_path / "traces.json"
    result = demo("--otlp-json", str(target), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(target.read_text())
    assert set(document) == {"resourceSpans"} and document["resourceSpans"]
    spans: list[dict[str, Any]] = []
    for resource_spans in document["resourceSpans"]:
        attrs = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
        assert attrs["service.name"] == {"stringValue": "tollgate-demo"}
        for scope_spans in resource_spans["scopeSpans"]:
            assert scope_spans["schemaUrl"] == "https://opentelemetry.io/schemas/1.41.0"
            spans += scope_spans["spans"]
    for span in spans:
        assert len(span["traceId"]) == 32 and HEX.match(span["traceId"])
        assert len(span["spanId"]) == 16 and HEX.match(span["spanId"])
        parent = span.get("parentSpanId")
        assert parent is None or (len(parent) == 16 and HEX.match(parent))
        assert isinstance(span["kind"], int)  # integer enums, lowerCamelCase keys
        assert "startTimeUnixNano" in span and "start_time_unix_nano" not in span
    roots = {s["name"]: s for s in spans if s["name"].startswith("invoke_agent ")}
    assert set(roots) == {"invoke_agent researcher", "invoke_agent looper", "invoke_agent ops"}
    chats = [s for s in spans if s["name"] == "chat demo-model"]
    assert len(chats) >= 6 and all(s["kind"] == 3 for s in chats)  # CLIENT
    for name, root in roots.items():
        assert root["kind"] == 1 and root["status"]["code"] == 2  # INTERNAL, ERROR: the run was stopped
        steps = [s for s in chats if s["traceId"] == root["traceId"]]
        assert steps and all(s["parentSpanId"] == root["spanId"] for s in steps), name  # one trace per run
    def error_type(span: dict[str, Any]) -> str | None:
        return next((a["value"]["stringValue"] for a in span["attributes"] if a["key"] == "error.type"), None)

    agents = ("researcher", "looper", "ops")
    assert [error_type(roots[f"invoke_agent {agent}"]) for agent in agents] == list(STOPS)
    # judged on the model's answer, so the step that proposed the loop / the disallowed call says why
    assert {"loop_detected", "tool_not_allowed"} <= {error_type(s) for s in chats}
    # it is the protobuf message itself: with the ids back in base64 it parses as ExportTraceServiceRequest
    for span in spans:
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in span:
                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    message = ParseDict(document, ExportTraceServiceRequest())
    assert sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans) == len(spans)


def test_a_guard_that_does_not_trip_fails_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    budget, *rest = scenarios()
    unguarded = dataclasses.replace(budget, policy={})  # no budget: the researcher finishes its brief
    monkeypatch.setattr(tour, "scenarios", lambda: (unguarded, *rest))
    out, err = io.StringIO(), io.StringIO()
    assert run_demo(out=out, err=err) == 1
    assert "tollgate demo: FAILED" in err.getvalue()
    assert "run 1 (budget): model call: expected budget_exhausted, got no refusal" in err.getvalue()
    assert "run stop reason: expected budget_exhausted, got None" in err.getvalue()
    assert "[stopped: loop_detected]" in out.getvalue()  # the other runs still played


def test_step_tree_nests_tool_calls_under_the_model_call_that_proposed_them() -> None:
    chat = {"operation": "chat", "model": "m", "status": 200, "decision": "allow", "cost_usd": 0.001,
            "input_tokens": 10, "output_tokens": 5, "tool_calls": ["read_file"]}
    tool = {"operation": "execute_tool", "model": "ws", "status": 200, "decision": "allow",
            "tool_calls": ["ws/read_file"]}
    stray = {**tool, "tool_calls": ["ws/delete_file"], "decision": "stop", "stop_reason": "tool_not_allowed"}
    run = {"run_id": "r", "agent": "a", "status": "stopped", "stop_reason": "tool_not_allowed",
           "steps": [chat, tool, stray]}
    lines = render_run(run, ascii=True)
    assert lines[0] == "run r  agent a  [stopped: tool_not_allowed]"
    assert lines[2].startswith("  |-- chat m") and "-> proposes read_file" in lines[2]
    assert lines[3].startswith("  |   `-- tools/call ws/read_file")
    assert lines[4].startswith("  `-- tools/call ws/delete_file") and "STOP tool_not_allowed" in lines[4]
