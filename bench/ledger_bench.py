"""Ledger cost: hot-path enqueue (`append_nowait`) per row and writer throughput (rows/s).

Usage: `.venv/bin/python bench/ledger_bench.py [--rows N]`. Writes only to a temporary directory;
bounded in rows, no network. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from gateway.ledger import Ledger, LedgerEntry, input_hash, verify


def _entry(i: int) -> LedgerEntry:
    return LedgerEntry("support-bot", f"run-{i % 64}", "chat", "gpt-4o-mini", input_hash(str(i)),
                       "stop" if i % 50 == 0 else "allow", "budget_exhausted" if i % 50 == 0 else None,
                       "step decided")


async def _enqueue_cost(path: Path, rows: int) -> tuple[float, float, float]:
    """Mean ns per append_nowait over a tight loop, plus p50/p99 of single timed calls (these include
    ~the timer's own overhead). The writer is running, as in the gateway."""
    ledger = Ledger.open(path)
    await ledger.start()
    entries = [_entry(i) for i in range(rows)]
    singles: list[int] = []
    total = 0
    for start in range(0, rows, 1000):  # 1000 appends per loop turn, then let the writer run
        chunk = entries[start:start + 1000]
        t0 = time.perf_counter_ns()
        for e in chunk:
            ledger.append_nowait(e)
        total += time.perf_counter_ns() - t0
        await asyncio.sleep(0)
    for e in entries[:20_000]:
        t0 = time.perf_counter_ns()
        ledger.append_nowait(e)
        singles.append(time.perf_counter_ns() - t0)
    await ledger.close()
    q = statistics.quantiles(singles, n=100)
    return total / rows, q[49], q[98]


def _enqueue_only(path: Path, rows: int) -> float:
    """Mean ns per append_nowait with no writer running: the enqueue alone, no GIL contention."""
    ledger = Ledger.open(path, max_pending=rows, hard_limit=rows)
    entries = [_entry(i) for i in range(rows)]
    t0 = time.perf_counter_ns()
    for e in entries:
        ledger.append_nowait(e)
    elapsed = time.perf_counter_ns() - t0
    ledger.close_sync()
    return elapsed / rows


async def _writer_rate(path: Path, rows: int, batch_size: int) -> float:
    ledger = Ledger.open(path, batch_size=batch_size, max_pending=rows)
    for i in range(rows):
        ledger.append_nowait(_entry(i))
    t0 = time.perf_counter()
    await ledger.start()
    await ledger.flush()
    elapsed = time.perf_counter() - t0
    await ledger.close()
    return rows / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        alone = _enqueue_only(Path(tmp) / "alone.db", args.rows)
        print(f"append_nowait, no writer running: mean {alone / 1000:.2f} us/row over {args.rows} rows")
        mean, p50, p99 = await _enqueue_cost(Path(tmp) / "enqueue.db", args.rows)
        print(f"append_nowait, writer running: mean {mean / 1000:.2f} us/row over {args.rows} rows; "
              f"single call p50 {p50 / 1000:.2f} us, p99 {p99 / 1000:.2f} us (timer included)")
        for batch in (64, 512, 2048):
            db = Path(tmp) / f"writer-{batch}.db"
            rate = await _writer_rate(db, args.rows, batch)
            t0 = time.perf_counter()
            result = verify(db)
            vrate = result.rows / (time.perf_counter() - t0)
            print(f"writer batch_size={batch}: {rate:,.0f} rows/s; verify {vrate:,.0f} rows/s ok={result.ok}")


if __name__ == "__main__":
    asyncio.run(main())
