"""The httpx side of a guarded request: the body each attempt sends, the request it goes out as, and its errors.

The rest of a request's state (counting, verdicts, the retry schedule, probe deadlines, its result) is
`RequestState` in ``_core/request_state.py``, free of httpx.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from .._core.connection_strategy import REUSE_UNDECIDED, ConnectionChoice
from .._core.decisions import FailureKind, ProgressTracker, wants_stream
from .._core.log import without_quoted_values
from .._core.origin_probes import ProbeBook
from .._core.origins import Origin
from .._core.policy import GuardPolicy
from .._core.request_state import Prober, RequestState
from .._core.stats import GuardStats
from .exceptions import FirstByteTimeout, failure_kind, guarded_error

__all__ = ["AttemptBody", "FirstAttempt", "RequestRun", "request_body", "with_connection_close"]


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
    a new connection learns from its first request which guarded request opened it (``async_connections.py``);
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

    Only for a request whose first attempt needs no per-request state: a replayable body, no per-request options, no
    first-byte deadline (see the transport). A ``Connection: close`` it needs goes on a copy of the request
    (`with_connection_close`), never on the caller's.
    """

    __slots__ = (
        "_book",
        "_connection",
        "_may_close",
        "_origin",
        "_policy",
        "_prober",
        "_request",
        "_started",
        "_stats",
        "_wants_stream",
    )

    def __init__(
        self,
        request: httpx.Request,
        *,
        origin: Origin | None,
        policy: GuardPolicy,
        stats: GuardStats,
        prober: Prober,
        book: ProbeBook,
        content: bytes,
        wants_stream: bool,
        started: float,
        connection: ConnectionChoice,
        may_close: bool,
    ) -> None:
        """As `RequestRun`'s arguments; ``content``: the request's bytes."""
        self.run = None
        self._connection = connection
        self._may_close = may_close
        self._content = content
        self._stream = request.stream
        self._stats = stats
        self._prober = prober
        self._book = book
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
                self._stats,
                self._prober,
                body=self._content,
                stream=self._wants_stream,
                user_stream=self._stream,
                started=self._started,
                book=self._book,
                connection=self._connection,
                may_close=self._may_close,
            )
            run.adopt_first_attempt(self)
        return run


def with_connection_close(request: httpx.Request, body: AttemptBody, extensions: dict[str, Any]) -> httpx.Request:
    """A copy of ``request`` that carries ``Connection: close`` and sends ``body``: the caller's headers are never
    changed."""
    headers = request.headers.copy()
    headers["Connection"] = "close"
    return httpx.Request(request.method, request.url, headers=headers, stream=body, extensions=extensions)


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


class RequestRun(RequestState):
    """A guarded httpx request across its attempts: `RequestState` plus the attempt's request and body.

    The one place that changes the caller's ``httpx.Request``: `begin_attempt` lends it the attempt's body (and
    extensions, when the attempt needs its own) instead of copying the request, and `end_attempt` gives the
    caller's back, whatever the attempt's outcome. A request that needs ``Connection: close`` goes out as a new
    ``httpx.Request``; the caller's headers are never changed.
    """

    __slots__ = ("attempt_body", "user_stream")
    attempt_body: AttemptBody

    def __init__(
        self,
        request: httpx.Request,
        origin: Origin | None,
        policy: GuardPolicy,
        stats: GuardStats,
        prober: Prober,
        *,
        body: bytes | None,
        stream: bool,
        user_stream: Any,
        started: float,
        book: ProbeBook,
        connection: ConnectionChoice = REUSE_UNDECIDED,
        may_close: bool = True,
    ) -> None:
        """``body``, ``stream``: `request_body(request)`; ``user_stream``: the caller's ``request.stream``;
        ``connection``, ``may_close``: as `RequestState`'s."""
        super().__init__(
            request,
            origin,
            policy,
            stats,
            prober,
            body=body,
            stream=stream,
            started=started,
            book=book,
            connection=connection,
            may_close=may_close,
        )
        self.user_stream = user_stream

    def begin_attempt(self, trace: Any) -> httpx.Request:
        """The request one attempt sends; `end_attempt()` must follow."""
        extensions = self.attempt_extensions(trace)
        self.attempt_body = stream = AttemptBody(self, self.body, self.user_stream)
        request: httpx.Request = self.request
        if self.close_connection:
            return with_connection_close(request, stream, extensions)
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

    def attempt_failed(self, exc: BaseException) -> BaseException:
        """Judge a failed attempt; returns the exception to raise from it (a first-byte expiry becomes
        `FirstByteTimeout`). Sets ``self.verdict`` for the retry hooks."""
        tracker = self.tracker
        if tracker is None:  # the hooks saw no new connection: the attempt ran on a pooled one
            tracker = self.tracker = ProgressTracker(hooked=True)
        kind = failure_kind(exc, tracker, deadline_applied=self.deadline_applied)
        if kind is None:
            return exc
        assert isinstance(exc, httpx.TransportError)
        if kind is FailureKind.FIRST_BYTE_TIMEOUT:
            exc = FirstByteTimeout(
                f"no response headers from {self.description} within first_byte_timeout="
                f"{self.policy.first_byte_timeout:g} s; the connection was discarded",
                request=self.request,
            )
        self.judge_failure(kind, type(exc).__name__, error_text(exc))
        return exc

    def headers_arrived(self, response: httpx.Response) -> bool:
        """`RequestState.judge_response` for an httpx response."""
        return self.judge_response(response.status_code, response.headers)

    def final_error(self, exc: httpx.TransportError) -> httpx.TransportError:
        """The error for the caller once the guard stops: the same httpx class, with the guard's account."""
        message, elapsed = self.final_message(error_text(exc) or type(exc).__name__)
        return guarded_error(exc, message=message, attempts=self.attempts, elapsed=elapsed, history=self.history)


def error_text(exc: BaseException) -> str:
    """An exception's message for the guard's history and errors; what our side refused to send is not repeated."""
    text = str(exc)
    return without_quoted_values(text) if isinstance(exc, httpx.LocalProtocolError) else text
