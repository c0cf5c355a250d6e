"""Benchmark of the Redis run store on a real local redis-server (not collected by pytest).

    .venv/bin/python tests/gateway/bench_redis.py [--ops N] [--concurrency C]

Prints per-operation latency (p50 / p99 in microseconds) of `reserve`, `settle`, `get` (without and with
steps), `apply` and `record_step`, one at a time, each against the SQLite and memory backends for
scale; then the throughput of concurrent reserve+settle pairs from C tasks on one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.store.base import Add, Claim, Push, Reservation, ReserveRequest, RunStore
from gateway.store.memory import MemoryRunStore
from gateway.store.redis import RedisRunStore
from gateway.store.sqlite import SqliteRunStore
from tests.redis_fixture import start_server

REQUEST = ReserveRequest(
    (
        Claim("tokens", 300.0, 1.0, 1e12, "token_budget_exhausted"),
        Claim("usd", 3e-4, 4e-6, 1e9, "budget_exhausted"),
        Claim("llm_calls", 1.0, 0.0, 1e12, "llm_call_cap"),
    ),
    16,
    250,
)
ACTUAL = {"tokens": 320.0, "input_tokens": 300.0, "output_tokens": 20.0, "usd": 3.8e-4, "llm_calls": 1.0}
STEP = {
    "operation": "chat",
    "model": "gpt-4o-mini",
    "status": 200,
    "input_tokens": 300,
    "output_tokens": 20,
    "cost_usd": 3.8e-4,
    "decisions": ["budget:allow", "caps:allow", "loop:allow"],
    "duration_ms": 812.5,
}


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(samples: list[float], op: Awaitable[object]) -> object:
    started = time.perf_counter_ns()
    result = await op
    samples.append((time.perf_counter_ns() - started) / 1000)
    return result


async def latencies(store: RunStore, ops: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {
        k: [] for k in ("reserve", "settle", "get", "get+steps", "apply", "record_step")
    }
    for i in range(50):  # a run with a full step history, as a busy run has
        await store.record_step("bench", "bot", STEP, float(i))
    for i in range(ops):
        now = 1000.0 + i
        grant = await timed(out["reserve"], store.reserve("bench", "bot", REQUEST, now))
        assert isinstance(grant, Reservation)
        await timed(out["get"], store.get("bench", steps=False))
        await timed(out["settle"], store.settle(grant, ACTUAL, now))
        adds, pushes = [Add("tool_calls", 1.0, 1e12, "tool_call_cap")], [Push("calls", (f"c{i % 7}",), 6)]
        await timed(out["apply"], store.apply("bench", "bot", adds, pushes, now))
        await timed(out["record_step"], store.record_step("bench", "bot", STEP, now))
        await timed(out["get+steps"], store.get("bench"))
    return out


async def throughput(store: RunStore, concurrency: int, pairs: int) -> float:
    async def worker(count: int) -> None:
        for _ in range(count):
            grant = await store.reserve("tp", "bot", REQUEST, 1.0)
            assert isinstance(grant, Reservation)
            await store.settle(grant, ACTUAL, 1.0)

    started = time.perf_counter()
    await asyncio.gather(*(worker(pairs // concurrency) for _ in range(concurrency)))
    return (pairs // concurrency * concurrency) / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp) / "redis")
        try:
            stores: dict[str, RunStore] = {
                "redis": RedisRunStore.open(server.url),
                "sqlite": SqliteRunStore.open(Path(tmp) / "state.db"),
                "memory": MemoryRunStore(),
            }
            print(f"per-operation latency, {args.ops} sequential ops each, microseconds (p50 / p99)")
            for name, store in stores.items():
                results = await latencies(store, args.ops)
                cells = "  ".join(
                    f"{op} {statistics.median(s):6.0f} / {pct(s, 0.99):6.0f}" for op, s in results.items()
                )
                print(f"  {name:6} {cells}")
            for name, store in stores.items():
                rate = await throughput(store, args.concurrency, args.ops * 2)
                print(
                    f"  {name:6} {args.concurrency} concurrent tasks: {rate:8.0f} reserve+settle pairs/s on one run"
                )
            for store in stores.values():
                await store.close()
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
