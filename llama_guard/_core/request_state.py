"""One guarded request across its attempts: counting, retry verdicts, the retry schedule, probe deadlines, result.

No HTTP library here: the request is read through the attributes httpx and httpx2 share (``method``, ``url``,
``headers``, ``extensions``); the flavour's `RequestRun` (``_httpx/attempts.py``) adds what needs httpx: the
attempt's request and body, and exception classes.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import tenacity

from .connection_strategy import REUSE_UNDECIDED, ConnectionChoice, teach
from .decisions import (
    PROBE_LOADING,
    FailureKind,
    ProgressTracker,
    RequestKind,
    Verdict,
    classify_request,
    verdict_for_failure,
    verdict_for_status,
)
from .late_answers import WatchedConnection
from .llama_server import RETRIED_STATUSES
from .log import STALL_LOG, WARN_ONCE, describe_request, logger
from .origin_probes import PROBE_BOOK, GivenUpProbe, OriginProbes, ProbeBook
from .origins import Origin
from .policy import GuardPolicy
from .probe import probe_deadline
from .result import EXTENSION, GuardResult, new_result
from .stats import GuardStats

__all__ = [
    "MAX_RETRIED_ERROR_BODY",
    "MAX_SOCKET_WAIT",
    "RETRIED_STATUSES",
    "Prober",
    "RequestState",
]

# A retriable 503/429 is read and closed before the retry; a larger body means it is not llama-server's short
# JSON error, and the response goes to the caller instead.
MAX_RETRIED_ERROR_BODY = 64 * 1024
# A sync socket refuses a timeout as large as some valid deadlines (OverflowError): cap what the guard hands it.
MAX_SOCKET_WAIT = 1e6
# The smallest backoff window for a 503 without Retry-After (doubling: 0.5, 1, 2 s with the default cap).
STATUS_BACKOFF = 0.5


class Prober(Protocol):
    """A transport's probe of a new connection: ``prober(network_stream, request_state)``; a coroutine function
    for async transports. Closes the stream and raises if the probe fails."""

    def __call__(self, stream: Any, run: Any, /) -> Any: ...


# Where a probe's first kick goes when nothing was learnt below its deadline: a quarter of it (0.125 s of the default
# 0.5 s), then half; a healthy but slow first answer costs at most two short connections.
UNLEARNT_KICK_FRACTION = 0.25


def retry_reason(verdict: Verdict | None) -> str:
    """Why a request is retried, for ``stats.retries_by_reason`` and the metrics: ``"stalled_connection"`` (a new
    connection failed its probe, or the first-byte deadline passed: llama-server's unread connections),
    ``"dead_connection"`` (a pooled connection the server had closed: its streams' keep-alive lie), ``"status"``
    (503 or 429), or ``"connection_error"`` (any other failure before the response)."""
    if verdict is None:
        return "connection_error"
    if verdict.status:
        return "status"
    if verdict.stall:
        return "stalled_connection"
    return "connection_error" if verdict.backoff else "dead_connection"


class RequestState:
    """State of one guarded request across its attempts, including how far its current attempt got.

    Not built for a request that its first attempt answers without help (see ``FirstAttempt``). What only a
    failure needs (the `RequestKind`, the caller's timeouts, the attempt's progress) is worked out when asked.
    """

    # Set when first needed, not in __init__: _kind (the `kind` property); tracker and attempt_timeouts.
    __slots__ = (
        "_kind",
        "_origin",
        "_origin_probes",
        "attempt_timeouts",
        "attempts",
        "body",
        "book",
        "close_connection",
        "closed_by_header",
        "connect_seconds",
        "connect_started",
        "connection",
        "deadline_applied",
        "failed_probes",
        "first_byte",
        "history",
        "loading_attempts",
        "loading_since",
        "policy",
        "probe_deadline_used",
        "probe_kicks",
        "probe_loading",
        "probe_number",
        "prober",
        "reconnects",
        "request",
        "retry_clock",
        "server_reads_connections",
        "started",
        "stats",
        "stream",
        "tracker",
        "user_extensions",
        "verdict",
    )
    _kind: RequestKind
    tracker: ProgressTracker | None
    attempt_timeouts: dict[str, float | None]

    def __init__(
        self,
        request: Any,
        origin: Origin | None,
        policy: GuardPolicy,
        stats: GuardStats,
        prober: Prober,
        *,
        body: bytes | None,
        stream: bool,
        started: float,
        book: ProbeBook | None = None,
        connection: ConnectionChoice = REUSE_UNDECIDED,
        may_close: bool = True,
    ) -> None:
        """``body``: the request's bytes if held in memory; ``stream``: whether it asks for ``"stream": true``;
        ``started``: when the guard received the request (``time.monotonic()``); ``book``: what the guard knows of
        probing each origin (default: the process's, `PROBE_BOOK`); ``connection``: the origin's connection
        strategy; ``may_close``: whether ``Connection: close`` may be sent (not where HTTP/2 may carry it)."""
        self.request = request
        self._origin = origin
        self._origin_probes: OriginProbes | None = None
        self.book = book if book is not None else PROBE_BOOK
        self.probe_deadline_used = policy.probe_timeout
        self.probe_number = 0
        self.probe_kicks = 0  # kick connections opened for the probe in progress
        self.policy = policy
        self.stats = stats
        self.prober = prober
        self.body = body
        self.stream = stream
        self.connection = connection
        self.connect_seconds: float | None = None  # the new connection's set-up time, until taught (auto)
        self.close_connection = may_close and (
            connection.strategy == "close" or (stream and policy.stream_mode == "close")
        )
        self.user_extensions = request.extensions
        self.started = started
        self.attempts = 0
        self.reconnects = 0
        self.failed_probes = 0
        self.server_reads_connections = False  # a probe got an HTTP answer: later attempts need no probe
        # The wait for a loading server (max_loading_wait): attempts that found it loading, since when it is loading
        # (None while it is not), whether the last probe was answered 503, and where max_retry_time counts from
        # (moved on by the time spent waiting for the server to load).
        self.loading_attempts = 0
        self.loading_since: float | None = None
        self.probe_loading = False
        self.retry_clock = started
        self.history: tuple[str, ...] = ()
        self.verdict: Verdict | None = None
        self.deadline_applied = False
        self.first_byte: float | None = None
        self.closed_by_header = False

    @property
    def kind(self) -> RequestKind:
        """Method, idempotency, inference endpoint, stream, replayable body: for retry decisions only."""
        try:
            return self._kind
        except AttributeError:  # the first time: the slot is empty
            self._kind = classify_request(self.request.method, self.request.url.path, self.body)
            return self._kind

    @property
    def origin(self) -> Origin:
        """Where the request goes (worked out only when needed: with ``origins="all"`` the happy path never is)."""
        if self._origin is None:
            self._origin = Origin.of_url(self.request.url)
        return self._origin

    @property
    def origin_probes(self) -> OriginProbes:
        """The probe deadline in force and the admission of new connections for this request's origin."""
        probes = self._origin_probes
        if probes is None:
            probes = self._origin_probes = self.book.of(self.origin)
        return probes

    @property
    def description(self) -> str:
        """For logs and error messages."""
        url = self.request.url
        return describe_request(self.request.method, url.scheme, url.host, url.port, url.path)

    @property
    def host_header(self) -> str:
        host: str = self.request.headers.get("host") or self.request.url.netloc.decode("ascii")
        return host

    @property
    def user_timeouts(self) -> dict[str, float | None]:
        """The caller's own timeouts (httpx's ``timeout`` extension)."""
        timeouts: dict[str, float | None] = self.user_extensions.get("timeout", {})
        return timeouts

    @property
    def may_retry(self) -> bool:
        """The last attempt failed, or answered 503/429, in a way the rules allow to retry."""
        return self.verdict is not None and self.verdict.retry

    @property
    def probing(self) -> bool:
        """New connections of this request's attempts are to be probed."""
        return self.policy.probe and not self.server_reads_connections and self.connection.strategy == "reuse"

    # -- the connection hooks report here -------------------------------------------------------------------------

    def probe(self, stream: Any) -> Any:
        """Probe a new connection of the current attempt (a coroutine for async transports)."""
        return self.prober(stream, self)

    def connecting(self) -> None:
        """The current attempt is opening a new connection."""
        tracker = self.tracker
        if tracker is None:
            tracker = self.tracker = ProgressTracker(hooked=True)
        tracker.connecting()
        self.connect_started = time.monotonic()

    def probing_off(self, why: str) -> None:
        """This attempt's new connection cannot be probed although the request probes (``why``: the kind of
        connection): said once per origin and reason, and in ``stats.probing_off``."""
        text = f"new connections to {self.origin} are not probed: {why}"
        self.stats.probing_off = text
        WARN_ONCE.warning(
            f"llama_guard: {text}; a connection llama-server leaves unread is not caught there (retries and stream "
            "handling still apply)"
        )

    def connection_ready(self) -> None:
        """The new connection of this attempt is ready for HTTP (connected, and TLS done for https), nothing written
        yet: what it cost teaches the origin's ``"auto"`` connection strategy while that is measuring, with the
        round trip of its probe (`probe_answered`) when it is probed."""
        if not self.connection.final:
            self.connect_seconds = time.monotonic() - self.connect_started

    def _teach_connect_cost(self, seconds: float) -> None:
        """What a new connection cost, for the origin's ``"auto"`` strategy. With a probe: the connect (and TLS)
        plus the probe's round trip, at least what a new connection per request would add (a round trip that the
        connect may not show: a proxy or relay accepts at once and defers the handshake's cost to the first byte)."""
        self.connect_seconds = None
        teach(self.origin, self.stats, connect_cost=seconds)

    def connected(self) -> None:
        """The new connection is up (and probed, when probing): nothing of the request is written to it yet."""
        assert self.tracker is not None, "connected() without connecting()"
        self.tracker.connected()
        if self.connect_seconds is not None:  # not probed: its connect alone
            self._teach_connect_cost(self.connect_seconds)

    # -- an attempt ------------------------------------------------------------------------------------------------

    def attempt_extensions(self, trace: Any) -> dict[str, Any]:
        """Count a new attempt; the request extensions it goes out with: the caller's own object unless the attempt
        needs the first-byte deadline or the guard's ``trace`` callback (a transport whose pool is out of reach)."""
        self.attempts += 1
        self.verdict = None
        # Followed by trace events: a tracker for them; else None until the hooks see a new connection.
        self.tracker = None if trace is None else ProgressTracker()
        extensions: dict[str, Any] = self.user_extensions
        deadline = self.policy.first_byte_timeout
        if deadline is not None:
            # The first-byte deadline rides on httpcore's read timeout, looked up for the headers and again for the
            # body (restored in headers_arrived()). A shorter read timeout of the caller's own stays in charge.
            caller_read = self.user_timeouts.get("read")
            self.deadline_applied = caller_read is None or deadline < caller_read
        if trace is not None or self.deadline_applied or EXTENSION in extensions:
            extensions = dict(extensions)
            extensions.pop(EXTENSION, None)
            if trace is not None:
                extensions["trace"] = trace
            if deadline is not None and self.deadline_applied:
                timeouts = dict(self.user_timeouts)
                timeouts["read"] = min(deadline, MAX_SOCKET_WAIT)
                self.attempt_timeouts = timeouts
                extensions["timeout"] = timeouts
        return extensions

    def next_probe_deadline(self) -> float:
        """The deadline of this request's next probe: the origin's deadline in force (`OriginProbes.deadline`) for
        its first probe, the configured ladder (`probe_deadline`) after one was given up, or with kicks on (then
        the learnt deadline is when the first kick goes: `next_kick`)."""
        policy = self.policy
        if self.failed_probes or policy.probe_kick:
            # The learnt deadline is for a first probe only: a request whose probe was given up waits the configured
            # ladder from then on, so a server that turned slow since the guard learnt (load arriving) costs that
            # request a reconnect, never its attempts (the late answer raises the learnt deadline for the next ones).
            deadline = probe_deadline(self.failed_probes, first=policy.probe_timeout, cap=policy.probe_timeout_max)
        else:
            deadline = self.origin_probes.deadline(policy)
        # The probe reads like any response: never wait longer than the caller's own read timeout allows.
        caller_read = self.user_timeouts.get("read")
        if caller_read is not None and caller_read < deadline:
            deadline = caller_read
        deadline = min(deadline, MAX_SOCKET_WAIT)
        self.probe_deadline_used = deadline
        return deadline

    def next_kick(self) -> float | None:
        """Seconds into the probe at which it opens its next kick connection (`GuardPolicy.probe_kick`): the
        origin's learnt deadline, then 2, 4, 8... times it; with nothing learnt below the probe's own deadline (too
        few answers yet, learning off), a quarter of that deadline, then half. None when no kick comes before the
        probe is given up. Read after `next_probe_deadline`."""
        if not self.policy.probe_kick:
            return None
        first = self.origin_probes.deadline(self.policy)
        if first >= self.probe_deadline_used:
            # A burst whose served connections are too few to learn from (the pool's threads held by long requests)
            # still gets its kicks: they cost one short connection each, a stall costs the probe's whole deadline.
            first = self.probe_deadline_used * UNLEARNT_KICK_FRACTION
        at = first * (2**self.probe_kicks)
        return at if at < self.probe_deadline_used else None

    def probe_wait(self, elapsed: float, remaining: float) -> tuple[bool, float]:
        """For a probe waiting ``elapsed`` s, with ``remaining`` s to its deadline: (open a kick now?, how long to
        wait before looking again: until the next kick at most)."""
        kick = self.next_kick()
        if kick is None:
            return False, remaining
        if elapsed >= kick:
            return True, 0.0
        return False, min(remaining, kick - elapsed)

    def probe_kicked(self, failure: BaseException | None = None) -> None:
        """A kick connection was opened for this probe and closed, or (``failure``) could not be opened: counted
        either way (the next kick waits twice as long), and failing kicks to an origin are said once per process,
        since the stalled connections they were for are then given up and replaced."""
        self.probe_kicks += 1
        self.origin_probes.kicked()
        if failure is None:
            self.stats.add(probe_kicks=1)
            return
        self.stats.add(probe_kicks=1, probe_kicks_failed=1)
        logger.debug("kick connection to %s failed: %s", self.origin, failure)
        WARN_ONCE.warning(
            f"llama_guard: kick connections to {self.origin} fail ({type(failure).__name__}): a connection the "
            "server left unread is given up at probe_timeout and replaced instead of rescued; "
            "stats.probe_kicks_failed counts them (GuardPolicy(probe_kick=False) turns kicks off)"
        )

    def probe_started(self) -> None:
        self.probe_number = self.origin_probes.probe_started()
        self.probe_kicks = 0

    def probe_answered(self, seconds: float) -> None:
        rescued = self.probe_kicks > 0
        self.stats.record_probe(seconds, answered=True, rescued=rescued)
        if rescued:  # one WARNING per burst, each rescue at DEBUG
            STALL_LOG.rescued(
                self.origin,
                f"{self.description}: the new connection answered its probe after {seconds:.2f} s and "
                f"{self.probe_kicks} kick{'s' if self.probe_kicks > 1 else ''}",
            )
        self.origin_probes.probe_answered(seconds, self.probe_number)
        if self.connect_seconds is not None and not rescued:  # a rescued probe measured the stall, not the network
            self._teach_connect_cost(self.connect_seconds + seconds)

    def probe_failed(self, seconds: float) -> None:
        """The probe failed with an error."""
        self.failed_probes += 1
        self.stats.record_probe(seconds, answered=False)
        self.origin_probes.probe_failed(self.probe_number)

    def probe_abandoned(self) -> None:
        """The probe was cancelled with its request: neither answered nor failed."""
        self.origin_probes.probe_failed(self.probe_number)

    def probe_given_up(self, seconds: float, connection: WatchedConnection) -> GivenUpProbe:
        """The probe's deadline passed. ``connection``, kept half closed, is watched for a late answer
        (`OriginProbes.probe_given_up`) and closed when the watch settles, or when the returned watch is ended (its
        transport closes). The adapter closes its own stream either way."""
        self.failed_probes += 1
        self.stats.record_probe(seconds, answered=False, given_up=True)
        if connection.unseen is not None:
            why = (
                f"a connection whose probe was given up could not be watched for a late answer: {connection.unseen}; "
                "such false alarms go uncounted (probes_answered_late) and do not raise the learnt probe deadline"
            )
            self.stats.late_answers_unseen = why
            WARN_ONCE.warning(f"llama_guard: {why}")
        return self.origin_probes.probe_given_up(
            self.probe_number,
            connection.peek,
            self.stats,
            time.monotonic() - seconds,
            watch=self.policy.probe_timeout_max,
            close=connection.close,
        )

    def probe_closed(self, status: int) -> bool:
        """The server answered the probe with ``status`` and closed the connection: that connection is lost. True
        when probing this origin can never leave a usable connection (a healthy answer), logged here; the
        transport then stops probing the origin."""
        # Else llama-server answers 503 with Connection: close while it loads a model: the server is reading new
        # connections, so this request's next attempts go unprobed: the request itself then gets the server's answer
        # (a 503 "Loading model", retried on its own terms, and handed to the caller if it lasts) instead of failing
        # probe after probe.
        self.server_reads_connections = True
        if not 200 <= status < 300:
            self.probe_loading = status == 503
            return False
        logger.warning(
            "%s closes connections after GET /health, so new connections cannot be probed; "
            "probing disabled for this origin",
            self.origin,
        )
        return True

    def judge_failure(self, kind: FailureKind, error_name: str, detail: str) -> None:
        """Record a failed attempt (``error_name``: the exception class the caller would see) and set
        ``self.verdict`` for the retry hooks."""
        tracker = self.tracker if self.tracker is not None else ProgressTracker(hooked=True)  # a pooled connection
        self.stats.add_error(error_name)
        progress = tracker.effective_progress()
        if kind is FailureKind.PROBE and self.probe_loading:
            self.probe_loading = False
            self.verdict = PROBE_LOADING
        else:
            self.verdict = verdict_for_failure(
                kind,
                progress=progress,
                reused_connection=tracker.reused_connection,
                body_started=tracker.body_started,
                request=self.kind,
                retry_non_idempotent=self.policy.retry_non_idempotent,
            )
        self._follow_loading()
        where = "a reused" if tracker.reused_connection else "a new" if tracker.new_connection else "no"
        self.history += (
            f"attempt {self.attempts}: {error_name} on {where} connection "
            f"({progress.name.lower()}): {self.verdict.reason} [{detail[:160] or 'no detail'}]",
        )
        if self.verdict.retry and self.verdict.stall:
            self.reconnects += 1

    def judge_response(self, status: int, headers: Any) -> bool:
        """Restore the caller's read timeout for the body, and judge a 503/429: True if the response is one to
        retry (``self.verdict`` says why)."""
        if self.deadline_applied:
            timeouts = self.attempt_timeouts  # set with the deadline in attempt_extensions()
            if "read" in self.user_timeouts:
                timeouts["read"] = self.user_timeouts["read"]
            else:
                del timeouts["read"]
        if status not in RETRIED_STATUSES:
            return False
        verdict = verdict_for_status(
            status,
            headers,
            request=self.kind,
            retry_non_idempotent=self.policy.retry_non_idempotent,
            max_retry_after=self.policy.max_retry_after,
        )
        if verdict is not None and verdict.retry:
            length = headers.get("content-length", "")
            if not length.isdigit() or int(length) > MAX_RETRIED_ERROR_BODY:
                verdict = Verdict(False, f"{status} with a body that is not a short error")
        self.verdict = verdict
        self._follow_loading()
        if verdict is None:
            return False
        self.history += (f"attempt {self.attempts}: HTTP {status}: {verdict.reason}",)
        return verdict.retry

    # -- the retry schedule (tenacity hooks) -----------------------------------------------------------------------

    def _follow_loading(self) -> None:
        """After a verdict: start or end the wait for a loading server. The time it lasted moves the clock of
        max_retry_time on, and each attempt that found the server loading is not one of max_attempts."""
        verdict = self.verdict
        now = time.monotonic()
        if verdict is not None and verdict.loading and verdict.retry:
            self.loading_attempts += 1
            if self.loading_since is None:
                self.loading_since = now
        elif self.loading_since is not None:
            self.retry_clock += now - self.loading_since
            self.loading_since = None

    def _stop(self, state: tenacity.RetryCallState) -> bool:
        """tenacity's stop condition: a loading server is waited for up to max_loading_wait; any other retry is
        bounded by max_attempts (attempts that found the server loading aside) and max_retry_time."""
        policy = self.policy
        now = time.monotonic()
        upcoming = state.upcoming_sleep or 0.0
        if self.verdict is PROBE_LOADING:
            # The probe found the server loading: the request itself has not been sent. It goes once, unprobed (the
            # server reads connections), so the caller gets the server's own answer, whatever max_loading_wait is.
            return False
        if self.loading_since is not None:
            return now + upcoming - self.loading_since >= policy.max_loading_wait
        if self.attempts - self.loading_attempts >= policy.max_attempts:
            return True
        return policy.max_retry_time is not None and now + upcoming - self.retry_clock >= policy.max_retry_time

    def retrying_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for tenacity's `Retrying`/`AsyncRetrying` (the transports add ``sleep``)."""
        return {
            "stop": self._stop,
            "wait": self._wait,
            "retry": self._should_retry,
            "before_sleep": self._before_sleep,
            "reraise": True,
        }

    def _should_retry(self, state: tenacity.RetryCallState) -> bool:
        return self.verdict is not None and self.verdict.retry

    def _wait(self, state: tenacity.RetryCallState) -> float:
        verdict = self.verdict
        if verdict is None or not verdict.backoff:
            return 0.0
        if verdict.delay is not None:
            return verdict.delay
        # Full jitter. Stalled connections come back over a window as wide as the probe deadline in force (measured
        # on b11434: reconnects spread over less reach the server as a new burst and stall again).
        policy = self.policy
        if verdict.stall:
            multiplier = max(policy.backoff, self.probe_deadline_used)
        elif verdict.status:
            # A 503 without Retry-After: llama-server loading a model, which takes seconds, not milliseconds.
            multiplier = max(policy.backoff, STATUS_BACKOFF)
        else:
            multiplier = policy.backoff
        return tenacity.wait_random_exponential(multiplier=multiplier, max=policy.backoff_max)(state)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        stall = self.verdict is not None and self.verdict.stall
        self.stats.record_retry(retry_reason(self.verdict), stall=stall)
        if self.loading_since is not None:
            of = f"waiting for the server to load, {time.monotonic() - self.loading_since:.1f} s of max_loading_wait"
        else:
            of = f"attempt {self.attempts - self.loading_attempts + 1} of {self.policy.max_attempts}"
        message = "retrying %s (%s) in %.2f s after %s" % (  # noqa: UP031 (the logging style)
            self.description,
            of,
            state.upcoming_sleep,
            self.history[-1].partition(": ")[2] if self.history else "a failure",
        )
        if stall:
            STALL_LOG.replaced(self.origin, message)  # one WARNING per burst, each reconnect at DEBUG
        else:
            logger.warning("%s", message)

    # -- the end ---------------------------------------------------------------------------------------------------

    def final_message(self, message: str) -> tuple[str, float]:
        """The caller's error message once the guard stops, with the guard's account; and the seconds spent."""
        elapsed = time.monotonic() - self.started
        if self.verdict is not None and not self.verdict.retry:
            why = f"not retried: {self.verdict.reason}"
        elif self.loading_since is not None:
            why = f"max_loading_wait={self.policy.max_loading_wait:g} s reached while the server was loading"
        elif self.attempts - self.loading_attempts >= self.policy.max_attempts:
            why = f"max_attempts={self.policy.max_attempts} reached"
        else:
            why = f"max_retry_time={self.policy.max_retry_time:g} s reached"
        attempts = "1 attempt" if self.attempts == 1 else f"{self.attempts} attempts"
        if self.attempts > 1:
            logger.warning("giving up on %s after %s: %s", self.description, attempts, why)
        return f"{message} [llama_guard: {self.description}, {attempts} in {elapsed:.2f} s, {why}]", elapsed

    def result(self, connection_closed: bool) -> GuardResult:
        """The guard's account for the response, which has just been handed its headers."""
        self.first_byte = first_byte = time.monotonic() - self.started
        # A stream's connection closed by the header (stats.stream_connections_closed); the close strategy's are not.
        self.closed_by_header = self.close_connection and self.stream
        connection = self.connection
        if not connection.final:
            self.answered(first_byte)
        return new_result(
            (
                self.attempts,
                self.reconnects,
                first_byte,
                self.stream,
                connection_closed or self.close_connection,
                self.history,
                connection.strategy,
            )
        )

    def answered(self, first_byte: float) -> None:
        """Teach the origin's ``"auto"`` connection strategy a request's time, while it is measuring."""
        teach(self.origin, self.stats, request=first_byte)
