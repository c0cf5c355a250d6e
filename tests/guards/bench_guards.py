"""Cost of the guard stages per step, memory vs SQLite run store (not collected by pytest).

    .venv/bin/python -m tests.guards.bench_guards [--runs 100] [--steps 30]

Each step does what `gateway.pipeline` does around the upstream call, with the built-in chain of a
realistic policy (USD + token budget, call and time caps, loop and no-progress detection):

    core:  chain.before + store.reserve + store.settle + chain.after
    full:  store.get + chain.before + effects + store.reserve + store.settle + store.get + chain.after + effects

Steps look like a working agent: the conversation grows by one new tool result per step, every answer
proposes one new tool call, so no guard stops a run. Each run has `--steps` steps (under the
40-call cap). Also timed: 200 concurrent reserves on one run whose budget pays for 10.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gateway.call import Answer, Call, ToolCall, ToolResult, Usage, digest
from gateway.config import Agent
from gateway.pricing import ModelPrice, Rate
from gateway.store.base import Claim, Denial, Reservation, ReserveRequest, RunStore
from gateway.store.memory import MemoryRunStore
from gateway.store.sqlite import SqliteRunStore
from guards.base import Add, Push, StepContext
from guards.budget import settlement
from guards.chain import GuardChain, Verdict
from guards.registry import build_chain

POLICY = Agent.model_validate(
    {
        "budget": {"usd": 2.0, "tokens": 200_000},
        "caps": {"llm_calls": 40, "tool_calls": 60, "seconds": 600},
        "loop": {"window": 6, "max_distinct": 3, "stall_steps": 3},
    }
)
PRICE = ModelPrice(Rate(0.15e-6), Rate(0.6e-6))  # gpt-4o-mini list price
MIN_OUTPUT_TOKENS = 16
MAX_TOKENS = 512


def script(steps: int) -> list[tuple[Call, Answer]]:
    out = []
    for n in range(steps):
        results = tuple(ToolResult(f"call_{k}", f"result {k}: " + "x" * 200) for k in range(n))
        call = Call(
            protocol="openai",
            operation="chat",
            model="gpt-4o-mini",
            max_tokens=MAX_TOKENS,
            input_bytes=2000 + 300 * n,
            tool_results=results,
            request_hash=digest(str(n).encode()),
        )
        answer = Answer(
            tool_calls=(ToolCall(f"call_{n}", "search", f'{{"query": "q{n}", "page": {n}}}'),),
            usage=Usage(500 + 75 * n, 40),
        )
        out.append((call, answer))
    return out


async def apply(store: RunStore, run_id: str, verdict: Verdict) -> None:
    for effect in verdict.effects:
        if isinstance(effect, Add):
            await store.add(run_id, "bench", effect.counter, effect.amount, limit=effect.limit, code=effect.code,
                            now=time.time())
        elif isinstance(effect, Push):
            await store.push(run_id, "bench", effect.key, effect.values, effect.keep)


async def step(
    store: RunStore, chain: GuardChain, run_id: str, call: Call, answer: Answer, timings: dict[str, list[int]]
) -> None:
    clock = time.perf_counter_ns
    t0 = clock()
    snapshot = await store.get(run_id)
    t1 = clock()
    verdict = chain.before(StepContext(call, "bench", run_id, POLICY, snapshot, time.time(), PRICE))
    t2 = clock()
    assert verdict.stop is None, verdict.stop
    await apply(store, run_id, verdict)
    t3 = clock()
    grant = await store.reserve(
        run_id, "bench", ReserveRequest(verdict.claims, MIN_OUTPUT_TOKENS, MAX_TOKENS), time.time()
    )
    t4 = clock()
    assert isinstance(grant, Reservation), grant
    await store.settle(grant, settlement(answer.usage, PRICE, grant), time.time())
    t5 = clock()
    snapshot = await store.get(run_id)
    t6 = clock()
    after = chain.after(StepContext(call, "bench", run_id, POLICY, snapshot, time.time(), PRICE), answer)
    t7 = clock()
    assert after.stop is None, after.stop
    await apply(store, run_id, after)
    t8 = clock()
    timings["chain.before"].append(t2 - t1)
    timings["store.reserve"].append(t4 - t3)
    timings["store.settle"].append(t5 - t4)
    timings["chain.after"].append(t7 - t6)
    timings["store.get (x2)"].append((t1 - t0) + (t6 - t5))
    timings["effects"].append((t3 - t2) + (t8 - t7))
    timings["core"].append((t2 - t1) + (t5 - t3) + (t7 - t6))
    timings["full"].append(t8 - t0)


def pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


async def bench_store(name: str, make: Callable[[], RunStore], runs: int, steps: int) -> dict[str, list[int]]:
    store = make()
    chain = GuardChain(build_chain(POLICY, "bench"))
    plan = script(steps)
    keys = ["chain.before", "store.reserve", "store.settle", "chain.after", "store.get (x2)", "effects", "core",
            "full"]
    timings: dict[str, list[int]] = {k: [] for k in keys}
    warm: dict[str, list[int]] = {k: [] for k in keys}
    for r in range(max(3, runs // 20)):
        for call, answer in plan:
            await step(store, chain, f"{name}-warm-{r}", call, answer, warm)
    for r in range(runs):
        for call, answer in plan:
            await step(store, chain, f"{name}-run-{r}", call, answer, timings)
    await store.close()
    return timings


async def concurrency(make: Callable[[], RunStore]) -> tuple[float, int]:
    store = make()
    request = ReserveRequest((Claim("usd", 0.001, 4e-6, 0.02, "budget_exhausted"),), 16, 250)
    start = time.perf_counter()
    results = await asyncio.gather(*(store.reserve("conc", "bench", request, time.time()) for _ in range(200)))
    grants = [r for r in results if isinstance(r, Reservation)]
    await asyncio.gather(*(store.settle(g, g.amounts, time.time()) for g in grants))
    wall = time.perf_counter() - start
    assert len(grants) == 10 and all(isinstance(r, Denial) for r in results if r not in grants)
    await store.close()
    return wall * 1000, len(grants)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        makers: dict[str, Callable[[], RunStore]] = {
            "memory": MemoryRunStore,
            "sqlite": lambda: SqliteRunStore.open(Path(tmp) / f"bench-{time.perf_counter_ns()}.db"),
        }
        print(f"{args.runs} runs x {args.steps} steps per backend; microseconds per step")
        for name, make in makers.items():
            timings = await bench_store(name, make, args.runs, args.steps)
            print(f"\n{name} ({len(timings['full'])} steps)")
            print(f"  {'stage':<16}{'p50':>9}{'p99':>9}{'mean':>9}")
            for key, values in timings.items():
                mean = statistics.fmean(values) / 1000.0
                print(f"  {key:<16}{pct(values, 0.5):>9.1f}{pct(values, 0.99):>9.1f}{mean:>9.1f}")
        print("\n200 concurrent reserves, budget for 10 (reserve all + settle the granted)")
        for name, make in makers.items():
            wall_ms, granted = await concurrency(make)
            print(f"  {name:<8} granted {granted}, wall {wall_ms:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
