"""One request's way through the guard: its attempts, the tenacity hooks that decide between them, its result.

Shared by the sync and async transports (it does no I/O); they own the network calls and the sleeping.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import tenacity

from .._core.decisions import (
    FailureKind,
    ProgressTracker,
    RequestKind,
    Verdict,
    classify_request,
    verdict_for_failure,
    verdict_for_status,
    wants_stream,
)
from .._core.log import describe_request, logger, without_quoted_values
from .._core.origins import Origin
from .._core.policy import GuardPolicy
from .._core.probe import probe_deadline
from .._core.result import EXTENSION, GuardResult, new_result
from .._core.stats import GuardStats
from .exceptions import FirstByteTimeout, failure_kind, guarded_error

__all__ = ["AttemptBody", "FirstAttempt", "RequestRun", "request_body"]

# A retriable 503/429 is read and closed before the retry; a larger body means it is not llama-server's short
# JSON error, and the response goes to the caller instead.
MAX_RETRIED_ERROR_BODY = 64 * 1024
# The longest wait the guard hands to a socket: valid deadlines beyond it (1e300 s is a valid float) mean "no limit"
# in practice, but a sync socket refuses a timeout that large (OverflowError from settimeout).
MAX_SOCKET_WAIT = 1e6
# The statuses a request may be retried on (verdict_for_status decides whether this one is).
RETRIED_STATUSES = frozenset({429, 503})
# The smallest backoff window for a 503 without Retry-After (doubling: 0.5, 1, 2 s with the default cap).
STATUS_BACKOFF = 0.5


def request_body(request: httpx.Request) -> tuple[bytes | None, bool]:
    """The request body when it is held in memory (and so can be inspected and sent again), else None; and
    whether the request asks llama-server for ``"stream": true``."""
    try:
        body = request.content
    except httpx.RequestNotRead:
        return None, False  # a one-shot stream: it cannot be inspected, or sent twice
    return body, request.method == "POST" and wants_stream(body)  # httpx upper-cases methods


class AttemptBody(httpx.SyncByteStream, httpx.AsyncByteStream):
    """The body one attempt sends, and the guarded request it belongs to.

    ``content``: the request's bytes when they are held in memory, sent afresh by every attempt; else None, and the
    caller's own one-shot ``stream`` is passed through (once: such a request is never sent twice).

    ``run``: the request's `RequestRun`. httpcore hands this object to the connection that serves the attempt, so
    a new connection learns from its first request which guarded request opened it (``_async_network.py``);
    requests on pooled connections carry it at no cost.

    An iterator object rather than httpx's async generator: when a write fails half way (a dead pooled
    connection), httpcore abandons the body's iterator, and an abandoned async generator makes trio's finalizer
    warn (a ResourceWarning) long after the request was retried and answered.
    """

    __slots__ = ("_content", "_stream", "run")

    def __init__(self, run: RequestRun | None, content: bytes | None, stream: Any) -> None:
        self.run = run
        self._content = content
        self._stream = stream

    def guarded_run(self) -> RequestRun | None:
        """The request this attempt belongs to (for the connection hooks); None once the attempt has ended."""
        return self.run

    def __iter__(self) -> Iterator[bytes]:
        if self._content is not None:
            return iter((self._content,))
        return iter(self._stream)

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._content is not None:
            return _OneChunk(self._content)
        return self._stream.__aiter__()  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._content is None:
            self._stream.close()

    async def aclose(self) -> None:
        if self._content is None:
            await self._stream.aclose()


class FirstAttempt(AttemptBody):
    """The body of a request's first attempt while the request has needed nothing but its body.

    Most requests are answered by their first attempt on a pooled connection, and need no `RequestRun`: for them
    the guard builds none (it would be most of the guard's work per request). This object keeps what a run is built
    from, and builds it when something needs one (`guarded_run`): the connection hooks, for a new connection to
    probe, or the transport, when the attempt fails or is answered 503/429. The run then carries on as if it had
    been there from the start, with this as its first attempt in progress.

    Only for a request the first attempt sends as it is: a replayable body, no per-request options, no first-byte
    deadline, no ``Connection: close`` to add (see the transport).
    """

    __slots__ = ("_guard", "_origin", "_policy", "_request", "_started", "_wants_stream")

    def __init__(
        self,
        guard: Any,
        request: httpx.Request,
        origin: Origin | None,
        policy: GuardPolicy,
        content: bytes,
        wants_stream: bool,
        started: float,
    ) -> None:
        self.run = None
        self._content = content
        self._stream = request.stream
        self._guard = guard
        self._request = request
        self._origin = origin
        self._policy = policy
        self._wants_stream = wants_stream
        self._started = started

    def guarded_run(self) -> RequestRun:
        run = self.run
        if run is None:
            run = self.run = RequestRun(
                self._request,
                self._origin,
                self._policy,
                self._guard,
                body=self._content,
                stream=self._wants_stream,
                user_stream=self._stream,
                started=self._started,
            )
            run.adopt_first_attempt(self)
        return run


class _OneChunk:
    __slots__ = ("_content",)

    def __init__(self, content: bytes | None) -> None:
        self._content = content

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        if self._content is None:
            raise StopAsyncIteration
        content, self._content = self._content, None
        return content


class RequestRun:
    """State of one guarded request across its attempts, including how far its current attempt got.

    Not built for a request that its first attempt answers without help (see `FirstAttempt`). When it is built,
    what only a failure needs (the request's method, path and idempotency as a `RequestKind`, the caller's
    timeouts, the attempt's progress) is worked out when a failure asks for it. Slotted.

    ``guard`` is the transport, whose ``stats`` count the request and whose probe the connection hooks call.
    """

    # Set when first needed, not in __init__: _kind (the `kind` property); attempt_body, tracker and
    # attempt_timeouts (begin_attempt).
    __slots__ = (
        "_kind",
        "_origin",
        "attempt_body",
        "attempt_timeouts",
        "attempts",
        "body",
        "close_connection",
        "closed_by_header",
        "deadline_applied",
        "failed_probes",
        "first_byte",
        "guard",
        "history",
        "policy",
        "reconnects",
        "request",
        "server_reads_connections",
        "started",
        "stats",
        "stream",
        "tracker",
        "user_extensions",
        "user_stream",
        "verdict",
    )
    _kind: RequestKind
    attempt_body: AttemptBody
    tracker: ProgressTracker | None
    attempt_timeouts: dict[str, float | None]

    def __init__(
        self,
        request: httpx.Request,
        origin: Origin | None,
        policy: GuardPolicy,
        guard: Any,
        *,
        body: bytes | None,
        stream: bool,
        user_stream: Any,
        started: float,
    ) -> None:
        """``body``: `request_body(request)`; ``stream``: whether it asks for ``"stream": true``; ``user_stream``:
        the caller's ``request.stream``; ``started``: when the guard received the request (``time.monotonic()``)."""
        self.request = request
        self._origin = origin
        self.policy = policy
        self.guard = guard
        self.stats: GuardStats = guard.stats
        self.body = body
        self.stream = stream
        self.close_connection = stream and policy.stream_mode == "close"
        self.user_extensions = request.extensions
        self.user_stream = user_stream
        self.started = started
        self.attempts = 0
        self.reconnects = 0
        self.failed_probes = 0
        self.server_reads_connections = False  # a probe got an HTTP answer: later attempts need no probe
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
    def description(self) -> str:
        """For logs and error messages (computed when needed: the happy path never needs it)."""
        url = self.request.url
        return describe_request(self.request.method, url.scheme, url.host, url.port, url.path)

    @property
    def host_header(self) -> str:
        return self.request.headers.get("host") or self.request.url.netloc.decode("ascii")

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
        return self.policy.probe and not self.server_reads_connections

    # -- the connection hooks report here -------------------------------------------------------------------------

    def connecting(self) -> None:
        """The current attempt is opening a new connection."""
        tracker = self.tracker
        if tracker is None:
            tracker = self.tracker = ProgressTracker(hooked=True)
        tracker.connecting()

    def connected(self) -> None:
        """The new connection is up (and probed, when probing): nothing of the request is written to it yet."""
        assert self.tracker is not None, "connected() without connecting()"
        self.tracker.connected()

    # -- building an attempt -------------------------------------------------------------------------------------

    def begin_attempt(self, trace: Callable[..., Any] | None) -> httpx.Request:
        """The request to send for one attempt: ``Connection: close`` for llama streams, and in its extensions
        the first-byte deadline and the guard's ``trace`` callback (only for a transport whose pool the guard
        cannot reach). The caller's request object lends its extensions attribute to the attempt (copying the
        whole request would cost more than the rest of the guard); `end_attempt()` gives the caller's back."""
        self.attempts += 1
        self.verdict = None
        # The attempt's progress. Followed by trace events: a tracker for them. Otherwise None until the connection
        # hooks see a new connection (`connecting`): nothing is built for an attempt on a pooled connection.
        self.tracker = None if trace is None else ProgressTracker()
        extensions = self.user_extensions
        deadline = self.policy.first_byte_timeout
        if deadline is not None:
            # The first-byte deadline rides on httpcore's read timeout, which it looks up when it starts reading
            # the headers, and again when it starts reading the body: restored in headers_arrived(), it never cuts
            # a body. A shorter read timeout of the caller's own stays in charge.
            caller_read = self.user_timeouts.get("read")
            self.deadline_applied = caller_read is None or deadline < caller_read
        if trace is not None or self.deadline_applied or EXTENSION in extensions:
            # Only then a copy: most requests go out with the caller's own extensions, untouched.
            extensions = dict(extensions)
            extensions.pop(EXTENSION, None)
            if trace is not None:
                extensions["trace"] = trace
            if deadline is not None and self.deadline_applied:
                timeouts = dict(self.user_timeouts)
                timeouts["read"] = min(deadline, MAX_SOCKET_WAIT)
                self.attempt_timeouts = timeouts
                extensions["timeout"] = timeouts
        self.attempt_body = stream = AttemptBody(self, self.body, self.user_stream)
        if self.close_connection:
            headers = self.request.headers.copy()
            headers["Connection"] = "close"
            return httpx.Request(
                self.request.method, self.request.url, headers=headers, stream=stream, extensions=extensions
            )
        request = self.request
        if extensions is not self.user_extensions:
            request.extensions = extensions
        request.stream = stream
        return request

    def adopt_first_attempt(self, body: AttemptBody) -> None:
        """This run is built during its first attempt, which went out as it was (a `FirstAttempt`)."""
        self.attempts = 1
        self.tracker = None
        self.attempt_body = body

    def end_attempt(self) -> None:
        # httpcore keeps the body as long as the response: it must not keep this request's state alive too.
        self.attempt_body.run = None
        request = self.request
        request.extensions = self.user_extensions
        request.stream = self.user_stream

    # -- probing new connections ---------------------------------------------------------------------------------

    def next_probe_deadline(self) -> float:
        deadline = probe_deadline(
            self.failed_probes, first=self.policy.probe_timeout, cap=self.policy.probe_timeout_max
        )
        # The probe reads like any response: never wait longer than the caller's own read timeout allows.
        caller_read = self.user_timeouts.get("read")
        if caller_read is not None and caller_read < deadline:
            deadline = caller_read
        return min(deadline, MAX_SOCKET_WAIT)

    def probe_answered(self, seconds: float) -> None:
        self.stats.record_probe(seconds, answered=True)

    def probe_failed(self, seconds: float) -> None:
        self.failed_probes += 1
        self.stats.record_probe(seconds, answered=False)

    # -- the outcome of an attempt ------------------------------------------------------------------------------

    def attempt_failed(self, exc: BaseException) -> BaseException:
        """Judge a failed attempt; returns the exception to raise from it (a first-byte expiry becomes
        `FirstByteTimeout`). Sets ``self.verdict`` for the tenacity hooks."""
        # No tracker: the connection hooks saw no new connection, so the attempt ran on a pooled one.
        tracker = self.tracker if self.tracker is not None else ProgressTracker(hooked=True)
        kind = failure_kind(exc, tracker, deadline_applied=self.deadline_applied)
        if kind is None:
            return exc
        assert isinstance(exc, httpx.TransportError)
        if kind is FailureKind.FIRST_BYTE_TIMEOUT:
            exc = self._first_byte_timeout(exc)
        self.stats.add_error(type(exc).__name__)
        self.verdict = verdict_for_failure(
            kind,
            progress=tracker.effective_progress(),
            reused_connection=tracker.reused_connection,
            body_started=tracker.body_started,
            request=self.kind,
            retry_non_idempotent=self.policy.retry_non_idempotent,
        )
        where = "a reused" if tracker.reused_connection else "a new" if tracker.new_connection else "no"
        detail = error_text(exc)[:160] or "no detail"
        self.history += (
            f"attempt {self.attempts}: {type(exc).__name__} on {where} connection "
            f"({tracker.effective_progress().name.lower()}): {self.verdict.reason} [{detail}]",
        )
        if self.verdict.retry and self.verdict.stall:
            self.reconnects += 1
        return exc

    def _first_byte_timeout(self, exc: httpx.TransportError) -> FirstByteTimeout:
        return FirstByteTimeout(
            f"no response headers from {self.description} within first_byte_timeout="
            f"{self.policy.first_byte_timeout:g} s; the connection was discarded",
            request=self.request,
        )

    def headers_arrived(self, response: httpx.Response) -> bool:
        """Restore the caller's read timeout for the body, and judge a 503/429: True if the response is one to
        retry (``self.verdict`` says why)."""
        if self.deadline_applied:
            timeouts = self.attempt_timeouts  # set with the deadline in begin_attempt()
            if "read" in self.user_timeouts:
                timeouts["read"] = self.user_timeouts["read"]
            else:
                del timeouts["read"]
        if response.status_code not in RETRIED_STATUSES:
            return False  # the usual case, decided without a call
        verdict = verdict_for_status(
            response.status_code,
            response.headers,
            request=self.kind,
            retry_non_idempotent=self.policy.retry_non_idempotent,
            max_retry_after=self.policy.max_retry_after,
        )
        if verdict is not None and verdict.retry:
            length = response.headers.get("content-length", "")
            if not length.isdigit() or int(length) > MAX_RETRIED_ERROR_BODY:
                verdict = Verdict(False, f"{response.status_code} with a body that is not a short error")
        self.verdict = verdict
        if verdict is None:
            return False
        self.history += (f"attempt {self.attempts}: HTTP {response.status_code}: {verdict.reason}",)
        return verdict.retry

    # -- tenacity hooks -------------------------------------------------------------------------------------------

    def retrying_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for tenacity's `Retrying`/`AsyncRetrying` (the transports add ``sleep``)."""
        policy = self.policy
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(policy.max_attempts)
        if policy.max_retry_time is not None:
            # tenacity's clock starts now, after the first attempt: count that attempt's time too.
            spent = time.monotonic() - self.started
            stop = stop | tenacity.stop_before_delay(max(policy.max_retry_time - spent, 0.0))
        return {
            "stop": stop,
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
        # Full jitter: attempts that failed together must not come back together. Stalled connections come back
        # over a window as wide as the probe deadline (measured on b11434: reconnects spread over less than that
        # reach the server as a new burst and stall again), doubling with each further stall.
        policy = self.policy
        if verdict.stall:
            multiplier = max(policy.backoff, policy.probe_timeout)
        elif verdict.status:
            # A 503 without Retry-After: llama-server loading a model, which takes seconds, not milliseconds.
            multiplier = max(policy.backoff, STATUS_BACKOFF)
        else:
            multiplier = policy.backoff
        return tenacity.wait_random_exponential(multiplier=multiplier, max=policy.backoff_max)(state)

    def _before_sleep(self, state: tenacity.RetryCallState) -> None:
        self.stats.add(retries=1, stall_reconnects=int(self._last_was_stall()))
        delay = state.upcoming_sleep
        logger.warning(
            "retrying %s (attempt %d of %d) in %.2f s after %s",
            self.description,
            self.attempts + 1,
            self.policy.max_attempts,
            delay,
            self.history[-1].partition(": ")[2] if self.history else "a failure",
        )

    def _last_was_stall(self) -> bool:
        return self.verdict is not None and self.verdict.stall

    # -- the end ---------------------------------------------------------------------------------------------------

    def final_error(self, exc: httpx.TransportError) -> httpx.TransportError:
        """The error for the caller once the guard stops: the same httpx class, with the guard's account."""
        elapsed = time.monotonic() - self.started
        if self.verdict is not None and not self.verdict.retry:
            why = f"not retried: {self.verdict.reason}"
        elif self.attempts >= self.policy.max_attempts:
            why = f"max_attempts={self.policy.max_attempts} reached"
        else:
            why = f"max_retry_time={self.policy.max_retry_time:g} s reached"
        message = error_text(exc) or type(exc).__name__
        attempts = "1 attempt" if self.attempts == 1 else f"{self.attempts} attempts"
        error = guarded_error(
            exc,
            message=f"{message} [llama_guard: {self.description}, {attempts} in {elapsed:.2f} s, {why}]",
            attempts=self.attempts,
            elapsed=elapsed,
            history=self.history,
        )
        if self.attempts > 1:
            logger.warning("giving up on %s after %s: %s", self.description, attempts, why)
        return error

    def result(self, connection_closed: bool) -> GuardResult:
        """The guard's account for the response, which has just been handed its headers."""
        self.first_byte = first_byte = time.monotonic() - self.started
        self.closed_by_header = self.close_connection
        return new_result((self.attempts, self.reconnects, first_byte, self.stream, connection_closed, self.history))


def error_text(exc: BaseException) -> str:
    """An exception's message for the guard's history and errors; what our side refused to send is not repeated."""
    text = str(exc)
    return without_quoted_values(text) if isinstance(exc, httpx.LocalProtocolError) else text
