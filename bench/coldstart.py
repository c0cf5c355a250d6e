"""Cold start of `python -m gateway serve`: from `Popen` to the first 200 chat completion through it,
with the `make bench` configuration (fake upstream, local OTLP sink, SQLite state, budget + caps +
loop guards, a regex output grammar). Repeats and prints best / median / worst, the CPU time the
gateway process had used by then (less sensitive than wall time to other load on the machine) and
its RSS high-water mark."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.__main__ import BODY, port, rss_mb, wait_ready


def bench_config(upstream: int, state_path: Path) -> dict[str, object]:
    """The configuration `make bench` serves (kept in step with bench/__main__.py by hand)."""
    return {
        "providers": {
            "fake": {"type": "openai", "base_url": f"http://127.0.0.1:{upstream}/v1", "api_key": "sk-bench"}
        },
        "models": {"gpt-*": "fake"},
        "pricing": {"gpt-*": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}},
        "state": {"backend": "sqlite", "path": str(state_path)},
        "agents": {"default": {"budget": {"usd": 1e9, "tokens": 10**15},
                               "caps": {"llm_calls": 10**9, "seconds": 10**7},
                               "loop": {"window": 6, "max_distinct": 3},
                               "output": {"grammar": "regex:[a-z ]+"}}},
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def once(py: str, upstream: int, tmp: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """One cold start in a fresh state directory: (seconds to first 200, CPU seconds of the gateway by
    then, VmHWM MB right after it)."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    (run_dir / "tollgate.yaml").write_text(yaml.safe_dump(bench_config(upstream, run_dir / "state.db")))
    tg, admin = port(), port()
    started = time.perf_counter()
    command = [py, "-m", "gateway", "serve", "--config", str(run_dir / "tollgate.yaml"),
               "--port", str(tg), "--admin-port", str(admin)]
    gate = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        await wait_ready(f"http://127.0.0.1:{tg}/v1/chat/completions", BODY, 30)
        cold = time.perf_counter() - started
        return cold, cpu_s(gate.pid), rss_mb(gate.pid)
    finally:
        gate.terminate()
        gate.wait(timeout=30)


async def main(runs: int, tracing: bool) -> None:
    py = sys.executable
    up, tmp = port(), Path(tempfile.mkdtemp())
    upstream = subprocess.Popen([py, "-m", "bench.upstream", str(up)])
    env = {**os.environ}
    if tracing:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{up}"
    try:
        await wait_ready(f"http://127.0.0.1:{up}/v1/chat/completions", BODY)
        results = [await once(py, up, tmp, env) for _ in range(runs)]
    finally:
        upstream.terminate()
        upstream.wait(timeout=30)
    colds = sorted(c * 1000 for c, _, _ in results)
    cpus = sorted(c * 1000 for _, c, _ in results)
    rss = [r for _, _, r in results]
    print(f"cold start ms over {runs}: best {colds[0]:.0f}  median {statistics.median(colds):.0f}  "
          f"worst {colds[-1]:.0f}  all {' '.join(f'{c:.0f}' for c in colds)}")
    print(f"gateway CPU ms by then: best {cpus[0]:.0f}  median {statistics.median(cpus):.0f}  "
          f"worst {cpus[-1]:.0f}")
    print(f"RSS after first answer MB: median {statistics.median(rss):.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-tracing", action="store_true", help="measure without span export")
    args = parser.parse_args()
    asyncio.run(main(args.runs, not args.no_tracing))
