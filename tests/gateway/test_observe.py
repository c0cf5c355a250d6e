"""The record stage (gateway/observe.py): a step's span is decided before the upstream call (its context
goes upstream) and built while the upstream works, yet it starts before the request left and its
duration covers the whole call; the span's max_tokens is what went upstream; the ledger row's decision;
the idle-run sweep."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as GenAI

from gateway.config import Agent, Limits, Provider
from gateway.identity import Identity
from gateway.observe import (
    forwarded_call,
    ledger_decision,
    ledger_stop_now,
    on_step,
)
from gateway.providers.openai_chat import OpenAIChat
from gateway.routing import Route
from gateway.step import Step
from otel.attributes import inference_start_attributes
from otel.setup import setup_telemetry
from tests.conftest import GatewayFactory
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, tool_call


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


# -- the span's max_tokens is what went upstream -----------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
PRICING = {"gpt-*": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}


def step_for(body: dict[str, Any]) -> Step:
    adapter = OpenAIChat()
    raw = orjson.dumps(body)
    call = adapter.parse_request(body, raw, Limits())
    route = Route("openai", Provider(type="openai", base_url="http://up.test/v1"), call.model, False)
    return Step(adapter, Identity("bot", Agent(), "run-1"), call, route, body, raw)


@pytest.mark.parametrize(("asked", "granted", "sent"), [
    (None, 300, 300), (1000, 300, 300), (300, 300, 300), (500, None, 500), (None, None, None),
])
def test_forwarded_call_has_the_max_tokens_the_upstream_is_given(
    asked: int | None, granted: int | None, sent: int | None
) -> None:
    step = step_for({"model": "gpt-4o-mini", "messages": MSG, **({"max_tokens": asked} if asked else {})})
    step.max_tokens_set = granted
    call = forwarded_call(step)
    assert call.max_tokens == sent and (call is step.call) == (sent == asked)  # copied only when clamped
    attrs = inference_start_attributes(call, provider_name="openai", server_address="up.test",
                                       server_port=443)
    assert attrs.get(GenAI.GEN_AI_REQUEST_MAX_TOKENS) == sent


async def test_the_span_of_a_clamped_call_says_the_max_tokens_sent(gateway_factory: GatewayFactory) -> None:
    h = await gateway_factory(pricing=PRICING, agents={"default": {"budget": {"usd": 0.001}}})
    exporter = InMemorySpanExporter()
    telemetry = setup_telemetry({}, exporter=exporter)
    h.gateway.services["telemetry"] = telemetry
    for run, extra in (("absent", {}), ("too-large", {"max_tokens": 100_000})):
        async with h.session.post(f"{h.url}/v1/chat/completions",
                                  json={"model": "gpt-4o-mini", "messages": MSG, **extra},
                                  headers={"x-tollgate-run-id": run}) as resp:
            assert resp.status == 200
            granted = int(resp.headers["x-tollgate-max-tokens"])
        sent = h.fake.seen[-1].json
        assert sent.get("max_tokens", sent.get("max_completion_tokens")) == granted < 100_000
        assert telemetry.force_flush()
        [span] = [s for s in exporter.get_finished_spans()
                  if (s.attributes or {}).get("tollgate.run_id") == run]
        assert (span.attributes or {})[GenAI.GEN_AI_REQUEST_MAX_TOKENS] == granted, run
    telemetry.shutdown()


# -- the ledger row of a step ------------------------------------------------------------------------


@pytest.mark.parametrize(("outcome", "row"), [
    ({}, ("allow", None, "")),
    ({"reasks": 1}, ("reask", None, "")),
    ({"dropped": 2}, ("drop", "tool_not_allowed", "2 disallowed tool call(s) dropped")),
    ({"dropped": 1, "reasks": 1},
     ("drop", "tool_not_allowed", "1 disallowed tool call(s) dropped, 1 re-ask(s)")),
    ({"dropped": 1, "stop": "tool_not_allowed"}, ("stop", "tool_not_allowed", "why")),
    ({"dropped": 1, "error": "output_nonconforming"}, ("error", "output_nonconforming", "")),
    ({"reasks": 2, "error": "output_nonconforming"}, ("error", "output_nonconforming", "")),
])
def test_ledger_decision(outcome: dict[str, Any], row: tuple[str, str | None, str]) -> None:
    step = step_for({"model": "gpt-4o-mini", "messages": MSG})
    step.reasks = outcome.get("reasks", 0)
    if "dropped" in outcome:
        step.extra["tools_dropped"] = outcome["dropped"]
    if "stop" in outcome:
        step.stop_reason, step.stop_detail = outcome["stop"], "why"
    step.error_type = outcome.get("error")
    assert ledger_decision(step) == row


@pytest.mark.parametrize("reasked", [False, True])
async def test_a_step_whose_tool_calls_were_dropped_is_a_drop_row(
    gateway_factory: GatewayFactory, reasked: bool
) -> None:
    """`on_violation: drop`: the answer the agent got was altered (or, with nothing left, re-asked)."""
    h = await gateway_factory(agents={"default": {"tools": {"allow": ["search_kb"], "on_violation": "drop"}}})
    text = "" if reasked else "here you go"
    h.fake.queue(Reply(body=openai_completion(text, tool_calls=[tool_call("drop_tables")])),
                 Reply(body=openai_completion("done")))
    async with h.session.post(f"{h.url}/v1/chat/completions", json={"model": "gpt-4o-mini", "messages": MSG},
                              headers={"x-tollgate-run-id": "dropped"}) as resp:
        assert resp.status == 200 and b"drop_tables" not in await resp.read()
    assert len(h.fake.seen) == (2 if reasked else 1)
    ledger = h.gateway.services["ledger"]
    await ledger.flush()
    [row] = ledger.rows("dropped")
    detail = "1 disallowed tool call(s) dropped" + (", 1 re-ask(s)" if reasked else "")
    assert (row["decision"], row["reason"], row["detail"]) == ("drop", "tool_not_allowed", detail)


async def test_a_stops_ledger_row_is_written_before_it_is_answered_and_only_once(
    gateway_factory: GatewayFactory,
) -> None:
    h = await gateway_factory()
    ledger = h.gateway.services["ledger"]
    step = step_for({"model": "gpt-4o-mini", "messages": MSG})
    step.stop_reason, step.stop_detail = "llm_call_cap", "the run made its 5 calls"
    written = ledger.written
    await ledger_stop_now(h.gateway, step)
    assert ledger.written == written + 1  # durable before the agent hears of it
    await ledger_stop_now(h.gateway, step)
    on_step(h.gateway, step)  # the step's telemetry after the answer: no second row
    await ledger.flush()
    assert ledger.written == written + 1
    row = ledger.rows("run-1")[-1]
    assert (row["decision"], row["reason"]) == ("stop", "llm_call_cap")
