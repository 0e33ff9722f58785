"""Errors of the requests/urllib3 flavour, and the one place where urllib3 and requests errors are translated into
the guard's terms.

The guard drives urllib3 (``HTTPConnectionPool.urlopen``), so it judges urllib3's errors; requests then wraps what
urllib3 raised in its own classes (``requests.ConnectionError(MaxRetryError(...))``), and the guard's adapter turns
that into the requests class the caller expects, carrying the guard's account::

    requests.RequestException
    ├── requests.ConnectionError
    │   ├── ProbeError              a new connection answered the probe with an error or not at all
    │   └── requests.ConnectTimeout
    │       └── ProbeTimeout        a new connection did not answer the probe (GET /health) in time
    ├── requests.Timeout
    │   └── requests.ReadTimeout
    │       └── FirstByteTimeout    no response headers within first_byte_timeout
    └── <requests class X>
        └── Guarded<X>              X, after the guard's attempts ran out or it may not retry
    GuardError                      mixin of all of the above: .attempts, .elapsed, .history

urllib3 used directly sees urllib3's own classes: ``Guarded<X>`` for a urllib3 error X (usually
``MaxRetryError``, whose ``reason`` says what failed: `Urllib3ProbeTimeout`, `Urllib3ProbeError`,
`Urllib3FirstByteTimeout` for the guard's own).
"""

from __future__ import annotations

import http.client
from typing import Any

import requests
import urllib3.exceptions as u3

from .._core.decisions import FailureKind
from .._core.errors import GuardedClasses, GuardError
from .._core.log import without_quoted_values, without_url_secrets

__all__ = [
    "FirstByteTimeout",
    "ProbeError",
    "ProbeTimeout",
    "Urllib3FirstByteTimeout",
    "Urllib3ProbeError",
    "Urllib3ProbeTimeout",
    "error_name",
    "error_text",
    "failure_kind",
    "guarded_requests_error",
    "guarded_urllib3_error",
]


# -- urllib3's level: what the guard raises inside urlopen ----------------------------------------------------------


class Urllib3ProbeTimeout(GuardError, u3.ConnectTimeoutError):
    """A new connection did not answer the probe in time (raised from its ``connect()``: nothing was sent)."""


class Urllib3ProbeError(GuardError, u3.NewConnectionError):
    """A new connection failed its probe: closed, reset, or answered with something that is not HTTP (raised from
    its ``connect()``: nothing was sent)."""


class Urllib3FirstByteTimeout(GuardError, u3.ReadTimeoutError):
    """No response headers within ``first_byte_timeout`` after the request was written."""


# -- requests' level: what the caller of a Session sees -----------------------------------------------------------


class ProbeTimeout(GuardError, requests.ConnectTimeout):
    """A new connection did not answer the probe (``GET /health``) in time: the server is not reading it."""


class ProbeError(GuardError, requests.ConnectionError):
    """A new connection failed the probe: closed, reset, or answered with something that is not HTTP."""


class FirstByteTimeout(GuardError, requests.ReadTimeout):
    """No response headers arrived within ``first_byte_timeout`` after the request was written."""


_PROBE_CLASSES: tuple[tuple[type[BaseException], type[requests.RequestException]], ...] = (
    (Urllib3ProbeTimeout, ProbeTimeout),
    (Urllib3ProbeError, ProbeError),
    (Urllib3FirstByteTimeout, FirstByteTimeout),
)


def reason_of(exc: BaseException) -> BaseException:
    """What failed: a ``MaxRetryError``'s reason, else the error itself."""
    if isinstance(exc, u3.MaxRetryError) and exc.reason is not None:
        return exc.reason
    return exc


def failure_kind(exc: BaseException, *, deadline_applied: bool) -> FailureKind | None:
    """The guard's name for why an attempt (one call of urllib3's ``urlopen``, which waits for the response
    headers) failed; None for errors that are not the network's (a bug, an interrupt), which pass through."""
    reason = reason_of(exc)
    if isinstance(reason, (Urllib3ProbeTimeout, Urllib3ProbeError)):
        return FailureKind.PROBE
    if isinstance(reason, u3.ReadTimeoutError):
        # Raised inside urlopen: waiting for the response headers, the request written.
        return FailureKind.FIRST_BYTE_TIMEOUT if deadline_applied else FailureKind.CALLER_TIMEOUT
    if isinstance(reason, (u3.ProxyError, u3.LocationValueError, u3.ProxySchemeUnknown)):
        return FailureKind.LOCAL
    if isinstance(reason, (u3.ConnectTimeoutError, u3.SSLError)):  # NewConnectionError, DNS, TLS: nothing sent
        return FailureKind.CONNECT
    if isinstance(reason, (u3.EmptyPoolError, u3.ClosedPoolError)):  # pool_block's wait: the caller's choice
        return FailureKind.CALLER_TIMEOUT
    if isinstance(reason, (u3.ProtocolError, u3.HTTPError, http.client.HTTPException, OSError)):
        return FailureKind.NETWORK
    return None


def error_name(exc: BaseException) -> str:
    """What failed, by class, for ``stats.errors`` and the history: a ``MaxRetryError``'s reason (urllib3 wraps each
    attempt's failure in one), the guard's own errors named as on every stack (``ProbeTimeout``...)."""
    reason = type(reason_of(exc))
    return _PUBLIC_NAMES.get(reason, reason.__name__)


def error_text(exc: BaseException) -> str:
    """An error's message for the guard's history and errors: what failed (a MaxRetryError's reason, without the
    URL it repeats), any URL's query string and user info redacted; and quoted values, where they may be what the
    caller was to send (a proxy's settings, a malformed URL). urllib3's reasons (a reset, a bad status line) stay
    readable."""
    reason = reason_of(exc)
    text = without_url_secrets(str(reason))
    if isinstance(reason, (u3.ProxyError, u3.LocationValueError, u3.ProxySchemeUnknown)):
        return without_quoted_values(text)
    return text


# The guard's own urllib3 errors, by the names the other stacks' errors have (docs/configuration.md, "errors").
_PUBLIC_NAMES: dict[type[BaseException], str] = {
    Urllib3ProbeTimeout: "ProbeTimeout",
    Urllib3ProbeError: "ProbeError",
    Urllib3FirstByteTimeout: "FirstByteTimeout",
}

# Guarded<X> for each urllib3 and requests error class X (a module attribute each).
_GUARDED: GuardedClasses[BaseException] = GuardedClasses(globals())


def _copy_as(cls: type[BaseException], exc: BaseException, args: tuple[Any, ...]) -> Any:
    """An instance of ``cls`` with ``exc``'s fields (urllib3's constructors differ from class to class)."""
    error: Any = cls.__new__(cls)
    error.__dict__.update(exc.__dict__)
    error.args = args
    return error


def guarded_urllib3_error(
    exc: BaseException, *, message: str, attempts: int, elapsed: float, history: tuple[str, ...]
) -> BaseException:
    """The urllib3 error to raise once the guard stops: the same class (``MaxRetryError`` keeps its ``reason``),
    whose message is the guard's account."""
    error = _copy_as(_GUARDED.of(type(exc)), exc, (message,))
    error.attempts, error.elapsed, error.history = attempts, elapsed, history
    return error  # type: ignore[no-any-return]


def guarded_requests_error(exc: requests.RequestException) -> requests.RequestException:
    """requests' error for a guarded request as the guard's: `ProbeTimeout`, `ProbeError`, `FirstByteTimeout` or
    ``Guarded<X>`` of requests' class X, when what urllib3 raised was the guard's; else ``exc`` as it is."""
    inner = exc.args[0] if exc.args else None
    if not isinstance(inner, GuardError) or isinstance(exc, GuardError):
        return exc
    reason = reason_of(inner)
    cls: type[BaseException] = next(
        (ours for theirs, ours in _PROBE_CLASSES if isinstance(reason, theirs)), _GUARDED.of(type(exc))
    )
    error = _copy_as(cls, exc, exc.args)
    error.attempts, error.elapsed, error.history = inner.attempts, inner.elapsed, inner.history
    return error  # type: ignore[no-any-return]
