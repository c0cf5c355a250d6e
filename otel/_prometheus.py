"""prometheus-client building blocks for `otel.metrics`: bounded label values, scrape-time counters,
and the exposition without `*_created` samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final, Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

OTHER: Final = "_OTHER"
M = TypeVar("M", bound=MetricWrapperBase)


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


class WithoutCreated:
    """The registry as scraped, minus prometheus-client's `*_created` samples (one extra series per
    label set, which Prometheus' text format does not need; disabling them is only possible
    process-wide in prometheus-client)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class Children(Generic[M]):
    """`metric.labels(*values)` memoised: prometheus-client validates and locks on every `labels()`
    call, which dominated the per-step cost. Label values are bounded upstream (config names, codes,
    `BoundedLabel`), so the cache is too."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child
