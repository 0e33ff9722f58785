"""The aiohttp side of a guarded request: its body, and its state across attempts (`AiohttpRequest`).

Everything decided about a request (counting, verdicts, the retry schedule, probe deadlines, its result) is
`RequestState` in ``_core/request_state.py``, shared with the httpx flavours; this module adds what needs aiohttp.
"""

from __future__ import annotations

import contextvars
from typing import Any

import aiohttp
import anyio
from aiohttp.payload import BytesPayload

from .._core.connection_strategy import REUSE_UNDECIDED, ConnectionChoice
from .._core.decisions import FailureKind, Progress, ProgressTracker, wants_stream
from .._core.log import without_quoted_values
from .._core.origins import Origin
from .._core.policy import GuardPolicy
from .._core.request_state import RequestState
from .._core.stats import GuardStats
from .exceptions import FirstByteTimeout, body_error, failure_kind, guarded_error

__all__ = ["CURRENT_ATTEMPT", "AiohttpRequest", "FirstAttempt", "current_run", "request_body"]


async def request_body(request: aiohttp.ClientRequest) -> tuple[bytes | None, bool]:
    """The request body when it is held in memory (and so can be inspected and sent again), else None; and
    whether the request asks llama-server for ``"stream": true``."""
    body = request.body
    if isinstance(body, bytes):  # aiohttp's empty body
        return body, False
    if not isinstance(body, BytesPayload):
        return None, False  # a file or a generator: treated as a one-shot stream, never sent twice
    content = await body.as_bytes()
    return content, request.method == "POST" and wants_stream(content)


class _RequestView:
    """What `RequestState` reads of a request (the attributes httpx's requests have)."""

    __slots__ = ("extensions", "headers", "method", "url")

    def __init__(self, request: aiohttp.ClientRequest) -> None:
        self.method = request.method
        self.url = request.url  # yarl: scheme, host, port and path as httpx's URL has them
        self.headers = request.headers
        self.extensions: dict[str, Any] = {}


def _no_prober(stream: Any, run: Any, /) -> Any:  # the connector probes (connector.py), not the state
    raise AssertionError("the aiohttp flavour probes in its connector hooks")


class AiohttpRequest(RequestState):
    """A guarded aiohttp request across its attempts: `RequestState`, the aiohttp request, and the first-byte
    deadline of the current attempt."""

    __slots__ = ("aiohttp_request", "deadline_scope")

    def __init__(
        self,
        request: aiohttp.ClientRequest,
        origin: Origin | None,
        policy: GuardPolicy,
        stats: GuardStats,
        *,
        body: bytes | None,
        stream: bool,
        started: float,
        connection: ConnectionChoice = REUSE_UNDECIDED,
    ) -> None:
        super().__init__(
            _RequestView(request),
            origin,
            policy,
            stats,
            _no_prober,
            body=body,
            stream=stream,
            started=started,
            connection=connection,
        )
        self.aiohttp_request = request
        self.deadline_scope: anyio.CancelScope | None = None

    @property
    def host_header(self) -> str:
        host: str | None = self.aiohttp_request.headers.get("Host")
        return host if host else f"{self.aiohttp_request.url.raw_host}:{self.aiohttp_request.url.port}"

    def begin_attempt(self) -> anyio.CancelScope | None:
        """Count a new attempt; the cancel scope that holds its first-byte deadline, if the policy sets one."""
        self.attempt_extensions(None)
        deadline = self.policy.first_byte_timeout
        if deadline is None:
            return None  # a cancel scope costs about as much as the rest of the guard's work on a request
        scope = self.deadline_scope = anyio.CancelScope(deadline=anyio.current_time() + deadline)
        return scope

    def connected(self) -> None:
        """The new connection is up and probed: the first-byte deadline starts now, as httpx's read timeout
        starts once the request is written (the connect and the probe have deadlines of their own)."""
        super().connected()
        scope, deadline = self.deadline_scope, self.policy.first_byte_timeout
        if scope is not None and deadline is not None:
            scope.deadline = anyio.current_time() + deadline

    def end_attempt(self) -> None:
        self.deadline_scope = None

    def attempt_failed(self, exc: BaseException | None) -> BaseException:
        """Judge a failed attempt (``exc`` None: the first-byte deadline expired); the exception to raise from it.
        Sets ``self.verdict`` for the retry hooks."""
        if self.tracker is None:  # the hooks saw no new connection: the attempt ran on a pooled one
            self.tracker = ProgressTracker(hooked=True)
        if exc is None:
            kind: FailureKind | None = FailureKind.FIRST_BYTE_TIMEOUT
            exc = FirstByteTimeout(
                f"no response headers from {self.description} within first_byte_timeout="
                f"{self.policy.first_byte_timeout:g} s; the connection was discarded"
            )
        else:
            kind = failure_kind(exc)
            if kind is not None and body_error(exc):
                # The headers were parsed: the attempt got as far as the response (known, not assumed).
                self.tracker.hooked = False
                self.tracker.saw_events = True
                self.tracker.progress = Progress.HEADERS
        if kind is None:
            return exc
        self.judge_failure(kind, type(exc).__name__, error_text(exc))
        return exc

    def final_error(self, exc: BaseException) -> BaseException:
        """The error for the caller once the guard stops: the same aiohttp class, with the guard's account."""
        message, elapsed = self.final_message(error_text(exc) or type(exc).__name__)
        return guarded_error(exc, message=message, attempts=self.attempts, elapsed=elapsed, history=self.history)


def error_text(exc: BaseException) -> str:
    return without_quoted_values(str(exc))


class FirstAttempt:
    """A request's first attempt while it has needed nothing but its body: most requests are answered by it on a
    pooled connection and need no `AiohttpRequest` (most of the guard's work per request). Keeps what one is built
    from, and builds it when something needs it (`guarded_run`): the connector hooks for a new connection, or the
    middleware on a failure or a 503/429; the run then carries on as if it had been there from the start."""

    __slots__ = ("body", "connection", "origin", "policy", "request", "run", "started", "stats", "stream")

    def __init__(
        self,
        request: aiohttp.ClientRequest,
        origin: Origin | None,
        policy: GuardPolicy,
        stats: GuardStats,
        body: bytes,
        stream: bool,
        started: float,
        connection: ConnectionChoice,
    ) -> None:
        self.request, self.origin, self.policy, self.stats = request, origin, policy, stats
        self.body, self.stream, self.started, self.connection = body, stream, started, connection
        self.run: AiohttpRequest | None = None

    def guarded_run(self) -> AiohttpRequest:
        run = self.run
        if run is None:
            run = self.run = AiohttpRequest(
                self.request,
                self.origin,
                self.policy,
                self.stats,
                body=self.body,
                stream=self.stream,
                started=self.started,
                connection=self.connection,
            )
            run.begin_attempt()  # this attempt, counted; no deadline (a first attempt sent as it is has none)
        return run


def current_run(request: aiohttp.ClientRequest) -> AiohttpRequest | None:
    """The guarded request of this task's attempt, if ``request`` is it (for the connector hooks)."""
    attempt = CURRENT_ATTEMPT.get()
    if attempt is None:
        return None
    run = attempt.guarded_run() if isinstance(attempt, FirstAttempt) else attempt
    return run if run.aiohttp_request is request else None


# The guarded request whose attempt runs in this task, for the connector hooks (connector.py): set by the
# middleware around each attempt, inside which aiohttp's connector makes any new connection.
CURRENT_ATTEMPT: contextvars.ContextVar[AiohttpRequest | FirstAttempt | None] = contextvars.ContextVar(
    "llama_guard_aiohttp_attempt", default=None
)
