"""Cost of the guard stages and the run store per step, memory vs SQLite (not collected by pytest).

    .venv/bin/python -m tests.guards.bench_guards [--runs 100] [--steps 30] [--repeat 5]

Each step does what `gateway.pipeline` does around the upstream call, with the built-in chain of a
realistic policy (USD + token budget, call and time caps, loop and no-progress detection):

    store.get(steps=False), chain.before, store.apply (its effects), store.reserve,
    (upstream: one turn of the event loop), store.settle, chain.after, store.apply, store.record_step

    core:  chain.before + store.reserve + store.settle + chain.after
    store: the five kinds of store call above (get + apply x2 + reserve + settle + record_step)
    full:  the whole step

Steps look like a working agent: the conversation grows by one new tool result per step, every answer
proposes one new tool call, so no guard stops a run. Each run has `--steps` steps (under the
40-call cap). The summary line per backend is the best (lowest) of `--repeat` passes of the mean
store time per step, and the thread CPU per step of a whole pass (this includes work a backend defers
to event-loop callbacks or to `close()`, which the per-call timings cannot see).
Also timed: 200 concurrent reserves on one run whose budget pays for 10.
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
    """The verdict's effects in one atomic store call, as `gateway.pipeline.apply_effects` does."""
    if not verdict.effects:
        return
    adds = [e for e in verdict.effects if isinstance(e, Add)]
    pushes = [e for e in verdict.effects if isinstance(e, Push)]
    denial = await store.apply(run_id, "bench", adds, pushes, time.time())
    assert denial is None, denial


async def step(
    store: RunStore, chain: GuardChain, run_id: str, call: Call, answer: Answer, timings: dict[str, list[int]]
) -> None:
    clock = time.perf_counter_ns
    t0 = clock()
    snapshot = await store.get(run_id, steps=False)
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
    await asyncio.sleep(0)  # the upstream call: lets callbacks a backend scheduled run, as in the server
    t4b = clock()
    await store.settle(grant, settlement(answer.usage, PRICE, grant), time.time())
    t5 = clock()
    after = chain.after(StepContext(call, "bench", run_id, POLICY, snapshot, time.time(), PRICE), answer)
    t6 = clock()
    assert after.stop is None, after.stop
    await apply(store, run_id, after)
    t7 = clock()
    summary = {  # the shape of gateway.step.Step.summary()
        "at": time.time(), "operation": "chat", "model": call.model, "provider": "openai", "stream": False,
        "status": 200, "decision": "allow", "stop_reason": None, "cost_usd": 0.0001,
        "input_tokens": answer.usage.input_tokens if answer.usage else None,
        "output_tokens": answer.usage.output_tokens if answer.usage else None,
        "tool_calls": [c.name for c in answer.tool_calls], "attempts": 1, "reasks": 0, "duration_ms": 1.0,
        "epoch": snapshot.epoch if snapshot is not None else 1,
    }
    await store.record_step(run_id, "bench", summary, time.time())
    t8 = clock()
    timings["chain.before"].append(t2 - t1)
    timings["store.get"].append(t1 - t0)
    timings["store.reserve"].append(t4 - t3)
    timings["store.settle"].append(t5 - t4b)
    timings["store.apply"].append((t3 - t2) + (t7 - t6))
    timings["store.record"].append(t8 - t7)
    timings["chain.after"].append(t6 - t5)
    timings["core"].append((t2 - t1) + (t5 - t4b) + (t4 - t3) + (t6 - t5))
    timings["store"].append((t1 - t0) + (t3 - t2) + (t4 - t3) + (t5 - t4b) + (t7 - t6) + (t8 - t7))
    timings["full"].append((t8 - t0) - (t4b - t4))


def pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


KEYS = ["chain.before", "chain.after", "store.get", "store.apply", "store.reserve", "store.settle",
        "store.record", "core", "store", "full"]


async def bench_store(
    name: str, make: Callable[[], RunStore], runs: int, steps: int
) -> tuple[dict[str, list[int]], float]:
    """One pass: warm-up runs, then `runs` runs of `steps` steps. Returns the timings and the thread CPU
    (microseconds per step) of the timed runs, the store's `close()` included."""
    store = make()
    chain = GuardChain(build_chain(POLICY, "bench"))
    plan = script(steps)
    timings: dict[str, list[int]] = {k: [] for k in KEYS}
    warm: dict[str, list[int]] = {k: [] for k in KEYS}
    for r in range(max(3, runs // 20)):
        for call, answer in plan:
            await step(store, chain, f"{name}-warm-{r}", call, answer, warm)
    cpu = time.thread_time_ns()
    for r in range(runs):
        for call, answer in plan:
            await step(store, chain, f"{name}-run-{r}", call, answer, timings)
    await store.close()
    return timings, (time.thread_time_ns() - cpu) / 1000.0 / (runs * steps)


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
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        makers: dict[str, Callable[[], RunStore]] = {
            "memory": MemoryRunStore,
            "sqlite": lambda: SqliteRunStore.open(Path(tmp) / f"bench-{time.perf_counter_ns()}.db"),
        }
        print(f"{args.runs} runs x {args.steps} steps per backend, best of {args.repeat}; "
              "microseconds per step")
        for name, make in makers.items():
            passes = [await bench_store(name, make, args.runs, args.steps) for _ in range(args.repeat)]
            timings, _ = min(passes, key=lambda p: statistics.fmean(p[0]["store"]))
            print(f"\n{name} ({len(timings['full'])} steps, the pass with the lowest mean store time)")
            print(f"  {'stage':<16}{'p50':>9}{'p99':>9}{'mean':>9}")
            for key, values in timings.items():
                mean = statistics.fmean(values) / 1000.0
                print(f"  {key:<16}{pct(values, 0.5):>9.1f}{pct(values, 0.99):>9.1f}{mean:>9.1f}")
            best_store = min(statistics.fmean(p[0]["store"]) for p in passes) / 1000.0
            best_cpu = min(p[1] for p in passes)
            print(f"  best of {args.repeat}: store {best_store:.1f} us/step (wall, sum of store calls), "
                  f"whole step {best_cpu:.1f} us/step (thread CPU, deferred work and close included)")
        print("\n200 concurrent reserves, budget for 10 (reserve all + settle the granted)")
        for name, make in makers.items():
            wall_ms, granted = await concurrency(make)
            print(f"  {name:<8} granted {granted}, wall {wall_ms:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
