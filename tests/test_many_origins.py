"""A client of origins without end (a gateway over pod addresses, a harness on random ports) keeps bounded memory:
what the process learns per origin is kept for at most `MAX_ORIGINS` origins, idle ones forgotten first, and a
guard counts at most that many origins one by one, the rest together as ``other``."""

from __future__ import annotations

import gc
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llama_guard import GuardPolicy, GuardStats, GuardTransport, Origin
from llama_guard._core.origin_book import MAX_ORIGINS, OriginBook
from llama_guard._core.stats import OTHER_ORIGINS, LatencyHistogram, StatsSet
from llama_guard._runtime import new_process_state
from llama_guard._runtime.stall_log import StallLog
from llama_guard.metrics import PrometheusCollector
from tests.test_metrics import sample, scrape

DOCS = Path(__file__).resolve().parents[1] / "docs"


class Entry:
    """An entry that says whether it is in use, or was used lately, as told."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = False
        self.lately = False

    def in_use(self) -> bool:
        return self.busy

    def used_lately(self) -> bool:
        return self.lately


def test_a_book_forgets_its_oldest_quiet_origin_past_its_limit(caplog: pytest.LogCaptureFixture) -> None:
    book: OriginBook[Entry] = OriginBook(what="what a test learnt", limit=3)
    first = book.of("a", lambda: Entry("a"))
    assert book.of("a", lambda: Entry("a again")) is first  # made once
    book.of("b", lambda: Entry("b"))
    book.of("c", lambda: Entry("c"))
    forgotten: list[str] = []

    class Account:
        def __init__(self, name: str) -> None:
            self.name = name

        def count_origin_forgotten(self) -> None:
            forgotten.append(self.name)

    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        book.of("d", lambda: Entry("d"), account=Account("for d"))
        book.of("e", lambda: Entry("e"), account=Account("for e"))
        book.of("e", lambda: Entry("e again"), account=Account("for e again"))  # there: none
    assert forgotten == ["for d", "for e"]  # each counted where it happened (stats.origins_forgotten)
    assert len(book) == 3
    assert book.get("a") is None
    assert book.get("b") is None  # the oldest went first
    assert [entry.name for entry in map(book.get, "cde") if entry is not None] == ["c", "d", "e"]
    returned = book.of("a", lambda: Entry("a, learnt again"))
    assert returned is not first
    assert returned.name == "a, learnt again"
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        "llama_guard keeps what a test learnt for at most 3 origins; past that it forgets an older origin's (a quiet "
        "one first), and learns it again if that origin returns (stats.origins_forgotten counts them)"
    ]


@pytest.mark.parametrize(
    ("mark", "first_kept", "size"),
    [
        # A second chance: the busy origin a stream of new ones passes by keeps what it taught; when every origin
        # looked at was used lately, the oldest goes all the same (the limit holds).
        ("lately", False, 2),
        # In use: never forgotten; when every entry is, the book grows past its limit rather than forget one.
        ("busy", True, 3),
    ],
)
def test_a_book_forgets_a_quiet_origin_first_and_never_one_in_use(mark: str, first_kept: bool, size: int) -> None:
    book: OriginBook[Entry] = OriginBook(what="what a test learnt", limit=2)
    first = book.of("first", lambda: Entry("first"))
    setattr(first, mark, True)
    book.of("quiet", lambda: Entry("quiet"))
    book.of("new", lambda: Entry("new"))
    assert book.get("first") is first  # the quiet one went in its place
    assert book.get("quiet") is None
    new = book.get("new")
    assert new is not None
    setattr(new, mark, True)
    book.of("newest", lambda: Entry("newest"))  # no quiet one left to forget
    assert len(book) == size
    assert (book.get("first") is first) is first_kept
    assert book.get("new") is new


def test_a_book_limit_must_be_a_number_of_origins() -> None:
    with pytest.raises(ValueError, match="limit is a number of origins, at least 1; got 0"):
        OriginBook(what="anything", limit=0)


def test_a_guard_counts_origins_past_its_limit_together(caplog: pytest.LogCaptureFixture) -> None:
    stats = GuardStats()
    origins = [Origin("http", f"10.0.{index // 250}.{index % 250}", 8080) for index in range(MAX_ORIGINS + 10)]
    with caplog.at_level(logging.WARNING, logger="llama_guard"):
        for origin in origins:
            stats.of_origin("httpx", origin).record_request(1, 0.01, False)
    accounts = stats.by_origin()
    assert len(accounts) == MAX_ORIGINS + 1
    assert accounts[("httpx", OTHER_ORIGINS)].requests == 10
    assert stats.snapshot().requests == MAX_ORIGINS + 10  # every request counted, once
    assert stats.of_origin("httpx", origins[0]) is accounts[("httpx", origins[0])]  # the first ones keep theirs
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1
    assert f"at most {MAX_ORIGINS} origins one by one" in said[0]
    families = scrape(PrometheusCollector(sources=[stats]))
    assert sample(families, "llama_guard_requests_total", stack="httpx", origin="other") == 10


def test_the_totals_of_guards_gone_count_origins_past_the_limit_together() -> None:
    watched = StatsSet()
    for index in range(MAX_ORIGINS + 5):
        stats = GuardStats()
        watched.add(stats)
        stats.of_origin("httpx", Origin("http", f"pod-{index}", 8080)).record_request(1, None, False)
        del stats
    gc.collect()
    totals = watched.totals()
    assert len(totals) == MAX_ORIGINS + 1
    assert sum(total.counts["requests"] for total in totals.values()) == MAX_ORIGINS + 5
    assert totals[("httpx", OTHER_ORIGINS)].counts["requests"] >= 5


def test_a_histogram_holds_no_buckets_until_its_first_sample() -> None:
    """Three per origin a guard reaches, most never sampled (no probe, no admission wait): 28 KB per origin, before."""
    empty, other = LatencyHistogram(), LatencyHistogram()
    empty.merge(LatencyHistogram())
    assert empty._buckets is None
    assert empty.buckets() == []
    assert empty.summary().count == 0
    other.record(0.25)
    empty.merge(other)
    assert empty.summary().count == 1
    assert empty.summary().max == 0.25


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port held on 127.0.0.1 (bound, not listening): connecting to it at any other loopback address is refused
    at once, and no other test's server can be given it."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:
        yield held.getsockname()[1]
    finally:
        held.close()


def test_a_guard_of_origins_without_end_keeps_bounded_state(refused_port: int) -> None:
    """One guarded client asks 1,100 loopback origins (each refused at once), with probing on: the probe book,
    the connection book and the guard's accounts stay within the limit, and every request is counted."""
    process = new_process_state()
    count = MAX_ORIGINS + 76
    transport = GuardTransport(policy=GuardPolicy(connection="reuse", max_attempts=1), process=process)
    with httpx.Client(transport=transport, timeout=5) as client:
        for index in range(count):
            with pytest.raises(httpx.ConnectError):
                client.get(f"http://127.1.{index // 250}.{index % 250 + 1}:{refused_port}/health")
    assert len(process.probes._origins) == MAX_ORIGINS
    assert len(process.connections._origins) == MAX_ORIGINS
    assert len(transport.stats.by_origin()) == MAX_ORIGINS + 1
    snap = transport.stats.snapshot()
    assert snap.requests == count
    assert sum(snap.errors.values()) == count
    assert len(snap.connection_strategies) == MAX_ORIGINS
    # Each origin past the limit made each book forget one: in stats, not only in the log.
    assert snap.origins_forgotten == 2 * (count - MAX_ORIGINS)
    # Counted on the origins' accounts, as every count is (the transport's own total is theirs summed).
    assert sum(account.origins_forgotten for account in transport.stats.by_origin().values()) == snap.origins_forgotten


def test_the_docs_give_the_limit() -> None:
    for page in ("metrics.md", "how-it-works.md", "configuration.md"):
        assert f"at most {MAX_ORIGINS:,} origins" in (DOCS / page).read_text(), page


def test_the_stall_episodes_of_origins_past_the_limit_are_counted_together() -> None:
    """The episodes the metrics show per origin (llama_guard_stall_episodes_total) are kept for at most
    MAX_ORIGINS origins, the rest under 'other', as the guards' counts are."""
    log = StallLog(episode=600.0)
    origins = [Origin("http", f"pod-{index}", 8080) for index in range(MAX_ORIGINS + 3)]
    try:
        for origin in origins:
            log.replaced(origin, "a stalled connection replaced")
        episodes = log.episodes()
    finally:
        logging.disable(logging.WARNING)
        try:
            log.flush()
        finally:
            logging.disable(logging.NOTSET)
    assert len(episodes) == MAX_ORIGINS + 1
    assert episodes[OTHER_ORIGINS] == 3
    assert sum(episodes.values()) == len(origins)


def test_an_origins_series_keeps_its_label_once_its_guard_is_gone() -> None:
    """The exporters name at most MAX_ORIGINS (stack, origin)s, given at first sight for good: an origin counted on
    its own while its guard lives stays on its own once the guard is gone, and one that came past the limit stays
    under 'other', its guard live or gone. (Before, a gone guard's origin past the limit of retired ones moved from
    its own series to 'other': a series that vanished, and 'other' jumping.)"""
    watched = StatsSet()
    keep = []
    for index in range(MAX_ORIGINS + 2):
        stats = GuardStats()
        watched.add(stats)
        stats.of_origin("httpx", Origin("http", f"pod-{index}", 8080)).record_request(1, None, False)
        keep.append(stats)
    live = watched.totals()
    assert len(live) == MAX_ORIGINS + 1
    assert live[("httpx", OTHER_ORIGINS)].counts["requests"] == 2
    keep.clear()
    gc.collect()
    assert {key: total.counts["requests"] for key, total in watched.totals().items()} == {
        key: total.counts["requests"] for key, total in live.items()
    }


class EpisodeLines(logging.Handler):
    """The stall episodes' WARNING lines as they come, and an event set once ``expected`` have come."""

    def __init__(self, expected: int) -> None:
        super().__init__(logging.WARNING)
        self.expected = expected
        self.lines: list[str] = []
        self.all_came = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "stalled connection" in record.getMessage() and "//pod-" in record.getMessage():
            self.lines.append(record.getMessage())
            if len(self.lines) >= self.expected:
                self.all_came.set()


def stall_timers() -> int:
    return sum(isinstance(thread, threading.Timer) for thread in threading.enumerate())


def test_a_burst_that_stalls_many_origins_runs_one_timer_thread() -> None:
    """A gateway's burst stalls connections to many origins at once: each origin's episode ends in its own WARNING,
    timed by one thread for the process (there was one thread per origin: 300 threads for this burst)."""
    origins = [Origin("http", f"pod-{index}", 8080) for index in range(300)]
    log = StallLog(episode=0.2)
    lines = EpisodeLines(len(origins))
    logger = logging.getLogger("llama_guard")
    logger.addHandler(lines)
    before = stall_timers()
    try:
        for origin in origins:
            log.replaced(origin, "a stalled connection replaced")
            log.replaced(origin, "another of the same episode")  # the episode under way: no new one
        during = stall_timers()
        assert lines.all_came.wait(timeout=30), f"{len(lines.lines)} of {len(origins)} episode lines came"
    finally:
        logger.removeHandler(lines)
        log.flush()
    assert during - before == 1
    assert sorted(lines.lines) == sorted(
        f"replaced 2 stalled connections to {origin} in the last 0.2 s (llama-server before b11737 did not read "
        "them; their requests went on new connections; each one at DEBUG level on the 'llama_guard' logger)"
        for origin in origins
    )
    assert log.episodes() == dict.fromkeys(origins, 1)


def test_an_origin_that_stalls_again_after_its_episode_opens_another() -> None:
    """An episode ended (logged) and its origin stalls again: a new episode, counted and logged in its turn, with
    the timer armed again after the flush."""
    origin = Origin("http", "pod-again", 8080)
    log = StallLog(episode=0.05)
    lines = EpisodeLines(2)
    logger = logging.getLogger("llama_guard")
    logger.addHandler(lines)
    try:
        log.replaced(origin, "the first episode's")
        log.flush(origin)
        log.rescued(origin, "the second episode's")
        assert lines.all_came.wait(timeout=30), lines.lines
    finally:
        logger.removeHandler(lines)
        log.flush()
    assert [line.split(" in the last")[0] for line in lines.lines] == [
        "replaced 1 stalled connection to http://pod-again:8080",
        "rescued 1 stalled connection to http://pod-again:8080",
    ]
    assert log.episodes() == {origin: 2}


def test_an_episode_of_rescued_and_replaced_connections_says_what_became_of_each() -> None:
    """One line for both: the rescued ones read on their own connection, the replaced ones' requests on new ones;
    no claim on how those requests ended (a replaced request may still fail)."""
    origin = Origin("http", "pod-both", 8080)
    log = StallLog(episode=60.0)
    for _ in range(2):
        log.rescued(origin, "rescued")
    log.replaced(origin, "replaced")
    lines = EpisodeLines(1)
    logger = logging.getLogger("llama_guard")
    logger.addHandler(lines)
    try:
        log.flush()
    finally:
        logger.removeHandler(lines)
    (line,) = lines.lines
    assert line.startswith(f"rescued 2 and replaced 1 stalled connections to {origin} in the last ")
    assert line.endswith(
        "(llama-server before b11737 had not read them; a kick connection made it read the rescued ones, and the "
        "replaced ones' requests went on new connections; each one at DEBUG level on the 'llama_guard' logger)"
    )
    assert "lost" not in line
