"""CPU of the record stage's telemetry per proxied step, as the gateway calls it (not collected by pytest).

    .venv/bin/python -m tests.otel.bench_observe [--steps 5000] [--repeat 5] [--stream] [--mode NAME]

A real gateway (the perf harness's agent policy: budget, caps, loop detection, a regex grammar) answers
one request from the fake provider; the `Step` it recorded is the template. Each measured step is a
fresh copy of it run through exactly what the pipeline calls for telemetry: `observe.start_span`
(parent, span start, trace headers), `StepSpan.first_chunk` when streamed, `observe.on_step` (guard
metrics, span end, GenAI histograms, cost and upstream counters). The ledger is left out (not
telemetry). Figures are microseconds per step, best of `--repeat` rounds:

- `wall`: the calling thread's time per step (what the event loop pays);
- `cpu`: the whole process' CPU (`time.process_time`, every thread) per step, including the export
  worker's encoding and HTTP once the round's spans are flushed: what the gateway pays in total.

Modes: `disabled` (`OTEL_SDK_DISABLED=true`, Prometheus only), `discard` (tracing on, an exporter that
drops batches: the SDK's own cost), `otlp` (OTLP/HTTP protobuf to a receiver in another process).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import time
import types
from collections.abc import Callable

import orjson
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway import observe
from gateway.app import create_app
from gateway.config import parse_config
from gateway.proxy import GATEWAY
from gateway.step import Step
from otel.setup import setup_telemetry
from otel.telemetry import Telemetry
from tests.conftest import base_config
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, openai_stream
from tests.otel.bench_otel import DiscardExporter, start_sink

AGENTS = {
    "default": {
        "budget": {"usd": 1e9, "tokens": 10**15},
        "caps": {"llm_calls": 10**9, "seconds": 10**7},
        "loop": {"window": 6, "max_distinct": 3},
        "output": {"grammar": "regex:[A-Za-z .]+"},
    }
}
PRICING = {"gpt-*": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}}
KEEP = ("snapshot", "epoch")  # step.extra entries the pipeline sets before the record stage


async def template(stream: bool) -> tuple[Step, object]:
    """One real step through a real gateway (and that gateway, for its config and redactor)."""
    fake = FakeProvider()
    fake.default = (
        Reply(chunks=openai_stream(["Your order ", "ships ", "today."]))
        if stream
        else Reply(body=openai_completion("Your order ships today."))
    )
    fake_server = TestServer(fake.app(), host="127.0.0.1")
    await fake_server.start_server()
    seen: list[Step] = []
    try:
        fake_url = str(fake_server.make_url("")).rstrip("/")
        config = parse_config(base_config(fake_url, agents=AGENTS, pricing=PRICING), env={}, base_dir=".")
        app = create_app(config, telemetry=setup_telemetry({"OTEL_SDK_DISABLED": "true"}))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        gw = app[GATEWAY]
        gw.hooks.on_step.append(seen.append)
        body = orjson.dumps(
            {
                "model": "gpt-4o-mini",
                "messages": [{"role": "user", "content": "Where is my order?"}],
                "stream": stream,
            }
        )
        async with ClientSession() as session, session.post(
            str(server.make_url("/v1/chat/completions")),
            data=body,
            headers={"content-type": "application/json", "x-tollgate-run-id": "bench"},
        ) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        await server.close()
    finally:
        await fake_server.close()
    assert seen and seen[0].stop_reason is None, seen
    return seen[0], gw


def fresh(step: Step, i: int) -> Step:
    extra = {k: step.extra[k] for k in KEEP if k in step.extra}
    identity = dataclasses.replace(step.identity, run_id=f"bench-{i % 64}")
    return dataclasses.replace(
        step, identity=identity, attempts=0, decisions=list(step.decisions), extra=extra
    )


def one(gw: object, step: Step, stream: bool) -> None:
    headers = {"content-type": "application/json"}
    observe.start_span(gw, step, headers)  # type: ignore[arg-type]
    step.attempts += 1
    if stream:
        span = step.extra.get(observe.SPAN)
        if span is not None:
            span.chunk()
    observe.on_step(gw, step)  # type: ignore[arg-type]


async def measure(build: Callable[[], Telemetry], base: Step, gw: object, steps: int, repeat: int, stream: bool
                  ) -> tuple[float, float, int]:
    """On a running loop: `start_span` builds the span on the loop's next turn (gateway/observe.py);
    `on_step` builds it at once when that turn has not come yet, as for a step the upstream answered
    before the loop turned. The loop turns between rounds."""
    telemetry = build()
    fake_gw = types.SimpleNamespace(
        config=gw.config,  # type: ignore[attr-defined]
        services={"telemetry": telemetry, "redactor": gw.services["redactor"]},  # type: ignore[attr-defined]
    )
    for i in range(1000):
        one(fake_gw, fresh(base, i), stream)
    await asyncio.sleep(0)
    telemetry.force_flush(10)
    walls, cpus = [], []
    for _ in range(repeat):
        batch = [fresh(base, i) for i in range(steps)]
        gc.collect()
        cpu0, wall = time.process_time(), 0
        for step in batch:
            started = time.perf_counter_ns()
            one(fake_gw, step, stream)
            wall += time.perf_counter_ns() - started
        await asyncio.sleep(0)
        telemetry.force_flush(30)
        cpus.append((time.process_time() - cpu0) / steps * 1e6)
        walls.append(wall / steps / 1000)
    dropped = telemetry.spans_dropped()
    telemetry.shutdown(5)
    return min(walls), min(cpus), dropped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--mode", action="append", default=[])
    parser.add_argument(
        "--env", action="append", default=[], metavar="OTEL_X=V", help="extra variable, otlp mode"
    )
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    base, gw = asyncio.run(template(args.stream))
    sink, sink_port = start_sink()
    modes: dict[str, Callable[[], Telemetry]] = {
        "disabled": lambda: setup_telemetry({"OTEL_SDK_DISABLED": "true"}),
        "discard": lambda: setup_telemetry({}, exporter=DiscardExporter()),
        "otlp": lambda: setup_telemetry(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}", **extra}
        ),
    }
    try:
        print(f"{args.steps} steps x {args.repeat} rounds, {'streamed' if args.stream else 'non-streamed'}; "
              f"us per step (best round); decisions {[f'{d.guard}:{d.action}' for d in base.decisions]}")
        print(f"{'mode':10} {'wall':>8} {'cpu':>8} {'dropped':>8}")
        for name, build in modes.items():
            if args.mode and name not in args.mode:
                continue
            wall, cpu, dropped = asyncio.run(measure(build, base, gw, args.steps, args.repeat, args.stream))
            print(f"{name:10} {wall:8.1f} {cpu:8.1f} {dropped:8d}")
    finally:
        sink.terminate()
        sink.wait()


if __name__ == "__main__":
    main()
