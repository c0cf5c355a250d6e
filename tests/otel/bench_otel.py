"""Cost of tracing + metrics per inference step (not collected by pytest).

    .venv/bin/python -m tests.otel.bench_otel [--steps 20000]

One step = everything the pipeline calls for a streamed chat step: `run_parent`, `start_inference`,
two guard events with their counters, `inject_headers`, `first_chunk`, `finish` (answer attributes,
span end, the GenAI histograms) and the upstream / cost counters. Timed per step with
`perf_counter_ns`; p50 / p99 / mean in microseconds, for:

- `disabled`: `OTEL_SDK_DISABLED=true` (Prometheus metrics only);
- `on`: tracing on, batch export to an exporter that discards (the SDK's work, no I/O);
- `collector up`: tracing on, OTLP/HTTP protobuf to a receiver in another process (full export cost:
  encoding and HTTP happen on the SDK's worker thread, competing for the GIL);
- `collector down`: tracing on, OTLP/HTTP to a closed loopback port (default 10 s export timeout:
  the worker backs off, the queue fills, ends are dropped and counted);
- `on + content`: tracing on with content capture and redaction.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel.redact import Redactor
from otel.runs import inject_headers
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.otel.samples import OPENAI_ANSWER, PROVIDER_KEY, openai_call


class DiscardExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


SINK = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def start_sink() -> tuple[subprocess.Popen[str], int]:
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    return sink, int(sink.stdout.readline())


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def step(telemetry: Telemetry, redactor: Redactor, i: int) -> None:
    call = CALL
    metrics = telemetry.metrics
    run_id = f"run-{i % 64}"
    parent = telemetry.run_parent(run_id, "support-bot")
    span = telemetry.start_inference(
        call,
        provider_name="openai",
        server_address="api.openai.com",
        server_port=443,
        parent=parent,
        attempt=0,
        run_id=run_id,
        agent="support-bot",
    )
    span.guard_event("budget", "continue", None, "reserved 0.0200")
    metrics.guard_decision("budget", "continue")
    span.guard_event("caps", "continue")
    metrics.guard_decision("caps", "continue")
    inject_headers(span.context)
    span.capture_input(call, redactor)
    span.chunk()
    span.capture_output(OPENAI_ANSWER, redactor)
    span.finish(OPENAI_ANSWER, cost_usd=0.0012)
    metrics.upstream_request("openai", 200)
    metrics.cost("support-bot", "openai", call.model, 0.0012)


CALL = openai_call(stream=True)


def measure(telemetry: Telemetry, steps: int) -> tuple[float, float, float]:
    redactor = Redactor(secrets=(PROVIDER_KEY,))
    for i in range(min(2000, steps)):
        step(telemetry, redactor, i)
    samples: list[int] = []
    for i in range(steps):
        started = time.perf_counter_ns()
        step(telemetry, redactor, i)
        samples.append(time.perf_counter_ns() - started)
    samples.sort()
    p50 = samples[len(samples) // 2] / 1000
    p99 = samples[int(len(samples) * 0.99)] / 1000
    return p50, p99, statistics.fmean(samples) / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000)
    steps = parser.parse_args().steps
    sink, sink_port = start_sink()
    modes = {
        "disabled (OTEL_SDK_DISABLED=true)": lambda: setup_telemetry({"OTEL_SDK_DISABLED": "true"}),
        "on (batch export, discarding exporter)": lambda: setup_telemetry({}, exporter=DiscardExporter()),
        "on, collector up (OTLP/HTTP, other process)": lambda: setup_telemetry(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}"}
        ),
        "on, collector down (OTLP/HTTP to closed port)": lambda: setup_telemetry(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
        ),
        "on + content capture and redaction": lambda: setup_telemetry(
            {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"}, exporter=DiscardExporter()
        ),
    }
    reference = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    print(
        f"{steps} steps per mode; microseconds per step; machine reference sum(range(1000)) = {reference:.1f} us"
    )
    print(f"{'mode':48} {'p50':>8} {'p99':>8} {'mean':>8} {'dropped':>8}")
    for name, build in modes.items():
        telemetry = build()
        p50, p99, mean = measure(telemetry, steps)
        dropped = telemetry.spans_dropped()
        telemetry.shutdown(timeout_s=2)
        print(f"{name:48} {p50:8.1f} {p99:8.1f} {mean:8.1f} {dropped:8d}")
    sink.terminate()
    sink.wait()


if __name__ == "__main__":
    main()
