"""Counts per (stack, origin) summed over guards, and the process's set of guards' counters, for
``llama_guard.metrics``.

A transport counts each request on its origin's account (`GuardStats.of_origin`, an `OriginStats`), which its
`GuardStats` shows with its own counts. `Accounts` finds a request's account by its URL's parts.

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

from .origins import Origin
from .stats import COUNTERS, GuardStats, LatencyHistogram, OriginStats, live_accounts

__all__ = ["COUNTS", "EVERY_STATS", "Accounts", "OriginTotals", "StatsSet"]

#: The whole-number counters of a `GuardStats` that are kept per origin (``passthrough`` counts other origins).
COUNTS = tuple(name for name in COUNTERS if name != "passthrough")


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
        finalizer = weakref.finalize(stats, _retire, weakref.ref(self), live_accounts(stats))
        finalizer.atexit = False

    def __contains__(self, stats: object) -> bool:
        return stats in self._live

    def totals(self) -> dict[Key, OriginTotals]:
        """Per (stack, origin): the counts of every followed `GuardStats`, live or gone."""
        result: dict[Key, OriginTotals] = {}
        with self._lock:
            while self._gone:
                for key, gone in self._gone.pop().items():
                    retired = self._retired.get(key)
                    if retired is None:
                        retired = self._retired[key] = OriginTotals(*key)
                    retired.add(gone)
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


def _retire(owner: weakref.ref[StatsSet], accounts: dict[Key, OriginStats]) -> None:
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
