"""What the guard learns about probing one origin: the probe deadline in force, and admission of new connections.

Sans-I/O: an adapter (httpx, aiohttp) asks this module for a deadline and a turn, does the I/O itself, and reports
what happened. One `OriginProbes` per origin, shared by every transport of the process through `PROBE_BOOK`: the
answer time of ``GET /health`` is the server's, and a burst that stalls a server is made of the connections of
every client in the process, not of one pool.

The deadline (see docs/how-it-works.md): once ``LEARN_AFTER`` probes of the origin were answered, a first probe
waits ``factor`` times the slowest of the last ``WINDOW`` answers, at least ``probe_timeout_min`` and at most the
configured ``probe_timeout``. A busy server answers late and its answers raise the deadline; a stalled connection
never answers and teaches nothing. A probe given up on whose answer still arrives (``probe_answered_late``) counts
as an answer of that latency, so one false alarm lifts the deadline above it.

Admission: while a probe of the origin was given up within ``RECOVERY_WINDOW`` seconds (``"after_stall"``), or
always (``"always"``), new connections to it are opened and probed one at a time, in the order they asked: the
next connection is opened once the previous one's probe was answered or given up. Reconnects after a stall then
reach the server one by one instead of as a new burst.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

from .origins import Origin
from .policy import GuardPolicy

__all__ = [
    "ADMISSION_POLL",
    "LEARN_AFTER",
    "PROBE_BOOK",
    "PROBE_SLICE",
    "RECOVERY_WINDOW",
    "WINDOW",
    "OriginProbes",
    "ProbeBook",
]

# Answers needed before the learnt deadline replaces the configured one, and how many recent answers it looks at.
LEARN_AFTER = 4
WINDOW = 64
# How long after a probe was given up new connections to its origin keep being admitted one at a time.
RECOVERY_WINDOW = 5.0
# A connection waiting for its turn looks again this often. A poll rather than a wake-up: the queue is shared by
# every transport of the process, across threads and event loops (asyncio, trio) that cannot wake one another.
ADMISSION_POLL = 0.001
# A probe in progress looks at the deadline in force this often, so that answers seen meanwhile (the healthy
# connections of the same burst) shorten its wait.
PROBE_SLICE = 0.02


class OriginProbes:
    """The probe state of one origin; thread-safe (sync transports share it between threads)."""

    __slots__ = ("_answers", "_in_progress", "_last_given_up", "_lock", "_next_ticket", "_queue", "origin")

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self._lock = threading.Lock()
        self._answers: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._last_given_up = -RECOVERY_WINDOW
        self._queue: collections.deque[int] = collections.deque()
        self._in_progress: set[int] = set()
        self._next_ticket = 0

    # -- the deadline ----------------------------------------------------------------------------------------------

    def deadline(self, policy: GuardPolicy) -> float:
        """The deadline in force for a first probe: learnt from the answers seen, or the configured one."""
        configured = policy.probe_timeout
        if not policy.probe_learning:
            return configured
        with self._lock:
            if len(self._answers) < LEARN_AFTER:
                return configured
            slowest = max(self._answers)
        return min(max(slowest * policy.probe_learning_factor, policy.probe_timeout_min), configured)

    def answers_seen(self) -> int:
        with self._lock:
            return len(self._answers)

    def probe_answered(self, seconds: float) -> None:
        with self._lock:
            self._answers.append(seconds)

    def probe_given_up(self) -> None:
        """A probe's deadline passed without an answer: the origin is recovering from a stall."""
        with self._lock:
            self._last_given_up = time.monotonic()

    def probe_answered_late(self, seconds: float) -> None:
        """A probe given up on was answered after all, ``seconds`` after it was sent: a false alarm. Counted as an
        answer, so the deadline rises above it."""
        self.probe_answered(seconds)

    # -- admission ---------------------------------------------------------------------------------------------------

    def recovering(self) -> bool:
        return time.monotonic() - self._last_given_up < RECOVERY_WINDOW

    def admission_needed(self, policy: GuardPolicy) -> bool:
        """Whether a new connection must take its turn (`take_ticket`, `admit`, `leave`) before it is opened."""
        mode = policy.connect_admission
        return mode == "always" or (mode == "after_stall" and self.recovering())

    def take_ticket(self) -> int:
        """A place in the queue of connections waiting to be opened; `admit` says when it is this one's turn."""
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._queue.append(ticket)
            return ticket

    def admit(self, ticket: int) -> bool:
        """True (once) when ``ticket`` may open its connection: it is first in the queue and no other connection
        to the origin is being opened and probed. `leave` must follow, whatever happens."""
        with self._lock:
            if self._in_progress or not self._queue or self._queue[0] != ticket:
                return False
            self._queue.popleft()
            self._in_progress.add(ticket)
            return True

    def leave(self, ticket: int) -> None:
        """The connection of ``ticket`` is probed (answered or given up), failed, or its request was cancelled."""
        with self._lock:
            if ticket in self._in_progress:
                self._in_progress.discard(ticket)
            else:
                with contextlib.suppress(ValueError):
                    self._queue.remove(ticket)

    def waiting(self) -> int:
        """Connections waiting for their turn (for tests and stats)."""
        with self._lock:
            return len(self._queue)


class ProbeBook:
    """`OriginProbes` by origin, created on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._origins: dict[Origin, OriginProbes] = {}

    def of(self, origin: Origin) -> OriginProbes:
        probes = self._origins.get(origin)  # a dict lookup is atomic in CPython: the lock only guards creation
        if probes is None:
            with self._lock:
                probes = self._origins.setdefault(origin, OriginProbes(origin))
        return probes

    def forget(self) -> None:
        """Drop everything learnt (tests; a process that points the same origin at a different server)."""
        with self._lock:
            self._origins.clear()


# The process's book: transports share it unless given their own.
PROBE_BOOK = ProbeBook()
