"""The metrics llama_guard exports, named once for both exporters, and how each is read from the counts.

Names follow each system's conventions: Prometheus' ``llama_guard_<what>_total`` for counters, base units
(``_seconds``) and ``_info`` for a description with value 1; OpenTelemetry's dotted ``llama_guard.<what>`` with
UCUM units (``s``, ``{request}``). Every series is per stack (``httpx``, ``httpx2``, ``aiohttp``, ``requests``,
``urllib3``) and origin
(``http://127.0.0.1:8080``), except the stall episodes, which the process counts per origin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .._core.origins import Origin
from .._core.stats import EVERY_STATS, OriginTotals, StatsSet
from .._runtime import PROCESS

__all__ = [
    "COUNTERS",
    "FIRST_BYTE",
    "FIRST_BYTE_BUCKETS",
    "METRICS",
    "OTEL_LABELS",
    "STALL_EPISODES",
    "STRATEGY",
    "UNGUARDED",
    "Metric",
    "Series",
    "counter_series",
    "first_byte_buckets",
    "split_strategy",
    "stall_episode_series",
    "unguarded_series",
]

#: The first-byte histogram's bucket bounds, in seconds: from a pooled answer (milliseconds) to a long non-streamed
#: completion, whose headers llama-server sends only when generation ends.
FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class Metric:
    """One exported metric: its names, kind, unit and extra label, and what it counts."""

    prometheus: str  # the family name; a counter's samples add "_total"
    opentelemetry: str
    kind: str  # "counter", "info" or "histogram"
    unit: str  # OpenTelemetry's (UCUM); Prometheus' is in the name
    description: str
    field: str | None = None  # the GuardStats counter it reads
    label: str | None = None  # the extra label of a breakdown (Prometheus name; OpenTelemetry's in OTEL_LABELS)

    @property
    def prometheus_sample(self) -> str:
        return f"{self.prometheus}_total" if self.kind == "counter" else self.prometheus


def _counter(field: str, prometheus: str, opentelemetry: str, unit: str, description: str) -> Metric:
    return Metric(prometheus, opentelemetry, "counter", unit, description, field=field)


COUNTERS: tuple[Metric, ...] = (
    _counter("requests", "llama_guard_requests", "llama_guard.requests", "{request}", "Requests the guard handled."),
    _counter(
        "attempts", "llama_guard_attempts", "llama_guard.attempts", "{attempt}", "Attempts sent, first attempts too."
    ),
    Metric(
        "llama_guard_retries",
        "llama_guard.retries",
        "counter",
        "{retry}",
        "Attempts after the first, by why the one before failed.",
        label="reason",
    ),
    Metric(
        "llama_guard_errors",
        "llama_guard.errors",
        "counter",
        "{error}",
        "Failed attempts by exception class, those a retry recovered included.",
        label="error",
    ),
    _counter(
        "stream_connections_closed",
        "llama_guard_stream_connections_closed",
        "llama_guard.stream_connections.closed",
        "{connection}",
        "Stream connections closed by Connection: close or dropped after the final chunk.",
    ),
    _counter(
        "stream_connections_dropped",
        "llama_guard_stream_connections_dropped",
        "llama_guard.stream_connections.dropped",
        "{connection}",
        "Of those, the connections shut down after the final chunk.",
    ),
    _counter("probes_sent", "llama_guard_probes", "llama_guard.probes.sent", "{probe}", "Probes of new connections."),
    _counter(
        "probes_failed",
        "llama_guard_probes_failed",
        "llama_guard.probes.failed",
        "{probe}",
        "Probes with no answer in time, or a bad one.",
    ),
    _counter(
        "probes_given_up",
        "llama_guard_probes_given_up",
        "llama_guard.probes.given_up",
        "{probe}",
        "Probes given up at their deadline: the connection was replaced.",
    ),
    _counter(
        "probes_answered_late",
        "llama_guard_probes_answered_late",
        "llama_guard.probes.answered_late",
        "{probe}",
        "Given-up probes answered afterwards all the same (late answers).",
    ),
    _counter(
        "probe_kicks",
        "llama_guard_probe_kicks",
        "llama_guard.kicks.opened",
        "{connection}",
        "Kick connections opened for probes that waited.",
    ),
    _counter(
        "probe_kicks_failed",
        "llama_guard_probe_kicks_failed",
        "llama_guard.kicks.failed",
        "{connection}",
        "Kick connections that could not connect.",
    ),
    _counter(
        "probes_rescued",
        "llama_guard_probes_rescued",
        "llama_guard.probes.rescued",
        "{probe}",
        "Probes answered after a kick: stalled connections rescued where they were.",
    ),
    _counter(
        "spares_opened",
        "llama_guard_spare_connections_opened",
        "llama_guard.spare_connections.opened",
        "{connection}",
        "Spare connections opened and probed ahead to replace dropped stream connections (prewarm).",
    ),
    _counter(
        "spares_used",
        "llama_guard_spare_connections_used",
        "llama_guard.spare_connections.used",
        "{connection}",
        "Spare connections a pool took instead of connecting.",
    ),
    _counter(
        "spares_failed",
        "llama_guard_spare_connections_failed",
        "llama_guard.spare_connections.failed",
        "{connection}",
        "Spare connections that could not be opened or failed their probe (not kept).",
    ),
    _counter(
        "origins_forgotten",
        "llama_guard_origins_forgotten",
        "llama_guard.origins.forgotten",
        "{origin}",
        "Older origins whose learnt probe deadline or connection cost the process forgot to make room for this one "
        "(past 1,024 origins; learnt again if they return).",
    ),
)
STALL_EPISODES = Metric(
    "llama_guard_stall_episodes",
    "llama_guard.stall_episodes",
    "counter",
    "{episode}",
    "Episodes of stalled connections (one WARNING each), per origin, in this process.",
)
STRATEGY = Metric(
    "llama_guard_connection_strategy",
    "llama_guard.connection.strategy",
    "info",
    "1",
    "The connection strategy chosen for the origin (GuardPolicy.connection), and why: value 1.",
)
UNGUARDED = Metric(
    "llama_guard_unguarded",
    "llama_guard.unguarded",
    "info",
    "1",
    "A client library whose requests install() leaves unguarded (an untested aiohttp, urllib3 1.x), and why: value 1.",
)
FIRST_BYTE = Metric(
    "llama_guard_first_byte_seconds",
    "llama_guard.first_byte.duration",
    "histogram",
    "s",
    "Seconds from the guard receiving a request to the response headers, retries included.",
)
METRICS: tuple[Metric, ...] = (*COUNTERS, STALL_EPISODES, STRATEGY, UNGUARDED, FIRST_BYTE)

#: The OpenTelemetry attribute for each Prometheus label (``reason``: a retry's; the strategy's is
#: ``llama_guard.connection.reason``).
OTEL_LABELS = {
    "stack": "llama_guard.stack",
    "origin": "llama_guard.origin",
    "reason": "llama_guard.retry.reason",
    "error": "error.type",
    "strategy": "llama_guard.connection.strategy",
    "library": "llama_guard.library",
}

# One sample: its labels (Prometheus names, in order) and value.
Series = tuple[dict[str, str], float]


def _labels(totals: OriginTotals) -> dict[str, str]:
    return {"stack": totals.stack, "origin": str(totals.origin)}


def counter_series(metric: Metric, every: dict[tuple[str, Origin], OriginTotals]) -> Iterator[Series]:
    """The samples of one of `COUNTERS` over every (stack, origin)."""
    breakdowns: dict[str, Callable[[OriginTotals], dict[str, int]]] = {
        "reason": lambda totals: dict(totals.retries_by_reason),
        "error": lambda totals: dict(totals.errors),
    }
    for totals in every.values():
        if metric.label is None:
            assert metric.field is not None
            yield _labels(totals), totals.counts[metric.field]
        else:
            for value, count in sorted(breakdowns[metric.label](totals).items()):
                yield {**_labels(totals), metric.label: value}, count


def split_strategy(text: str) -> tuple[str, str]:
    """``"close (a loopback address: ...)"`` -> ``("close", "a loopback address: ...")``."""
    strategy, _, reason = text.partition(" (")
    return strategy, reason[:-1] if reason.endswith(")") else reason


def strategy_series(every: dict[tuple[str, Origin], OriginTotals]) -> Iterator[Series]:
    for totals in every.values():
        if totals.connection_strategy is not None:
            strategy, reason = split_strategy(totals.connection_strategy)
            yield {**_labels(totals), "strategy": strategy, "reason": reason}, 1


def unguarded_series(sources: StatsSet | None) -> Iterator[Series]:
    """The libraries an installation among ``sources`` (default: every guard of the process) leaves alone."""
    for library, reason in (EVERY_STATS if sources is None else sources).unguarded().items():
        yield {"library": library, "reason": reason}, 1


def stall_episode_series() -> Iterator[Series]:
    """The stall episodes of the process's origins (its `ProcessState`, which every guard shares by default)."""
    for origin, count in sorted(PROCESS.stalls.episodes().items()):
        yield {"origin": str(origin)}, count


def first_byte_buckets(totals: OriginTotals) -> tuple[list[int], int, float]:
    """Cumulative counts at each of `FIRST_BYTE_BUCKETS` (then +Inf), the count, and the exact sum of seconds.

    The guard's histogram has buckets 2% wide; one that straddles a bound is counted above it (so a sample up to 2%
    below a bound may be counted in the next bucket)."""
    cumulative = [0] * (len(FIRST_BYTE_BUCKETS) + 1)
    for upper, count in totals.first_byte.buckets():
        for index, bound in enumerate(FIRST_BYTE_BUCKETS):
            if upper <= bound * (1 + 1e-9):
                for at in range(index, len(cumulative)):
                    cumulative[at] += count
                break
        else:
            cumulative[-1] += count
    return cumulative, cumulative[-1], totals.first_byte.total


def read_totals(sources: StatsSet | None) -> dict[tuple[str, Origin], OriginTotals]:
    """Per (stack, origin), sorted: the counts of ``sources`` (default: every guard of the process)."""
    every = (EVERY_STATS if sources is None else sources).totals()
    return dict(sorted(every.items(), key=lambda item: (item[0][0], str(item[0][1]))))
