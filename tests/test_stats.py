"""Stats: thread-safe counters and a fixed-memory latency histogram (made by its first sample) whose maximum is
exact."""

from __future__ import annotations

import random
import re
import threading

import pytest

from llama_guard import GuardStats
from llama_guard._core.stats import LatencyHistogram


def test_histogram_percentiles_within_two_percent() -> None:
    rng = random.Random(7)
    samples = [rng.lognormvariate(-4, 1.5) for _ in range(20_000)]
    histogram = LatencyHistogram()
    for sample in samples:
        histogram.record(sample)
    ordered = sorted(samples)
    for percent in (50, 90, 99, 99.9):
        exact = ordered[int(len(ordered) * percent / 100) - 1]
        assert histogram.percentile(percent) == pytest.approx(exact, rel=0.025), percent
    assert histogram.summary().max == max(samples)  # exact, not bucketed
    assert histogram.summary().count == len(samples)


def test_histogram_edges() -> None:
    histogram = LatencyHistogram()
    assert histogram.percentile(99) == 0.0
    histogram.record(0.0)
    histogram.record(-1.0)  # clock oddities count as zero
    histogram.record(10 * 86_400.0)  # beyond the last bucket: kept, max exact
    assert histogram.summary().max == 10 * 86_400.0
    with pytest.raises(ValueError, match="percent must be from 0 to 100"):
        histogram.percentile(101)


def test_histogram_memory_is_fixed() -> None:
    histogram = LatencyHistogram()
    histogram.record(0.0)
    assert histogram._buckets is not None
    size = len(histogram._buckets)
    for index in range(100_000):
        histogram.record(index * 1e-4)
    assert len(histogram._buckets) == size


def test_counters_are_thread_safe() -> None:
    stats = GuardStats()

    def work() -> None:
        for _ in range(5_000):
            stats.add(retries=1)
            stats.add_error("ReadError")
            stats.record_request(attempts=1, first_byte=0.001, closed_by_header=True)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snap = stats.snapshot()
    assert snap.requests == snap.attempts == snap.retries == snap.stream_connections_closed == 40_000
    assert snap.errors == {"ReadError": 40_000}
    assert snap.first_byte is not None
    assert snap.first_byte.count == 40_000
    stats.reset()
    assert stats.snapshot().attempts == 0


def test_snapshot_as_dict_is_plain_data() -> None:
    import json

    stats = GuardStats()
    stats.record_probe(0.002, answered=True)
    stats.record_probe(0.5, answered=False)
    data = stats.snapshot().as_dict()
    json.dumps(data)
    assert data["probes_sent"] == 2
    assert data["probes_failed"] == 1
    assert data["probe_latency"]["count"] == 1


def test_an_empty_distribution_is_false_and_the_repr_names_the_attributes() -> None:
    stats = GuardStats()
    snap = stats.snapshot()
    assert not snap.first_byte  # `snap.first_byte.max if snap.first_byte else None` gives None
    assert snap.first_byte is not None
    assert snap.first_byte.count == 0
    assert snap.as_dict()["first_byte"]["count"] == 0  # as_dict() keeps the empty summary
    stats.record_request(attempts=1, first_byte=0.25, closed_by_header=True)
    snap = stats.snapshot()
    assert snap.first_byte
    assert snap.first_byte.max == 0.25
    text = repr(stats)
    for name in ("requests", "attempts", "retries", "stall_reconnects", "stream_connections_closed", "probes_sent"):
        assert f" {name}=" in text, name
        assert hasattr(stats, name), name
    assert "stream_connections_closed=1" in text


@pytest.mark.parametrize("value", [-5, -1, "1", 1.0, True, None], ids=repr)
def test_add_takes_whole_numbers_from_zero_and_adds_nothing_otherwise(value: object) -> None:
    """A counter never goes down (a Prometheus counter would), and a string is not added as a raw TypeError: the
    counter and the rule are named, and the other increments of the call are not added either."""
    stats = GuardStats()
    message = (
        "GuardStats.add(): the increment of requests must be a whole number >= 0 (a counter never goes down); "
        f"got {value!r}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        stats.add(retries=1, requests=value)  # type: ignore[arg-type]
    assert (stats.retries, stats.requests) == (0, 0)
    stats.add(retries=0, requests=2)
    assert (stats.retries, stats.requests) == (0, 2)
