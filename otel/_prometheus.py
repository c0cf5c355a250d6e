"""prometheus-client building blocks for `otel.metrics`: bounded label values, and metric families
whose children are plain slots objects, exposed through prometheus-client's own collector interface
(`collect()` yields its `*MetricFamily` objects, `generate_latest` writes the text format).

Why not prometheus-client's `Counter` / `Histogram`: each `inc()` / `observe()` takes a lock and checks
observability, a histogram observation increments two locked values after a linear scan of its bounds,
and `labels()` validates on every call. A step records about fifteen values; that was ~6% of the
gateway's instructions per request (`python -m bench.instructions`). Here an increment is one
attribute update and a bucket is found by bisection.

Concurrency contract: children are updated without a lock, so every update must come from one thread.
In tollgate that is the event loop's (every caller of `otel.metrics.Metrics` runs on it; scrapes are
served on it too). Exposition matches prometheus-client's for the same observations, minus the
`*_created` samples, which the Prometheus text format does not need (tests/otel/test_prometheus.py
compares the two).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate
from typing import Final, Generic, TypeVar

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

OTHER: Final = "_OTHER"


class BoundedLabel:
    """At most `limit` distinct values; later newcomers become `_OTHER` (memory and series bound)."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if not value:
            return ""
        if value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return OTHER
        self._seen.add(value)
        return value


class CounterChild:
    """One label set of a `CounterFamily`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter can only be incremented by a non-negative amount")
        self.value += amount


class HistogramChild:
    """One label set of a `HistogramFamily`: a count per bucket (not cumulative; the last bucket is
    `+Inf`) and the sum. A value lands in the first bucket whose upper bound is >= it, as in
    prometheus-client; NaN lands in none (and makes the sum NaN), as there."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0.0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        if not math.isnan(amount):
            self.counts[bisect_left(self._bounds, amount)] += 1

    def merge(self, other: HistogramChild) -> None:
        """Add what `other` (with the same bounds) observed."""
        if other._bounds != self._bounds:
            raise ValueError("histograms with different buckets cannot be merged")
        self.sum += other.sum
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]


C = TypeVar("C", CounterChild, HistogramChild)


class _Family(Collector, Generic[C]):
    """Children by label values, created on first use (`labels(*values)`, memoised); a subclass says
    how a child is made (`_child`), which family it is exposed as (`_family`) and with which samples
    (`collect`)."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str]) -> None:
        self._name = name
        self._doc = doc
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], C] = {}

    def labels(self, *values: str) -> C:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: {len(self._labelnames)} label values expected, got {len(values)}")
            child = self._children[values] = self._child()
        return child

    def _child(self) -> C:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        yield self._family()


class CounterFamily(_Family[CounterChild]):
    """A counter (`<name>_total`); with no label names, its one series exists from the start."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str] = ()) -> None:
        super().__init__(name, doc, labelnames)
        if not self._labelnames:
            self.labels()

    def _child(self) -> CounterChild:
        return CounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        yield family


class HistogramFamily(_Family[HistogramChild]):
    """A histogram over sorted finite `buckets` (upper bounds; `+Inf` is added)."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str], buckets: Iterable[float]) -> None:
        super().__init__(name, doc, labelnames)
        bounds = tuple(float(b) for b in buckets)
        if not bounds or list(bounds) != sorted(set(bounds)) or not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"{name}: buckets must be finite, distinct and sorted")
        self._bounds = bounds
        self._le = (*(floatToGoString(b) for b in bounds), "+Inf")

    def _child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, list(zip(self._le, accumulate(child.counts))), child.sum)
        yield family


class GaugeValue(Collector):
    """One unlabelled gauge: read from `read` at scrape time when given, else the last `set`."""

    def __init__(self, name: str, doc: str, read: Callable[[], float] | None = None) -> None:
        self._name, self._doc, self._read = name, doc, read
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._doc)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._doc, value=self._read() if self._read is not None else self.value)


class CallbackCounter(Collector):
    """A counter family whose samples come from a callback at scrape time."""

    def __init__(
        self, name: str, doc: str, labelname: str | None, read: Callable[[], Iterable[tuple[str, float]]]
    ):
        self._name, self._doc, self._labelname, self._read = name, doc, labelname, read

    def _family(self, samples: Iterable[tuple[str, float]]) -> CounterMetricFamily:
        labels = [self._labelname] if self._labelname else None
        family = CounterMetricFamily(self._name, self._doc, labels=labels)
        for value_label, value in samples:
            family.add_metric([value_label] if self._labelname else [], value)
        return family

    def describe(self) -> Iterator[Metric]:
        yield self._family(())

    def collect(self) -> Iterator[Metric]:
        yield self._family(self._read())
