"""Grammar costs for issue 5's closing note. Not collected by pytest (no test_ prefix).

Run from the repo root: .venv/bin/python -m tests.grammars.bench_grammars

Prints medians of repeated runs: complete validation per KB of output for each kind, incremental
checking per streamed chunk, checker creation and finish, compile time of the 10-field schema (cold)
and a cache hit (sync and async).
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
from collections.abc import Callable

from grammars import compile as compile_mod
from grammars.compile import Constraint, compile_async, compile_constraint
from grammars.spec import JSON_OBJECT, ConstraintSpec, choice_spec, json_schema_spec
from tests.grammars.samples import USER, USER_SCHEMA


def median_ns(fn: Callable[[], object], *, repeat: int = 200, number: int = 1) -> float:
    """Median wall time of `number` calls, per call, in nanoseconds."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter_ns() - start) / number)
    return statistics.median(samples)


def about_1kb(make: Callable[[int], str]) -> str:
    n = 1
    while len(make(n).encode()) < 1024:
        n += 1
    return make(n)


def user_doc(n_orders: int) -> str:
    orders = [
        {"sku": f"SKU-{i}", "qty": i + 1, "price": 9.99, "created_at": "2024-05-01T10:00:00Z"}
        for i in range(n_orders)
    ]
    return json.dumps({**USER, "orders": orders})


def main() -> None:
    user = json_schema_spec(USER_SCHEMA)
    cases: list[tuple[str, ConstraintSpec, str]] = [
        ("json_schema (10 fields)", user, about_1kb(user_doc)),
        ("json_object", JSON_OBJECT, about_1kb(user_doc)),
        (
            "regex (dates, one per line)",
            ConstraintSpec("regex", r"([0-9]{4}-[0-9]{2}-[0-9]{2}\n)+"),
            about_1kb(lambda n: "2024-05-01\n" * n),
        ),
        (
            "lark (arithmetic)",
            ConstraintSpec("lark", _ARITH),
            about_1kb(lambda n: " + ".join(["(12 * 3.5 - 7)"] * n)),
        ),
        (
            "gbnf (bullet list)",
            ConstraintSpec("gbnf", 'root ::= item+\nitem ::= "- " [^\\n]+ "\\n"'),
            about_1kb(lambda n: "- buy milk and eggs\n" * n),
        ),
        ("choice (1 KB option)", choice_spec(["x" * 1024, "y"]), "x" * 1024),
    ]
    print("complete validation (validate), about 1 KB of output")
    print(f"  {'kind':30} {'bytes':>6} {'µs/call':>9} {'µs/KB':>8}")
    for label, spec, text in cases:
        constraint = compile_constraint(spec)
        assert constraint.validate(text) is None, label
        ns = median_ns(functools.partial(constraint.validate, text))
        size = len(text.encode())
        print(f"  {label:30} {size:6} {ns / 1e3:9.1f} {ns / 1e3 * 1024 / size:8.1f}")
    short = compile_constraint(choice_spec(["positive", "neutral", "negative"]))
    short_ns = median_ns(lambda: short.validate("neutral"))
    print(f"  {'choice (3 options, 7 chars)':30} {7:6} {short_ns / 1e3:9.1f}")

    print("\nincremental check (feed), per streamed chunk; checker creation and finish()")
    print(f"  {'kind':30} {'chunk':>5} {'µs/chunk':>9} {'new µs':>7} {'finish µs':>9}")
    for label, spec, text in cases[:5]:
        constraint = compile_constraint(spec)
        for native in (True, False) if spec.is_json else (False,):
            for size in (4, 16):
                parts = [text[i : i + size] for i in range(0, len(text), size)]

                def run(c: Constraint = constraint, p: list[str] = parts, n: bool = native) -> None:
                    checker = c.checker(native=n)
                    for part in p:
                        checker.feed(part)

                new_ns = median_ns(functools.partial(constraint.checker, native=native))
                total = median_ns(run, repeat=50)
                finishes = []
                for _ in range(30):
                    checker = constraint.checker(native=native)
                    for part in parts:
                        assert checker.feed(part), label
                    finishes.append(median_ns(checker.finish, repeat=1))
                finish_ns = statistics.median(finishes)
                name = label + (" native" if native else " syntax" if spec.is_json else "")
                print(
                    f"  {name:30} {size:5} {(total - new_ns) / len(parts) / 1e3:9.2f} {new_ns / 1e3:7.1f} "
                    f"{finish_ns / 1e3:9.1f}"
                )

    def cold() -> None:
        compile_mod.clear_cache()
        compile_constraint(user)

    print("\ncompile and cache")
    print(f"  compile 10-field schema, cold:    {median_ns(cold, repeat=30) / 1e6:8.2f} ms")
    compile_constraint(user)
    hit_ns = median_ns(lambda: compile_constraint(user), number=100)
    print(f"  cache hit, compile_constraint:    {hit_ns / 1e3:8.2f} µs")
    spec_hit_ns = median_ns(lambda: compile_constraint(json_schema_spec(USER_SCHEMA)), number=100)
    print(f"  cache hit incl. building the spec:{spec_hit_ns / 1e3:8.2f} µs")

    async def hits() -> float:
        start = time.perf_counter_ns()
        for _ in range(10_000):
            await compile_async(user)
        return (time.perf_counter_ns() - start) / 10_000

    print(f"  cache hit, await compile_async:   {asyncio.run(hits()) / 1e3:8.2f} µs")
    for label, spec, _ in cases[2:]:

        def cold_other(s: ConstraintSpec = spec) -> None:
            compile_mod.clear_cache()
            compile_constraint(s)

        print(f"  compile {label + ', cold:':26}{median_ns(cold_other, repeat=30) / 1e6:8.2f} ms")


_ARITH = """
?start: sum
?sum: product | sum "+" product | sum "-" product
?product: atom | product "*" atom | product "/" atom
?atom: NUMBER | "-" atom | "(" sum ")"
%import common.NUMBER
%import common.WS_INLINE
%ignore WS_INLINE
"""

if __name__ == "__main__":
    main()
