"""What the process learns per origin, kept for a bounded number of origins.

A gateway over pod addresses or a harness on random ports reaches origins without end; what the guard learnt about
each (`OriginProbes`, `OriginConnections`: a few KB) would otherwise stay for the life of the process. Past
`MAX_ORIGINS`, making an origin's entry forgets an older one: learnt again if that origin returns, as on a first
request. One used within `IDLE_AFTER` goes only when none of the oldest few is quieter (a second chance, as the CLOCK
page-replacement algorithm gives); one in use (a probe under way, a connection waiting its turn) is never forgotten.
A request that looked an entry up just before it was forgotten uses it to its end; the next request gets the new one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from itertools import islice
from typing import Generic, Protocol, TypeVar

from .log import logger

__all__ = ["IDLE_AFTER", "MAX_ORIGINS", "REMEMBERED_BY_URL", "OriginBook"]

#: Origins an `OriginBook` keeps what it learnt about.
MAX_ORIGINS = 1024
#: An origin used within this many seconds is forgotten only when no older, quieter one can be: a busy origin keeps
#: what it taught while a stream of new ones passes through.
IDLE_AFTER = 60.0
#: Origins a guard remembers by its URL's parts as its HTTP library spells them (its accounts, routes and connection
#: choices: one dict lookup per request); more are looked up each time (a client of very many servers).
REMEMBERED_BY_URL = 256
# How many of the oldest entries one insertion looks at for one to forget: bounded work per new origin.
_EVICTION_SCAN = 8


class _Forgettable(Protocol):
    def in_use(self) -> bool:
        """Something under way depends on this entry: it must not be forgotten."""

    def used_lately(self) -> bool:
        """Used within `IDLE_AFTER`: forgotten only when no quieter entry can be."""


class _CountsForgotten(Protocol):
    def count_origin_forgotten(self) -> None:
        """Count one older origin forgotten to make room (`GuardStats`)."""


EntryT = TypeVar("EntryT", bound=_Forgettable)


class OriginBook(Generic[EntryT]):
    """Entries by key, made on first use; at most ``limit`` of them unless the oldest are all in use. ``what``: what
    an entry holds, for the one log line said when the book first forgets one."""

    def __init__(self, *, what: str, limit: int = MAX_ORIGINS) -> None:
        if limit < 1:
            raise ValueError(f"limit is a number of origins, at least 1; got {limit!r}")
        self._what = what
        self._limit = limit
        self._entries: dict[Hashable, EntryT] = {}
        #: The entry of a key, or None: the dict's own method, so a lookup (once per request) runs no Python code.
        self.get: Callable[[Hashable], EntryT | None] = self._entries.get
        self._lock = threading.Lock()
        self._said = False

    def of(self, key: Hashable, make: Callable[[], EntryT], *, account: _CountsForgotten | None = None) -> EntryT:
        """The entry of ``key``, made by ``make`` if there is none (a dict lookup is atomic in CPython: the lock
        only guards making one). ``account`` counts an older entry forgotten to make room for this one."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        made = make()  # outside the lock: an entry may take locks of its own
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry
            forgotten = len(self._entries) >= self._limit and self._forget_one()
            self._entries[key] = made
        if not forgotten:
            return made
        if account is not None:
            account.count_origin_forgotten()
        if not self._said:
            self._said = True
            logger.warning(
                "llama_guard keeps %s for at most %d origins; past that it forgets an older origin's (a quiet one "
                "first), and learns it again if that origin returns (stats.origins_forgotten counts them)",
                self._what,
                self._limit,
            )
        return made

    def _forget_one(self) -> bool:
        """Drop one of the oldest few entries: the oldest quiet one, else the oldest not in use; those looked at and
        kept go to the back. False if every one is in use (the book then grows past its limit). Under the lock."""
        entries = self._entries
        fallback: Hashable | None = None
        for key in list(islice(entries, _EVICTION_SCAN)):
            entry = entries.pop(key)
            if not entry.in_use():
                if not entry.used_lately():
                    return True
                if fallback is None:
                    fallback = key
            entries[key] = entry
        if fallback is None:
            return False
        del entries[fallback]
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def forget(self) -> None:
        """Drop every entry (tests; a process that points the same origins at different servers)."""
        with self._lock:
            self._entries.clear()
