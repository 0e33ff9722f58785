"""Errors the guard raises, and the one place where httpx errors are translated into the guard's terms.

Every error the guard raises is an instance of the httpx class it stands for, so existing handlers keep working,
and of `GuardError`, which carries what the guard tried::

    Exception
    └── httpx.TransportError ... (httpx's own tree)
        ├── httpx.ReadTimeout
        │   └── FirstByteTimeout        no response headers within first_byte_timeout
        ├── httpx.ConnectTimeout
        │   └── ProbeTimeout            a new connection did not answer the probe (GET /health) in time
        ├── httpx.ConnectError
        │   └── ProbeError              a new connection answered the probe with an error or not at all
        └── <httpx class X>
            └── Guarded<X>              X, after the guard's attempts ran out or it may not retry
    GuardError                          mixin of all of the above: .attempts, .elapsed, .history
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from .._core.decisions import FailureKind
from .._core.errors import GuardedClasses, GuardError

__all__ = ["FirstByteTimeout", "GuardError", "ProbeError", "ProbeTimeout", "failure_kind", "guarded_error"]


class FirstByteTimeout(GuardError, httpx.ReadTimeout):
    """No response headers arrived within ``first_byte_timeout`` after the request was written."""


class ProbeTimeout(GuardError, httpx.ConnectTimeout):
    """A new connection did not answer the probe (``GET /health``) in time: the server is not reading it."""


class ProbeError(GuardError, httpx.ConnectError):
    """A new connection failed the probe: closed, reset, or answered with something that is not HTTP."""


# Guarded<X> for each httpx error class X (a module attribute each).
_GUARDED: GuardedClasses[httpx.TransportError] = GuardedClasses(globals())


def guarded_error(
    exc: httpx.TransportError, *, message: str, attempts: int, elapsed: float, history: tuple[str, ...]
) -> httpx.TransportError:
    """The error to raise when the guard stops trying: same httpx class, the guard's account in its message."""
    cls = _GUARDED.of(type(exc))
    try:
        request: httpx.Request | None = exc.request
    except RuntimeError:  # httpx raises this when the error was created without a request
        request = None
    error = cls(message, request=request)
    assert isinstance(error, GuardError)
    error.attempts, error.elapsed, error.history = attempts, elapsed, history
    return error


def failure_kind(exc: BaseException, *, deadline_applied: bool, waiting: Callable[[], bool]) -> FailureKind | None:
    """The guard's name for why an attempt failed; None for errors that are not the network's (cancellation,
    the caller's own trace callback raising, ...), which pass through untouched. ``waiting()``: the attempt was
    waiting for its response headers (a read timeout then is the first-byte deadline's, when it applied)."""
    if isinstance(exc, (ProbeTimeout, ProbeError)):
        return FailureKind.PROBE
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return FailureKind.CONNECT
    if isinstance(exc, httpx.ReadTimeout):
        return FailureKind.FIRST_BYTE_TIMEOUT if deadline_applied and waiting() else FailureKind.CALLER_TIMEOUT
    if isinstance(exc, (httpx.PoolTimeout, httpx.WriteTimeout)):
        return FailureKind.CALLER_TIMEOUT
    if isinstance(exc, (httpx.LocalProtocolError, httpx.UnsupportedProtocol, httpx.ProxyError)):
        return FailureKind.LOCAL
    if isinstance(exc, httpx.TransportError):
        return FailureKind.NETWORK
    return None
