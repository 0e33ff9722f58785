"""The probe of one new connection as a state machine: the driver performs the I/O it is told, and reports back.

Sans-I/O, as hishel's ``State.next()``: ``ProbeMachine.next(event)`` returns the next `ProbeAction`, and every
decision (the deadline in force, when to kick, when to give up, what an answer means, what is counted) is made here
and in `RequestState`. A driver is a short loop over its own stream::

    machine = ProbeMachine(run, socket=raw_socket)
    action = machine.next(Start())
    while True:
        if isinstance(action, Write):     write action.data within action.timeout -> Written() / TimedOut() / Broken(e)
        elif isinstance(action, Read):    read within action.timeout -> Received(data) / TimedOut() / Broken(e)
        elif isinstance(action, Kick):    open a TCP connection to action.host:action.port and close it -> Kicked(e)
        elif isinstance(action, Usable):  the probe passed: return
        elif isinstance(action, Abort):   close the connection, keep action.watch, raise (ProbeTimeout if timed_out)
        action = machine.next(event)

A cancelled driver sends `Cancelled()` before re-raising (the machine then forgets its probe). A pair of state and
event that cannot happen raises `UnexpectedEvent`: a driver that reports out of turn is a bug, never guessed at.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from .late_answers import WatchedConnection
from .origin_probes import PROBE_SLICE, GivenUpProbe
from .probe import ProbeAnswer, ProbeExchange, ProbeProtocolError

__all__ = [
    "Abort",
    "Broken",
    "Cancelled",
    "Kick",
    "KICK_CONNECT_TIMEOUT",
    "Kicked",
    "ProbeAction",
    "ProbeEvent",
    "ProbeMachine",
    "ProbeState",
    "Read",
    "READ_SIZE",
    "Received",
    "Start",
    "TimedOut",
    "UnexpectedEvent",
    "Usable",
    "Write",
    "Written",
]

# How much a driver reads at a time: more than any answer to GET /health (a few hundred bytes).
READ_SIZE = 65536
# A kick connection that does not connect within this is counted as failed.
KICK_CONNECT_TIMEOUT = 1.0


class ProbeState(enum.Enum):
    IDLE = "idle"  # nothing sent yet
    WRITING = "writing"  # GET /health being written
    READING = "reading"  # waiting for the answer
    KICKING = "kicking"  # a kick connection being opened (the probe still waits for its answer)
    DONE = "done"  # usable, or aborted: no event is expected any more


# -- events: what the driver reports ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """The connection is ready for HTTP (connected, TLS done): begin."""


@dataclass(frozen=True, slots=True)
class Written:
    """The probe's request was written whole."""


@dataclass(frozen=True, slots=True)
class Received:
    """Bytes read from the connection (``b""``: the server closed it)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The write, or the read slice, passed its timeout."""


@dataclass(frozen=True, slots=True)
class Kicked:
    """The kick connection was opened and closed, or (``failure``) could not be opened."""

    failure: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Broken:
    """Writing or reading failed (a network error, or the stack's protocol error)."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The probe's request was cancelled while it ran."""


ProbeEvent: TypeAlias = Start | Written | Received | TimedOut | Kicked | Broken | Cancelled


# -- actions: what the driver does next ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write:
    data: bytes
    timeout: float


@dataclass(frozen=True, slots=True)
class Read:
    """Read up to `READ_SIZE` bytes within ``timeout`` seconds."""

    timeout: float


@dataclass(frozen=True, slots=True)
class Kick:
    """Open a bare TCP connection to ``host:port`` within ``timeout`` and close it at once, writing nothing:
    accepting it makes llama-server's pool (before b11737) spawn a thread, which serves the oldest unread
    connection first."""

    host: str
    port: int
    timeout: float = KICK_CONNECT_TIMEOUT


@dataclass(frozen=True, slots=True)
class Usable:
    """The server answered and keeps the connection: the request may be written to it."""


@dataclass(frozen=True, slots=True)
class Abort:
    """The probe failed: close the connection and raise the stack's ProbeTimeout (``timed_out``) or ProbeError
    with ``message``. ``watch``: a given-up connection's late-answer watch, for the driver's `GivenUpWatches`;
    ``unprobeable``: the origin closes every probed connection, so the driver stops probing it."""

    timed_out: bool
    message: str
    watch: GivenUpProbe | None = None
    unprobeable: bool = False


ProbeAction: TypeAlias = Write | Read | Kick | Usable | Abort


class UnexpectedEvent(RuntimeError):
    """A driver reported an event the probe cannot meet in its state."""


class ProbeMachine:
    """One probe of one new connection (``run``: the `RequestState` of the request that opened it)."""

    __slots__ = ("_clock", "_deadline", "_exchange", "_kick_host", "_run", "_socket", "_started", "state")

    def __init__(
        self, run: Any, *, socket: Any = None, kick_host: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``socket``: the connection's socket (or a backend's wrapper of one), duplicated if the probe is given up
        so that a late answer is still seen; ``kick_host``: where kick connections go (default: the origin's host,
        as the request's URL spells it)."""
        self._run = run
        self._socket = socket
        self._kick_host = kick_host
        self._clock = clock
        self._exchange = ProbeExchange(run.host_header)
        self._started = 0.0
        self._deadline = 0.0
        self.state = ProbeState.IDLE

    def next(self, event: ProbeEvent) -> ProbeAction:
        handler = _TRANSITIONS.get((self.state, type(event)))
        if handler is None:
            raise UnexpectedEvent(f"a probe in state {self.state.value} cannot take {type(event).__name__}")
        return handler(self, event)

    # -- transitions ----------------------------------------------------------------------------------------------

    def _on_start(self, event: Start) -> ProbeAction:
        run = self._run
        run.probe_started()
        self._deadline = run.next_probe_deadline()
        self._started = self._clock()
        self.state = ProbeState.WRITING
        return Write(self._exchange.request_bytes(), self._deadline)

    def _on_written(self, event: Written) -> ProbeAction:
        return self._wait()

    def _on_write_timed_out(self, event: TimedOut) -> ProbeAction:
        return self._give_up()

    def _on_read_slice_passed(self, event: TimedOut) -> ProbeAction:
        self._run.origin_probes.check_given_up()  # while probes wait, given-up ones are watched
        return self._wait()

    def _on_kicked(self, event: Kicked) -> ProbeAction:
        self._run.probe_kicked(event.failure)
        return self._wait()

    def _on_received(self, event: Received) -> ProbeAction:
        try:
            answer = self._exchange.feed(event.data)
        except ProbeProtocolError as error:
            return self._on_broken(Broken(error))
        if answer is None:
            return self._wait()
        return self._answered(answer)

    def _on_broken(self, event: Broken) -> ProbeAction:
        self.state = ProbeState.DONE
        self._run.probe_failed(self._elapsed())
        return Abort(False, f"the probe of a new connection to {self._run.origin} failed: {event.error}")

    def _on_cancelled(self, event: Cancelled) -> ProbeAction:
        self.state = ProbeState.DONE
        self._run.probe_abandoned()
        return Abort(False, f"the probe of a new connection to {self._run.origin} was cancelled")

    # -- shared steps ---------------------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return self._clock() - self._started

    def _wait(self) -> ProbeAction:
        """Wait for the answer: a read slice, or a kick when one is due; give up at the deadline in force, which
        may change while the probe waits (other probes of the origin are answered)."""
        run = self._run
        self._deadline = run.next_probe_deadline()
        elapsed = self._elapsed()
        remaining = self._deadline - elapsed
        if remaining <= 0:
            return self._give_up()
        kick_now, remaining = run.probe_wait(elapsed, remaining)
        if kick_now:
            self.state = ProbeState.KICKING
            return Kick(self._kick_host or run.request.url.host, run.origin.port)
        self.state = ProbeState.READING
        return Read(min(remaining, PROBE_SLICE))

    def _give_up(self) -> ProbeAction:
        self.state = ProbeState.DONE
        run = self._run
        watch = run.probe_given_up(self._elapsed(), WatchedConnection.of(self._socket))
        return Abort(
            True,
            f"new connection to {run.origin} did not answer GET /health within {self._deadline:.3g} s: the server "
            "is not reading it (llama-server before b11737 under a burst of connections); reconnecting",
            watch,
        )

    def _answered(self, answer: ProbeAnswer) -> ProbeAction:
        self.state = ProbeState.DONE
        run = self._run
        if answer.keep_alive:
            run.probe_answered(self._elapsed())
            return Usable()
        # An answer that closes the connection fails the probe (counted with the ProbeError it raises).
        run.probe_failed(self._elapsed())
        unprobeable = run.probe_closed(answer.status)
        return Abort(
            False,
            f"{run.origin} answered GET /health with {answer.status} and closed the connection",
            None,
            unprobeable,
        )


_Handler: TypeAlias = Callable[[ProbeMachine, Any], ProbeAction]
_S = ProbeState
# Every (state, event) pair a probe can meet; any other raises UnexpectedEvent.
_TRANSITIONS: dict[tuple[ProbeState, type], _Handler] = {
    (_S.IDLE, Start): ProbeMachine._on_start,
    (_S.WRITING, Written): ProbeMachine._on_written,
    (_S.WRITING, TimedOut): ProbeMachine._on_write_timed_out,
    (_S.WRITING, Broken): ProbeMachine._on_broken,
    (_S.WRITING, Cancelled): ProbeMachine._on_cancelled,
    (_S.READING, Received): ProbeMachine._on_received,
    (_S.READING, TimedOut): ProbeMachine._on_read_slice_passed,
    (_S.READING, Broken): ProbeMachine._on_broken,
    (_S.READING, Cancelled): ProbeMachine._on_cancelled,
    (_S.KICKING, Kicked): ProbeMachine._on_kicked,
    (_S.KICKING, Cancelled): ProbeMachine._on_cancelled,
}
