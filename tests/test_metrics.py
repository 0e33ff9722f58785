"""llama_guard.metrics: counts per stack and origin, the Prometheus collector, the OpenTelemetry instruments, and
`stats_of` / `result_of`; on real loopback sockets against the emulator.

Every figure an exporter shows is compared with the `GuardStats` it comes from, and with what the test made happen
(requests sent, streams, retries the emulator forced).
"""

from __future__ import annotations

import asyncio
import gc
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import llama_guard
import llama_guard.metrics
from llama_guard import GuardPolicy, GuardStats, Origin
from llama_guard._core.decisions import FailureKind, Progress, RequestKind, verdict_for_failure, verdict_for_status
from llama_guard._core.request_machine import retry_reason
from llama_guard._core.stats import COUNTERS, COUNTS, EVERY_STATS, LatencyHistogram, StatsSet, _Count, _Summed
from llama_guard.metrics import FIRST_BYTE_BUCKETS, METRICS, PrometheusCollector, instrument_opentelemetry
from llama_guard.testing import LlamaServerEmulator

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
ORIGIN = Origin.of("http", "127.0.0.1", 8080)


def chat(*, stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": stream}


def origin_of(server: LlamaServerEmulator) -> Origin:
    return Origin.of("http", "127.0.0.1", server.port)


# -- an origin's account ---------------------------------------------------------------------------------------


def test_an_origin_account_counts_into_its_parent_too() -> None:
    """Each way of counting reaches both the account and the transport's GuardStats, once."""
    parent = GuardStats()
    account = parent.of_origin("httpx", ORIGIN)
    assert parent.of_origin("httpx", ORIGIN) is account
    account.record_request(2, 0.25, True)
    account.record_retry("dead_connection", stall=False)
    account.record_retry("stalled_connection", stall=True)
    account.record_probe(0.01, answered=True, rescued=True)
    account.record_probe(0.5, answered=False, given_up=True)
    account.add(probe_kicks=2, stream_connections_closed=1, stream_connections_dropped=1)
    account.add_error("RemoteProtocolError")
    account.record_admission_wait(0.1)
    for stats in (parent, account):
        snap = stats.snapshot()
        assert (snap.requests, snap.attempts, snap.retries, snap.stall_reconnects) == (1, 2, 2, 1)
        assert snap.retries_by_reason == {"dead_connection": 1, "stalled_connection": 1}
        assert (snap.probes_sent, snap.probes_failed, snap.probes_given_up, snap.probes_rescued) == (2, 1, 1, 1)
        assert (snap.probe_kicks, snap.stream_connections_closed, snap.stream_connections_dropped) == (2, 2, 1)
        assert snap.errors == {"RemoteProtocolError": 1}
        assert snap.admission_waits == 1
        assert snap.first_byte is not None
        assert (snap.first_byte.count, snap.first_byte.max) == (1, 0.25)
    # The conditions the transport reports are the parent's, whichever object sets them.
    account.late_answers_unseen = "no socket"
    assert parent.late_answers_unseen == account.late_answers_unseen == "no socket"
    assert parent.by_origin() == {("httpx", ORIGIN): account}
    parent.reset()
    assert account.snapshot().requests == parent.snapshot().requests == 0


@pytest.mark.parametrize("args", [(1, 0.2, False), (3, None, True), (2, -1.0, False), (1, 1e-7, True)])
def test_an_account_records_a_request_as_the_stats_do(args: tuple[int, float | None, bool]) -> None:
    """The account's own record_request (one lock, one bucket lookup for both) counts what GuardStats' does."""
    reference = GuardStats()
    reference.record_request(*args)
    parent = GuardStats()
    account = parent.of_origin("httpx", ORIGIN)
    account.record_request(*args)
    assert parent.snapshot().as_dict() == reference.snapshot().as_dict() == account.snapshot().as_dict()


def test_an_account_shows_its_parents_conditions() -> None:
    """The conditions a transport reports (public_path, probing_off, ...; any added later too) read the same
    through an account's snapshot, so it says what its transport's does."""
    parent = GuardStats()
    account = parent.of_origin("httpx", ORIGIN)
    conditions = [name for name, value in vars(parent).items() if value is None and not name.startswith("_")]
    assert {"public_path", "probing_off", "late_answers_unseen"} <= set(conditions)
    for name in conditions:
        setattr(parent, name, f"because of {name}")
    shown = account.snapshot().as_dict()
    for name in conditions:
        assert getattr(account, name) == f"because of {name}"  # read by snapshot() and repr()
        assert shown.get(name, f"because of {name}") == f"because of {name}"
    assert "probing=off" in repr(account)  # repr() reads the snapshot too


def test_every_count_is_kept_once_and_summed_when_read() -> None:
    """Whatever a GuardStats keeps (a counter, a tally, a distribution; one added later too) is kept by the object
    that counted it and read as its own plus its accounts': a plain attribute would be a count the parent misses."""
    fresh = GuardStats()
    assert not {name for name, value in vars(fresh).items() if type(value) is int}
    assert set(fresh._counts) == set(COUNTERS) == {n for n, v in vars(GuardStats).items() if isinstance(v, _Count)}
    kept = {name for name, value in vars(fresh).items() if isinstance(value, (Counter, LatencyHistogram))}
    summed = {f"_{name}" for name, value in vars(GuardStats).items() if isinstance(value, _Summed)}
    assert kept == summed == {"_errors", "_retries_by_reason", "_first_byte", "_probe_latency", "_admission_wait"}
    # Every whole-number counter but passthrough (other origins) is kept per origin and summed by the exporters.
    assert set(COUNTERS) - {"passthrough"} == set(COUNTS)


def test_a_parent_shows_its_own_counts_and_its_accounts() -> None:
    """The parent's own counts (passthrough, a drop counted on the transport) and its accounts' add up; an account
    shows only its own; setting a counter on the parent sets what it reads."""
    parent = GuardStats()
    account = parent.of_origin("httpx", ORIGIN)
    other = parent.of_origin("aiohttp", ORIGIN)
    parent.add(passthrough=1, stream_connections_closed=1)
    parent.record_request(1, 0.5, False)
    account.record_request(2, 0.25, True)
    other.record_request(1, None, False)
    other.add_error("ReadTimeout")
    parent.add_error("ReadTimeout")
    assert (parent.requests, parent.attempts, parent.stream_connections_closed, parent.passthrough) == (3, 4, 2, 1)
    assert (account.requests, account.attempts, account.stream_connections_closed, account.passthrough) == (1, 2, 1, 0)
    assert (parent.first_byte.summary().count, parent.first_byte.summary().max) == (2, 0.5)
    assert (parent.errors, account.errors, other.errors) == ({"ReadTimeout": 2}, {}, {"ReadTimeout": 1})
    parent.requests = 10
    assert (parent.requests, account.requests, other.requests) == (10, 1, 1)
    with pytest.raises(AttributeError, match=r"no counter 'request'; its counters: requests, "):
        parent.add(request=1)
    assert parent.snapshot().requests == 10


def test_totals_keep_the_counts_of_a_transport_that_is_gone() -> None:
    """A StatsSet holds its GuardStats weakly, and folds the counts of a collected one into its totals."""
    stats = GuardStats()
    watched = StatsSet([stats])
    stats.of_origin("httpx", ORIGIN).record_request(3, 0.1, False)
    assert watched.totals()[("httpx", ORIGIN)].counts["attempts"] == 3
    del stats
    gc.collect()
    assert len(list(watched._live)) == 0  # not kept alive by the set, nor by its account's finalizer
    totals = watched.totals()[("httpx", ORIGIN)]
    assert (totals.counts["requests"], totals.counts["attempts"], totals.first_byte.total) == (1, 3, 0.1)
    stats = GuardStats()
    watched.add(stats)
    stats.of_origin("httpx", ORIGIN).record_request(1, None, False)
    assert watched.totals()[("httpx", ORIGIN)].counts["requests"] == 2


def test_the_counts_of_guards_gone_are_folded_without_a_reading() -> None:
    """A process that makes a client per call and never reads its metrics: each gone guard's accounts are folded
    into one total per (stack, origin) as the next guard joins, not kept one per guard until a reading (about
    30 KB each: 44 MB after 1,500 clients, before)."""
    watched = StatsSet()
    for _ in range(50):
        stats = GuardStats()
        watched.add(stats)
        stats.of_origin("httpx", ORIGIN).record_request(1, 0.01, False)
        del stats
        gc.collect()
    assert len(watched._gone) <= 1  # the last one's, until the next joins or a reading
    assert len(watched._retired) == 1
    assert watched.totals()[("httpx", ORIGIN)].counts["requests"] == 50


REQUEST = RequestKind("POST", idempotent=False, inference=True, stream=False, replayable=True)


@pytest.mark.parametrize(
    ("verdict", "reason"),
    [
        (
            verdict_for_failure(
                FailureKind.PROBE,
                progress=Progress.CONNECTED,
                reused_connection=False,
                body_started=False,
                request=REQUEST,
                retry_non_idempotent=False,
            ),
            "stalled_connection",
        ),
        (
            verdict_for_failure(
                FailureKind.FIRST_BYTE_TIMEOUT,
                progress=Progress.WRITTEN,
                reused_connection=False,
                body_started=True,
                request=REQUEST,
                retry_non_idempotent=False,
            ),
            "stalled_connection",
        ),
        (
            verdict_for_failure(
                FailureKind.FIRST_BYTE_TIMEOUT,
                progress=Progress.WRITTEN,
                reused_connection=True,
                connection_read=True,
                body_started=True,
                request=REQUEST,
                retry_non_idempotent=False,
            ),
            "slow_answer",
        ),
        (
            verdict_for_failure(
                FailureKind.NETWORK,
                progress=Progress.WRITTEN,
                reused_connection=True,
                body_started=True,
                request=REQUEST,
                retry_non_idempotent=False,
            ),
            "dead_connection",
        ),
        (
            verdict_for_failure(
                FailureKind.CONNECT,
                progress=Progress.NOTHING,
                reused_connection=False,
                body_started=False,
                request=REQUEST,
                retry_non_idempotent=False,
            ),
            "connection_error",
        ),
        (
            verdict_for_status(503, {}, request=REQUEST, retry_non_idempotent=False, max_retry_after=30.0),
            "status",
        ),
        (None, "connection_error"),
    ],
)
def test_retry_reasons(verdict: Any, reason: str) -> None:
    assert retry_reason(verdict) == reason


# -- counted per origin and stack, on real sockets ---------------------------------------------------------------


def test_one_transport_two_origins_are_two_accounts() -> None:
    """A transport serving two servers counts each apart; the accounts add up to the transport's counts."""
    with LlamaServerEmulator() as first, LlamaServerEmulator() as second:
        transport = llama_guard.GuardTransport()
        with httpx.Client(transport=transport, timeout=10.0) as client:
            for _ in range(3):
                assert client.post(first.url + CHAT, json=chat()).status_code == 200
            with client.stream("POST", second.url + CHAT, json=chat(stream=True)) as response:
                response.read()
    accounts = transport.stats.by_origin()
    assert set(accounts) == {("httpx", origin_of(first)), ("httpx", origin_of(second))}
    assert accounts["httpx", origin_of(first)].requests == 3
    assert accounts["httpx", origin_of(second)].requests == 1
    assert accounts["httpx", origin_of(second)].stream_connections_closed == 1
    snap = transport.stats.snapshot()
    for name in COUNTS:
        assert getattr(snap, name) == sum(getattr(account, name) for account in accounts.values()), name


def stacks() -> list[Any]:
    cases = [pytest.param("httpx", id="httpx")]
    try:
        import httpx2  # noqa: F401

        cases.append(pytest.param("httpx2", id="httpx2"))
    except ImportError:
        cases.append(pytest.param("httpx2", id="httpx2", marks=pytest.mark.skip(reason="httpx2 is not installed")))
    cases.append(pytest.param("aiohttp", id="aiohttp"))
    cases.append(pytest.param("requests", id="requests"))
    cases.append(pytest.param("urllib3", id="urllib3"))
    return cases


def three_blocking_requests(stack: str, url: str) -> GuardStats:
    """The same through a guarded requests session, or (``"urllib3"``) a urllib3 pool under install()."""
    import requests
    import urllib3

    if stack == "requests":
        with llama_guard.guard(requests.Session()) as session:
            for body in (chat(), chat(), chat(stream=True)):
                response = session.post(url + CHAT, json=body, timeout=10.0)
                assert response.status_code == 200
                assert llama_guard.result_of(response) is not None
            return llama_guard.stats_of(session)
    installation = llama_guard.install(origins=[url])
    try:
        pool = urllib3.PoolManager()
        for body in (chat(), chat(), chat(stream=True)):
            response = pool.request("POST", url + CHAT, json=body, timeout=10.0)
            assert response.status == 200
            assert llama_guard.result_of(response) is not None
        pool.clear()
        return installation.stats
    finally:
        llama_guard.uninstall()


async def three_requests(stack: str, url: str) -> GuardStats:
    """Two plain requests and a stream through a guarded client of ``stack``; its counters."""
    if stack == "aiohttp":
        from llama_guard.aiohttp import guarded_session

        async with guarded_session(url) as session:
            for body in (chat(), chat(), chat(stream=True)):
                async with session.post(CHAT, json=body) as response:
                    assert response.status == 200
                    await response.read()
                    assert llama_guard.result_of(response) is not None
            return llama_guard.stats_of(session)
    library: Any = httpx
    if stack == "httpx2":
        import httpx2

        library = httpx2
    async with llama_guard.guard(library.AsyncClient(base_url=url, timeout=10.0)) as client:
        for body in (chat(), chat(), chat(stream=True)):
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200
            assert llama_guard.result_of(response) is not None
        return llama_guard.stats_of(client)


@pytest.mark.parametrize("stack", stacks())
def test_each_stack_is_named_in_its_accounts(stack: str) -> None:
    """Each stack's counts go under its own name, in the stats and in what Prometheus scrapes."""
    with LlamaServerEmulator() as server:
        if stack in ("requests", "urllib3"):
            stats = three_blocking_requests(stack, server.url)
        else:
            stats = asyncio.run(three_requests(stack, server.url))
        origin = origin_of(server)
        assert list(stats.by_origin()) == [(stack, origin)]
        account = stats.by_origin()[stack, origin]
        assert (account.requests, account.stream_connections_closed) == (3, 1)
        assert account.first_byte.summary().count == 3
        families = scrape(PrometheusCollector(sources=[stats]))
        assert sample(families, "llama_guard_requests_total", stack=stack, origin=str(origin)) == 3


def test_retries_are_counted_by_reason() -> None:
    """The emulator drops every request written to a stream's kept connection: with the guard's stream handling off,
    each such request is retried, counted as a dead connection, exactly as often as the server dropped one."""
    policy = GuardPolicy(stream_mode="off", connection="reuse")
    with LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        transport = llama_guard.GuardTransport(httpx.HTTPTransport(limits=limits), policy=policy)
        with httpx.Client(transport=transport, base_url=server.url, timeout=10.0) as client:
            for index in range(6):
                with client.stream("POST", CHAT, json=chat(stream=index % 2 == 0)) as response:
                    response.read()
        dropped = server.stats().requests_dropped_after_stream
    snap = transport.stats.snapshot()
    assert dropped >= 1
    assert snap.retries_by_reason == {"dead_connection": dropped}
    assert snap.retries == dropped


# -- the exporters ----------------------------------------------------------------------------------------------


def scrape(collector: PrometheusCollector) -> dict[str, Any]:
    """Metric families by name, parsed from the text a scrape returns."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    family_name = re.sub(r"_(total|bucket|count|sum|info)$", "", name)
    found = [
        s.value
        for s in families[family_name].samples
        if s.name == name and all(s.labels.get(key) == value for key, value in labels.items())
    ]
    assert len(found) == 1, (name, labels, families[family_name].samples)
    return float(found[0])


def otel_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: list(metric.data.data_points)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }


def otel_points_of(sources: list[Any] | None) -> dict[str, list[Any]]:
    """One collection of the guard's instruments on a meter provider of their own, reading ``sources``."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        instrument_opentelemetry(provider, sources=sources)
        return otel_points(reader)
    finally:
        provider.shutdown()


def otel_value(points: dict[str, list[Any]], name: str, **attributes: str) -> Any:
    found = [p for p in points[name] if all(p.attributes.get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, (name, attributes, points[name])
    return found[0]


def test_prometheus_and_opentelemetry_show_the_stats() -> None:
    """Names, types and label sets as documented; every counter equal to the stats it reads, in both exporters."""
    with LlamaServerEmulator(stream_close="on_reuse", http_threads=16, pool_bug=False) as server:
        transport = llama_guard.GuardTransport(policy=GuardPolicy(stream_mode="off", connection="reuse"))
        with httpx.Client(transport=transport, base_url=server.url, timeout=10.0) as client:
            for index in range(8):
                with client.stream("POST", CHAT, json=chat(stream=index % 2 == 0)) as response:
                    response.read()
    origin = str(origin_of(server))
    snap = transport.stats.snapshot()
    assert snap.retries >= 1  # something to show besides requests
    families = scrape(PrometheusCollector(sources=[transport]))
    points = otel_points_of([transport])
    labels = {"stack": "httpx", "origin": origin}
    attributes = {"llama_guard.stack": "httpx", "llama_guard.origin": origin}
    for metric in METRICS:
        if metric.field is not None:
            expected = getattr(snap, metric.field)
            assert families[metric.prometheus].type == "counter"
            assert sample(families, metric.prometheus_sample, **labels) == expected, metric.prometheus
            assert otel_value(points, metric.opentelemetry, **attributes).value == expected, metric.opentelemetry
    for reason, count in snap.retries_by_reason.items():
        assert sample(families, "llama_guard_retries_total", reason=reason, **labels) == count
        point = otel_value(points, "llama_guard.retries", **{"llama_guard.retry.reason": reason}, **attributes)
        assert point.value == count
    for error, count in snap.errors.items():
        assert sample(families, "llama_guard_errors_total", error=error, **labels) == count
    # The first-byte histogram: every response counted once, in seconds, in the same buckets on both sides.
    assert snap.first_byte is not None
    assert families["llama_guard_first_byte_seconds"].type == "histogram"
    assert sample(families, "llama_guard_first_byte_seconds_count", **labels) == snap.first_byte.count == 8
    assert sample(families, "llama_guard_first_byte_seconds_sum", **labels) == pytest.approx(snap.first_byte.mean * 8)
    histogram = otel_value(points, "llama_guard.first_byte.duration", **attributes)
    assert histogram.count == 8
    assert list(histogram.explicit_bounds) == list(FIRST_BYTE_BUCKETS)
    cumulative = 0
    for bound, count in zip(histogram.explicit_bounds, histogram.bucket_counts, strict=False):
        cumulative += count
        assert sample(families, "llama_guard_first_byte_seconds_bucket", le=str(float(bound)), **labels) == cumulative


def test_the_exporters_show_what_install_leaves_unguarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An installation on urllib3 1.x leaves requests and urllib3 alone: both exporters say which library and why,
    as its stats do. The control: an installation that guards everything it found has no such sample."""
    import urllib3

    llama_guard.install(origins=["http://127.0.0.1:9"])
    try:
        assert not scrape(PrometheusCollector())["llama_guard_unguarded_info"].samples
        llama_guard.uninstall()
        monkeypatch.setattr(urllib3, "__version__", "1.26.19")  # not test_requests' version: a warning is said once
        installation = llama_guard.install(origins=["http://127.0.0.1:9"])
        why = installation.stats.snapshot().unguarded["urllib3"]
        families = scrape(PrometheusCollector(sources=[installation]))
        points = otel_points_of([installation])
    finally:
        llama_guard.uninstall()
    # The text format has no info type: an info family is a gauge whose name ends in _info.
    [shown] = families["llama_guard_unguarded_info"].samples
    assert (shown.labels, shown.value) == ({"library": "urllib3", "reason": why}, 1)
    point = otel_value(points, "llama_guard.unguarded", **{"llama_guard.library": "urllib3"})
    assert point.attributes["llama_guard.unguarded.reason"] == why
    assert point.value == 1


def test_the_first_byte_buckets_place_each_sample_below_its_bound() -> None:
    """A sample lands in the first bucket whose bound is at least it (within the guard's 2% buckets)."""
    stats = GuardStats()
    account = stats.of_origin("httpx", ORIGIN)
    for seconds in (0.001, 0.004, 0.02, 0.2, 0.2, 3.0, 400.0):
        account.record_request(1, seconds, False)
    families = scrape(PrometheusCollector(sources=[stats]))
    labels = {"stack": "httpx", "origin": str(ORIGIN)}
    counts = {
        bound: sample(families, "llama_guard_first_byte_seconds_bucket", le=bound, **labels)
        for bound in ("0.005", "0.01", "0.025", "0.1", "0.25", "1.0", "5.0", "300.0", "+Inf")
    }
    assert counts == {
        "0.005": 2,
        "0.01": 2,
        "0.025": 3,
        "0.1": 3,
        "0.25": 5,
        "1.0": 5,
        "5.0": 6,
        "300.0": 6,
        "+Inf": 7,
    }
    assert sample(families, "llama_guard_first_byte_seconds_sum", **labels) == pytest.approx(403.425)


def test_the_opentelemetry_histogram_records_each_sample_once() -> None:
    """Fed at each collection with the samples since the last: two collections, no sample counted twice."""
    stats = GuardStats()
    account = stats.of_origin("aiohttp", ORIGIN)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        instrument_opentelemetry(provider, sources=[stats])
        account.record_request(1, 0.02, False)
        first = otel_points(reader)
        account.record_request(1, 2.0, False)
        account.record_request(1, 2.0, False)
        second = otel_points(reader)
    finally:
        provider.shutdown()
    attributes = {"llama_guard.stack": "aiohttp", "llama_guard.origin": str(ORIGIN)}
    assert otel_value(first, "llama_guard.first_byte.duration", **attributes).count == 1
    histogram = otel_value(second, "llama_guard.first_byte.duration", **attributes)
    assert histogram.count == 3  # cumulative
    assert histogram.sum == pytest.approx(4.02, rel=0.02)
    assert otel_value(second, "llama_guard.requests", **attributes).value == 3


def test_the_collector_reads_every_guard_of_the_process_by_default() -> None:
    """No sources: a new transport is exported without being registered, and stays counted, under the same label,
    once it is gone. (Its own label, or "other" in a test process that has exported 1,024 origins already.)"""
    origin = Origin.of("http", "127.0.0.1", 1)  # a port no test serves on
    stats = GuardStats()
    stats.of_origin("httpx2", origin).record_request(1, None, False)
    label = str(EVERY_STATS.label_of(("httpx2", origin))[1])
    before = sample(scrape(PrometheusCollector()), "llama_guard_requests_total", stack="httpx2", origin=label)
    del stats
    gc.collect()
    after = sample(scrape(PrometheusCollector()), "llama_guard_requests_total", stack="httpx2", origin=label)
    assert before == after >= 1


def test_docs_list_every_metric() -> None:
    """docs/metrics.md names every metric, in both systems' spelling, with its unit."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    for metric in METRICS:
        assert f"`{metric.prometheus_sample}" in text or f"`{metric.prometheus}" in text, metric.prometheus
        assert f"`{metric.opentelemetry}`" in text, metric.opentelemetry
        assert f"`{metric.unit}`" in text, metric.unit


# -- stats_of and result_of --------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[LlamaServerEmulator]:
    with LlamaServerEmulator() as emulator:
        yield emulator


def test_stats_of_a_guarded_client_is_its_guards_counters(server: LlamaServerEmulator) -> None:
    client = llama_guard.guard(
        httpx.Client(base_url=server.url, mounts={"http://example.invalid": httpx.HTTPTransport()})
    )
    with client:
        response = client.post(CHAT, json=chat())
    stats = llama_guard.stats_of(client)
    assert stats.requests == 1
    assert llama_guard.result_of(response) == response.extensions["llama_guard"]
    # The transport, and the GuardStats itself, give the same object.
    assert llama_guard.stats_of(stats) is stats
    transport = llama_guard.GuardTransport()
    with httpx.Client(transport=transport) as built:
        assert llama_guard.stats_of(built) is transport.stats is llama_guard.stats_of(transport)


def test_stats_of_refuses_what_has_no_guard(server: LlamaServerEmulator) -> None:
    with httpx.Client(base_url=server.url) as plain:
        with pytest.raises(ValueError, match=r"no guard: guard it with llama_guard\.guard\(client\)"):
            llama_guard.stats_of(plain)
        response = plain.post(CHAT, json=chat())
    assert llama_guard.result_of(response) is None
    with pytest.raises(TypeError, match="stats_of"):
        llama_guard.stats_of(object())
    with pytest.raises(TypeError, match="result_of"):
        llama_guard.result_of(object())


def test_stats_of_a_client_install_guards_is_the_installation(server: LlamaServerEmulator) -> None:
    installation = llama_guard.install(origins=[server.url])
    try:
        with httpx.Client(base_url=server.url) as client:
            client.post(CHAT, json=chat())
            assert llama_guard.stats_of(client) is installation.stats is llama_guard.stats_of(installation)
        # install() registers nothing: the collector reads every guard of the process, its own included (under its
        # origin's label, or "other" in a test process that has exported 1,024 origins already).
        families = scrape(PrometheusCollector())
        origin = str(EVERY_STATS.label_of(("httpx", origin_of(server)))[1])
        assert sample(families, "llama_guard_requests_total", stack="httpx", origin=origin) >= 1
    finally:
        llama_guard.uninstall()
    assert installation.stats.requests == 1


def test_the_public_names_of_llama_guard_metrics() -> None:
    import llama_guard.metrics

    assert sorted(llama_guard.metrics.__all__) == [
        "FIRST_BYTE_BUCKETS",
        "METRICS",
        "Metric",
        "OpenTelemetryMetrics",
        "PrometheusCollector",
        "instrument_opentelemetry",
        "register_prometheus",
    ]
    for name in llama_guard.metrics.__all__:
        value = getattr(llama_guard.metrics, name)
        if isinstance(value, type):
            assert value.__module__ == "llama_guard.metrics", name


def test_register_prometheus_registers_once() -> None:
    """The collector describes its families without reading the counts; a second one in the same registry is
    refused by prometheus_client as duplicated series."""
    registry = CollectorRegistry()
    collector = llama_guard.metrics.register_prometheus(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        llama_guard.metrics.register_prometheus(registry)
    registry.unregister(collector)
    llama_guard.metrics.register_prometheus(registry)


def test_stopped_instruments_report_nothing() -> None:
    stats = GuardStats()
    stats.of_origin("httpx", ORIGIN).record_request(1, 0.1, False)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        instruments = instrument_opentelemetry(provider, sources=[stats])
        assert otel_value(otel_points(reader), "llama_guard.requests").value == 1
        instruments.stop()
        data = reader.get_metrics_data()
        points = otel_points(reader) if data is not None else {}
    finally:
        provider.shutdown()
    assert all(not found for name, found in points.items() if name != "llama_guard.first_byte.duration")


@pytest.mark.parametrize(
    ("blocked", "make", "extra"),
    [
        ("prometheus_client", lambda: PrometheusCollector(), "prometheus"),
        ("opentelemetry", lambda: instrument_opentelemetry(), "otel"),
    ],
)
def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch, blocked: str, make: Any, extra: str) -> None:
    """Without its library, an exporter says which extra to install (llama_guard itself imports neither)."""
    for name in [name for name in sys.modules if name == blocked or name.startswith(blocked + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'llama-guard\[{extra}\]'"):
        make()


# -- bad arguments: named, with what is accepted ---------------------------------------------------------------------

KINDS = "guarded httpx/httpx2 clients, aiohttp or requests sessions, guard transports or adapters"


def export_prometheus(sources: Any) -> object:
    return llama_guard.metrics.register_prometheus(CollectorRegistry(), sources=sources)


def export_opentelemetry(sources: Any) -> object:
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    try:
        return instrument_opentelemetry(provider, sources=sources)
    finally:
        provider.shutdown()


EXPORTERS = [
    pytest.param(export_prometheus, id="register_prometheus"),
    pytest.param(lambda sources: PrometheusCollector(sources=sources), id="PrometheusCollector"),
    pytest.param(export_opentelemetry, id="instrument_opentelemetry"),
]


@pytest.mark.parametrize("export", EXPORTERS)
def test_sources_that_are_not_a_list_are_refused_by_name(export: Any) -> None:
    """One client is not iterable, a string would be read a character at a time and a dict by its keys: each is
    refused as what it is, with what ``sources`` takes; one source is told to go in a list."""
    with llama_guard.guard(httpx.Client()) as client:
        with pytest.raises(TypeError, match=r"^sources must be a list of what to export \(" + re.escape(KINDS)) as info:
            export(client)
        assert str(info.value).endswith("got httpx.Client (for this one alone, pass sources=[client])")
        with pytest.raises(TypeError, match=r"^sources must be a list .* got str 'x'$"):
            export("x")
        with pytest.raises(TypeError, match=r"^sources must be a list .* got dict$"):
            export({"client": client})
        with pytest.raises(TypeError, match=r"got llama_guard\.GuardStats \(for this one alone, pass sources=\[it\]\)"):
            export(GuardStats())


@pytest.mark.parametrize("export", EXPORTERS)
def test_a_source_without_counters_is_named_by_its_place(export: Any) -> None:
    stats = GuardStats()
    with pytest.raises(TypeError, match=r"^sources\[1\] must be one of: " + re.escape(KINDS) + r".*; got str 'x'$"):
        export([stats, "x"])
    with pytest.raises(TypeError, match=r"^sources\[0\] must be one of: .*; got httpx\.Response$"):
        export([httpx.Response(200)])
    with (
        httpx.Client() as plain,
        pytest.raises(ValueError, match=r"^sources\[1\]: this Client has no guard: guard it with llama_guard"),
    ):
        export([stats, plain])


def test_a_registry_or_meter_provider_of_the_wrong_kind_is_named() -> None:
    """Not an AttributeError from deep inside: the argument, what it was, and a hint when it looks like sources
    given in its place (``sources`` is keyword-only)."""
    stats = GuardStats()
    with pytest.raises(TypeError, match=r"^registry must be a prometheus_client CollectorRegistry, or None .*got str$"):
        llama_guard.metrics.register_prometheus("x")
    hint = r"\(sources is keyword-only: register_prometheus\(sources=\[\.\.\.\]\)\)$"
    with pytest.raises(TypeError, match=r"^registry must be .*; got list " + hint):
        llama_guard.metrics.register_prometheus([stats])
    with pytest.raises(TypeError, match=r"^registry must be .*; got llama_guard\.GuardStats " + hint):
        llama_guard.metrics.register_prometheus(stats)
    with pytest.raises(TypeError, match=r"^meter_provider must be an OpenTelemetry MeterProvider, or None .*got str$"):
        instrument_opentelemetry("x")
    hint = r"\(sources is keyword-only: instrument_opentelemetry\(sources=\[\.\.\.\]\)\)$"
    with pytest.raises(TypeError, match=r"^meter_provider must be .*; got list " + hint):
        instrument_opentelemetry([stats])
