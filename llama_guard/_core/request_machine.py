"""One guarded request's life across its attempts, as a state machine: the driver does the I/O, the machine decides.

Sans-I/O, as hishel's ``State.next()``: `RequestMachine.next(event)` takes what just happened and returns the next
`RequestAction`. Each stack's driver performs the action with its own I/O (``_drive/async_drive.py`` runs the one
loop, each stack gives it an `AttemptIO`) and reports the outcome as the next event::

    READY ──BEGIN──> SENDING ──Answered(503/429)──> READING_ERROR ──ERROR_BODY_READ──> WAITING or DELIVERING
                       │  ╰──Answered──> DELIVERING ──Delivered──> DONE (Done: the result)
                       ╰──Failed──> WAITING ──SLEPT──> SENDING      (or DONE: Fail, RERAISE)

A request's new connections during an attempt have machines of their own (``connection_machine.py``), which report
to the request's plan (``guard.py``): how far the attempt's new connection got (`RequestPlan.new_connection`, read
into the attempt's `ProgressTracker` when it fails) and what the probes found (`RequestPlan.failed_probes` and the
rest). A pair of state and event that cannot happen raises `UnexpectedEvent`: a driver that reports out of turn is a
bug, never guessed at.

Most requests never get a machine: their first attempt goes out as the caller built it and is answered, on a pooled
connection or on a new one, probed or not (`RequestPlan.as_is`, ``guard.py``). A machine is made when something
needs one (a failure, a 503/429), and then carries on from that first attempt.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from .decisions import (
    FailureKind,
    Progress,
    RequestKind,
    Verdict,
    classify_request,
    verdict_for_failure,
    verdict_for_status,
)
from .llama_server import RETRIED_STATUSES
from .log import logger
from .result import GuardResult
from .retry_pacing import RetryPacing

if TYPE_CHECKING:
    from .guard import RequestPlan

__all__ = [
    "MAX_RETRIED_ERROR_BODY",
    "MAX_SOCKET_WAIT",
    "BEGIN",
    "CANCELLED",
    "ERROR_BODY_READ",
    "READ_ERROR_BODY",
    "RERAISE",
    "SLEPT",
    "Answered",
    "Deliver",
    "Delivered",
    "Done",
    "Fail",
    "Failed",
    "ProgressTracker",
    "RequestAction",
    "RequestEvent",
    "RequestMachine",
    "RequestSignal",
    "RequestState",
    "RequestStep",
    "Send",
    "Sleep",
    "UnexpectedEvent",
    "retry_reason",
]


def _steps() -> dict[str, Progress | str]:
    """httpcore trace event names ("<module>.<step>.<phase>") -> what each says about an attempt."""
    steps: dict[str, Progress | str] = {
        "connection.connect_tcp.started": "connect",
        "connection.connect_unix_socket.started": "connect",
        "connection.connect_tcp.complete": Progress.CONNECTED,
        "connection.connect_unix_socket.complete": Progress.CONNECTED,
    }
    for module in ("http11", "http2"):
        steps[f"{module}.send_request_headers.started"] = Progress.WRITING
        steps[f"{module}.send_request_body.started"] = "body"
        steps[f"{module}.send_request_body.complete"] = Progress.WRITTEN
        steps[f"{module}.receive_response_headers.complete"] = Progress.HEADERS
    return steps


_STEPS: Final = _steps()


class ProgressTracker:
    """How far one attempt got, for the retry decision when it fails.

    Fed one of two ways:

    - ``hooked=True``: from what the guard's hooks on the pool's connections noted on the plan
      (`RequestPlan.new_connection`: being opened, then up and probed), made when the attempt fails: the hooks see
      each new connection and nothing else, so they cost nothing on a pooled connection. A failure on a connection
      that was up is then taken as "request written": httpcore writes as soon as it holds a connection, and nothing
      but the write and the read can fail after that. This tells "nothing sent" only where it matters (connect and
      probe failures) and errs on the side of "may have reached the server" everywhere else.
    - otherwise: from httpcore's trace event names (`observe`), for a wrapped transport whose pool the guard
      cannot reach.
    """

    __slots__ = ("body_started", "hooked", "new_connection", "progress", "saw_events")

    def __init__(self, *, hooked: bool = False) -> None:
        self.progress = Progress.NOTHING
        self.new_connection = False
        self.body_started = False
        self.saw_events = False
        self.hooked = hooked

    @property
    def reused_connection(self) -> bool:
        """The request went out on a pooled connection (no connect happened during this attempt)."""
        if self.hooked:
            return not self.new_connection
        return self.progress >= Progress.WRITING and not self.new_connection

    def connecting(self) -> None:
        self.saw_events = True
        self.new_connection = True

    def connected(self) -> None:
        """The new connection is up, and probed when the probe is on: nothing of the request is written yet."""
        self.progress = max(self.progress, Progress.CONNECTED)

    def observe(self, event: str) -> None:
        self.saw_events = True
        step = _STEPS.get(event)
        if step is None:
            return
        if isinstance(step, Progress):
            self.progress = max(self.progress, step)
        elif step == "connect":
            self.new_connection = True
        else:
            self.body_started = True

    def effective_progress(self) -> Progress:
        """Progress for retry decisions, assuming the worst where it is not known: the request was written."""
        if self.hooked:
            # Only a connect or a probe that failed is known to have sent nothing.
            connect_failed = self.new_connection and self.progress is Progress.NOTHING
            return Progress.NOTHING if connect_failed else Progress.WRITTEN
        return self.progress if self.saw_events else Progress.WRITTEN


# A retriable 503/429 is read and closed before the retry; a larger body means it is not llama-server's short
# JSON error, and the response goes to the caller instead.
MAX_RETRIED_ERROR_BODY: Final = 64 * 1024
# A sync socket refuses a timeout as large as some valid deadlines (OverflowError): cap what the guard hands it.
MAX_SOCKET_WAIT: Final = 1e6


class RequestState(enum.Enum):
    READY = "ready"  # nothing sent yet
    SENDING = "sending"  # an attempt is out: connecting, writing, or waiting for the response headers
    READING_ERROR = "reading error"  # a retriable 503/429's short body being read
    WAITING = "waiting"  # before the next attempt
    DELIVERING = "delivering"  # the response goes to the caller (its stream's connection dropped, if need be)
    DONE = "done"  # answered, failed or cancelled: no event is expected any more


# -- events: what the driver reports ------------------------------------------------------------------------------


class RequestSignal(enum.Enum):
    """The events that carry nothing but themselves."""

    BEGIN = "begin"  # send the request (its first attempt)
    ERROR_BODY_READ = "error body read"  # the retriable 503/429's body was read whole (its connection pooled again)
    SLEPT = "slept"  # the wait before the next attempt is over
    CANCELLED = "cancelled"  # the request was cancelled (or interrupted) while an action ran


BEGIN, ERROR_BODY_READ, SLEPT, CANCELLED = RequestSignal


@dataclass(frozen=True, slots=True)
class Answered:
    """The attempt's response headers arrived. ``streaming``: the response is a llama-server stream (chunked, or
    an event stream), whose connection the server closes after the final chunk."""

    status: int
    headers: Mapping[str, str]
    streaming: bool


@dataclass(frozen=True, slots=True)
class Failed:
    """The attempt failed with an error the driver maps to ``kind`` (None: not the network's, such as the caller's
    own trace callback raising: passed through as it is); ``error_name``: the class the caller would see;
    ``detail``: its message, nothing secret in it."""

    kind: FailureKind | None
    error_name: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Delivered:
    """The response is the caller's; ``closed``: its connection will not be reused (dropped after the stream, or
    closed by the header)."""

    closed: bool


RequestEvent: TypeAlias = Answered | Failed | Delivered | RequestSignal


# -- actions: what the driver does next ---------------------------------------------------------------------------


class RequestStep(enum.Enum):
    """The actions that carry nothing but themselves."""

    READ_ERROR_BODY = "read error body"  # read the 503/429's short body whole: its connection goes back to the pool,
    # and the caller still gets it if this was the last attempt
    RERAISE = "reraise"  # raise the last attempt's error as it is: it is not the network's


READ_ERROR_BODY, RERAISE = RequestStep


@dataclass(frozen=True, slots=True)
class Send:
    """Send one attempt: with ``Connection: close`` when ``close_connection``; with the response headers due within
    ``first_byte_deadline`` seconds when it is set (the caller's own read timeout then applies to the body only)."""

    attempt: int
    close_connection: bool
    first_byte_deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Deliver:
    """The last response goes to the caller; ``drop_stream``: shut its connection when the stream ends (a
    llama-server stream on a connection that was not closed by the header)."""

    drop_stream: bool


@dataclass(frozen=True, slots=True)
class Done:
    """The guard's account of the request, for the response the caller gets."""

    result: GuardResult


@dataclass(frozen=True, slots=True)
class Fail:
    """The guard stops: raise the last attempt's error as the guard's (same class), with ``message``."""

    message: str
    attempts: int
    elapsed: float
    history: tuple[str, ...]


RequestAction: TypeAlias = Send | Sleep | Deliver | Done | Fail | RequestStep


class UnexpectedEvent(RuntimeError):
    """A driver reported an event the machine cannot meet in its state."""


def retry_reason(verdict: Verdict | None) -> str:
    """Why a request is retried, for ``stats.retries_by_reason`` and the metrics: ``"stalled_connection"`` (a new
    connection failed its probe, or the first-byte deadline passed: llama-server's unread connections),
    ``"dead_connection"`` (a pooled connection the server had closed: its streams' keep-alive lie), ``"status"``
    (503 or 429), ``"slow_answer"`` (the first-byte deadline passed on a connection the server reads), or
    ``"connection_error"`` (any other failure before the response)."""
    if verdict is None:
        return "connection_error"
    if verdict.status:
        return "status"
    if verdict.stall:
        return "stalled_connection"
    if verdict.slow_answer:
        return "slow_answer"
    return "connection_error" if verdict.backoff else "dead_connection"


class RequestMachine:
    """The life of one guarded request (``plan``: its facts, `RequestPlan`)."""

    __slots__ = (
        "_kind",
        "_pacing",
        "attempts",
        "closed_by_header",
        "deadline_applied",
        "first_byte",
        "history",
        "plan",
        "reconnects",
        "state",
        "streaming",
        "tracker",
        "verdict",
    )
    _kind: RequestKind

    def __init__(self, plan: RequestPlan, *, sent: bool = False) -> None:
        """``sent``: the first attempt is out already, as the caller built it (`RequestPlan.as_is`): the machine
        begins there, in `RequestState.SENDING`."""
        self.plan = plan
        self.state = RequestState.SENDING if sent else RequestState.READY
        self.attempts = 1 if sent else 0
        self.reconnects = 0
        self.history: tuple[str, ...] = ()
        self.verdict: Verdict | None = None
        # How far the current attempt got: fed by its connection's machine (a new connection), else made at its
        # failure (a pooled connection: the hooks saw nothing), or by the trace path's events.
        self.tracker: ProgressTracker | None = None
        self.deadline_applied = False  # the current attempt waits for its headers under first_byte_timeout
        self.first_byte: float | None = None
        self.closed_by_header = False
        self.streaming = False  # the last response is a llama-server stream
        self._pacing: RetryPacing | None = None

    # -- what the machine is about ---------------------------------------------------------------------------------

    @property
    def kind(self) -> RequestKind:
        """Method, idempotency, inference endpoint, stream, replayable body: for retry decisions only."""
        try:
            return self._kind
        except AttributeError:  # the first time: the slot is empty
            request = self.plan.request
            self._kind = classify_request(request.method, request.url.path, self.plan.body)
            return self._kind

    @property
    def waiting_for_headers(self) -> bool:
        """The current attempt wrote its request (as far as the guard knows) and waits for the response headers: a
        read timeout now is the first-byte deadline's, when it applies."""
        return self._tracker().effective_progress() == Progress.WRITTEN

    def _tracker(self) -> ProgressTracker:
        """How far the current attempt got, once it failed: followed through the trace's events, or else made from
        what the plan noted of its new connection (none: it ran on a pooled one)."""
        tracker = self.tracker
        if tracker is None:
            tracker = self.tracker = ProgressTracker(hooked=True)
            new_connection = self.plan.new_connection
            if new_connection:
                tracker.connecting()
                if new_connection > 1:
                    tracker.connected()
        return tracker

    def follow_trace(self) -> ProgressTracker:
        """The current attempt is followed through httpcore's trace events (a pool the guard cannot hook): its
        tracker, fed by the events."""
        tracker = self.tracker = ProgressTracker()
        return tracker

    # -- the state machine ------------------------------------------------------------------------------------------

    def next(self, event: RequestEvent) -> RequestAction:
        key = event if type(event) is RequestSignal else type(event)
        handler = _TRANSITIONS.get((self.state, key))
        if handler is None:
            raise UnexpectedEvent(f"a request in state {self.state.value} cannot take {_name(key)}")
        return handler(self, event)

    def _on_begin(self, event: RequestSignal) -> RequestAction:
        self.state = RequestState.SENDING
        self.attempts += 1
        self.verdict = None
        self.tracker = None
        plan = self.plan
        plan.new_connection = 0
        deadline = plan.policy.first_byte_timeout
        if deadline is not None:
            # The first-byte deadline: the driver waits that long for the headers (httpcore's read timeout, looked up
            # for the headers and again for the body). A shorter read timeout of the caller's own stays in charge.
            caller_read = plan.caller_read_timeout()
            self.deadline_applied = caller_read is None or deadline < caller_read
        return Send(
            self.attempts,
            plan.close_connection,
            min(deadline, MAX_SOCKET_WAIT) if deadline is not None and self.deadline_applied else None,
        )

    def _on_answered(self, event: Answered) -> RequestAction:
        self.streaming = event.streaming
        if self._judge_response(event.status, event.headers):
            self.state = RequestState.READING_ERROR
            return READ_ERROR_BODY
        return self._deliver()

    def _on_failed(self, event: Failed) -> RequestAction:
        if event.kind is None:
            self.state = RequestState.DONE
            return RERAISE
        self._judge_failure(event.kind, event.error_name, event.detail)
        return self._after_outcome(answered=False)

    def _on_error_body_read(self, event: RequestSignal) -> RequestAction:
        return self._after_outcome(answered=True)

    def _on_error_body_failed(self, event: Failed) -> RequestAction:
        # Judged as the 503/429 it was: retried on its terms; the error is what the caller gets if the guard stops.
        return self._after_outcome(answered=False)

    def _on_delivered(self, event: Delivered) -> RequestAction:
        self.state = RequestState.DONE
        return Done(self.result(event.closed))

    def _on_cancelled(self, event: RequestSignal) -> RequestAction:
        self.state = RequestState.DONE
        return RERAISE

    def _after_outcome(self, *, answered: bool) -> RequestAction:
        """After an attempt was judged: wait and send again, or end with its outcome (a response, or an error)."""
        delay = self._next_delay()
        if delay is not None:
            self.state = RequestState.WAITING
            return Sleep(delay)
        if answered:
            return self._deliver()
        self.state = RequestState.DONE
        message, elapsed = self.final_message()
        return Fail(message, self.attempts, elapsed, self.history)

    def _deliver(self) -> Deliver:
        self.state = RequestState.DELIVERING
        return Deliver(self.streaming and self.plan.drops_streams)

    # -- verdicts ---------------------------------------------------------------------------------------------------

    def _judge_failure(self, kind: FailureKind, error_name: str, detail: str) -> None:
        """Record a failed attempt (``error_name``: the exception class the caller would see) and its verdict."""
        tracker = self._tracker()
        plan = self.plan
        plan.stats.add_error(error_name)
        progress = tracker.effective_progress()
        if kind is FailureKind.PROBE and plan.probe_verdict is not None:  # answered, then closed: no stall
            self.verdict, plan.probe_verdict = plan.probe_verdict, None
        else:
            self.verdict = verdict_for_failure(
                kind,
                progress=progress,
                reused_connection=tracker.reused_connection,
                connection_read=tracker.reused_connection or plan.new_connection == 3,
                body_started=tracker.body_started,
                request=self.kind,
                retry_non_idempotent=plan.policy.retry_non_idempotent,
            )
        self.pacing.follow(self.verdict, time.monotonic())
        where = "a reused" if tracker.reused_connection else "a new" if tracker.new_connection else "no"
        self.history += (
            f"attempt {self.attempts}: {error_name} on {where} connection "
            f"({progress.name.lower()}): {self.verdict.reason} [{detail[:160] or 'no detail'}]",
        )
        if self.verdict.retry and self.verdict.stall:
            self.reconnects += 1

    def _judge_response(self, status: int, headers: Mapping[str, str]) -> bool:
        """Judge a 503/429: True if the response is one to retry (``self.verdict`` says why)."""
        if status not in RETRIED_STATUSES:
            return False
        policy = self.plan.policy
        verdict = verdict_for_status(
            status,
            headers,
            request=self.kind,
            retry_non_idempotent=policy.retry_non_idempotent,
            max_retry_after=policy.max_retry_after,
        )
        if verdict is not None and verdict.retry:
            length = headers.get("content-length", "")
            if not length.isdigit() or int(length) > MAX_RETRIED_ERROR_BODY:
                verdict = Verdict(False, f"{status} with a body that is not a short error")
        self.verdict = verdict
        self.pacing.follow(verdict, time.monotonic())
        if verdict is None:
            return False
        self.history += (f"attempt {self.attempts}: HTTP {status}: {verdict.reason}",)
        return verdict.retry

    # -- pacing -------------------------------------------------------------------------------------------------------

    @property
    def pacing(self) -> RetryPacing:
        pacing = self._pacing
        if pacing is None:
            pacing = self._pacing = RetryPacing(self.plan.policy, self.plan.started)
        return pacing

    def _next_delay(self) -> float | None:
        """The wait before the next attempt, counted and logged; None when the guard stops."""
        verdict = self.verdict
        pacing = self.pacing
        plan = self.plan
        probe_deadline = plan.probe_deadline_used
        delay = pacing.next_delay(
            verdict,
            attempts=self.attempts,
            probe_deadline=plan.policy.probe_timeout if probe_deadline is None else probe_deadline,
            now=time.monotonic(),
        )
        if delay is None:
            return None
        assert verdict is not None
        # Counted when decided, with its log line: a retry cancelled during its wait (the caller's timeout during a
        # Retry-After) stays counted, as the log said it; a counter never goes down (Prometheus).
        plan.stats.record_retry(retry_reason(verdict), stall=verdict.stall)
        if pacing.loading_since is not None:
            of = f"waiting for the server to load, {time.monotonic() - pacing.loading_since:.1f} s of max_loading_wait"
        else:
            of = f"attempt {pacing.counted(self.attempts) + 1} of {plan.policy.max_attempts}"
        message = "retrying %s (%s) in %.2f s after %s" % (  # noqa: UP031 (the logging style)
            plan.description,
            of,
            delay,
            self.history[-1].partition(": ")[2] if self.history else "a failure",
        )
        if verdict.stall:
            plan.process.stalls.replaced(plan.origin, message)  # one WARNING per burst, each reconnect at DEBUG
        else:
            logger.warning("%s", message)
        return delay

    # -- the end ------------------------------------------------------------------------------------------------------

    def final_message(self, error_text: str = "") -> tuple[str, float]:
        """The guard's account for the caller's error once it stops (after ``error_text``, the error's own message,
        when given), and the seconds spent."""
        plan = self.plan
        elapsed = time.monotonic() - plan.started
        why = self.pacing.why_stopped(self.verdict, self.attempts)
        attempts = "1 attempt" if self.attempts == 1 else f"{self.attempts} attempts"
        if self.attempts > 1:
            logger.warning("giving up on %s after %s: %s", plan.description, attempts, why)
        account = f"[llama_guard: {plan.description}, {attempts} in {elapsed:.2f} s, {why}]"
        return (f"{error_text} {account}" if error_text else account), elapsed

    def result(self, connection_closed: bool) -> GuardResult:
        """The guard's account for the response, which has just been handed its headers."""
        plan = self.plan
        self.first_byte = first_byte = time.monotonic() - plan.started
        # Counted in stats.stream_connections_closed: a stream's connection closed by the header, whichever put it on
        # (the close strategy or stream_mode='close'); the close strategy's other requests are not.
        self.closed_by_header = plan.close_connection and plan.stream
        connection = plan.connection
        if not connection.final:
            plan.teach(request=first_byte)
        return GuardResult(
            attempts=self.attempts,
            reconnects=self.reconnects,
            first_byte_seconds=first_byte,
            stream=plan.stream,
            connection_closed=connection_closed or plan.close_connection,
            history=self.history,
            connection=connection.strategy,
        )

    def counted(self) -> None:
        """Count the request once, however it ended (the drive loop's last step)."""
        self.plan.stats.record_request(self.attempts, self.first_byte, self.closed_by_header)

    # -- what the request's connections report -----------------------------------------------------------------------

    def headers_received(self) -> None:
        """The current attempt's response headers had arrived when it failed (aiohttp reports a bad body that came
        with them before it hands the headers out): known, not assumed, to have got that far."""
        tracker = self._tracker()
        tracker.hooked = False
        tracker.saw_events = True
        tracker.progress = Progress.HEADERS


def _name(key: type | enum.Enum) -> str:
    return key.name if isinstance(key, enum.Enum) else key.__name__


_Handler: TypeAlias = Callable[[RequestMachine, Any], RequestAction]
_S = RequestState
# Every (state, event) pair a request can meet (an event's class, or a signal); any other raises UnexpectedEvent.
_TRANSITIONS: dict[tuple[RequestState, type | RequestSignal], _Handler] = {
    (_S.READY, BEGIN): RequestMachine._on_begin,
    (_S.READY, CANCELLED): RequestMachine._on_cancelled,
    (_S.SENDING, Answered): RequestMachine._on_answered,
    (_S.SENDING, Failed): RequestMachine._on_failed,
    (_S.SENDING, CANCELLED): RequestMachine._on_cancelled,
    (_S.READING_ERROR, ERROR_BODY_READ): RequestMachine._on_error_body_read,
    (_S.READING_ERROR, Failed): RequestMachine._on_error_body_failed,
    (_S.READING_ERROR, CANCELLED): RequestMachine._on_cancelled,
    (_S.WAITING, SLEPT): RequestMachine._on_begin,
    (_S.WAITING, CANCELLED): RequestMachine._on_cancelled,
    (_S.DELIVERING, Delivered): RequestMachine._on_delivered,
    (_S.DELIVERING, CANCELLED): RequestMachine._on_cancelled,
}
