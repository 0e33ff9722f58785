"""OpenTelemetry instruments (``pip install 'llama-guard[otel]'``): the guards' counters for a meter provider.

Observable counters and gauges read the counts when the SDK collects; nothing is recorded per request. The
first-byte histogram is a synchronous instrument (the API has no observable histogram) fed at each collection with
the samples the guard counted since the last one, each at the upper bound of its 2%-wide bucket (so the counts are
exact, the sum within 2%).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from .._core.extras import missing_extra
from .._core.origins import Origin
from .._core.stats import OriginTotals
from . import catalog
from .prometheus import keyword_hint, sources_set
from .sources import kind_of

__all__ = ["OpenTelemetryMetrics", "instrument_opentelemetry"]


def _otel_metrics() -> Any:
    try:
        from opentelemetry import metrics
    except ModuleNotFoundError as exc:
        missing_extra(
            exc, feature="llama_guard.metrics' OpenTelemetry instruments", extra="otel", modules=("opentelemetry",)
        )
    return metrics


def _attributes(labels: dict[str, str]) -> dict[str, str]:
    return {catalog.OTEL_LABELS[name]: value for name, value in labels.items()}


class OpenTelemetryMetrics:
    """The guards' counters as OpenTelemetry instruments of the meter ``llama_guard`` (see ``docs/metrics.md``).

    Made by `instrument_opentelemetry`. ``sources`` as for `PrometheusCollector`. The instruments stay with the
    meter provider (OpenTelemetry cannot remove an instrument); `stop()` makes them report nothing more.
    """

    def __init__(self, meter_provider: Any = None, *, sources: Iterable[object] | None = None) -> None:
        from .. import __version__

        metrics = _otel_metrics()
        if meter_provider is not None and not callable(getattr(meter_provider, "get_meter", None)):
            raise TypeError(
                "meter_provider must be an OpenTelemetry MeterProvider, or None for the global one; "
                f"got {kind_of(meter_provider)}{keyword_hint(meter_provider, 'instrument_opentelemetry')}"
            )
        provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
        self._sources = sources_set(sources)
        self.meter = provider.get_meter("llama_guard", __version__)
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, Origin], OriginTotals] = {}
        self._fed: dict[tuple[str, Origin], dict[float, int]] = {}  # first-byte samples recorded, per bucket
        self._stopped = False
        meter = self.meter
        # The histogram first: the first observable callback of each collection feeds it (below).
        self._first_byte = meter.create_histogram(
            catalog.FIRST_BYTE.opentelemetry,
            unit=catalog.FIRST_BYTE.unit,
            description=catalog.FIRST_BYTE.description,
            explicit_bucket_boundaries_advisory=list(catalog.FIRST_BYTE_BUCKETS),
        )
        self.instruments: dict[str, Any] = {catalog.FIRST_BYTE.opentelemetry: self._first_byte}
        for index, metric in enumerate(catalog.COUNTERS):
            self.instruments[metric.opentelemetry] = meter.create_observable_counter(
                metric.opentelemetry,
                callbacks=[self._refreshing(metric) if index == 0 else self._counter_callback(metric)],
                unit=metric.unit,
                description=metric.description,
            )
        self.instruments[catalog.STALL_EPISODES.opentelemetry] = meter.create_observable_counter(
            catalog.STALL_EPISODES.opentelemetry,
            callbacks=[self._stall_episodes],
            unit=catalog.STALL_EPISODES.unit,
            description=catalog.STALL_EPISODES.description,
        )
        self.instruments[catalog.STRATEGY.opentelemetry] = meter.create_observable_gauge(
            catalog.STRATEGY.opentelemetry,
            callbacks=[self._strategies],
            unit=catalog.STRATEGY.unit,
            description=catalog.STRATEGY.description,
        )

        self.instruments[catalog.UNGUARDED.opentelemetry] = meter.create_observable_gauge(
            catalog.UNGUARDED.opentelemetry,
            callbacks=[self._unguarded],
            unit=catalog.UNGUARDED.unit,
            description=catalog.UNGUARDED.description,
        )

    def stop(self) -> None:
        """Report nothing more (the instruments stay registered, empty)."""
        self._stopped = True

    # -- callbacks ---------------------------------------------------------------------------------------------

    def _refreshing(self, metric: catalog.Metric) -> Any:
        """The first counter's callback: reads the counts for the whole collection and feeds the histogram."""
        counter = self._counter_callback(metric)

        def callback(options: Any) -> Iterator[Any]:
            if not self._stopped:
                self._refresh()
            observations: Iterator[Any] = counter(options)
            return observations

        return callback

    def _counter_callback(self, metric: catalog.Metric) -> Any:
        observation = _otel_metrics().Observation

        def callback(options: Any) -> Iterator[Any]:
            if self._stopped:
                return iter(())
            with self._lock:
                every = self._totals
            return (observation(count, _attributes(labels)) for labels, count in catalog.counter_series(metric, every))

        return callback

    def _stall_episodes(self, options: Any) -> Iterator[Any]:
        if self._stopped:
            return iter(())
        observation = _otel_metrics().Observation
        return (observation(count, _attributes(labels)) for labels, count in catalog.stall_episode_series())

    def _strategies(self, options: Any) -> Iterator[Any]:
        if self._stopped:
            return iter(())
        observation = _otel_metrics().Observation
        with self._lock:
            every = self._totals
        found = []
        for labels, value in catalog.strategy_series(every):
            reason = labels.pop("reason")
            attributes = _attributes(labels)
            attributes["llama_guard.connection.reason"] = reason
            found.append(observation(value, attributes))
        return iter(found)

    def _unguarded(self, options: Any) -> Iterator[Any]:
        if self._stopped:
            return iter(())
        observation = _otel_metrics().Observation
        found = []
        for labels, value in catalog.unguarded_series(self._sources):
            attributes = _attributes({"library": labels["library"]})
            attributes["llama_guard.unguarded.reason"] = labels["reason"]
            found.append(observation(value, attributes))
        return iter(found)

    def _refresh(self) -> None:
        every = catalog.read_totals(self._sources)
        with self._lock:
            self._totals = every
            for key, totals in every.items():
                fed = self._fed.setdefault(key, {})
                attributes = _attributes({"stack": key[0], "origin": str(key[1])})
                for upper, count in totals.first_byte.buckets():
                    new = count - fed.get(upper, 0)
                    fed[upper] = count
                    for _ in range(new):  # the API records one sample at a time
                        self._first_byte.record(upper, attributes)


def instrument_opentelemetry(
    meter_provider: Any = None, *, sources: Iterable[object] | None = None
) -> OpenTelemetryMetrics:
    """Create the guard's instruments on ``meter_provider`` (default: the global one,
    ``opentelemetry.metrics.get_meter_provider()``), reading ``sources`` (default: every guard of the process)."""
    return OpenTelemetryMetrics(meter_provider, sources=sources)
