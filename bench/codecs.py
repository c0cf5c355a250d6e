"""orjson against the standard library's json on the bodies a step parses and writes: the measurement
behind using orjson on the hot path. `python -m bench.codecs [--seconds S]` prints microseconds per call.

The bodies: the benchmark's own request and answer, and an agent-sized request (40 messages of ~1 KB,
10 tools, ~46 KB), the size a long tool loop reaches.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from bench.__main__ import BODY
from bench.upstream import ANSWER


def agent_request(messages: int = 40, tools: int = 10) -> bytes:
    """A long agent loop's request: alternating turns of ~1 KB and tool definitions."""
    return json.dumps({
        "model": "gpt-4o-mini",
        "messages": [{"role": "user" if i % 2 else "assistant", "content": "lorem ipsum dolor sit amet " * 40}
                     for i in range(messages)],
        "tools": [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 100,
                                                     "parameters": {"type": "object",
                                                                    "properties": {"a": {"type": "string"}}}}}
                  for i in range(tools)],
    }).encode()


BODIES: dict[str, bytes] = {"bench request": BODY, "bench answer": ANSWER}


@dataclass(frozen=True)
class Timing:
    """Microseconds per call of each library, for one body."""

    name: str
    size: int
    loads_json: float
    loads_orjson: float
    dumps_json: float
    dumps_orjson: float


def per_call_us(fn: Callable[[], Any], seconds: float) -> float:
    """The best of three runs of `fn` lasting about `seconds` in all, in microseconds per call."""
    timer = timeit.Timer(fn)
    probe = 10
    once = max(timer.timeit(probe) / probe, 1e-9)  # a first guess at one call, to size the runs
    runs = max(probe, int(seconds / 3 / once))
    return min(timer.repeat(3, runs)) / runs * 1e6


def measure(name: str, body: bytes, seconds: float = 0.3) -> Timing:
    """Both libraries on `body`; raises ValueError if they do not read it the same way (a timing of
    two different results would compare nothing)."""
    value = json.loads(body)
    if orjson.loads(body) != value:
        raise ValueError(f"{name}: orjson and json disagree on what the body holds")
    if json.loads(orjson.dumps(value)) != value:
        raise ValueError(f"{name}: orjson's output does not read back as the body")
    return Timing(
        name=name,
        size=len(body),
        loads_json=per_call_us(lambda: json.loads(body), seconds),
        loads_orjson=per_call_us(lambda: orjson.loads(body), seconds),
        dumps_json=per_call_us(lambda: json.dumps(value).encode(), seconds),
        dumps_orjson=per_call_us(lambda: orjson.dumps(value), seconds),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=0.3, help="time spent per library and operation")
    args = parser.parse_args()
    for name, body in {**BODIES, "agent request": agent_request()}.items():
        t = measure(name, body, args.seconds)
        print(f"{t.name} ({t.size:,} B): parse json {t.loads_json:.1f} us, orjson {t.loads_orjson:.1f} us; "
              f"serialize json {t.dumps_json:.1f} us, orjson {t.dumps_orjson:.1f} us")


if __name__ == "__main__":
    main()
