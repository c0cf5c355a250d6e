"""otel/_prometheus.py: bounded label values, memoised children, scrape-time counters, no `_created`."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from otel._prometheus import OTHER, BoundedLabel, CallbackCounter, Children, WithoutCreated


@pytest.mark.parametrize(
    ("limit", "values", "expected"),
    [
        (2, ["a", "b", "c", "a", "d", "b"], ["a", "b", OTHER, "a", OTHER, "b"]),
        (1, ["x", "x", "y"], ["x", "x", OTHER]),
        (0, ["x"], [OTHER]),
        (3, [None, "", "m"], ["", "", "m"]),  # absent is the empty label value and uses no slot
        (1, ["", "m", "n"], ["", "m", OTHER]),
    ],
)
def test_bounded_label(limit: int, values: list[str | None], expected: list[str]) -> None:
    bound = BoundedLabel(limit)
    assert [bound(v) for v in values] == expected


def test_children_are_memoised_per_label_tuple() -> None:
    registry = CollectorRegistry()
    counter = Counter("things", "Things.", ("kind", "result"), registry=registry)
    children = Children(counter)
    first = children("a", "ok")
    assert children("a", "ok") is first
    assert children("a", "fail") is not first
    first.inc(2)
    children("a", "ok").inc()
    assert registry.get_sample_value("things_total", {"kind": "a", "result": "ok"}) == 3.0
    assert registry.get_sample_value("things_total", {"kind": "a", "result": "fail"}) == 0.0


def test_children_refuse_a_wrong_label_count() -> None:
    children = Children(Counter("c", "C.", ("one",), registry=CollectorRegistry()))
    with pytest.raises(ValueError):
        children("a", "b")


@pytest.mark.parametrize(
    ("labelname", "samples", "expected"),
    [
        (None, [("", 4.0)], ['errors_total 4.0']),
        ("component", [("span.end", 2.0), ("metrics.cost", 1.0)],
         ['errors_total{component="span.end"} 2.0', 'errors_total{component="metrics.cost"} 1.0']),
        ("component", [], []),
    ],
)
def test_callback_counter_reads_at_scrape_time(labelname: str | None, samples: list[tuple[str, float]],
                                               expected: list[str]) -> None:
    registry = CollectorRegistry()
    calls: list[int] = []

    def read() -> list[tuple[str, float]]:
        calls.append(1)
        return samples

    registry.register(CallbackCounter("errors", "Errors.", labelname, read))
    assert calls == []  # registering describes the family without reading it
    text = generate_latest(registry).decode()
    assert "# TYPE errors_total counter" in text.splitlines()
    assert [line for line in text.splitlines() if line.startswith("errors_total")] == expected
    assert len(calls) == 1


def test_without_created_drops_only_created_samples() -> None:
    registry = CollectorRegistry()
    Counter("hits", "Hits.", registry=registry).inc(3)
    full = generate_latest(registry).decode()
    assert "hits_created" in full
    text = generate_latest(WithoutCreated(registry)).decode()
    assert "hits_created" not in text
    assert "hits_total 3.0" in text
