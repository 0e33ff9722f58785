"""The urllib3 side of a guarded request: what `RequestState` reads of it, its errors, and its first-byte deadline.

Everything decided about a request (counting, verdicts, the retry schedule, probe deadlines, its result) is
`RequestState` in ``_core/request_state.py``, shared with the httpx and aiohttp flavours; `Urllib3Run` adds what
needs urllib3. One attempt is one call of urllib3's ``HTTPConnectionPool.urlopen`` (``pool_guard.py``).
"""

from __future__ import annotations

import contextvars
import socket
from typing import Any, Protocol

from .._core.connection_strategy import REUSE_UNDECIDED, ConnectionChoice
from .._core.decisions import FailureKind, ProgressTracker
from .._core.origin_probes import ProbeBook
from .._core.origins import Origin
from .._core.policy import GuardPolicy
from .._core.request_state import MAX_SOCKET_WAIT, RequestState
from .._core.stats import GuardStats
from .exceptions import Urllib3FirstByteTimeout, error_text, failure_kind, guarded_urllib3_error

__all__ = ["CURRENT_RUN", "GuardedAttempt", "RequestView", "Url", "Urllib3Run", "caller_read_timeout"]


class Url:
    """A request's URL with the parts `RequestState` reads (as httpx's ``URL`` has them)."""

    __slots__ = ("host", "path", "port", "scheme")

    def __init__(self, scheme: str, host: str, port: int | None, path: str) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port
        self.path = path

    @property
    def netloc(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port is None else f"{host}:{self.port}").encode("ascii", "replace")


class RequestView:
    """What `RequestState` reads of a request: ``method``, ``url``, ``headers`` and ``extensions``."""

    __slots__ = ("extensions", "headers", "method", "url")

    def __init__(self, method: str, url: Url, headers: Any, read_timeout: float | None) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        # The caller's read timeout, as httpx's timeout extension holds it: the first-byte deadline is armed only
        # when it is shorter.
        self.extensions: dict[str, Any] = {"timeout": {"read": read_timeout}}


def _no_prober(stream: Any, run: Any, /) -> Any:  # the connection hook probes (connections.py), not the state
    raise AssertionError("the urllib3 flavour probes in its connection hook")


def caller_read_timeout(timeout: Any) -> float | None:
    """The read timeout of a urllib3 ``Timeout`` (already the pool's ``_get_timeout``), in seconds or None."""
    read = timeout.read_timeout
    if isinstance(read, (int, float)):
        return float(read)
    if read is None:
        return None
    return socket.getdefaulttimeout()  # urllib3's _DEFAULT_TIMEOUT: the socket module's default


class Urllib3Run(RequestState):
    """A guarded urllib3 request across its attempts: `RequestState`, and the guard that owns it (whose
    connection hooks probe, keep given-up connections watched, and remember origins that cannot be probed)."""

    __slots__ = ("guard",)

    def __init__(
        self,
        request: RequestView,
        origin: Origin | None,
        policy: GuardPolicy,
        stats: GuardStats,
        guard: Any,
        *,
        body: bytes | None,
        stream: bool,
        started: float,
        book: ProbeBook,
        connection: ConnectionChoice = REUSE_UNDECIDED,
    ) -> None:
        super().__init__(
            request,
            origin,
            policy,
            stats,
            _no_prober,
            body=body,
            stream=stream,
            started=started,
            book=book,
            connection=connection,
        )
        self.guard = guard

    def guarded_run(self) -> Urllib3Run:
        """This run (as a first attempt sent as is builds it, for the connection hook)."""
        return self

    @property
    def host_header(self) -> str:
        headers = self.request.headers
        if headers:
            for name, value in headers.items():
                if name.lower() == "host":
                    return str(value)
        netloc: bytes = self.request.url.netloc
        return netloc.decode("ascii")

    def begin_attempt(self) -> float | None:
        """Count a new attempt; the read timeout it goes out with when the first-byte deadline is armed, else
        None (the caller's own)."""
        self.attempt_extensions(None)
        if not self.deadline_applied:
            return None
        read = self.attempt_timeouts["read"]
        return MAX_SOCKET_WAIT if read is None else min(read, MAX_SOCKET_WAIT)

    def caller_read(self) -> float | None:
        """The caller's read timeout, for the body once the headers arrived under the first-byte deadline."""
        read: float | None = self.user_timeouts.get("read")
        return read

    def attempt_failed(self, exc: BaseException) -> BaseException | None:
        """Judge a failed attempt; the exception to keep for it (a first-byte expiry becomes
        `Urllib3FirstByteTimeout`), or None for an error that is not the network's (raised as it is). Sets
        ``self.verdict`` for the retry schedule."""
        if self.tracker is None:  # the hook saw no new connection: the attempt ran on a pooled one
            self.tracker = ProgressTracker(hooked=True)
        kind = failure_kind(exc, deadline_applied=self.deadline_applied)
        if kind is None:
            return None
        if kind is FailureKind.FIRST_BYTE_TIMEOUT:
            pool: Any = getattr(exc, "pool", None)
            exc = Urllib3FirstByteTimeout(
                pool,
                getattr(exc, "url", None),
                f"no response headers from {self.description} within first_byte_timeout="
                f"{self.policy.first_byte_timeout:g} s; the connection was discarded",
            )
        self.judge_failure(kind, type(exc).__name__, error_text(exc))
        return exc

    def final_error(self, exc: BaseException) -> BaseException:
        """The error for the caller once the guard stops: the same urllib3 class, with the guard's account."""
        message, elapsed = self.final_message(error_text(exc) or type(exc).__name__)
        return guarded_urllib3_error(
            exc, message=message, attempts=self.attempts, elapsed=elapsed, history=self.history
        )


# The guarded request whose attempt runs in this thread (or task), for the connection hook (connections.py): set by
# the guard around each call of urllib3's urlopen, inside which a new connection connects. Also tells the guard
# that a urlopen called inside an attempt (urllib3's own redirect) is part of it.
class GuardedAttempt(Protocol):
    """A `Urllib3Run`, or the guard's first attempt that builds one when asked (``pool_guard._FirstAttempt``)."""

    def guarded_run(self) -> Urllib3Run: ...


CURRENT_RUN: contextvars.ContextVar[GuardedAttempt | None] = contextvars.ContextVar(
    "llama_guard_urllib3_run", default=None
)
