"""The urllib3 side of a guarded request: what the core reads of it, and the I/O of its attempts.

Every decision about the request is its plan's and machine's (``_core/guard.py``, ``_core/request_machine.py``), and
the loop over its attempts is the shared one (``_drive/sync_drive.py``). One attempt is one call of the pool's own
``HTTPConnectionPool.urlopen`` (``pool_guard.py``), with urllib3's own retries taken out; `Urllib3Attempts` makes
that call, reads a 503's short body, marks a stream's connection to be dropped, and makes the caller's error.
"""

from __future__ import annotations

import functools
import io
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from urllib3.response import BaseHTTPResponse, HTTPResponse
from urllib3.util.timeout import Timeout

from .._core.attempt_context import CURRENT_PLAN
from .._core.decisions import FailureKind
from .._core.errors import caller_error
from .._core.guard import RequestPlan
from .._core.llama_server import RETRIED_STATUSES
from .._core.request_machine import ERROR_BODY_READ, MAX_SOCKET_WAIT, Answered, Fail, Failed, RequestSignal, Send
from .._core.result import GuardResult
from .exceptions import Urllib3FirstByteTimeout, error_name, error_text, failure_kind, guarded_urllib3_error
from .internals import pool_timeout

__all__ = [
    "RESULT_ATTRIBUTE",
    "CallView",
    "Url",
    "Urllib3Attempts",
    "drop_stream",
    "is_streaming",
    "target_url",
    "with_close",
]

# The attribute a guarded response carries its `GuardResult` in.
RESULT_ATTRIBUTE = "_llama_guard_result"


@dataclass(frozen=True, slots=True)
class Url:
    """A request's URL with the parts the core reads (as httpx's ``URL`` has them)."""

    scheme: str
    host: str
    port: int | None
    path: str

    @property
    def netloc(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port is None else f"{host}:{self.port}").encode("ascii", "replace")


def target_url(pool: Any, url: object) -> Url:
    """What a ``urlopen`` call on ``pool`` asks for: ``url`` is a path on the pool's origin or, on a pool of a
    forwarding proxy (urllib3's ``ProxyManager``, an http:// target), the absolute URL the proxy is to fetch: the
    pool's host is then the proxy's, not the server's."""
    text = str(url)
    if text[:1] != "/" and "://" in text:
        parts = urlsplit(text)
        return Url(parts.scheme.lower(), parts.hostname or "", parts.port, parts.path or "/")
    return Url(pool.scheme, pool.host, pool.port, text.partition("?")[0])


class CallView:
    """What the core reads of one guarded ``urlopen`` call (``method``, ``url``, ``headers``, ``extensions``, worked
    out when asked), and the call every attempt makes: the caller's, with urllib3's own retries taken out (see
    ``pool_guard.py``), the body left unread (the guard judges the headers first) and, when the plan says so,
    ``Connection: close`` on a copy of the headers."""

    __slots__ = ("_extensions", "call", "method", "pool")

    def __init__(self, pool: Any, call: dict[str, Any], method: str) -> None:
        self.pool = pool
        self.call = call
        self.method = method
        self._extensions: dict[str, Any] | None = None

    @property
    def url(self) -> Url:
        return target_url(self.pool, self.call["url"])

    @property
    def headers(self) -> Any:
        headers = self.call.get("headers")
        return headers if headers is not None else self.pool.headers

    @property
    def host_header(self) -> str:
        headers = self.headers
        if headers:
            for name, value in headers.items():
                if name.lower() == "host":
                    return str(value)
        return self.url.netloc.decode("ascii")

    @property
    def extensions(self) -> dict[str, Any]:
        """The caller's read timeout, as httpx's ``timeout`` extension holds it (the first-byte deadline is armed
        only when it is shorter)."""
        if self._extensions is None:
            timeout = pool_timeout(self.pool, self.call.get("timeout", Timeout.DEFAULT_TIMEOUT))
            self._extensions = {"timeout": {"read": _read_seconds(timeout)}}
        return self._extensions

    def timeout(self) -> Timeout:
        """The call's timeout, as the pool works it out."""
        return pool_timeout(self.pool, self.call.get("timeout", Timeout.DEFAULT_TIMEOUT))


def _read_seconds(timeout: Timeout) -> float | None:
    """The read timeout of a urllib3 ``Timeout`` in seconds, or None."""
    read = timeout.read_timeout
    if isinstance(read, (int, float)):
        return float(read)
    if read is None:
        return None
    return socket.getdefaulttimeout()  # urllib3's _DEFAULT_TIMEOUT: the socket module's default


def with_close(headers: Any) -> dict[str, Any]:
    """A copy of ``headers`` with ``Connection: close`` (replacing any Connection header)."""
    closing = {name: value for name, value in headers.items() if name.lower() != "connection"}
    closing["Connection"] = "close"
    return closing


class Urllib3Attempts:
    """The urllib3 I/O of one guarded request's attempts, for the shared drive loop (`SyncAttemptIO`)."""

    __slots__ = ("_error", "_original", "_plan", "_preload", "_response")

    def __init__(self, plan: RequestPlan, original: Any, preload: tuple[bool, bool]) -> None:
        """``original``: the pool's own ``urlopen``, bound; ``preload``: the caller's ``preload_content`` and
        ``decode_content``."""
        self._plan = plan
        self._original = original
        self._preload = preload
        self._response: BaseHTTPResponse | None = None
        self._error: BaseException | None = None

    @property
    def _view(self) -> CallView:
        view: CallView = self._plan.request
        return view

    def send(self, send: Send) -> Answered | Failed:
        view = self._view
        call = view.call  # Connection: close on its copy of the headers already, when the plan says it
        deadline = send.first_byte_deadline
        if deadline is not None:  # the first-byte deadline rides on the read timeout, for the headers
            call = dict(call)
            call["timeout"] = Timeout(connect=view.timeout().connect_timeout, read=min(deadline, MAX_SOCKET_WAIT))
        token = CURRENT_PLAN.set(self._plan)
        try:
            response: BaseHTTPResponse = self._original(**call)
        except Exception as exc:
            return self.failed(exc)
        finally:
            CURRENT_PLAN.reset(token)
        if deadline is not None and response.status not in RETRIED_STATUSES:
            _restore_read_timeout(response, self._plan.caller_read_timeout())
        return self.answered(response)

    def failed(self, exc: Exception) -> Failed:
        plan = self._plan
        kind = failure_kind(exc, deadline_applied=plan.machine().deadline_applied)
        if kind is FailureKind.FIRST_BYTE_TIMEOUT:
            pool: Any = getattr(exc, "pool", None)
            timeout = Urllib3FirstByteTimeout(
                pool,
                getattr(exc, "url", None),
                f"no response headers from {plan.description} within first_byte_timeout="
                f"{plan.policy.first_byte_timeout:g} s; the connection was discarded",
            )
            timeout.__cause__ = exc
            exc = timeout
        self._error = exc
        return Failed(kind, error_name(exc), error_text(exc))

    def answered(self, response: BaseHTTPResponse) -> Answered:
        self._response = response
        return Answered(response.status, response.headers, is_streaming(response))

    def read_error_body(self) -> RequestSignal | Failed:
        """A retriable 503/429 (a short JSON error: the machine checked its length): read whole so that its
        connection goes back to the pool, and replaced by a response that holds the same bytes, for the caller if
        this was the last attempt."""
        response = self._response
        assert response is not None
        try:
            data = response.read(decode_content=False)  # its Content-Length is at most MAX_RETRIED_ERROR_BODY
        except Exception as exc:
            self._error = exc
            return Failed(None)
        finally:
            response.release_conn()
        # urllib3 2.2.3 and later say the version as text too ("HTTP/1.1"; "HTTP/?" unless given).
        version_string: dict[str, Any] = (
            {"version_string": response.version_string} if hasattr(response, "version_string") else {}
        )
        self._response = HTTPResponse(
            body=io.BytesIO(data),
            headers=response.headers,
            status=response.status,
            version=response.version,
            reason=response.reason,
            preload_content=False,
            decode_content=False,
            request_method=getattr(response, "_request_method", None),
            request_url=response.url,
            retries=response.retries,
            **version_string,
        )
        return ERROR_BODY_READ

    def drop_stream(self) -> bool:
        assert self._response is not None
        return drop_stream(self._response, self._plan.stats)

    def respond(self, result: GuardResult) -> BaseHTTPResponse:
        response = self._response
        assert response is not None
        return respond(response, result, self._preload)

    def error(self, fail: Fail | None) -> BaseException:
        assert self._error is not None
        return caller_error(self._error, fail, text=error_text, guarded=guarded_urllib3_error)


def respond(response: BaseHTTPResponse, result: GuardResult, preload: tuple[bool, bool]) -> BaseHTTPResponse:
    """The caller's response, carrying ``result``. urllib3 reads a preloaded body in urlopen (``preload_content``,
    its default; requests asks for none); each attempt left it unread (the guard judges the headers first), so it is
    read here, and the connection goes back to the pool at its end."""
    setattr(response, RESULT_ATTRIBUTE, result)
    preload_content, decode_content = preload
    if preload_content:
        response.read(decode_content=decode_content, cache_content=True)
    return response


def is_streaming(response: BaseHTTPResponse) -> bool:
    """`is_streaming_response` for a urllib3 response: its ``chunked`` flag says Transfer-Encoding: chunked without a
    header lookup (case-insensitive lookups cost as much as the rest of the guard's work on an answer)."""
    if getattr(response, "chunked", False):
        return True
    content_type: str = response.headers.get("content-type", "")
    return content_type[:17].lower() == "text/event-stream"


def drop_stream(response: BaseHTTPResponse, stats: Any) -> bool:
    """llama-server closes a stream's connection right after the final chunk, whatever its headers said: the
    response's ``release_conn`` closes the connection before it gives it back to the pool (urllib3 opens a new one in
    its place when it is next taken), instead of pooling it."""
    connection = getattr(response, "connection", None)
    if connection is None or getattr(connection, "sock", None) is None:
        return connection is not None  # http.client closed it already (the response said Connection: close)
    response.release_conn = functools.partial(_release_dropped, response, stats)  # type: ignore[method-assign]
    return True


def _release_dropped(response: BaseHTTPResponse, stats: Any) -> None:
    """A dropped stream's ``release_conn`` (urllib3 and requests call it at the body's end or the response's
    close): its connection closed and counted, then given back as urllib3 does."""
    del response.release_conn  # the class's own again, and no cycle left through the instance
    connection: Any = response.connection
    if connection is not None and connection.sock is not None:
        stats.add(stream_connections_closed=1, stream_connections_dropped=1)
        connection.close()
    response.release_conn()


def _restore_read_timeout(response: BaseHTTPResponse, read: float | None) -> None:
    """The headers came under the first-byte deadline: the body is read under the caller's own read timeout, on
    the socket the body comes from (http.client's response holds it even when its connection let go of it:
    ``Connection: close``)."""
    body = getattr(getattr(getattr(response, "_fp", None), "fp", None), "raw", None)
    sock = getattr(body, "_sock", None)
    if sock is None:
        sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        sock.settimeout(read)
