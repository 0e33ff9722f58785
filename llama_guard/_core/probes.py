"""Probes of new connections, free of I/O: the exchange (``GET /health`` written, its answer parsed with h11) and
what the guard learns about probing one origin (the probe deadline in force, admission of new connections).

Why a probe: llama-server builds before b11737 can leave a newly accepted keep-alive connection unread for as long
as other connections stay open (cpp-httplib's thread pool does not grow when its idle counter is stale). The
defect only ever hits the first exchange of a connection: once a server thread owns a connection, it owns it for
the connection's life. An answer to the probe proves a thread owns it, so the real request is written only to a
connection that will be read. A probe that goes unanswered is harmless when the server runs it later; a real
completion would run twice. Any complete HTTP response proves a server thread read the connection (200, or 503
while a model loads); the connection is usable afterwards only if the server keeps it open (HTTP/1.1 keep-alive).

A new connection's machine (``connection_machine.py``) asks this module for a deadline and a turn, its
driver does the I/O, and the machine reports what happened. One `OriginProbes` per origin, shared by every guard of
the process through its `ProbeBook` (``ProcessState.probes``): the answer time of ``GET /health`` is the server's,
and a burst that stalls a server is made of the connections of every client in the process, not of one pool.

The deadline (see docs/how-it-works.md): once ``LEARN_AFTER`` probes of the origin were answered, a first probe
waits ``factor`` times the slowest of the last ``WINDOW`` answers, at least ``probe_timeout_min`` and at most the
configured ``probe_timeout``. A busy server answers late and its answers raise the deadline; a stalled connection
never answers and teaches nothing. A probe given up on whose answer still arrives (``probe_answered_late``) counts
as an answer of that latency, so one false alarm lifts the deadline above it.

Late answers (`GivenUpProbe`): a connection given up on is kept, half closed (``_runtime.late_answers``), and
looked at without reading whenever a probe of the origin starts, waits a slice, or is answered, and once more when
its watch ends (the book's `Scheduler`); it is closed when the watch settles. An answer seen
there counts as late (a false alarm: the server was serving it, only slowly) unless a connection opened after the
give-up was being probed meanwhile: cpp-httplib serves waiting connections oldest first, so the thread it starts for
a new connection first answers the stalled ones, just before the new one; such an answer proves nothing about load.
The count is so a lower bound of false alarms (a server's own count of ``GET /health`` is the exact one).

Admission: while a probe of the origin was given up within ``RECOVERY_WINDOW`` seconds (``"after_stall"``), or
always (``"always"``), new connections to it are opened and probed one at a time, in the order they asked: the
next connection is opened once the previous one's probe was answered or given up, or has waited ``probe_timeout``
(a request's later probes wait longer: the ladder). Reconnects after a stall then reach the server one by one
instead of as a new burst. A waiting connection sleeps until woken (`Turn`): the
connection that frees the turn wakes the one now first in the queue, in whatever thread or event loop it waits.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import h11

from .llama_server import HEALTH_PATH as PROBE_PATH
from .origin_book import IDLE_AFTER, OriginBook
from .origins import Origin
from .policy import GuardPolicy
from .stats import GuardStats

__all__ = [
    "LEARN_AFTER",
    "PROBE_SLICE",
    "RECOVERY_WINDOW",
    "WINDOW",
    "Admission",
    "GivenUpProbe",
    "GivenUpWatches",
    "OriginProbes",
    "ProbeAnswer",
    "ProbeBook",
    "ProbeExchange",
    "ProbeProtocolError",
    "Turn",
    "probe_deadline",
]


# -- the exchange: one probe's bytes and its answer -----------------------------------------------------------------

PROBE_USER_AGENT = "llama-guard-probe"
MAX_PROBE_RESPONSE = 64 * 1024


class ProbeProtocolError(Exception):
    """The server answered the probe with something that is not a complete HTTP response."""


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    status: int
    keep_alive: bool


class ProbeExchange:
    """One probe: the bytes to write, then `feed()` what the server sends until it returns an answer."""

    def __init__(self, host: str) -> None:
        self._connection = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=MAX_PROBE_RESPONSE)
        self._request = h11.Request(
            method="GET",
            target=PROBE_PATH,
            headers=[("Host", host), ("User-Agent", PROBE_USER_AGENT), ("Accept", "*/*")],
        )
        self._status: int | None = None
        self._received = 0

    def request_bytes(self) -> bytes:
        data = self._connection.send(self._request) or b""
        return data + (self._connection.send(h11.EndOfMessage()) or b"")

    def feed(self, data: bytes) -> ProbeAnswer | None:
        """Take bytes read from the connection (``b""`` at EOF); the answer once the response is complete."""
        self._received += len(data)
        if self._received > MAX_PROBE_RESPONSE:
            raise ProbeProtocolError(f"the answer to GET {PROBE_PATH} is larger than {MAX_PROBE_RESPONSE} bytes")
        try:
            self._connection.receive_data(data)
            while True:
                event = self._connection.next_event()
                if event is h11.NEED_DATA:
                    if not data:
                        raise ProbeProtocolError(f"the server closed the connection before answering GET {PROBE_PATH}")
                    return None
                if isinstance(event, h11.Response):
                    self._status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    assert self._status is not None
                    keep_alive = self._connection.their_state is h11.DONE and self._connection.our_state is h11.DONE
                    trailing = len(self._connection.trailing_data[0])
                    if trailing:  # they would be read as the real request's response
                        raise ProbeProtocolError(f"{trailing} bytes after the answer to GET {PROBE_PATH}")
                    return ProbeAnswer(self._status, keep_alive)
                elif isinstance(event, h11.ConnectionClosed):
                    raise ProbeProtocolError(f"the server closed the connection before answering GET {PROBE_PATH}")
        except h11.RemoteProtocolError as exc:
            raise ProbeProtocolError(f"the answer to GET {PROBE_PATH} is not valid HTTP/1.1: {exc}") from None


def probe_deadline(failed_probes: int, *, first: float, cap: float) -> float:
    """The deadline of the next probe of a request: ``first`` for the first two, then doubling, up to ``cap``.

    A second probe that fails too is most often a reconnect that reached the server together with another one
    (measured on b11434), not a slow server: it gets the same short deadline, so that a request rescued on its
    third attempt still has its first response within about 2.5 s.
    """
    return min(first * 2.0 ** min(max(failed_probes - 1, 0), 32), cap)


# -- what the guard learns about probing one origin ------------------------------------------------------------------

# Answers needed before the learnt deadline replaces the configured one, and how many recent answers it looks at.
LEARN_AFTER = 4
WINDOW = 64
# How long after a probe was given up new connections to its origin keep being admitted one at a time.
RECOVERY_WINDOW = 5.0
# A probe in progress looks at the deadline in force this often, so that answers seen meanwhile (the healthy
# connections of the same burst) shorten its wait.
PROBE_SLICE = 0.02


def _nothing() -> None:
    pass


class Turn(Protocol):
    """How a connection waiting for admission is woken (``_runtime/admission_turns.py``: a thread's, an event
    loop's)."""

    def wake(self) -> None:
        """Tell the waiter its turn may have come; callable from any thread, at any time (also after the wait)."""


class _Scheduler(Protocol):
    def at(self, when: float, call: Callable[[], None]) -> None: ...


@dataclass(eq=False)
class GivenUpProbe:
    """A connection whose probe was given up, watched for a late answer; closed (``close``) once ``settled``."""

    peek: Callable[[], bool | None]  # True: bytes wait to be read; False: closed or reset; None: nothing yet
    stats: GuardStats  # of the transport that gave it up
    started: float  # when its probe was sent
    watch_until: float
    newer_than: int  # probes of the origin started before the give-up: an answer to a later one may drain this
    looked_at: float  # the last look that found nothing
    close: Callable[[], None] = _nothing
    settled: bool = False
    answered_late: bool = False

    def end(self) -> None:
        """Stop watching and close the connection (its transport closes)."""
        self.settled = True
        self.close()


class GivenUpWatches:
    """The watches one guard started (a transport's, a connector's): ended when it closes, so that its given-up
    connections go with it."""

    __slots__ = ("_lock", "_watches")

    def __init__(self) -> None:
        self._watches: list[GivenUpProbe] = []
        self._lock = threading.Lock()

    def add(self, watch: GivenUpProbe) -> None:
        with self._lock:
            self._watches = [kept for kept in self._watches if not kept.settled]
            self._watches.append(watch)

    def end_all(self) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.end()

    def __len__(self) -> int:
        with self._lock:
            return sum(not watch.settled for watch in self._watches)


class OriginProbes:
    """The probe state of one origin; thread-safe (sync transports share it between threads)."""

    __slots__ = (
        "_admitted",
        "_answers",
        "_connecting",
        "_given_up",
        "_in_progress",
        "_kicked_before",
        "_last_given_up",
        "_last_probe",
        "_lock",
        "_next_ticket",
        "_probes_pending",
        "_probes_started",
        "_queue",
        "_recent_answers",
        "_scheduler",
        "_turns",
        "origin",
    )

    def __init__(self, origin: Origin, scheduler: _Scheduler | None = None) -> None:
        """``scheduler``: calls the last look at a given-up connection when its watch ends (none: the look comes
        with the origin's next probe, or when the watch is ended)."""
        self.origin = origin
        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._answers: collections.deque[float] = collections.deque(maxlen=WINDOW)
        # (when, probe number) of recent answers: tells an answer drained by a newer connection.
        self._recent_answers: collections.deque[tuple[float, int]] = collections.deque(maxlen=WINDOW)
        self._probes_started = 0
        # Probes numbered up to this one were waiting when a kick connection was opened (probe_kick): their answers
        # may come from the thread the kick woke, so they are not learnt from.
        self._kicked_before = 0
        self._probes_pending: set[int] = set()
        self._given_up: list[GivenUpProbe] = []
        self._last_given_up = -RECOVERY_WINDOW
        self._queue: collections.deque[int] = collections.deque()
        self._turns: dict[int, Turn] = {}  # how to wake each waiting ticket
        self._in_progress: set[int] = set()
        # Of those, the ones whose connect has not returned yet, and until when each holds the turn: a connect that
        # hangs (its SYN unanswered) holds it no longer than `admit`'s ``hold``.
        self._connecting: dict[int, float] = {}
        self._next_ticket = 0
        self._admitted = 0
        self._last_probe = time.monotonic()  # when a probe last started (or the origin was first met)

    def in_use(self) -> bool:
        """A probe, a given-up connection's watch or an admission under way (`OriginBook` keeps it)."""
        with self._lock:
            return bool(self._probes_pending or self._given_up or self._queue or self._in_progress)

    def used_lately(self) -> bool:
        """A probe started within `IDLE_AFTER` (`OriginBook` forgets a quieter origin first)."""
        return time.monotonic() - self._last_probe < IDLE_AFTER

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
        """Answers the deadline is learnt from (late answers included)."""
        with self._lock:
            return len(self._answers)

    def probe_started(self) -> int:
        """A probe of a new connection is sent: its number, for `probe_answered`."""
        self.check_given_up()
        with self._lock:
            self._probes_started += 1
            self._probes_pending.add(self._probes_started)
            self._last_probe = time.monotonic()
            return self._probes_started

    def probe_answered(self, seconds: float, number: int) -> None:
        """The probe ``number`` (from `probe_started`) was answered in ``seconds``: learnt from, unless a kick went
        out while it waited (`kicked`)."""
        self.check_given_up()
        with self._lock:
            self._probes_pending.discard(number)
            if number > self._kicked_before:
                self._answers.append(seconds)
            self._recent_answers.append((time.monotonic(), number))

    def kicked(self) -> None:
        """A kick connection to the origin was opened: the probes waiting now may be served by the thread it wakes,
        whichever probe opened it, so their answers time the rescue, not the server."""
        with self._lock:
            self._kicked_before = self._probes_started

    def probe_failed(self, number: int) -> None:
        """The probe ``number`` failed with an error (a given-up one: `probe_given_up`)."""
        with self._lock:
            self._probes_pending.discard(number)

    def probe_given_up(
        self,
        number: int,
        peek: Callable[[], bool | None],
        stats: GuardStats,
        started: float,
        *,
        watch: float,
        close: Callable[[], None] = _nothing,
    ) -> GivenUpProbe:
        """The probe ``number``'s deadline passed without an answer: the origin is recovering from a stall. ``peek``
        looks at the connection, kept half closed, for up to ``watch`` seconds after the probe was sent (an answer
        later than any probe of the guard would wait for is no false alarm), until the returned watch is settled;
        then ``close`` closes it."""
        now = time.monotonic()
        with self._lock:
            self._probes_pending.discard(number)
            self._last_given_up = now
            given_up = GivenUpProbe(peek, stats, started, started + watch, self._probes_started, now, close)
            self._given_up.append(given_up)
        if self._scheduler is not None:  # the last look, even if no probe comes to look
            self._scheduler.at(given_up.watch_until, self.check_given_up)
        return given_up

    def check_given_up(self) -> None:
        """Look at the connections given up on: count late answers, settle what needs watching no longer."""
        if not self._given_up:
            return
        now = time.monotonic()
        with self._lock:
            watches, self._given_up = self._given_up, []
            recent = list(self._recent_answers)
            newest_pending = max(self._probes_pending, default=0)
        pending = []
        for watch in watches:
            if watch.settled:  # by its transport, which closed
                continue
            waiting = watch.peek()
            if waiting is None and now < watch.watch_until:
                watch.looked_at = now
                pending.append(watch)
                continue
            # Was a connection opened after the give-up being probed since the last look? Then that connection's
            # thread may have answered this one on its way.
            drained = newest_pending > watch.newer_than or any(
                when >= watch.looked_at and number > watch.newer_than for when, number in recent
            )
            if waiting and not drained:
                watch.answered_late = True
                watch.stats.add(probes_answered_late=1)
                with self._lock:
                    self._answers.append(now - watch.started)  # it came since the last look: at most this late
            watch.end()
        if pending:
            with self._lock:
                self._given_up.extend(pending)

    # -- admission ---------------------------------------------------------------------------------------------------

    def recovering(self) -> bool:
        return time.monotonic() - self._last_given_up < RECOVERY_WINDOW

    def admission_needed(self, policy: GuardPolicy) -> bool:
        """Whether a new connection must take its turn (`take_ticket`, `admit`, `leave`) before it is opened."""
        mode = policy.connect_admission
        return mode == "always" or (mode == "after_stall" and self.recovering())

    def take_ticket(self, turn: Turn) -> int:
        """A place in the queue of connections waiting to be opened; `admit` says when it is this one's turn.
        ``turn`` is woken whenever it may have come (made by the waiter, in its own thread or event loop)."""
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._queue.append(ticket)
            self._turns[ticket] = turn
            return ticket

    def admit(self, ticket: int, hold: float) -> bool:
        """True (once) when ``ticket`` may open its connection: it is first in the queue and no other connection
        to the origin is being opened and probed, or each that is has been connecting for ``hold`` seconds or more
        (a connect that hangs does not keep the queue waiting on the OS's bound). `leave` must follow, whatever
        happens; `connected` when its connect returns."""
        now = time.monotonic()
        with self._lock:
            if not self._queue or self._queue[0] != ticket or self._held(now):
                return False
            self._queue.popleft()
            self._turns.pop(ticket, None)
            self._in_progress.add(ticket)
            self._connecting[ticket] = now + hold
            self._admitted += 1
            turn = self._turns.get(self._queue[0]) if self._queue else None
        if turn is not None:
            turn.wake()  # the new head times its wait on this connect's hold now (`hold_ends_in`)
        return True

    def _held(self, now: float) -> bool:
        """Whether a connection being opened (within its hold) or probed keeps the turn. Under the lock."""
        connecting = self._connecting
        return any(now < connecting.get(ticket, math.inf) for ticket in self._in_progress)

    def hold_ends_in(self, ticket: int) -> float | None:
        """For the head of the queue while every connection ahead is still connecting: the seconds until the last
        of them stops holding the turn (when `admit` lets ``ticket`` go); else None (a connection being probed
        wakes the head when it leaves)."""
        with self._lock:
            if not self._queue or self._queue[0] != ticket or not self._in_progress:
                return None
            until = max(self._connecting.get(holder, math.inf) for holder in self._in_progress)
            return None if until == math.inf else max(0.0, until - time.monotonic())

    def connected(self, ticket: int) -> None:
        """The connect of ``ticket``'s connection returned: it holds the turn through its probe now."""
        with self._lock:
            self._connecting.pop(ticket, None)

    def leave(self, ticket: int) -> None:
        """The connection of ``ticket`` is probed (answered or given up), failed, or its request was cancelled (or
        its wait timed out): the connection now first in the queue is woken, its turn may have come."""
        with self._lock:
            if ticket in self._in_progress:
                self._in_progress.discard(ticket)
                self._connecting.pop(ticket, None)
            else:
                self._turns.pop(ticket, None)
                with contextlib.suppress(ValueError):
                    self._queue.remove(ticket)
            head_may_go = self._queue and not self._held(time.monotonic())
            turn = self._turns.get(self._queue[0]) if head_may_go else None
        if turn is not None:
            turn.wake()  # outside the lock: an asyncio or trio waker schedules a call on the waiter's loop

    def opening(self) -> int:
        """Connections admitted and not yet probed (for tests and stats)."""
        with self._lock:
            return len(self._in_progress)

    def admitted(self) -> int:
        """Connections admitted so far, after a wait or not (for tests)."""
        with self._lock:
            return self._admitted

    def waiting(self) -> int:
        """Connections waiting for their turn (for tests and stats)."""
        with self._lock:
            return len(self._queue)


class ProbeBook:
    """`OriginProbes` by origin, created on first use, for at most `MAX_ORIGINS` origins (`OriginBook`)
    (``scheduler``: see `OriginProbes`)."""

    def __init__(self, scheduler: _Scheduler | None = None) -> None:
        self._scheduler = scheduler
        self._origins: OriginBook[OriginProbes] = OriginBook(what="the probe deadline learnt")

    def of(self, origin: Origin, stats: GuardStats | None = None) -> OriginProbes:
        """``origin``'s entry; ``stats``: the account that counts an older origin forgotten to make room for it."""
        probes = self._origins.get(origin)
        if probes is not None:
            return probes
        return self._origins.of(origin, lambda: OriginProbes(origin, self._scheduler), account=stats)

    def forget(self) -> None:
        """Drop everything learnt (tests; a process that points the same origin at a different server)."""
        self._origins.forget()


TurnT = TypeVar("TurnT", bound=Turn)


class Admission(Generic[TurnT]):
    """A new connection's place in its origin's queue (``connect_admission``): taken before it is opened, left once
    it is probed (`leave`, whatever happened). ``waits``: it was not admitted at once; the drive loop then waits on
    ``turn`` (made in its own thread or event loop) until `admitted`, bounded by the connect timeout and by
    `hold_ends_in`, and leaving if cancelled, then reports `waited`; a wait that timed out fails the connect with
    `timeout_message`. ``hold``: how long a connect that has not returned holds the turn (the policy's
    ``probe_timeout``: a connect is one round trip, less than a probe's)."""

    __slots__ = ("_hold", "_probes", "_started", "_stats", "_ticket", "turn", "waits")

    def __init__(self, probes: OriginProbes, stats: GuardStats, turn: TurnT, *, hold: float) -> None:
        self._probes = probes
        self._stats = stats
        self._hold = hold
        self.turn = turn
        self._ticket = probes.take_ticket(turn)
        self.waits = not probes.admit(self._ticket, hold)
        self._started = time.monotonic()

    def admitted(self) -> bool:
        """Whether its turn has come (asked again after each wake-up of ``turn``)."""
        return self._probes.admit(self._ticket, self._hold)

    def hold_ends_in(self) -> float | None:
        """Seconds until the connects ahead stop holding the turn, if that is what it waits for (else None)."""
        return self._probes.hold_ends_in(self._ticket)

    def connected(self) -> None:
        """Its connect returned: the turn is held through the probe now."""
        self._probes.connected(self._ticket)

    def waited(self, admitted: bool) -> bool:
        """The wait for the turn ended: ``admitted``, and counted (`GuardStats.record_admission_wait`), or timed out,
        and the place given up. Returns ``admitted``."""
        if admitted:
            self._stats.record_admission_wait(time.monotonic() - self._started)
        else:
            self.leave()
        return admitted

    def timeout_message(self, bound: float | None) -> str:
        return (
            f"waited {bound:g} s (the connect timeout) for the other new connections to {self._probes.origin} to be "
            "probed first (connect_admission)"
        )

    def leave(self) -> None:
        """Give the place up: the connection is probed, failed, or was cancelled; wakes the next one in the queue."""
        self._probes.leave(self._ticket)
