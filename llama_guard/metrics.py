"""The guards' counters where operators look: Prometheus and OpenTelemetry, each an optional extra.

    from llama_guard.metrics import register_prometheus, instrument_opentelemetry

    register_prometheus()  # pip install 'llama-guard[prometheus]': prometheus_client's REGISTRY
    instrument_opentelemetry()  # pip install 'llama-guard[otel]': the global meter provider

Both read, when scraped or collected, the counters of every guard of the process (every transport, aiohttp session
and `install()`), per stack (``httpx``, ``httpx2``, ``aiohttp``) and origin; ``sources=[...]`` narrows that to
some clients or transports. Nothing is recorded per request beyond what the guard counts anyway. ``METRICS`` lists
every metric (``docs/metrics.md`` explains them).
"""

from . import _public
from ._metrics.catalog import FIRST_BYTE_BUCKETS, METRICS, Metric
from ._metrics.opentelemetry import OpenTelemetryMetrics, instrument_opentelemetry
from ._metrics.prometheus import PrometheusCollector, register_prometheus

__all__ = [
    "FIRST_BYTE_BUCKETS",
    "METRICS",
    "Metric",
    "OpenTelemetryMetrics",
    "PrometheusCollector",
    "instrument_opentelemetry",
    "register_prometheus",
]

_public.present_as_public(globals())
