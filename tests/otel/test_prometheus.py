"""otel/_prometheus.py: bounded label values, lock-free families exposed as prometheus-client exposes its
own, scrape-time counters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from otel._prometheus import (
    OTHER,
    BoundedLabel,
    CallbackCounter,
    CounterFamily,
    GaugeValue,
    HistogramChild,
    HistogramFamily,
)


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
    counter = CounterFamily("things", "Things.", ("kind", "result"))
    registry.register(counter)
    first = counter.labels("a", "ok")
    assert counter.labels("a", "ok") is first
    assert counter.labels("a", "fail") is not first
    first.inc(2)
    counter.labels("a", "ok").inc()
    assert registry.get_sample_value("things_total", {"kind": "a", "result": "ok"}) == 3.0
    assert registry.get_sample_value("things_total", {"kind": "a", "result": "fail"}) == 0.0


@pytest.mark.parametrize("family", [CounterFamily("c", "C.", ("one",)), HistogramFamily("h", "H.", ("one",), (1.0,))])
def test_children_refuse_a_wrong_label_count(family: CounterFamily | HistogramFamily) -> None:
    with pytest.raises(ValueError, match="1 label values expected, got 2"):
        family.labels("a", "b")
    with pytest.raises(ValueError):
        family.labels()


def test_a_counter_refuses_a_negative_increment() -> None:
    child = CounterFamily("c", "C.", ("one",)).labels("a")
    with pytest.raises(ValueError):
        child.inc(-1)
    assert child.value == 0.0


@pytest.mark.parametrize("buckets", [(), (2.0, 1.0), (1.0, 1.0), (1.0, math.inf), (math.nan,)])
def test_histogram_buckets_must_be_finite_distinct_and_sorted(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets"):
        HistogramFamily("h", "H.", (), buckets)


def _exposition(collector: object) -> list[str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


_LABELS = st.tuples(st.sampled_from(["a", "b", ""]), st.sampled_from(["x", "y"]))
_VALUES = st.one_of(st.floats(min_value=0, max_value=1e9, allow_nan=False), st.integers(0, 10**6),
                    st.sampled_from([0.01, 0.02, 4.0, 16.0, 1e9]))  # on bucket bounds too


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_LABELS, _VALUES), max_size=30))
def test_exposition_matches_prometheus_client(observations: list[tuple[tuple[str, str], float]]) -> None:
    """Same observations, same text as prometheus-client's Counter and Histogram (minus `_created`)."""
    buckets = (0.01, 0.02, 0.04, 1.0, 4.0, 16.0)
    ours_counter, ours_histogram = CounterFamily("c", "C.", ("p", "q")), HistogramFamily("h", "H.", ("p", "q"), buckets)
    theirs_counter = Counter("c", "C.", ("p", "q"), registry=None)
    theirs_histogram = Histogram("h", "H.", ("p", "q"), buckets=buckets, registry=None)
    for labels, value in observations:
        ours_counter.labels(*labels).inc(value)
        theirs_counter.labels(*labels).inc(value)
        ours_histogram.labels(*labels).observe(value)
        theirs_histogram.labels(*labels).observe(value)
    assert _exposition(ours_counter) == _exposition(theirs_counter)
    assert _exposition(ours_histogram) == _exposition(theirs_histogram)


def test_unlabelled_counter_is_exposed_from_the_start() -> None:
    theirs = Counter("r", "R.", registry=None)
    assert _exposition(CounterFamily("r", "R.")) == _exposition(theirs)


def test_histogram_nan_counts_in_no_bucket_as_in_prometheus_client() -> None:
    ours, theirs = HistogramFamily("h", "H.", (), (1.0,)), Histogram("h", "H.", buckets=(1.0,), registry=None)
    for value in (0.5, math.nan):
        ours.labels().observe(value)
        theirs.observe(value)
    assert _exposition(ours) == _exposition(theirs)


@pytest.mark.parametrize("read", [None, lambda: 2.5])
def test_gauge_value_reads_its_callback_or_its_last_set(read: object) -> None:
    gauge = GaugeValue("g", "G.", read)  # type: ignore[arg-type]
    gauge.set(1.25)
    theirs = Gauge("g", "G.", registry=None)
    theirs.set(2.5 if read else 1.25)
    assert _exposition(gauge) == _exposition(theirs)


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


def test_a_histogram_child_merges_what_another_observed() -> None:
    family = HistogramFamily("h", "doc", ("a",), (0.1, 1.0))
    into, other = family.labels("x"), HistogramChild((0.1, 1.0))
    into.observe(0.05)
    for value in (0.5, 2.0):
        other.observe(value)
    into.merge(other)
    assert (into.counts, into.sum) == ([1.0, 1.0, 1.0], 2.55)
    with pytest.raises(ValueError, match="different buckets"):
        into.merge(HistogramChild((0.2,)))
