"""The aiohttp side of a guarded request: its body, what the core reads of it, and the I/O of its attempts.

Every decision about the request is its plan's and machine's (``_core/guard.py``, ``_core/request_machine.py``), and
the loop over its attempts is the shared one (``_drive/async_drive.py``); `AiohttpAttempts` does aiohttp's part:
call the middleware's handler once per attempt (under the first-byte deadline, a cancel scope), read a 503's body,
drop a stream's connection, and make the caller's error.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any

import aiohttp
import anyio
from aiohttp.payload import BytesPayload

from .._core.attempt_context import CURRENT_PLAN
from .._core.decisions import FailureKind, is_streaming_response
from .._core.errors import caller_error
from .._core.guard import RequestPlan
from .._core.log import without_url_secrets
from .._core.request_machine import ERROR_BODY_READ, Answered, Fail, Failed, RequestSignal, Send
from .._core.result import GuardResult
from .exceptions import FirstByteTimeout, body_error, failure_kind, guarded_error, translate
from .internals import drop_after_response, fail_body_on_connection_loss

__all__ = ["ATTEMPT_DEADLINE", "RESULTS", "AiohttpAttempts", "RequestView", "drop_stream", "plan_of", "request_body"]

# The guard's account of each response it handled; weak, so that it lives as long as the response.
RESULTS: weakref.WeakKeyDictionary[aiohttp.ClientResponse, GuardResult] = weakref.WeakKeyDictionary()


async def request_body(request: aiohttp.ClientRequest) -> bytes | None:
    """The request body when it is held in memory (and so can be inspected and sent again), else None."""
    body = request.body
    if isinstance(body, bytes):  # aiohttp's empty body
        return body
    if not isinstance(body, BytesPayload):
        return None  # a file or a generator: treated as a one-shot stream, never sent twice
    return await body.as_bytes()


class RequestView:
    """What the core reads of an aiohttp request (the attributes httpx's requests have), and the request."""

    __slots__ = ("aiohttp_request", "extensions", "headers", "method", "url")

    def __init__(self, request: aiohttp.ClientRequest) -> None:
        self.aiohttp_request = request
        self.method = request.method
        self.url = request.url  # yarl: scheme, host, port and path as httpx's URL has them
        self.headers = request.headers
        self.extensions: dict[str, Any] = {}

    @property
    def host_header(self) -> str:
        host: str | None = self.headers.get("Host")
        return host if host else f"{self.url.raw_host}:{self.url.port}"


def plan_of(request: aiohttp.ClientRequest) -> RequestPlan | None:
    """The plan of the guarded request whose attempt runs in this task, if ``request`` is it (for the connector's
    hooks: another session's request inside a guarded attempt is not)."""
    plan = CURRENT_PLAN.get()
    if plan is None or not isinstance(plan.request, RequestView) or plan.request.aiohttp_request is not request:
        return None
    return plan


# The cancel scope that holds the first-byte deadline of this task's attempt, for the connector's hooks: the
# deadline starts again once a new connection is up and probed (the connect and the probe have deadlines of their
# own), as httpx's read timeout starts once the request is written.
ATTEMPT_DEADLINE: contextvars.ContextVar[anyio.CancelScope | None] = contextvars.ContextVar(
    "llama_guard_aiohttp_deadline", default=None
)


class AiohttpAttempts:
    """The aiohttp I/O of one guarded request's attempts, for the shared drive loop (`AsyncAttemptIO`)."""

    __slots__ = ("_error", "_handler", "_plan", "_response")

    def __init__(self, plan: RequestPlan, handler: Any) -> None:
        self._plan = plan
        self._handler = handler
        self._response: aiohttp.ClientResponse | None = None
        self._error: BaseException | None = None

    @property
    def _request(self) -> aiohttp.ClientRequest:
        request: aiohttp.ClientRequest = self._plan.request.aiohttp_request
        return request

    async def send(self, send: Send) -> Answered | Failed:
        request = self._request
        if send.close_connection:
            request.headers["Connection"] = "close"  # aiohttp's own copy of the caller's headers
        deadline = send.first_byte_deadline
        token = CURRENT_PLAN.set(self._plan)
        response: aiohttp.ClientResponse | None = None
        try:
            if deadline is None:  # a cancel scope costs about as much as the rest of the guard's work on a request
                response = await self._handler(request)
            else:
                scope = anyio.CancelScope(deadline=anyio.current_time() + deadline)
                deadline_token = ATTEMPT_DEADLINE.set(scope)
                try:
                    with scope:
                        response = await self._handler(request)
                finally:
                    ATTEMPT_DEADLINE.reset(deadline_token)
        except Exception as exc:
            return self.failed(exc)
        finally:
            CURRENT_PLAN.reset(token)
        if response is None:  # the deadline cancelled the attempt; aiohttp closed its connection
            return self.failed(None)
        return self.answered(response)

    def failed(self, exc: Exception | None) -> Failed:
        """Judge a failed attempt (``exc`` None: the first-byte deadline expired); the error is kept for `error`."""
        plan = self._plan
        if exc is None:
            self._error = FirstByteTimeout(
                f"no response headers from {plan.description} within first_byte_timeout="
                f"{plan.policy.first_byte_timeout:g} s; the connection was discarded"
            )
            return Failed(FailureKind.FIRST_BYTE_TIMEOUT, "FirstByteTimeout", str(self._error))
        self._error = exc = translate(exc)
        kind = failure_kind(exc)
        if kind is not None and body_error(exc):
            plan.machine().headers_received()  # the headers were parsed: the attempt got as far as the response
        return Failed(kind, type(exc).__name__, error_text(exc))

    def answered(self, response: aiohttp.ClientResponse) -> Answered:
        self._response = response
        return Answered(response.status, response.headers, is_streaming_response(response.headers))

    async def read_error_body(self) -> RequestSignal | Failed:
        response = self._response
        assert response is not None
        try:
            await response.read()  # at the end of the body aiohttp puts the connection back in the pool
        except Exception as exc:  # judged as the 503/429 it was: retried by the schedule
            response.close()
            self._error = exc
            return Failed(None)
        except BaseException:
            response.close()
            raise
        return ERROR_BODY_READ

    def drop_stream(self) -> bool:
        assert self._response is not None
        return drop_stream(self._response, self._plan.stats)

    def respond(self, result: GuardResult) -> aiohttp.ClientResponse:
        response = self._response
        assert response is not None
        if result.connection_closed:
            fail_body_on_connection_loss(response)
        RESULTS[response] = result
        return response

    def error(self, fail: Fail | None) -> BaseException:
        assert self._error is not None
        return caller_error(self._error, fail, text=error_text, guarded=guarded_error)


def error_text(error: BaseException) -> str:
    """An error's message for the guard's history and errors: aiohttp's own words (a bad status line, the address
    a connect failed to), with a URL's query string and user info taken out (a `ClientResponseError` names the
    request's URL). Every quoted value was redacted, what made the message useful included."""
    return without_url_secrets(str(error))


def drop_stream(response: aiohttp.ClientResponse, stats: Any) -> bool:
    """llama-server closes a stream's connection right after the final chunk, whatever its headers said: have
    aiohttp close it instead of pooling it."""
    if not drop_after_response(response):
        return False
    stats.add(stream_connections_closed=1, stream_connections_dropped=1)
    return True
