"""The Prometheus collector (``pip install 'llama-guard[prometheus]'``): the guards' counters at each scrape.

A custom collector (prometheus_client's ``Collector`` protocol: ``collect()`` and ``describe()``) reads the counts
when scraped; nothing is recorded per request beyond what the guard counts anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .._core.extras import missing_extra
from .._core.stats import StatsSet
from . import catalog
from .sources import stats_of

__all__ = ["PrometheusCollector", "register_prometheus", "sources_set"]


def _prometheus() -> Any:
    try:
        import prometheus_client.core
    except ModuleNotFoundError as exc:
        missing_extra(
            exc, feature="llama_guard.metrics' Prometheus collector", extra="prometheus", modules=("prometheus_client",)
        )
    return prometheus_client.core


def sources_set(sources: Iterable[object] | None) -> StatsSet | None:
    """None (every guard of the process) or the `StatsSet` of ``sources`` (each resolved by `stats_of`)."""
    if sources is None:
        return None
    return StatsSet(stats_of(source) for source in sources)


class PrometheusCollector:
    """The guards' counters as Prometheus metrics, per stack and origin (see ``docs/metrics.md`` for the list).

    ``sources``: what to export, as clients, transports, sessions, installations or `GuardStats` (held weakly;
    the counts of one that is gone are kept); default: every guard of the process, present and past.
    Register it with a registry (`register_prometheus`, or ``registry.register(collector)``).
    """

    def __init__(self, sources: Iterable[object] | None = None) -> None:
        self._core = _prometheus()
        self._sources = sources_set(sources)

    def describe(self) -> Iterator[Any]:
        """The metric families, without samples (so that registering does not read the counts)."""
        core = self._core
        for metric in catalog.METRICS:
            yield self._family(core, metric, [])

    def collect(self) -> Iterator[Any]:
        core = self._core
        every = catalog.read_totals(self._sources)
        for metric in catalog.COUNTERS:
            labels = ["stack", "origin"] + ([metric.label] if metric.label else [])
            family = self._family(core, metric, labels)
            for values, count in catalog.counter_series(metric, every):
                family.add_metric([values[name] for name in labels], count)
            yield family
        family = self._family(core, catalog.STALL_EPISODES, ["origin"])
        for values, count in catalog.stall_episode_series():
            family.add_metric([values["origin"]], count)
        yield family
        labels = ["stack", "origin", "strategy", "reason"]
        family = self._family(core, catalog.STRATEGY, [])
        for values, _ in catalog.strategy_series(every):
            family.add_metric([], {name: values[name] for name in labels})
        yield family
        family = self._family(core, catalog.UNGUARDED, [])
        for values, _ in catalog.unguarded_series(self._sources):
            family.add_metric([], values)
        yield family
        family = self._family(core, catalog.FIRST_BYTE, ["stack", "origin"])
        for (stack, origin), totals in every.items():
            cumulative, _, seconds = catalog.first_byte_buckets(totals)
            bounds = [*(repr(float(bound)) for bound in catalog.FIRST_BYTE_BUCKETS), "+Inf"]
            family.add_metric([stack, str(origin)], list(zip(bounds, cumulative, strict=True)), seconds)
        yield family

    @staticmethod
    def _family(core: Any, metric: catalog.Metric, labels: list[str]) -> Any:
        if metric.kind == "counter":
            return core.CounterMetricFamily(metric.prometheus, metric.description, labels=labels)
        if metric.kind == "info":
            return core.InfoMetricFamily(metric.prometheus, metric.description, labels=labels)
        return core.HistogramMetricFamily(metric.prometheus, metric.description, labels=labels, unit="seconds")


def register_prometheus(registry: Any = None, *, sources: Iterable[object] | None = None) -> PrometheusCollector:
    """Register a `PrometheusCollector` with ``registry`` (default: prometheus_client's global ``REGISTRY``,
    which ``prometheus_client.start_http_server`` and ``make_asgi_app`` serve); returns the collector, which
    ``registry.unregister(collector)`` removes."""
    collector = PrometheusCollector(sources)
    if registry is None:
        registry = _prometheus().REGISTRY
    registry.register(collector)
    return collector
