"""Counts per (stack, origin), and the process's set of guards' counters, for ``llama_guard.metrics``.

A transport's `GuardStats` counts everything it guarded. For metrics the same counts are wanted per origin and per
stack (httpx, httpx2, aiohttp): `GuardStats.of_origin` gives an `OriginStats`, a `GuardStats` whose every count
also goes to its parent, under the parent's one lock. A transport hands a request's counting to its origin's
account instead of to its own `GuardStats`; nothing else changes.

`StatsSet` holds `GuardStats` objects weakly, and keeps the counts of those that are gone (folded into retired
totals when their owner is collected), so that the totals it reports never go down while transports come and go.
`EVERY_STATS` is the process's: every `GuardStats` joins it when it is made.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .origins import Origin
from .stats import COUNTERS, GuardStats, LatencyHistogram, StatsSnapshot

__all__ = ["COUNTS", "EVERY_STATS", "Accounts", "OriginStats", "OriginTotals", "StatsSet"]

#: The whole-number counters of a `GuardStats` that are kept per origin (``passthrough`` counts other origins).
COUNTS = tuple(name for name in COUNTERS if name != "passthrough")


class _ParentCondition:
    """A condition of an origin's account that is its parent's (``stats.probing_off``...): read and set there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, account: OriginStats | None, owner: type) -> Any:
        if account is None:
            return self
        parent = account._parent()
        return None if parent is None else getattr(parent, self._name)

    def __set__(self, account: OriginStats, value: str | None) -> None:
        parent = account._parent()
        if parent is not None:
            setattr(parent, self._name, value)


class OriginStats(GuardStats):
    """The counts of one origin through one stack: a `GuardStats` whose counts go to its parent too.

    Shares the parent's lock; the conditions the parent reports (``public_path``, ``probing_off``,
    ``late_answers_unseen``) are the parent's, read and set through this object alike. The parent is held weakly:
    its accounts outlive it (`StatsSet` reads them once it is gone), and must not keep it alive.
    """

    _by_origin: dict[tuple[str, Origin], GuardStats] = {}  # noqa: RUF012 (never filled: an account has none)

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

    # -- every count, to both ------------------------------------------------------------------------------------

    def add(self, **increments: int) -> None:
        parent = self._parent()
        if parent is not None:
            parent.add(**increments)
        super().add(**increments)

    def add_error(self, kind: str) -> None:
        parent = self._parent()
        if parent is not None:
            parent.add_error(kind)
        super().add_error(kind)

    def record_retry(self, reason: str, *, stall: bool) -> None:
        parent = self._parent()
        if parent is not None:
            parent.record_retry(reason, stall=stall)
        super().record_retry(reason, stall=stall)

    def record_request(self, attempts: int, first_byte: float | None, closed_by_header: bool) -> None:
        """`GuardStats.record_request` for both in one hold of the shared lock (once per request: half the
        instructions of two calls); the first byte goes to this account's histogram alone, which the parent's
        snapshot merges (`GuardStats.snapshot`)."""
        parent = self._parent()
        lock = self._lock
        lock.acquire()
        try:
            self._count_request(attempts, closed_by_header)
            if parent is not None:
                parent._count_request(attempts, closed_by_header)
            if first_byte is not None:
                self.first_byte.record(first_byte)
        finally:
            lock.release()

    def record_probe(self, seconds: float, *, answered: bool, given_up: bool = False, rescued: bool = False) -> None:
        """`GuardStats.record_probe` for both in one hold of the shared lock, as `record_request`."""
        parent = self._parent()
        with self._lock:
            self._count_probe(seconds, answered, given_up, rescued)
            if parent is not None:
                parent._count_probe(seconds, answered, given_up, rescued)

    def record_admission_wait(self, seconds: float) -> None:
        parent = self._parent()
        if parent is not None:
            parent.record_admission_wait(seconds)
        super().record_admission_wait(seconds)

    def record_connection_choice(self, *args: Any, **kwargs: Any) -> None:
        parent = self._parent()
        if parent is not None:
            parent.record_connection_choice(*args, **kwargs)
        super().record_connection_choice(*args, **kwargs)

    # -- the parent's conditions ---------------------------------------------------------------------------------

    public_path = _ParentCondition()
    probing_off = _ParentCondition()
    late_answers_unseen = _ParentCondition()
    bypassed = _ParentCondition()

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
        self._gone: list[dict[Key, GuardStats]] = []
        self._lock = threading.Lock()
        for item in stats:
            self.add(item)

    def add(self, stats: GuardStats) -> None:
        """Follow ``stats`` (a transport's, an installation's) for as long as it lives; then keep its counts."""
        if isinstance(stats, OriginStats):
            raise TypeError("add the transport's GuardStats, not one origin's account")
        with self._lock:
            if stats in self._live:
                return
            self._live.add(stats)
        finalizer = weakref.finalize(stats, _retire, weakref.ref(self), stats._by_origin)
        finalizer.atexit = False

    def __contains__(self, stats: object) -> bool:
        return stats in self._live

    def totals(self) -> dict[Key, OriginTotals]:
        """Per (stack, origin): the counts of every followed `GuardStats`, live or gone."""
        result: dict[Key, OriginTotals] = {}
        with self._lock:
            while self._gone:
                for key, account in self._gone.pop().items():
                    retired = self._retired.get(key)
                    if retired is None:
                        retired = self._retired[key] = OriginTotals(*key)
                    retired.add(account)
            live = list(self._live)
            for key, retired in self._retired.items():
                result[key] = OriginTotals(*key)
                result[key].merged(retired)
        for stats in live:
            strategies = getattr(stats, "connection_strategies", None)
            for key, account in stats.by_origin().items():
                totals = result.get(key)
                if totals is None:
                    totals = result[key] = OriginTotals(*key)
                totals.add(account, strategies)
        return result


def _retire(owner: weakref.ref[StatsSet], accounts: dict[Key, GuardStats]) -> None:
    stats_set = owner()
    if stats_set is not None and accounts:
        stats_set._gone.append(accounts)


#: Every `GuardStats` of the process (each joins when made): what the exporters read unless told otherwise.
EVERY_STATS = StatsSet()


class Accounts:
    """One transport's (or middleware's) accounts per origin in its `GuardStats` (`GuardStats.of_origin`),
    remembered by the URL's (scheme, host, port) as its HTTP library spells them: one dict lookup per request."""

    __slots__ = ("_known", "_stack", "_stats")

    #: Origins remembered by their URL's parts; more are looked up each time (a client of very many servers).
    MAX_REMEMBERED = 256

    def __init__(self, stats: GuardStats, stack: str) -> None:
        """``stack``: the name counts are kept under (``"httpx"``, ``"httpx2"``, ``"aiohttp"``, ``"requests"``)."""
        self._stats = stats
        self._stack = stack
        self._known: dict[tuple[str, str, int | None], GuardStats] = {}

    def of(self, scheme: str, host: str, port: int | None, origin: Origin | None) -> GuardStats:
        """The account of a request's origin (``origin``: if the caller worked it out already)."""
        account = self._known.get((scheme, host, port))
        if account is None:
            account = self._stats.of_origin(
                self._stack, origin if origin is not None else Origin.of(scheme, host, port)
            )
            if len(self._known) < self.MAX_REMEMBERED:
                self._known[scheme, host, port] = account
        return account
