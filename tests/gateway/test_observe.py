"""The record stage's span timing: a step's span is decided before the upstream call (its context goes
upstream) and built while the upstream works, yet it starts before the request left and its duration
covers the whole call."""

from __future__ import annotations

import time

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory
from tests.fakes.upstream import FakeProvider, Reply, openai_completion


async def test_span_is_decided_first_and_covers_the_upstream_call(
    gateway_factory: GatewayFactory, fake: tuple[FakeProvider, str]
) -> None:
    h = await gateway_factory()
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry
    h.fake.queue(Reply(body=openai_completion("hi"), delay=0.2))
    before = time.time_ns()
    async with h.session.post(
        f"{h.url}/v1/chat/completions",
        data=orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}),
        headers={"content-type": "application/json", "x-tollgate-run-id": "timed"},
    ) as resp:
        assert resp.status == 200
        await resp.read()
    assert telemetry.force_flush()
    [span] = [s for s in exporter.get_finished_spans() if s.name == "chat gpt-4o-mini"]
    assert span.start_time is not None and span.end_time is not None
    assert before <= span.start_time and span.end_time - span.start_time >= 0.2e9  # the upstream's delay
    assert span.context is not None
    assert h.fake.seen[-1].headers["traceparent"] == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-{span.context.trace_flags:02x}"
    text = telemetry.metrics.render()[0].decode()
    line = next(x for x in text.splitlines() if x.startswith("gen_ai_client_operation_duration_seconds_sum"))
    assert float(line.rsplit(" ", 1)[1]) >= 0.2  # the metric's duration also starts before the request
    telemetry.shutdown()
