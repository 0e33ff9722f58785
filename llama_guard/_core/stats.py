"""Counters a guarded transport keeps, safe to update from many threads and tasks, and the process's set of them.

A transport's `GuardStats` has an account per (stack, origin) (`GuardStats.of_origin`, an `OriginStats`): each
request is counted once, on its origin's account, and the transport's stats read as their own counts plus their
accounts'. A transport counts at most `MAX_ORIGINS` origins one by one; the requests to any more are counted
together under `OTHER_ORIGINS` (``other`` in the metrics), as OpenTelemetry's cardinality limit does, so a client of
servers without end keeps bounded memory. Latencies go into a log-bucketed histogram of fixed size (about 2%
resolution from 10 microseconds to a day, made by its first sample), so a client that serves millions of requests
keeps constant memory, while the maximum stays exact: with the defects this library exists for, the maximum is the
figure that matters, not the average.

`StatsSet` holds `GuardStats` objects weakly, and keeps the counts of those that are gone (folded into retired
totals when their owner is collected), so that the totals it reports never go down while transports come and go.
`EVERY_STATS` is the process's: every `GuardStats` joins it when it is made; ``llama_guard.metrics`` reads it.
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from .log import logger
from .origin_book import MAX_ORIGINS
from .origins import Origin

__all__ = [
    "COUNTERS",
    "COUNTS",
    "EVERY_STATS",
    "OTHER_ORIGINS",
    "GuardStats",
    "LatencyHistogram",
    "LatencySummary",
    "OriginStats",
    "OriginTotals",
    "StatsSet",
    "StatsSnapshot",
    "counted_apart",
]

#: The whole-number counters of `GuardStats` and `StatsSnapshot`, in the order they are shown.
COUNTERS = (
    "requests",
    "passthrough",
    "attempts",
    "retries",
    "stall_reconnects",
    "stream_connections_closed",
    "probes_sent",
    "probes_failed",
    "probes_given_up",
    "probes_answered_late",
    "probe_kicks",
    "probe_kicks_failed",
    "probes_rescued",
    "admission_waits",
    "stream_connections_dropped",
    "spares_opened",
    "spares_used",
    "spares_failed",
    "origins_forgotten",
)
#: The whole-number counters of a `GuardStats` that are kept per origin (``passthrough`` counts other origins).
COUNTS = tuple(name for name in COUNTERS if name != "passthrough")


#: Where the requests to origins past `MAX_ORIGINS` are counted, by a `GuardStats` and by `StatsSet`.
OTHER_ORIGINS = Origin("", "other", 0)

KeyT = TypeVar("KeyT")


def counted_apart(key: KeyT, counted: Collection[KeyT]) -> bool:
    """Whether ``key`` is counted on its own where ``counted`` are (accounts, exporters, stall episodes): it is
    already, or fewer than `MAX_ORIGINS` are; the rest are counted together under `OTHER_ORIGINS`."""
    return key in counted or len(counted) < MAX_ORIGINS


_MIN_SECONDS = 1e-5
_GROWTH = 1.02
_BUCKETS = int(math.log(86_400 / _MIN_SECONDS, _GROWTH)) + 2
# The buckets' upper bounds as `LatencyHistogram.record` bisects them: the last bucket takes anything beyond.
_RECORD_BOUNDS = [_MIN_SECONDS * _GROWTH**index for index in range(_BUCKETS - 1)] + [math.inf]


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """A latency distribution in seconds; percentiles are bucket upper bounds (within 2%), max is exact.

    False when it holds no samples, so ``snap.first_byte.max if snap.first_byte else None`` reads as it says.
    """

    count: int
    max: float
    p50: float
    p90: float
    p99: float
    p999: float
    mean: float

    def __bool__(self) -> bool:
        return self.count > 0

    def as_dict(self) -> dict[str, float]:
        """Plain data for JSON and logs."""
        return {name: getattr(self, name) for name in self.__slots__}


class LatencyHistogram:
    """Bounded-memory latency distribution. Not locked itself: `GuardStats` holds the lock.

    The buckets (about 9 KB) are made by the first sample: a guard keeps three of these per origin it reaches, and
    most origins never see a probe or an admission wait (or an answer: a closed port)."""

    __slots__ = ("_buckets", "_max", "_total")

    def __init__(self) -> None:
        self._buckets: list[int] | None = None
        self._max = 0.0
        self._total = 0.0

    @property
    def _count(self) -> int:
        # Not kept as a counter: recording runs for every request, reading rarely.
        return 0 if self._buckets is None else sum(self._buckets)

    def record(self, seconds: float) -> int:
        """Count a sample; returns its bucket (the first whose bound it does not exceed)."""
        # Once per request, so lean: one bisection, comparisons rather than max()/min() calls, no sample count.
        if seconds < 0.0:  # a clock oddity, counted as zero
            seconds = 0.0
        index = bisect_left(_RECORD_BOUNDS, seconds)
        if seconds > self._max:
            self._max = seconds
        buckets = self._buckets
        if buckets is None:
            buckets = self._buckets = [0] * _BUCKETS
        buckets[index] += 1
        self._total += seconds
        return index

    def percentile(self, percent: float) -> float:
        """The smallest bucket bound below which ``percent`` % of the samples fall (0.0 with no samples)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be from 0 to 100; got {percent!r}")
        count = self._count
        if count == 0 or self._buckets is None:
            return 0.0
        rank = math.ceil(count * percent / 100) or 1
        seen = 0
        for index, count in enumerate(self._buckets):
            seen += count
            if seen >= rank:
                upper = _MIN_SECONDS * _GROWTH**index
                return min(upper, self._max)
        return self._max

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s samples to this histogram."""
        if other._buckets is None:
            return
        buckets = self._buckets
        if buckets is None:
            buckets = self._buckets = [0] * _BUCKETS
        for index, count in enumerate(other._buckets):
            if count:
                buckets[index] += count
        self._total += other._total
        if other._max > self._max:
            self._max = other._max

    def buckets(self) -> list[tuple[float, int]]:
        """The non-empty buckets, in order: (upper bound in seconds, samples); a sample is at most its bound and
        above the bound of the bucket before (2% below)."""
        if self._buckets is None:
            return []
        return [(_MIN_SECONDS * _GROWTH**index, count) for index, count in enumerate(self._buckets) if count]

    @property
    def total(self) -> float:
        """The exact sum of the samples, in seconds."""
        return self._total

    def summary(self) -> LatencySummary:
        count = self._count
        return LatencySummary(
            count=count,
            max=self._max,
            p50=self.percentile(50),
            p90=self.percentile(90),
            p99=self.percentile(99),
            p999=self.percentile(99.9),
            mean=self._total / count if count else 0.0,
        )


@dataclass(frozen=True)
class StatsSnapshot:
    """A consistent copy of a transport's counters at one moment."""

    requests: int
    passthrough: int
    attempts: int
    retries: int
    stall_reconnects: int
    stream_connections_closed: int
    probes_sent: int
    probes_failed: int
    # Probes whose deadline passed (counted in probes_failed too), and of those, the ones whose answer arrived
    # afterwards all the same: false alarms, the connection was being served, only late.
    probes_given_up: int = 0
    probes_answered_late: int = 0
    # Kick connections opened for probes that waited the learnt deadline (probe_kick), those that could not connect
    # (counted in probe_kicks too), and the probes answered after a kick: stalled connections rescued, not replaced.
    probe_kicks: int = 0
    probe_kicks_failed: int = 0
    probes_rescued: int = 0
    # New connections that waited for their turn to be opened (connect_admission), and how long they waited.
    admission_waits: int = 0
    # Of stream_connections_closed, those shut down after the final chunk (the rest went out with Connection: close).
    stream_connections_dropped: int = 0
    # Spare connections opened and probed ahead for a dropped stream's replacement (GuardPolicy.prewarm), those a
    # pool then took instead of connecting, and those that could not be opened or failed their probe.
    spares_opened: int = 0
    spares_used: int = 0
    spares_failed: int = 0
    # Older origins' learnt state (probe deadline, connection cost) the process forgot to make room for this
    # origin's, past MAX_ORIGINS origins: learnt again if they return.
    origins_forgotten: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # Retries by why the attempt before failed: "stalled_connection" (a probe failed, or the first-byte deadline),
    # "dead_connection" (a pooled connection the server had closed), "status" (503/429), "slow_answer" (the
    # first-byte deadline on a connection the server reads), "connection_error".
    retries_by_reason: dict[str, int] = field(default_factory=dict)
    first_byte: LatencySummary | None = None
    probe_latency: LatencySummary | None = None
    admission_wait: LatencySummary | None = None
    # Why the guard follows requests through httpcore's public trace extension instead of its hooks on the pool
    # (an httpcore/httpx version it was not tested with, or a pool out of reach); None when the hooks are in place.
    public_path: str | None = None
    # Why new connections are not probed although the policy asks for it (the wrapped transport sends without
    # httpcore, so the guard cannot reach its connections); None while probing works or is off by policy.
    probing_off: str | None = None
    # Why a connection whose probe was given up could not be watched for a late answer (the transport gave no
    # socket to duplicate): false alarms then go uncounted. None while every given-up connection was watched.
    late_answers_unseen: str | None = None
    # Why some of its client's requests go round this guard: the client sends them through transports of its own
    # (httpx's proxy= mounts one); None otherwise. Worked out when the client enters or closes its transports.
    bypassed: str | None = None
    # The connection strategy in force per origin ("close (a loopback address: ...)"; GuardPolicy.connection).
    connection_strategies: dict[str, str] = field(default_factory=dict)
    # The client libraries install() leaves alone, and why ({"aiohttp": "aiohttp 3.11.18 is not a version ..."}):
    # their requests go out unguarded. Empty when install() guards every library it found (and outside install()).
    unguarded: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON and logs."""
        data: dict[str, Any] = {name: getattr(self, name) for name in COUNTERS}
        data["errors"] = dict(self.errors)
        data["retries_by_reason"] = dict(self.retries_by_reason)
        # `is not None`: an empty summary is false, and still a summary (count 0).
        data["first_byte"] = self.first_byte.as_dict() if self.first_byte is not None else None
        data["probe_latency"] = self.probe_latency.as_dict() if self.probe_latency is not None else None
        data["admission_wait"] = self.admission_wait.as_dict() if self.admission_wait is not None else None
        data["public_path"] = self.public_path
        data["probing_off"] = self.probing_off
        data["late_answers_unseen"] = self.late_answers_unseen
        data["bypassed"] = self.bypassed
        data["connection_strategies"] = dict(self.connection_strategies)
        data["unguarded"] = dict(self.unguarded)
        return data


class _Count:
    """A whole-number counter of a `GuardStats`, read as its own count plus its origin accounts' (`of_origin`).

    Each count is kept once, by the object that counted it (a transport counts a request on its origin's account):
    summed when read, which is rare, instead of written twice for every request. Setting it sets the total.
    """

    __slots__ = ("_name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, stats: None, owner: type) -> _Count: ...
    @overload
    def __get__(self, stats: GuardStats, owner: type) -> int: ...
    def __get__(self, stats: GuardStats | None, owner: type) -> int | _Count:
        if stats is None:
            return self
        name = self._name
        total = stats._counts[name]
        for account in tuple(stats._by_origin.values()):  # a copy in one step: another thread may add an origin
            total += account._counts[name]
        return total

    def __set__(self, stats: GuardStats, value: int) -> None:
        stats._counts[self._name] += value - self.__get__(stats, type(stats))


_Merged = TypeVar("_Merged", LatencyHistogram, Counter[str])


class _Summed(Generic[_Merged]):
    """A distribution (`LatencyHistogram`) or a tally (``Counter``) of a `GuardStats`, read as its own merged with
    its origin accounts' (see `_Count`): the object itself while it has no accounts, a merged copy otherwise."""

    __slots__ = ("_add", "_own")

    def __init__(self, add: Callable[[_Merged, _Merged], object]) -> None:
        self._add: Callable[[_Merged, _Merged], object] = add  # adds the second's samples to the first

    def __set_name__(self, owner: type, name: str) -> None:
        self._own = f"_{name}"

    @overload
    def __get__(self, stats: None, owner: type) -> _Summed[_Merged]: ...
    @overload
    def __get__(self, stats: GuardStats, owner: type) -> _Merged: ...
    def __get__(self, stats: GuardStats | None, owner: type) -> _Merged | _Summed[_Merged]:
        if stats is None:
            return self
        own: _Merged = getattr(stats, self._own)
        accounts: tuple[OriginStats, ...] = tuple(stats._by_origin.values())
        if not accounts:
            return own
        merged = type(own)()
        for part in (own, *(getattr(account, self._own) for account in accounts)):
            self._add(merged, part)
        return merged


def _tally(into: Counter[str], other: Counter[str]) -> None:
    into.update(other)


def _check_increment(name: str, value: object) -> None:
    """`GuardStats.add`'s rule for an increment that is not a plain int >= 0 (an int subclass passes, not bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"GuardStats.add(): the increment of {name} must be a whole number >= 0 (a counter never goes down); "
            f"got {value!r}"
        )


class GuardStats:
    """Live counters of one guarded transport (``transport.stats``).

    Attributes are read directly (``stats.retries``); `snapshot()` gives a consistent copy of all of them.
    ``requests`` counts requests to llama-server origins that the guard handled; ``passthrough`` those it let by
    unchanged. ``errors`` counts the failures of attempts by kind (the httpx exception class name), including those
    that a retry then recovered. A transport counts each request on its origin's account (`of_origin`); what this
    object shows is its own counts plus its accounts'.
    """

    _by_origin: dict[tuple[str, Origin], OriginStats]

    requests = _Count()
    passthrough = _Count()
    attempts = _Count()
    retries = _Count()
    stall_reconnects = _Count()
    stream_connections_closed = _Count()
    probes_sent = _Count()
    probes_failed = _Count()
    probes_given_up = _Count()
    probes_answered_late = _Count()
    probe_kicks = _Count()
    probe_kicks_failed = _Count()
    probes_rescued = _Count()
    admission_waits = _Count()
    stream_connections_dropped = _Count()
    spares_opened = _Count()
    spares_used = _Count()
    spares_failed = _Count()
    origins_forgotten = _Count()
    errors = _Summed(_tally)
    retries_by_reason = _Summed(_tally)
    first_byte = _Summed(LatencyHistogram.merge)
    probe_latency = _Summed(LatencyHistogram.merge)
    admission_wait = _Summed(LatencyHistogram.merge)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.public_path: str | None = None  # set by a transport that cannot use its hooks; see StatsSnapshot
        self.probing_off: str | None = None  # set by a transport that cannot probe; see StatsSnapshot
        self.late_answers_unseen: str | None = None  # set when a given-up connection cannot be watched; ditto
        self.connection_strategies: dict[str, str] = {}  # origin -> its connection strategy; see StatsSnapshot
        self._final_strategies: set[str] = set()  # origins whose strategy is chosen: a provisional one never returns
        self.bypassed: str | None = None  # set when a closing transport finds its client sent round it; ditto
        self.unguarded: dict[str, str] = {}  # library -> why install() leaves it alone; see StatsSnapshot
        # The same counts per (stack, origin): `of_origin`, for llama_guard.metrics.
        self._by_origin: dict[tuple[str, Origin], OriginStats] = {}
        self._past_max_origins = False  # past MAX_ORIGINS origins, and said so
        self.reset()
        EVERY_STATS.add(self)

    def reset(self) -> None:
        """Zero every counter and distribution, its accounts' too."""
        with self._lock:
            self._counts = dict.fromkeys(COUNTERS, 0)
            self._errors: Counter[str] = Counter()
            self._retries_by_reason: Counter[str] = Counter()
            self._first_byte = LatencyHistogram()
            self._probe_latency = LatencyHistogram()
            self._admission_wait = LatencyHistogram()
        for account in tuple(self._by_origin.values()):
            account.reset()

    def add(self, **increments: int) -> None:
        """Add to counters by name, atomically: ``stats.add(attempts=1, retries=1)``. Each increment is a whole
        number >= 0 (a counter never goes down); anything else raises `ValueError` and adds nothing."""
        counts = self._counts
        for name, value in increments.items():
            if name not in counts:
                raise AttributeError(f"GuardStats has no counter {name!r}; its counters: {', '.join(COUNTERS)}")
            if type(value) is not int or value < 0:  # one check on the usual path; the details only if it fails
                _check_increment(name, value)
        with self._lock:
            for name, value in increments.items():
                counts[name] += value

    def count_origin_forgotten(self) -> None:
        """The process forgot what it learnt about an older origin to make room for this account's (`OriginBook`)."""
        self.add(origins_forgotten=1)

    def add_error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind] += 1

    def record_retry(self, reason: str, *, stall: bool) -> None:
        """A retry is about to go out because of ``reason`` (see `StatsSnapshot.retries_by_reason`)."""
        with self._lock:
            counts = self._counts
            counts["retries"] += 1
            counts["stall_reconnects"] += stall
            self._retries_by_reason[reason] += 1

    def of_origin(self, stack: str, origin: Origin) -> GuardStats:
        """The counts of ``origin`` reached through ``stack`` (``"httpx"``, ``"httpx2"``, ``"aiohttp"``): a
        `GuardStats` whose counts this one shows too. Made on first use; the same object afterwards."""
        key = (stack, origin)
        account = self._by_origin.get(key)
        if account is None:
            if not counted_apart(key, self._by_origin):
                key = _counted_together(stack, origin, "a guard", told=self._past_max_origins)
                self._past_max_origins = True
                account = self._by_origin.get(key)
                if account is not None:
                    return account
            made = OriginStats(self, stack, key[1])  # outside the lock, which it shares
            with self._lock:
                account = self._by_origin.setdefault(key, made)
        return account

    def by_origin(self) -> dict[tuple[str, Origin], GuardStats]:
        """Every (stack, origin) counted so far, and its counts (`of_origin`)."""
        with self._lock:
            return dict(self._by_origin)

    def record_request(self, attempts: int, first_byte: float | None, closed_by_header: bool) -> None:
        """One guarded request has ended: its attempts, its first-byte latency if it was answered, and whether it
        went out with ``Connection: close``. One lock for all (acquire/release: cheaper than ``with``, per request)."""
        lock = self._lock
        lock.acquire()
        try:
            counts = self._counts
            counts["requests"] += 1
            counts["attempts"] += attempts
            if closed_by_header:
                counts["stream_connections_closed"] += 1
            if first_byte is not None:
                self._first_byte.record(first_byte)
        finally:
            lock.release()

    def record_probe(self, seconds: float, *, answered: bool, given_up: bool = False, rescued: bool = False) -> None:
        """A probe ended: answered in ``seconds`` (``rescued``: after a kick), or failed (``given_up``: its deadline
        passed)."""
        with self._lock:
            counts = self._counts
            counts["probes_sent"] += 1
            if answered:
                self._probe_latency.record(seconds)
                counts["probes_rescued"] += rescued
            else:
                counts["probes_failed"] += 1
                counts["probes_given_up"] += given_up

    def record_connection_choice(self, origin: str, choice: str, *, final: bool = True) -> None:
        """The connection strategy of ``origin`` (``GuardPolicy.connection``) is ``choice`` now. A provisional one
        (``final=False``: auto still measuring) never replaces a final one: a request that read its strategy just
        before another made the choice reports after it. At most `MAX_ORIGINS` origins are listed, as counted."""
        strategies = self.connection_strategies
        if strategies.get(origin) != choice and counted_apart(origin, strategies):
            with self._lock:
                if final:
                    self._final_strategies.add(origin)
                elif origin in self._final_strategies:
                    return
                self.connection_strategies = {**self.connection_strategies, origin: choice}

    def record_unguarded(self, library: str, why: str) -> None:
        """`install()` leaves ``library``'s clients alone because of ``why`` (see `StatsSnapshot.unguarded`)."""
        if self.unguarded.get(library) != why:
            with self._lock:
                self.unguarded = {**self.unguarded, library: why}  # a new dict: readers copy without the lock

    def record_admission_wait(self, seconds: float) -> None:
        with self._lock:
            self._counts["admission_waits"] += 1
            self._admission_wait.record(seconds)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                **{name: getattr(self, name) for name in COUNTERS},
                errors=dict(self.errors),
                retries_by_reason=dict(self.retries_by_reason),
                first_byte=self.first_byte.summary(),
                probe_latency=self.probe_latency.summary(),
                admission_wait=self.admission_wait.summary(),
                public_path=self.public_path,
                probing_off=self.probing_off,
                late_answers_unseen=self.late_answers_unseen,
                connection_strategies=dict(self.connection_strategies),
                bypassed=self.bypassed,
                unguarded=dict(self.unguarded),
            )

    def __repr__(self) -> str:
        snap = self.snapshot()
        fb = snap.first_byte
        latency = f", first_byte max={fb.max:.3f}s p99={fb.p99:.3f}s" if fb and fb.count else ""
        probing = " probing=off" if snap.probing_off is not None else ""
        unguarded = f" unguarded={','.join(sorted(snap.unguarded))}" if snap.unguarded else ""
        kicks = (
            f" probe_kicks={snap.probe_kicks} probe_kicks_failed={snap.probe_kicks_failed} "
            f"probes_rescued={snap.probes_rescued}"
            if snap.probe_kicks
            else ""
        )
        return (
            f"<GuardStats requests={snap.requests} passthrough={snap.passthrough} attempts={snap.attempts} "
            f"retries={snap.retries} "
            f"stall_reconnects={snap.stall_reconnects} stream_connections_closed={snap.stream_connections_closed} "
            f"probes_sent={snap.probes_sent} probes_failed={snap.probes_failed} "
            f"probes_given_up={snap.probes_given_up} probes_answered_late={snap.probes_answered_late} "
            f"admission_waits={snap.admission_waits}{kicks}{probing}{unguarded} errors={snap.errors}{latency}>"
        )


class _ParentCondition:
    """A condition of an origin's account that is its parent's (``stats.probing_off``...): read and set there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, account: OriginStats | None, owner: type) -> Any:
        if account is None:
            return self
        parent = account._parent()
        return None if parent is None else getattr(parent, self._name)

    def __set__(self, account: OriginStats, value: Any) -> None:
        parent = account._parent()
        if parent is not None:
            setattr(parent, self._name, value)


class OriginStats(GuardStats):
    """The counts of one origin through one stack (`GuardStats.of_origin`), which its parent shows with its own.

    Shares the parent's lock; the conditions the parent reports (``public_path``, ``probing_off``,
    ``late_answers_unseen``) and its connection strategies are the parent's, read and set through this object alike.
    The parent is held weakly: its accounts outlive it (`StatsSet` reads them once it is gone), and must not keep it
    alive.
    """

    _by_origin: dict[tuple[str, Origin], OriginStats] = {}  # noqa: RUF012 (never filled: an account has none)
    _past_max_origins = False  # never set, for the same reason

    def __init__(self, parent: GuardStats, stack: str, origin: Origin) -> None:  # no super(): see the properties
        self._parent = weakref.ref(parent)
        self._lock = parent._lock
        self.stack = stack
        self.origin = origin
        self.connection_strategies: dict[str, str] = {}
        self._final_strategies: set[str] = set()  # as GuardStats keeps them: see record_connection_choice
        GuardStats.reset(self)

    def of_origin(self, stack: str, origin: Origin) -> GuardStats:
        raise TypeError("an origin's account has no accounts of its own: ask its parent")

    def record_connection_choice(self, origin: str, choice: str, *, final: bool = True) -> None:
        """Recorded here and for the parent, which reports every origin's strategy."""
        parent = self._parent()
        if parent is not None:
            parent.record_connection_choice(origin, choice, final=final)
        super().record_connection_choice(origin, choice, final=final)

    public_path = _ParentCondition()
    probing_off = _ParentCondition()
    late_answers_unseen = _ParentCondition()
    bypassed = _ParentCondition()
    unguarded = _ParentCondition()

    def snapshot(self) -> StatsSnapshot:
        """`GuardStats.snapshot`, with every condition the parent reports (any ``str | None`` attribute it has that
        this account does not keep: one added to GuardStats later too), read from the parent now. (Not a
        ``__getattr__``: that would slow every attribute access of the account, which counts every request.)"""
        parent = self._parent()
        if parent is not None:
            own = vars(self)
            for name, value in vars(parent).items():
                if (value is None or isinstance(value, str)) and not name.startswith("_"):
                    own[name] = value
        return super().snapshot()

    def __repr__(self) -> str:
        return f"<OriginStats {self.stack} {self.origin} {super().__repr__()}>"


@dataclass
class OriginTotals:
    """The counts of one (stack, origin), summed over guards: what the exporters read."""

    stack: str
    origin: Origin
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    errors: Counter[str] = field(default_factory=Counter)
    retries_by_reason: Counter[str] = field(default_factory=Counter)
    first_byte: LatencyHistogram = field(default_factory=LatencyHistogram)
    connection_strategy: str | None = None

    def add(self, account: GuardStats, strategies: dict[str, str] | None = None) -> None:
        """Add ``account``'s counts (read under its lock: one consistent moment); ``strategies``: its parent's
        connection strategies (``GuardStats.connection_strategies``), where a transport records its choices."""
        with account._lock:
            for name in COUNTS:
                self.counts[name] += getattr(account, name)
            self.errors.update(account.errors)
            self.retries_by_reason.update(account.retries_by_reason)
            self.first_byte.merge(account.first_byte)
            for choices in (getattr(account, "connection_strategies", None), strategies):
                if choices:
                    self.connection_strategy = choices.get(str(self.origin), self.connection_strategy)

    def merged(self, other: OriginTotals) -> None:
        for name in COUNTS:
            self.counts[name] += other.counts[name]
        self.errors.update(other.errors)
        self.retries_by_reason.update(other.retries_by_reason)
        self.first_byte.merge(other.first_byte)
        if other.connection_strategy is not None:
            self.connection_strategy = other.connection_strategy


Key = tuple[str, Origin]


class StatsSet:
    """`GuardStats` objects held weakly, with the counts of those already gone: totals never go down."""

    def __init__(self, stats: Iterable[GuardStats] = ()) -> None:
        self._live: weakref.WeakSet[GuardStats] = weakref.WeakSet()
        self._retired: dict[Key, OriginTotals] = {}
        # The accounts of GuardStats collected since the last reading: appended by their finalizer (which may run in
        # any thread, inside a garbage collection, so it takes no lock) and folded into _retired when read.
        self._gone: list[dict[Key, OriginStats]] = []
        # The (stack, origin)s exported under their own labels, at most MAX_ORIGINS: given at first sight, for good.
        self._exported: set[Key] = set()
        self._past_max_origins = False  # past MAX_ORIGINS origins, and said so
        self._lock = threading.Lock()
        for item in stats:
            self.add(item)

    def add(self, stats: GuardStats) -> None:
        """Follow ``stats`` (a transport's, an installation's) for as long as it lives; then keep its counts."""
        if isinstance(stats, OriginStats):
            raise TypeError("add the transport's GuardStats, not one origin's account")
        with self._lock:
            self._fold_gone()  # here too, not only when read: a process that never reads keeps no pile
            if stats in self._live:
                return
            self._live.add(stats)
        finalizer = weakref.finalize(stats, _retire, weakref.ref(self), stats._by_origin)  # the dict: later ones too
        finalizer.atexit = False

    def __contains__(self, stats: object) -> bool:
        return stats in self._live

    def unguarded(self) -> dict[str, str]:
        """The client libraries an installation among the followed stats leaves alone, and why (`record_unguarded`):
        a condition of now, so only live stats say it."""
        with self._lock:
            live = list(self._live)
        found: dict[str, str] = {}
        for stats in live:
            found.update(stats.unguarded)
        return dict(sorted(found.items()))

    def totals(self) -> dict[Key, OriginTotals]:
        """Per (stack, origin) as exported (`label_of`): the counts of every followed `GuardStats`, live or gone."""
        result: dict[Key, OriginTotals] = {}
        with self._lock:
            self._fold_gone()
            live = list(self._live)
            for key, retired in self._retired.items():
                result[key] = OriginTotals(*key)
                result[key].merged(retired)
        for stats in live:
            strategies = getattr(stats, "connection_strategies", None)
            for key, account in stats.by_origin().items():
                label = self.label_of(key)
                totals = result.get(label)
                if totals is None:
                    totals = result[label] = OriginTotals(*label)
                totals.add(account, strategies)
        return result

    def label_of(self, key: Key) -> Key:
        """The (stack, origin) the counts of ``key`` are exported under, for good: its own while fewer than
        `MAX_ORIGINS` are, else `OTHER_ORIGINS` (counted together, as OpenTelemetry's cardinality limit does). A
        series never moves: an origin's counts stay its own once its guards are gone."""
        with self._lock:
            return self._label_of(key)

    def _label_of(self, key: Key) -> Key:
        """`label_of`, under the lock."""
        if key[1] == OTHER_ORIGINS:
            return key
        if counted_apart(key, self._exported):
            self._exported.add(key)
            return key
        label = _counted_together(*key, "the guards of the process", told=self._past_max_origins)
        self._past_max_origins = True
        return label

    def _fold_gone(self) -> None:
        """Fold the accounts of collected stats into the retired totals, one per (stack, origin) as exported
        (`label_of`). Under the lock."""
        while self._gone:
            for key, gone in self._gone.pop().items():
                label = self._label_of(key)
                retired = self._retired.get(label)
                if retired is None:
                    retired = self._retired[label] = OriginTotals(*label)
                retired.add(gone)


def _counted_together(stack: str, origin: Origin, counted_by: str, *, told: bool) -> Key:
    """The key past `MAX_ORIGINS`: `OTHER_ORIGINS`; said unless ``told`` (the counting object says it once)."""
    if not told:
        logger.warning(
            "llama_guard counts the requests of at most %d origins one by one (%s reached more: %s); the requests to "
            "any further origin are counted together as origin 'other' in stats and metrics",
            MAX_ORIGINS,
            counted_by,
            origin,
        )
    return (stack, OTHER_ORIGINS)


def _retire(owner: weakref.ref[StatsSet], accounts: dict[Key, OriginStats]) -> None:
    stats_set = owner()
    if stats_set is not None and accounts:
        stats_set._gone.append(accounts)


#: Every `GuardStats` of the process (each joins when made): what the exporters read unless told otherwise.
EVERY_STATS = StatsSet()
