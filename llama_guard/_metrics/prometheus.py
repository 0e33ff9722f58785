"""The Prometheus collector (``pip install 'llama-guard[prometheus]'``): the guards' counters at each scrape.

A custom collector (prometheus_client's ``Collector`` protocol: ``collect()`` and ``describe()``) reads the counts
when scraped; nothing is recorded per request beyond what the guard counts anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .._core.extras import missing_extra
from .._core.stats import StatsSet
from . import catalog
from .sources import SOURCE_KINDS, kind_of, stats_of

__all__ = ["PrometheusCollector", "keyword_hint", "register_prometheus", "sources_set"]


def _prometheus() -> Any:
    try:
        import prometheus_client.core
    except ModuleNotFoundError as exc:
        missing_extra(
            exc, feature="llama_guard.metrics' Prometheus collector", extra="prometheus", modules=("prometheus_client",)
        )
    return prometheus_client.core


def sources_set(sources: Iterable[object] | None) -> StatsSet | None:
    """None (every guard of the process) or the `StatsSet` of ``sources`` (each resolved by `stats_of`).

    Raises `TypeError` for ``sources`` that is not a list (one client, a string, a dict) and for an item that is
    not something with counters, `ValueError` for a client or session without a guard; each names what was given.
    """
    if sources is None:
        return None
    if isinstance(sources, (str, bytes, Mapping)) or not isinstance(sources, Iterable):
        if isinstance(sources, (str, bytes)):
            given = f"{kind_of(sources)} {sources!r}"
        elif isinstance(sources, Mapping):
            given = kind_of(sources)
        else:
            given = f"{kind_of(sources)} (for this one alone, pass sources=[{_name_of(sources)}])"
        raise TypeError(
            f"sources must be a list of what to export ({SOURCE_KINDS}), or None for every guard of the process; "
            f"got {given}"
        )
    found = []
    for index, source in enumerate(sources):
        try:
            found.append(stats_of(source))
        except TypeError:
            raise TypeError(
                f"sources[{index}] must be one of: {SOURCE_KINDS}; got {kind_of(source)}"
                + (f" {source!r}" if isinstance(source, (str, bytes, int, float)) else "")
            ) from None
        except ValueError as exc:
            raise ValueError(f"sources[{index}]: {exc}") from None
    return StatsSet(found)


def _name_of(value: object) -> str:
    """How to call ``value`` in an example: ``client``, ``session`` or ``it``."""
    library = type(value).__module__.partition(".")[0]
    if library in ("httpx", "httpx2"):
        return "client"
    return "session" if library in ("aiohttp", "requests") else "it"


def keyword_hint(value: object, function: str) -> str:
    """A note for a ``registry`` or ``meter_provider`` that looks like ``sources``, which is keyword-only."""
    looks_like_sources = isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))
    if not looks_like_sources:
        try:
            stats_of(value)
        except TypeError:
            return ""
        except ValueError:  # a client or session without a guard: a source all the same
            pass
    return f" (sources is keyword-only: {function}(sources=[...]))"


class PrometheusCollector:
    """The guards' counters as Prometheus metrics, per stack and origin (see ``docs/metrics.md`` for the list).

    ``sources``: a list of what to export, as clients, transports, sessions, installations or `GuardStats` (held
    weakly; the counts of one that is gone are kept); default: every guard of the process, present and past.
    Anything else raises `TypeError` (a client without a guard, `ValueError`), naming it.
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
    elif not callable(getattr(registry, "register", None)):
        raise TypeError(
            "registry must be a prometheus_client CollectorRegistry, or None for prometheus_client's REGISTRY; "
            f"got {kind_of(registry)}{keyword_hint(registry, 'register_prometheus')}"
        )
    registry.register(collector)
    return collector
