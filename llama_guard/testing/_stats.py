"""Server-side counters, so tests can prove what the server really did.

A client-side retry layer can only be judged from the server's point of view:
how many requests arrived, how many inference runs started and finished, which
connections waited in the pool with their request unread.  All counters are
updated under one lock and read as an immutable :class:`EmulatorStats`
snapshot; every update notifies a condition so tests can wait for a state with
a deadline instead of sleeping.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from ._faults import Fault

__all__ = ["ConnectionWait", "EmulatorStats", "StatsRecorder"]


@dataclass(frozen=True)
class ConnectionWait:
    """How long one accepted connection waited for a pool thread.

    ``unread_bytes`` is the size of the kernel's receive queue (``FIONREAD``)
    when a thread finally picked the connection up -- or when ``stop()``
    abandoned it (``served=False``).  Non-zero means the client's request sat
    unread for (at most) ``waited`` seconds.
    """

    connection_id: int
    waited: float
    unread_bytes: int
    served: bool


@dataclass(frozen=True)
class EmulatorStats:
    """Immutable snapshot of the emulator's counters.

    The ``connections_queued*`` and ``oldest_queued_wait`` fields are live:
    computed when the snapshot is taken from the connections still waiting for
    a pool thread.  ``errors`` lists unexpected exceptions inside the emulator
    itself (bugs, not injected faults); tests should expect it to be empty.
    """

    requests: Mapping[tuple[str, str], int]
    responses: Mapping[int, int]
    completions_started: int
    completions_finished: int
    completions_cancelled: int
    connections_accepted: int
    connections_closed: int
    connections_active: int
    connections_queued: int
    connections_queued_unread: int
    oldest_queued_wait: float
    connection_waits: tuple[ConnectionWait, ...]
    streams_closed_after_done: int
    faults_triggered: Mapping[Fault, int]
    pool_threads: int
    pool_dynamic_spawned: int
    pool_peak_threads: int
    slots_busy: int
    slots_waiting: int
    errors: tuple[str, ...] = ()
    #: ``stream_close="on_reuse"``: requests that arrived on a connection the server had given up after a stream,
    #: and were dropped unread and unanswered (the connection closed under them). Not in ``requests``.
    requests_dropped_after_stream: int = 0
    #: ``stall_burst``: bursts begun (a connection accepted while none of the previous burst's was open).
    stall_bursts: int = 0
    #: ``stall_burst``: connections whose first request was left unread, in all.
    connections_stalled: int = 0
    #: ``stall_burst``: stalled connections let go by :meth:`LlamaServerEmulator.release_stalled`.
    stalled_released_by_call: int = 0
    #: ``stall_burst``: stalled connections served because a served connection of the server closed (a pool
    #: thread became free and took the oldest waiting job).
    stalled_released_by_close: int = 0
    #: ``stall_burst``: stalled connections that carried a second request once served: their client was still
    #: waiting for the answer to the first one (a guard's probe answered within its deadline) and went on to use
    #: the connection. A client that gave up on a stalled connection half-closes or closes it: none there.
    stalled_used_after_release: int = 0
    #: ``stall_burst`` (live): connections held stalled now, and how many of them hold unread bytes.
    connections_stalled_now: int = 0
    connections_stalled_unread: int = 0

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def requests_to(self, path: str, method: str | None = None) -> int:
        """Requests received for ``path`` (any method unless given)."""
        return sum(n for (m, p), n in self.requests.items() if p == path and method in (None, m))

    @property
    def unread_waits(self) -> tuple[float, ...]:
        """Queue waits of connections whose request bytes sat unread."""
        return tuple(w.waited for w in self.connection_waits if w.unread_bytes > 0)

    @property
    def max_unread_wait(self) -> float:
        return max(self.unread_waits, default=0.0)

    @property
    def max_queue_wait(self) -> float:
        return max((w.waited for w in self.connection_waits), default=0.0)

    def connections_waited_unread(self, threshold: float = 0.5) -> int:
        """Connections whose request waited unread for at least ``threshold`` s.

        A short wait is normal (the pool thread's wake-up latency); the
        idle-counter bug shows up as waits of seconds.
        """
        return sum(1 for waited in self.unread_waits if waited >= threshold)


#: The plain counts (`StatsRecorder.count` takes one), each named as its `EmulatorStats` field.
Count = Literal[
    "completions_started",
    "completions_finished",
    "completions_cancelled",
    "connections_accepted",
    "connections_closed",
    "connections_active",
    "streams_closed_after_done",
    "requests_dropped_after_stream",
    "stall_bursts",
    "connections_stalled",
    "stalled_released_by_call",
    "stalled_released_by_close",
    "stalled_used_after_release",
]


@dataclass
class _Counters:
    requests: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    responses: collections.Counter[int] = field(default_factory=collections.Counter)
    faults: collections.Counter[Fault] = field(default_factory=collections.Counter)
    # Each of `Count`, by name: the names are written once, in `Count` (and as the `EmulatorStats` fields).
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(get_args(Count), 0))
    waits: list[ConnectionWait] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LiveView:
    """Values the emulator computes at snapshot time (not stored counters), named as in `EmulatorStats`."""

    connections_queued: int = 0
    connections_queued_unread: int = 0
    oldest_queued_wait: float = 0.0
    pool_threads: int = 0
    pool_dynamic_spawned: int = 0
    pool_peak_threads: int = 0
    slots_busy: int = 0
    slots_waiting: int = 0
    connections_stalled_now: int = 0
    connections_stalled_unread: int = 0


def _numbers(record: LiveView) -> dict[str, Any]:
    """The fields of ``record`` by name: each is the `EmulatorStats` field of the same name."""
    return {item.name: getattr(record, item.name) for item in fields(record)}


class StatsRecorder:
    """The mutable side: thread-safe increments plus change notification."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self._c = _Counters()

    @contextlib.contextmanager
    def _change(self) -> Iterator[_Counters]:
        """The counters, to change under the lock; whoever waits on ``changed`` hears of it once it is made."""
        with self.changed:
            yield self._c
            self.changed.notify_all()

    def count(self, name: Count, delta: int = 1) -> None:
        """Add ``delta`` (1, or -1 for the ``connections_active`` gauge) to the count ``name``."""
        with self._change() as c:
            c.counts[name] += delta

    def request(self, method: str, path: str) -> None:
        with self._change() as c:
            c.requests[(method, path)] += 1

    def response(self, status: int) -> None:
        with self._change() as c:
            c.responses[status] += 1

    def fault(self, fault: Fault) -> None:
        with self._change() as c:
            c.faults[fault] += 1

    def wait(self, record: ConnectionWait) -> None:
        with self._change() as c:
            c.waits.append(record)

    def error(self, description: str) -> None:
        """An unexpected exception inside the emulator (a bug, not a fault)."""
        with self._change() as c:
            c.errors.append(description)

    def reset(self) -> None:
        """Zero every counter except ``connections_active`` (a live gauge)."""
        with self._change() as c:
            self._c = _Counters()
            self._c.counts["connections_active"] = c.counts["connections_active"]

    def snapshot_and_reset(self, live: LiveView) -> EmulatorStats:
        """Atomically take a snapshot and zero the counters."""
        with self.changed:
            before = self.snapshot(live)
            self.reset()
            return before

    def snapshot(self, live: LiveView) -> EmulatorStats:
        with self.changed:
            c = self._c
            # The counts go by name (a count added to Count and EmulatorStats needs no line here); the collections
            # are copied.
            return EmulatorStats(
                requests=dict(c.requests),
                responses=dict(c.responses),
                faults_triggered=dict(c.faults),
                connection_waits=tuple(c.waits),
                errors=tuple(c.errors),
                **c.counts,
                **_numbers(live),
            )
