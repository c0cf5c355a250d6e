"""Cost of tracing + metrics per step, measured through a running gateway (not collected by pytest).

    .venv/bin/python -m tests.otel.bench_gateway [--requests 4000] [--stream] [--env OTEL_BSP_...=V]

Every mode is a real gateway (proxy app on loopback, in-memory run store, ledger) in front of the
scriptable fake provider, all in this process and event loop, started with its own `OTEL_*`
variables (read by `_gateway_ctx` at startup). One sample = one whole request as the agent sees it
(`POST /v1/chat/completions`, body read), timed with `perf_counter_ns`. The modes run interleaved in
blocks of 100 requests so drift (CPU frequency, GC, pools) spreads evenly over them. Runs hold 50
steps each. Modes:

- `none`: the telemetry service removed after startup (no spans, no Prometheus samples);
- `disabled`: `OTEL_SDK_DISABLED=true` (Prometheus metrics only), the baseline issue 6 names;
- `on, collector up`: OTLP/HTTP protobuf to a receiver in another process (export on the SDK
  worker thread, competing for the GIL);
- `on, collector down`: OTLP/HTTP to a closed loopback port (export fails, spans are dropped and
  counted);
- `on + content`: collector up, with `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY`
  (content serialised and redacted on the request path).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.config import parse_config
from gateway.proxy import GATEWAY
from tests.conftest import base_config
from tests.fakes.upstream import FakeProvider, Reply, openai_completion, openai_stream
from tests.otel.bench_otel import closed_port, start_sink

BLOCK = 100
STEPS_PER_RUN = 50
MESSAGES = [
    {"role": "system", "content": "You are a support bot. Answer briefly."},
    {"role": "user", "content": "Where is my order 12345? My token is Bearer abcdefghijklmnop."},
]


@dataclass
class Mode:
    name: str
    env: dict[str, str]
    strip: bool = False  # remove the telemetry service after startup
    url: str = ""
    samples: list[int] = field(default_factory=list)
    dropped: Callable[[], int] = lambda: 0


async def start(mode: Mode, fake_url: str, tmp: str, servers: list[TestServer]) -> None:
    saved = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(mode.env)
    try:
        config = parse_config(base_config(fake_url), env={}, base_dir=tmp)
        app = create_app(config)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()  # runs _gateway_ctx, which reads os.environ
    finally:
        for key in [k for k in os.environ if k.startswith("OTEL_")]:
            del os.environ[key]
        os.environ.update(saved)
    servers.append(server)
    gw = app[GATEWAY]
    telemetry = gw.services["telemetry"]
    mode.dropped = telemetry.spans_dropped
    if mode.strip:
        del gw.services["telemetry"]
    mode.url = str(server.make_url("/v1/chat/completions"))


async def one(session: ClientSession, mode: Mode, index: int, body: bytes, record: bool) -> None:
    headers = {"content-type": "application/json", "x-tollgate-run-id": f"bench-{index // STEPS_PER_RUN}"}
    started = time.perf_counter_ns()
    async with session.post(mode.url, data=body, headers=headers) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    if record:
        mode.samples.append(time.perf_counter_ns() - started)


async def bench(requests: int, stream: bool, extra: dict[str, str]) -> None:
    fake = FakeProvider()
    fake.default = (
        Reply(chunks=openai_stream(["Your order ", "ships ", "today."]))
        if stream
        else Reply(body=openai_completion("Your order ships today."))
    )
    fake_server = TestServer(fake.app(), host="127.0.0.1")
    await fake_server.start_server()
    fake_url = str(fake_server.make_url("")).rstrip("/")
    sink, sink_port = start_sink()
    up = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}", **extra}
    modes = [
        Mode("none (no telemetry service)", {"OTEL_SDK_DISABLED": "true"}, strip=True),
        Mode("disabled (OTEL_SDK_DISABLED=true)", {"OTEL_SDK_DISABLED": "true"}),
        Mode("on, collector up (OTLP/HTTP, other process)", up),
        Mode(
            "on, collector down (closed port)",
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
                "OTEL_EXPORTER_OTLP_TIMEOUT": "500",
                **extra,
            },
        ),
        Mode(
            "on + content capture (collector up)",
            {**up, "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"},
        ),
    ]
    servers: list[TestServer] = []
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": MESSAGES, "stream": stream})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in modes:
                await start(mode, fake_url, tmp, servers)
            async with ClientSession() as session:
                warm = min(500, requests // 4)
                for start_at in range(0, requests + warm, BLOCK):
                    for mode in modes:
                        for i in range(start_at, start_at + BLOCK):
                            await one(session, mode, i, body, record=i >= warm)
                reference = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
                kind = "streamed" if stream else "non-streamed"
                print(f"extra variables of the traced modes: {extra or 'none'}")
                print(
                    f"{requests} {kind} requests per mode, whole request in microseconds "
                    f"(client + gateway + fake provider, one process); reference sum(range(1000)) = "
                    f"{reference:.1f} us"
                )
                base = next(m for m in modes if m.name.startswith("disabled"))
                base_p50 = sorted(base.samples)[len(base.samples) // 2] / 1000
                print(f"{'mode':46} {'p50':>8} {'p99':>8} {'mean':>8} {'p50-disabled':>13} {'dropped':>8}")
                for mode in modes:
                    samples = sorted(mode.samples)
                    p50 = samples[len(samples) // 2] / 1000
                    p99 = samples[int(len(samples) * 0.99)] / 1000
                    mean = sum(samples) / len(samples) / 1000
                    print(
                        f"{mode.name:46} {p50:8.1f} {p99:8.1f} {mean:8.1f} {p50 - base_p50:+13.1f} "
                        f"{mode.dropped():8d}"
                    )
    finally:
        for server in reversed(servers):
            await server.close()  # flushes each gateway's telemetry (bounded)
        await fake_server.close()
        sink.terminate()
        sink.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--env", action="append", default=[], metavar="OTEL_X=V", help="extra variable, traced modes"
    )
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # the dead collector's export errors
    asyncio.run(bench(args.requests, args.stream, extra))


if __name__ == "__main__":
    main()
