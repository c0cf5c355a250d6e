"""Instructions per request, counted by callgrind: repeatable whatever else the machine is doing, so a
change on the hot path can be judged by a few hundred requests instead of many timed runs.

`python -m bench.instructions [--requests N] [--target tollgate|bare] [--state sqlite|memory]
[--body short|agent]` starts the fast fake upstream, then tollgate (the `make bench` configuration:
every guard, an output grammar, tracing to the upstream's OTLP sink) or the bare aiohttp proxy under
`valgrind --tool=callgrind`, warms it up, zeroes the counters, sends N requests at concurrency 16 and
prints the instructions per request (the target process only; its export thread included): of the benchmark's short request, or of
an agent-sized one (`bench.bodies`, ~64 KB). Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

from bench.__main__ import BODY, load, port, wait_ready
from bench.bodies import agent_body

WARM_UP = 300


def config(upstream: int, tmp: Path, state: str) -> Path:
    """The `make bench` gateway configuration, written under `tmp`."""
    data = {
        "providers": {"fake": {"type": "openai", "base_url": f"http://127.0.0.1:{upstream}/v1", "api_key": "sk-bench"}},
        "models": {"gpt-*": "fake"},
        "pricing": {"gpt-*": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}},
        "state": {"backend": state, "path": str(tmp / "state.db")},
        "agents": {"default": {"budget": {"usd": 1e9, "tokens": 10**15},
                               "caps": {"llm_calls": 10**9, "seconds": 10**7},
                               "loop": {"window": 6, "max_distinct": 3},
                               "output": {"grammar": "regex:[a-z ]+"}}},
    }
    path = tmp / "tollgate.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def control(pid: int, action: str) -> None:
    subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True, timeout=120)


def total_instructions(out_dir: Path) -> int:
    """The sum of `summary:` lines over the dumps callgrind wrote after the counters were zeroed."""
    total = 0
    for dump in out_dir.glob("callgrind.out.*"):
        text = dump.read_text(errors="replace")
        if "Trigger: dump bench" not in text:
            continue
        found = re.search(r"^summary:\s+(\d+)", text, re.MULTILINE)
        total += int(found.group(1)) if found else 0
    return total


BODIES: dict[str, Callable[[], bytes]] = {"short": lambda: BODY, "agent": agent_body}


async def measure(requests: int, target: str, state: str, body_kind: str = "short") -> int:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    up, proxy, admin = port(), port(), port()
    tmp = Path(tempfile.mkdtemp())
    py = sys.executable
    upstream = subprocess.Popen([py, "-m", "bench.upstream", str(up)])
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{up}", "PYTHONMALLOC": "malloc"}
    command = ([py, "-m", "bench.bare", str(proxy), str(up)] if target == "bare" else
               [py, "-m", "gateway", "serve", "--config", str(config(up, tmp, state)), "--port", str(proxy),
                "--admin-port", str(admin)])
    grind = subprocess.Popen(["valgrind", "--tool=callgrind", "--dump-instr=no", "--separate-threads=no",
                              f"--callgrind-out-file={tmp}/callgrind.out.%p", *command],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = BODIES[body_kind]()
    try:
        url = f"http://127.0.0.1:{proxy}/v1/chat/completions"
        await wait_ready(f"http://127.0.0.1:{up}/v1/chat/completions", BODY)
        await wait_ready(url, BODY, 300)
        await load(url, body, 16, WARM_UP)
        control(grind.pid, "--zero")
        await load(url, body, 16, requests)
        subprocess.run(["callgrind_control", "--dump=bench", str(grind.pid)], check=True, capture_output=True,
                       timeout=300)
        return total_instructions(tmp) // requests
    finally:
        grind.terminate()
        grind.wait(timeout=120)
        upstream.terminate()
        upstream.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--target", choices=("tollgate", "bare"), default="tollgate")
    parser.add_argument("--state", choices=("sqlite", "memory"), default="sqlite")
    parser.add_argument("--body", choices=tuple(BODIES), default="short",
                        help="the benchmark's short request, or an agent-sized one (bench.bodies, ~64 KB)")
    args = parser.parse_args()
    per_request = asyncio.run(measure(args.requests, args.target, args.state, args.body))
    print(f"{args.target}: {per_request / 1000:,.0f} k instructions per {args.body} request "
          f"({args.requests} requests at concurrency 16, after {WARM_UP} to warm up)")


if __name__ == "__main__":
    main()
