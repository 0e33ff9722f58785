"""Errors the aiohttp flavour raises, and the one place where aiohttp errors are translated into the guard's terms.

Every error the guard raises is an instance of the aiohttp class it stands for, so existing handlers keep working,
and of `GuardError`, which carries what the guard tried::

    aiohttp.ClientError
    ├── aiohttp.ClientConnectorError
    │   ├── ProbeTimeout            a new connection did not answer the probe (GET /health) in time
    │   └── ProbeError              a new connection answered the probe with an error or not at all
    ├── aiohttp.ServerTimeoutError (also asyncio.TimeoutError)
    │   └── FirstByteTimeout        no response headers within first_byte_timeout
    └── <aiohttp class X>
        └── Guarded<X>              X, after the guard's attempts ran out or it may not retry
    GuardError                      mixin of all of the above: .attempts, .elapsed, .history
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import aiohttp
from aiohttp.http_exceptions import BadHttpMessage, PayloadEncodingError

from .._core.decisions import FailureKind
from .._core.errors import GuardedClasses, GuardError

__all__ = [
    "FirstByteTimeout",
    "ProbeError",
    "ProbeTimeout",
    "body_error",
    "failure_kind",
    "guarded_error",
    "probe_error",
    "translate",
]


class _Account:
    """Shows the guard's account, once the guard has given up, instead of aiohttp's own message."""

    def __str__(self) -> str:
        message = self.__dict__.get("llama_guard_message")
        return str(message) if message is not None else super().__str__()


class ProbeTimeout(_Account, GuardError, aiohttp.ClientConnectorError):
    """A new connection did not answer the probe (``GET /health``) in time: the server is not reading it."""


class ProbeError(_Account, GuardError, aiohttp.ClientConnectorError):
    """A new connection failed the probe: closed, reset, or answered with something that is not HTTP."""


class FirstByteTimeout(_Account, GuardError, aiohttp.ServerTimeoutError):
    """No response headers arrived within ``first_byte_timeout`` of the attempt's connection being ready."""


def probe_error(cls: type[ProbeTimeout | ProbeError], request: aiohttp.ClientRequest, message: str) -> Exception:
    """A probe failure as aiohttp reports a failed connect (a `aiohttp.ClientConnectorError`, with the message as
    its ``strerror``), whose text is the probe's own message, not aiohttp's ``Cannot connect to host ...``."""
    code = errno.ETIMEDOUT if cls is ProbeTimeout else errno.ECONNABORTED
    error = cls(request.connection_key, OSError(code, message))
    error.__dict__["llama_guard_message"] = message  # replaced by the guard's account if it gives up
    return error


def translate(exc: Exception) -> Exception:
    """aiohttp's own error for a failure that aiohttp reports as a bug in itself, else ``exc``.

    aiohttp 3.12 and later on Python 3.12 and later start the request body's writer eagerly: when the server closes
    the connection between the body and its end (``write_eof``), the writer closes the connection before the
    response is started, and ``ClientResponse.start`` fails on ``None.read`` with an ``AttributeError`` (plain
    aiohttp raises it as is). It is the server closing a written request's connection: `ServerDisconnectedError`,
    judged as any other by how far the request got."""
    if isinstance(exc, AttributeError) and exc.obj is None and exc.name == "read" and _raised_in_response_start(exc):
        error = aiohttp.ServerDisconnectedError("the server closed the connection while the request was written")
        error.__cause__ = exc
        return error
    return exc


def _raised_in_response_start(exc: BaseException) -> bool:
    traceback = exc.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    if traceback is None:
        return False
    code = traceback.tb_frame.f_code
    return code.co_name == "start" and code.co_filename.endswith(("client_reqrep.py", "client_reqrep.pyc"))


def failure_kind(exc: BaseException) -> FailureKind | None:
    """The guard's name for why an attempt failed; None for errors that are not the network's (cancellation, a
    bug in another middleware, ...), which pass through untouched. The first-byte deadline is the middleware's own
    and is named there."""
    if isinstance(exc, (ProbeTimeout, ProbeError)):
        return FailureKind.PROBE
    if isinstance(exc, aiohttp.ClientConnectorError):  # DNS, refused, TLS handshake: nothing was sent
        return FailureKind.CONNECT
    if isinstance(exc, asyncio.TimeoutError):  # the caller's ClientTimeout (connect, sock_read, total)
        return FailureKind.CALLER_TIMEOUT
    if isinstance(exc, (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)):
        return FailureKind.LOCAL
    if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        # Reset, server disconnected, or a response that is not HTTP (aiohttp reports a parse error as a
        # ClientResponseError before any headers were delivered).
        return FailureKind.NETWORK
    if isinstance(exc, OSError):  # raw socket errors reach the middleware before aiohttp wraps them
        return FailureKind.NETWORK
    return None


def body_error(exc: BaseException) -> bool:
    """A failure in the response body, which aiohttp reports before handing out the headers when the body arrived
    with them (a bad chunk, a short body): the response had begun, so it is never retried."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, PayloadEncodingError):  # TransferEncodingError, ContentLengthError, ...
            return True
        # aiohttp's C parser (llhttp) reports a bad chunk as a plain BadHttpMessage; only its reason says where.
        if type(cause) is BadHttpMessage and "chunk" in str(cause.message).lower():
            return True
        cause = cause.__cause__
    return False


# Guarded<X> for each aiohttp error class X (a module attribute each), which says the guard's account.
_GUARDED: GuardedClasses[BaseException] = GuardedClasses(globals(), mixins=(_Account,))


def guarded_error(
    exc: BaseException, *, message: str, attempts: int, elapsed: float, history: tuple[str, ...]
) -> BaseException:
    """The error to raise when the guard stops trying: an instance of the same aiohttp class (its fields copied,
    since aiohttp's constructors differ from class to class) whose message carries the guard's account."""
    cls = _GUARDED.of(type(exc))
    error: Any = cls.__new__(cls)
    error.args = exc.args
    error.__dict__.update(exc.__dict__)
    if isinstance(exc, OSError):
        error.errno, error.strerror = exc.errno, exc.strerror
    error.__dict__["llama_guard_message"] = message
    error.attempts, error.elapsed, error.history = attempts, elapsed, history
    assert isinstance(error, GuardError)
    return error
