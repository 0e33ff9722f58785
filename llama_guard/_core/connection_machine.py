"""A new connection of a guarded attempt, as a state machine: admitted, opened, probed, then handed to the request.

Sans-I/O: `ConnectionMachine.next(event)` returns the next `ConnectionAction`; the drive loop
(``_drive/async_drive.py``) performs it with the stack's I/O (`ConnectionIO`) and reports back. Three steps, each
only where it makes sense for the connection:

- **Admission** (``connect_admission``): while the origin recovers from a stall, its new connections are opened and
  probed one at a time (`Admit`; the queue is the origin's `OriginProbes`).
- **Open** (`OPEN`): the stack connects (TCP, and TLS when it does TLS within its connect); the time it took teaches the
  origin's ``"auto"`` connection strategy. A stack whose TLS handshake comes after its connect returns (httpcore)
  is told `AWAIT_TLS` and reports `TlsDone` later.
- **Probe** (``GET /health`` on the keep-alive strategy): written (`Write`), its answer read in slices (`Read`) while
  the deadline in force may change, kicks opened when due (`Kick`), given up at the deadline (`GiveUp`: the drive
  loop duplicates the socket for the late-answer watch and reports `Watched`). `READY`: the request may be written;
  `Abort`: close the connection and fail its connect (nothing of the request was sent).

Where a mechanism cannot work for this connection (a proxy in between, HTTP/2), the machine says so once per origin
and reason and in ``stats.probing_off``, and skips it: never silent.

    NEW ──Opening──> ADMITTING ──Admitted──> OPENING ──Opened──> WRITING ──WRITTEN──> READING ⇄ KICKING
     │                  ╰──NotAdmitted──> DONE (Abort)     │  ╰──> AWAITING_TLS ──TlsDone──> WRITING or DONE
     ╰──Opening──> OPENING (no admission)                 ╰──Opened──> DONE (READY: not probed)
                                                  READING ──Received──> DONE (READY, or Abort)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from .decisions import verdict_for_closed_probe
from .log import logger
from .probes import (
    PROBE_SLICE,
    Admission,
    GivenUpProbe,
    GivenUpWatches,
    OriginProbes,
    ProbeAnswer,
    ProbeExchange,
    ProbeProtocolError,
    probe_deadline,
)
from .request_machine import MAX_SOCKET_WAIT

if TYPE_CHECKING:
    from .connection_strategy import OriginConnections
    from .guard import RequestPlan

__all__ = [
    "KICK_CONNECT_TIMEOUT",
    "READ_SIZE",
    "AWAIT_TLS",
    "CANCELLED",
    "OPEN",
    "OPEN_FAILED",
    "READY",
    "TIMED_OUT",
    "WRITTEN",
    "Abort",
    "Admit",
    "Admitted",
    "Broken",
    "ConnectionAction",
    "ConnectionEvent",
    "ConnectionMachine",
    "ConnectionSignal",
    "ConnectionState",
    "ConnectionStep",
    "GiveUp",
    "Kick",
    "Kicked",
    "NotAdmitted",
    "Opened",
    "Opening",
    "Read",
    "Received",
    "TlsDone",
    "UnexpectedEvent",
    "Watched",
    "Write",
]

# How much a driver reads at a time: more than any answer to GET /health (a few hundred bytes).
READ_SIZE: Final = 65536
# A kick connection that does not connect within this is counted as failed.
KICK_CONNECT_TIMEOUT: Final = 1.0
# A probe's first kick goes at the origin's learnt deadline or at this fraction of its own deadline, if sooner (0.125
# s of the default 0.5 s), and its kicks are never further apart: a kick serves the oldest stalled connection, maybe
# another probe's, so every probe kicks at least 3 times before its give-up (doubling from a late start gave 1 or 2).
KICK_FRACTION: Final = 0.25


class ConnectionState(enum.Enum):
    NEW = "new"  # about to be opened
    ADMITTING = "admitting"  # waiting for its turn in the origin's queue
    OPENING = "opening"  # the stack connects
    AWAITING_TLS = "awaiting TLS"  # connected; the stack's TLS handshake comes later
    WRITING = "writing"  # GET /health being written
    READING = "reading"  # waiting for its answer
    KICKING = "kicking"  # a kick connection being opened (the probe still waits for its answer)
    GIVING_UP = "giving up"  # the probe's deadline passed: the socket is being kept for the late-answer watch
    DONE = "done"  # ready, or aborted: no event is expected any more


# -- events: what the driver reports ------------------------------------------------------------------------------


class ConnectionSignal(enum.Enum):
    """The events that carry nothing but themselves."""

    OPEN_FAILED = "open failed"  # the stack's connect (or TLS handshake) raised: its error goes on as it is
    WRITTEN = "written"  # the probe's request was written whole
    TIMED_OUT = "timed out"  # the write, or the read slice, passed its timeout
    CANCELLED = "cancelled"  # the attempt was cancelled (or interrupted) while an action ran


OPEN_FAILED, WRITTEN, TIMED_OUT, CANCELLED = ConnectionSignal


@dataclass(frozen=True, slots=True)
class Opening:
    """A new connection is about to be opened for the request's current attempt.

    ``direct``: to the origin itself, not to a proxy (``proxy`` names it, for the warning); ``http1``: the pool
    speaks HTTP/1.1 (not HTTP/2 only: h2c with prior knowledge); ``tls_later``: the stack's TLS handshake comes
    after its connect returns (no admission then: its turn could not be given back if the handshake never came);
    ``admits``: the driver can wait for a turn here (not inside a trace callback); ``kick_path``: a Unix socket
    to kick through instead of the origin's TCP address; ``kick_host``: the host kicks go to (default: the
    request's)."""

    direct: bool = True
    proxy: str | None = None
    http1: bool = True
    tls_later: bool = False
    admits: bool = True
    kick_path: str | None = None
    kick_host: str | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """Its turn came (or came at once)."""

    admission: Admission[Any]


@dataclass(frozen=True, slots=True)
class NotAdmitted:
    """Its turn did not come within the connect timeout (``bound`` seconds); the place was given up."""

    admission: Admission[Any]
    bound: float | None


@dataclass(frozen=True, slots=True)
class Opened:
    """The stack connected (and did TLS, unless `Opening.tls_later`). ``h2``: the connection negotiated HTTP/2
    (ALPN, or the stack's HTTP/2 connection class); ``socket``: its socket, or a backend's wrapper of one, for the
    late-answer watch (None: it has none)."""

    h2: bool = False
    socket: Any = None


@dataclass(frozen=True, slots=True)
class TlsDone:
    """The TLS handshake the stack did after its connect is done (`Opened`'s fields, of the TLS connection)."""

    h2: bool = False
    socket: Any = None


@dataclass(frozen=True, slots=True)
class Received:
    """Bytes read from the connection (``b""``: the server closed it)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Kicked:
    """The kick connection was opened and closed, or (``failure``) could not be opened."""

    failure: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Broken:
    """Writing or reading failed (a network error, or the stack's protocol error)."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Watched:
    """The given-up connection is kept for its late-answer watch: ``peek`` looks for an answer without reading,
    ``close`` closes it; ``unseen`` says why no answer can be seen, when one could have come."""

    peek: Callable[[], bool | None]
    close: Callable[[], None]
    unseen: str | None = None


ConnectionEvent: TypeAlias = (
    Opening | Admitted | NotAdmitted | Opened | TlsDone | Received | Kicked | Broken | Watched | ConnectionSignal
)


# -- actions: what the driver does next ---------------------------------------------------------------------------


class ConnectionStep(enum.Enum):
    """The actions that carry nothing but themselves: the stack's own steps, between which the machine waits."""

    OPEN = "open"  # connect (the stack's own connect)
    AWAIT_TLS = "await TLS"  # hand the connection to the stack for its TLS handshake; report `TlsDone` after it
    READY = "ready"  # the request may be written to the connection


OPEN, AWAIT_TLS, READY = ConnectionStep


@dataclass(frozen=True, slots=True)
class Admit:
    """Take a place in the origin's queue and wait for the turn, within the connect timeout (`Admission`)."""

    probes: Any  # the origin's OriginProbes
    stats: Any  # where the wait is counted
    hold: float  # how long a connect that has not returned holds the turn (Admission)


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
    """Open a bare connection to ``host:port`` (or the Unix socket ``path``) within ``timeout`` and close it at once,
    writing nothing: accepting it makes llama-server's pool (before b11737) spawn a thread, which serves the oldest
    unread connection first."""

    host: str
    port: int
    path: str | None = None
    timeout: float = KICK_CONNECT_TIMEOUT


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Keep the connection's socket for the late-answer watch (duplicated, half closed) and report `Watched`."""

    socket: Any


@dataclass(frozen=True, slots=True)
class Abort:
    """Close the connection (if open) and fail its connect: the stack's ProbeTimeout (``reason="probe timeout"``),
    ProbeError (``"probe error"``) or ConnectTimeout (``"connect timeout"``: no turn in time), with ``message``;
    or (``"raised"``: the open failed, or the attempt was cancelled) let the stack's own error go on."""

    reason: str
    message: str


ConnectionAction: TypeAlias = Admit | Write | Read | Kick | GiveUp | Abort | ConnectionStep


class UnexpectedEvent(RuntimeError):
    """A driver reported an event the connection cannot meet in its state."""


class ConnectionMachine:
    """One new connection of the current attempt of ``plan``'s request.

    It reports to the plan (`RequestPlan.opening`, `opened`, and what its probe found: ``failed_probes`` and the
    rest), not to the request's machine: an attempt sent as it is has none, and its new connection needs none."""

    __slots__ = (
        "_admission",
        "_caller_read",
        "_clock",
        "_connect_seconds",
        "_deadline",
        "_exchange",
        "_kick_host",
        "_kick_path",
        "_kicks",
        "_measures",
        "_number",
        "_probes",
        "_probing",
        "_sample",
        "_socket",
        "_started",
        "_tls_later",
        "_watches",
        "opening_started",
        "plan",
        "state",
    )

    def __init__(
        self,
        plan: RequestPlan,
        *,
        watches: GivenUpWatches | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``watches``: where a given-up connection's watch is kept, to be ended when its owner closes (default: the
        request's guard's)."""
        self.plan = plan
        self._watches = watches
        self._clock = clock
        self.state = ConnectionState.NEW
        self._admission: Admission[Any] | None = None
        # The origin's probe book and the caller's read timeout, looked up once (`_on_opening`, the only handler of
        # NEW, and `_start_probe`): a probe consults them at every step, and each lookup through the plan is a hash
        # and two calls.
        self._probes: OriginProbes
        self._caller_read: float | None = None
        self._probing = False
        # While auto measures: whether this connection teaches what it cost, and the origin's measurements when its
        # probe takes a sample (`OriginConnections.start_sample`).
        self._measures = False
        self._sample: OriginConnections | None = None
        self._tls_later = False
        self._kick_host: str | None = None
        self._kick_path: str | None = None
        self._socket: Any = None
        self._exchange: ProbeExchange | None = None
        self._number = 0
        self._kicks = 0
        self._started = 0.0
        self._deadline = 0.0
        self._connect_seconds: float | None = None  # what opening it cost, to teach with its probe's round trip
        self.opening_started = 0.0

    @property
    def done(self) -> bool:
        return self.state is ConnectionState.DONE

    @property
    def kicks(self) -> int:
        """Kick connections opened for this connection's probe."""
        return self._kicks

    def next(self, event: ConnectionEvent) -> ConnectionAction:
        key = event if type(event) is ConnectionSignal else type(event)
        handler = _TRANSITIONS.get((self.state, key))
        if handler is None:
            name = key.name if isinstance(key, ConnectionSignal) else key.__name__
            raise UnexpectedEvent(f"a connection in state {self.state.value} cannot take {name}")
        return handler(self, event)

    # -- admission and open -----------------------------------------------------------------------------------------

    def _on_opening(self, event: Opening) -> ConnectionAction:
        plan = self.plan
        plan.opening()
        self.opening_started = self._clock()
        self._tls_later = event.tls_later
        self._kick_host, self._kick_path = event.kick_host, event.kick_path
        probing = plan.probing
        if probing and not event.direct:
            self._probing_off(
                f"they go through a proxy at {event.proxy} (HTTP, CONNECT or SOCKS), whose connections are not "
                "llama-server's"
            )
            probing = False
        if probing and not event.http1:
            self._probing_off(
                "the pool speaks HTTP/2 only (h2c with prior knowledge, http1=False), unlike llama-server"
            )
            probing = False
        origin = plan.origin
        process = plan.guard.process
        probing = probing and origin not in plan.guard.unprobeable
        if not plan.connection.final:  # auto measures: only the connections that take a sample are probed
            self._measures = True
            if probing:
                sample = process.connections.of(origin, plan.stats)
                if sample.start_sample():
                    self._sample = sample
                else:  # its connect alone would read cheaper than the probed samples: it teaches nothing
                    probing = self._measures = False
        self._probing = probing
        probes = self._probes = process.probes.of(origin, plan.stats)
        if self._probing and event.admits and not event.tls_later and probes.admission_needed(plan.policy):
            self.state = ConnectionState.ADMITTING
            return Admit(probes, plan.stats, plan.policy.probe_timeout)
        self.state = ConnectionState.OPENING
        return OPEN

    def _on_admitted(self, event: Admitted) -> ConnectionAction:
        self._admission = event.admission
        self.state = ConnectionState.OPENING
        return OPEN

    def _on_not_admitted(self, event: NotAdmitted) -> ConnectionAction:
        self.state = ConnectionState.DONE
        return Abort("connect timeout", event.admission.timeout_message(event.bound))

    def _on_open_failed(self, event: ConnectionSignal) -> ConnectionAction:
        self._end()
        return Abort("raised", "")

    def _on_opened(self, event: Opened | TlsDone) -> ConnectionAction:
        if self._admission is not None and isinstance(event, Opened):
            self._admission.connected()
        if self._tls_later and isinstance(event, Opened):
            self.state = ConnectionState.AWAITING_TLS
            return AWAIT_TLS
        connect_seconds = self._clock() - self.opening_started if self._measures else None
        if self._probing and event.h2:
            # Not llama-server (HTTP/1.1 only); an HTTP/1.1 probe would break the HTTP/2 connection.
            self._probing_off("the connection negotiated HTTP/2 (ALPN h2), which llama-server does not speak")
            self._probing = False
        if not self._probing:
            if connect_seconds is not None:  # not probed: its connect alone
                self.plan.teach(connect_cost=connect_seconds)
            return self._ready()
        self._socket = event.socket
        self._connect_seconds = connect_seconds
        return self._start_probe()

    # -- the probe ----------------------------------------------------------------------------------------------------

    def _start_probe(self) -> ConnectionAction:
        plan = self.plan
        self._number = self._probes.probe_started()
        self._kicks = 0
        self._exchange = ProbeExchange(plan.host_header)
        self._caller_read = plan.caller_read_timeout()
        self._deadline = self._probe_deadline()
        self._started = self._clock()
        self.state = ConnectionState.WRITING
        return Write(self._exchange.request_bytes(), self._deadline)

    def _probe_deadline(self) -> float:
        """This probe's deadline: the origin's learnt one for a request's first probe, the configured ladder
        (`probe_deadline`) after one was given up, or with kicks on (the learnt deadline is then when the first kick
        goes: `_next_kick`); never longer than the caller's own read timeout."""
        plan = self.plan
        policy = plan.policy
        if plan.failed_probes or policy.probe_kick:
            # The learnt deadline is for a first probe only: a request whose probe was given up waits the configured
            # ladder from then on, so a server that turned slow since the guard learnt (load arriving) costs that
            # request a reconnect, never its attempts (the late answer raises the learnt deadline for the next ones).
            deadline = probe_deadline(plan.failed_probes, first=policy.probe_timeout, cap=policy.probe_timeout_max)
        else:
            deadline = self._probes.deadline(policy)
        caller_read = self._caller_read
        if caller_read is not None and caller_read < deadline:
            deadline = caller_read
        deadline = min(deadline, MAX_SOCKET_WAIT)
        plan.probe_deadline_used = deadline
        return deadline

    def _next_kick(self) -> float | None:
        """Seconds into the probe at which it opens its next kick (`GuardPolicy.probe_kick`): the origin's learnt
        deadline, then 2, 4, 8... times it, but the first no later and the spacing never wider than a quarter of the
        probe's own deadline (`KICK_FRACTION`). None when no kick comes before the give-up."""
        plan = self.plan
        if not plan.policy.probe_kick:
            return None
        widest = self._deadline * KICK_FRACTION
        # Nothing learnt below the deadline (too few answers yet, learning off; as in a burst whose served
        # connections are too few to learn from) still kicks: a kick costs one short connection, a stall the deadline.
        at = min(self._probes.deadline(plan.policy), widest)
        for _ in range(self._kicks):
            at += min(at, widest)
        return at if at < self._deadline else None

    def _on_written(self, event: ConnectionSignal) -> ConnectionAction:
        return self._wait()

    def _on_write_timed_out(self, event: ConnectionSignal) -> ConnectionAction:
        return self._give_up()

    def _on_read_slice_passed(self, event: ConnectionSignal) -> ConnectionAction:
        self._probes.check_given_up()  # while probes wait, given-up ones are watched
        return self._wait()

    def _on_kicked(self, event: Kicked) -> ConnectionAction:
        self._kicks += 1
        plan = self.plan
        self._probes.kicked()
        if event.failure is None:
            plan.stats.add(probe_kicks=1)
        else:
            plan.stats.add(probe_kicks=1, probe_kicks_failed=1)
            logger.debug("kick connection to %s failed: %s", plan.origin, event.failure)
            plan.process.warnings.warning(
                f"kick connections to {plan.origin} fail ({type(event.failure).__name__}): a connection "
                "the server left unread is given up at probe_timeout and replaced instead of rescued; "
                "stats.probe_kicks_failed counts them (GuardPolicy(probe_kick=False) turns kicks off)"
            )
        return self._wait()

    def _on_received(self, event: Received) -> ConnectionAction:
        assert self._exchange is not None
        try:
            answer = self._exchange.feed(event.data)
        except ProbeProtocolError as error:
            return self._on_broken(Broken(error))
        if answer is None:
            return self._wait()
        return self._answered(answer)

    def _on_broken(self, event: Broken) -> ConnectionAction:
        self._probe_failed()
        self._end()
        return Abort("probe error", f"the probe of a new connection to {self.plan.origin} failed: {event.error}")

    def _on_cancelled(self, event: ConnectionSignal) -> ConnectionAction:
        if self._exchange is not None:  # the probe was sent: neither answered nor failed
            self._probes.probe_failed(self._number)
        self._end()
        return Abort("raised", "")

    def _on_watched(self, event: Watched) -> ConnectionAction:
        plan = self.plan
        seconds = self._elapsed()
        plan.failed_probes += 1
        plan.stats.record_probe(seconds, answered=False, given_up=True)
        if event.unseen is not None:
            why = (
                f"a connection whose probe was given up could not be watched for a late answer: {event.unseen}; "
                "such false alarms go uncounted (probes_answered_late) and do not raise the learnt probe deadline"
            )
            plan.stats.late_answers_unseen = why
            plan.process.warnings.warning(why)
        watch: GivenUpProbe = self._probes.probe_given_up(
            self._number,
            event.peek,
            plan.stats,
            self._clock() - seconds,
            watch=plan.policy.probe_timeout_max,
            close=event.close,
        )
        (self._watches if self._watches is not None else plan.guard.given_up).add(watch)
        self._end()
        return Abort(
            "probe timeout",
            f"new connection to {plan.origin} did not answer GET /health within {self._deadline:.3g} s: the server "
            "is not reading it (llama-server before b11737 under a burst of connections); reconnecting",
        )

    # -- shared steps -------------------------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        return self._clock() - self._started

    def _wait(self) -> ConnectionAction:
        """Wait for the answer: a read slice, or a kick when one is due; give up at the deadline in force, which
        may change while the probe waits (other probes of the origin are answered)."""
        plan = self.plan
        self._deadline = self._probe_deadline()
        elapsed = self._elapsed()
        remaining = self._deadline - elapsed
        if remaining <= 0:
            return self._give_up()
        if self._admission is not None and elapsed >= plan.policy.probe_timeout:
            # A later probe of a request waits the ladder's longer deadlines; the origin's turn is held no longer than
            # a first probe's, so one stalled connection does not keep the others queued behind it for seconds.
            self._leave_admission()
        kick = self._next_kick()
        if kick is not None:
            if elapsed >= kick:
                self.state = ConnectionState.KICKING
                return Kick(self._kick_host or plan.request.url.host, plan.origin.port, self._kick_path)
            remaining = min(remaining, kick - elapsed)
        self.state = ConnectionState.READING
        return Read(min(remaining, PROBE_SLICE))

    def _give_up(self) -> ConnectionAction:
        self.state = ConnectionState.GIVING_UP
        return GiveUp(self._socket)

    def _answered(self, answer: ProbeAnswer) -> ConnectionAction:
        plan = self.plan
        seconds = self._elapsed()
        if answer.keep_alive:
            rescued = self._kicks > 0
            plan.stats.record_probe(seconds, answered=True, rescued=rescued)
            if rescued:  # one WARNING per burst, each rescue at DEBUG
                plan.process.stalls.rescued(
                    plan.origin,
                    f"{plan.description}: the new connection answered its probe after {seconds:.2f} s and "
                    f"{self._kicks} kick{'s' if self._kicks > 1 else ''}",
                )
            self._probes.probe_answered(seconds, self._number)
            if self._connect_seconds is not None and not rescued:  # a rescued probe timed the stall, not the network
                plan.teach(connect_cost=self._connect_seconds + seconds)
            return self._ready(read=True)
        # An answer that closes the connection fails the probe (counted with the ProbeError it raises).
        self._probe_failed()
        self._probe_closed(answer.status)
        self._end()
        return Abort(
            "probe error", f"{plan.origin} answered GET /health with {answer.status} and closed the connection"
        )

    def _probe_failed(self) -> None:
        plan = self.plan
        plan.failed_probes += 1
        plan.stats.record_probe(self._elapsed(), answered=False)
        self._probes.probe_failed(self._number)

    def _probe_closed(self, status: int) -> None:
        """The server answered the probe with ``status`` and closed the connection: that connection is lost."""
        plan = self.plan
        # llama-server answers 503 with Connection: close while it loads a model: the server is reading new
        # connections, so this request's next attempts go unprobed: the request itself then gets the server's answer
        # (a 503 "Loading model", retried on its own terms, and handed to the caller if it lasts) instead of failing
        # probe after probe.
        plan.server_reads_connections = True
        plan.probe_verdict = verdict_for_closed_probe(status)
        if 200 <= status < 300:
            # A healthy server that closes every probed connection: probing can never leave a usable one there.
            plan.guard.unprobeable.add(plan.origin)
            self._probing_off(
                f"{plan.origin} closes connections after answering GET /health ({status}), so a probed connection "
                "cannot be kept: probing disabled for this origin"
            )

    def _probing_off(self, why: str) -> None:
        """This connection cannot be probed although the request probes (``why``: the kind of connection): said once
        per origin and reason, and in ``stats.probing_off``."""
        plan = self.plan
        text = f"new connections to {plan.origin} are not probed: {why}"
        plan.stats.probing_off = text
        plan.process.warnings.warning(
            f"{text}; a connection llama-server leaves unread is not caught there (retries and stream "
            "handling still apply)"
        )

    def _ready(self, *, read: bool = False) -> ConnectionStep:
        self._end()
        self.plan.opened(read=read)
        return READY

    def _end(self) -> None:
        self.state = ConnectionState.DONE
        sample = self._sample
        if sample is not None:
            self._sample = None
            sample.end_sample()
        self._leave_admission()

    def _leave_admission(self) -> None:
        admission = self._admission
        if admission is not None:
            self._admission = None
            admission.leave()  # wakes the next connection waiting for its turn


_Handler: TypeAlias = Callable[[ConnectionMachine, Any], ConnectionAction]
_S = ConnectionState
# Every (state, event) pair a connection can meet (an event's class, or a signal); any other raises UnexpectedEvent.
_TRANSITIONS: dict[tuple[ConnectionState, type | ConnectionSignal], _Handler] = {
    (_S.NEW, Opening): ConnectionMachine._on_opening,
    (_S.ADMITTING, Admitted): ConnectionMachine._on_admitted,
    (_S.ADMITTING, NotAdmitted): ConnectionMachine._on_not_admitted,
    (_S.ADMITTING, CANCELLED): ConnectionMachine._on_cancelled,
    (_S.OPENING, Opened): ConnectionMachine._on_opened,
    (_S.OPENING, OPEN_FAILED): ConnectionMachine._on_open_failed,
    (_S.OPENING, CANCELLED): ConnectionMachine._on_cancelled,
    (_S.AWAITING_TLS, TlsDone): ConnectionMachine._on_opened,
    (_S.AWAITING_TLS, OPEN_FAILED): ConnectionMachine._on_open_failed,
    (_S.AWAITING_TLS, CANCELLED): ConnectionMachine._on_cancelled,
    (_S.WRITING, WRITTEN): ConnectionMachine._on_written,
    (_S.WRITING, TIMED_OUT): ConnectionMachine._on_write_timed_out,
    (_S.WRITING, Broken): ConnectionMachine._on_broken,
    (_S.WRITING, CANCELLED): ConnectionMachine._on_cancelled,
    (_S.READING, Received): ConnectionMachine._on_received,
    (_S.READING, TIMED_OUT): ConnectionMachine._on_read_slice_passed,
    (_S.READING, Broken): ConnectionMachine._on_broken,
    (_S.READING, CANCELLED): ConnectionMachine._on_cancelled,
    (_S.KICKING, Kicked): ConnectionMachine._on_kicked,
    (_S.KICKING, CANCELLED): ConnectionMachine._on_cancelled,
    (_S.GIVING_UP, Watched): ConnectionMachine._on_watched,
    (_S.GIVING_UP, CANCELLED): ConnectionMachine._on_cancelled,
}
