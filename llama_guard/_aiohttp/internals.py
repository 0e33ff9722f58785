"""Every access the guard makes to private attributes of aiohttp, behind one version gate.

The guard hooks a connector's ``_create_connection`` (where a new connection is made, before its first request is
written: the probe goes there), marks a llama stream's connection to be closed on release (``response._protocol``:
``force_close()``, or ``close()`` when aiohttp has pooled it already), and, for a session it guards, turns off
aiohttp's own one-time resend of idempotent requests (``ClientSession._retry_connection``: the guard's rules decide
instead) and reads or replaces its ``_middlewares``. None of that is public API: it is done here only, and only on
the aiohttp versions in `TESTED_VERSIONS`. On any other version `check_version()` logs one warning naming it, and
the guard runs on public API only: retries, the first-byte deadline and ``Connection: close`` on streams stay on;
the probe and the drop after a stream are off, and ``stats.public_path`` says so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from .._core.log import WarnOnce
from .._readiness import readable_now

__all__ = [
    "SESSION_REQUEST_METHOD",
    "TESTED_VERSIONS",
    "check_version",
    "disable_connection_retry",
    "restore_connection_retry",
    "drop_after_response",
    "fail_body_on_connection_loss",
    "hook_new_connections",
    "session_middlewares",
    "session_of",
    "sessions_out_of_reach",
    "set_session_middlewares",
    "unhook_new_connections",
    "unhookable_connector",
    "unsupported_version",
    "untested_version",
]

# The versions whose private attributes used here were read and run against (the guard's aiohttp tests): every
# release on PyPI from 3.12.4 to 3.14.5 (there is no 3.12.5). 3.12.2 and 3.12.3 have no ``ResponseHandler.closed``,
# and 3.12.0 no ``Payload.as_bytes()`` either, which the public path needs too: the pin starts at 3.12.4.
TESTED_VERSIONS: frozenset[str] = frozenset(
    {
        *("3.12.4", "3.12.6", "3.12.7", "3.12.8", "3.12.9", "3.12.10", "3.12.11", "3.12.12", "3.12.13", "3.12.14"),
        *("3.12.15", "3.13.0", "3.13.1", "3.13.2", "3.13.3", "3.13.4", "3.13.5"),
        *("3.14.0", "3.14.1", "3.14.2", "3.14.3", "3.14.4", "3.14.5"),
    }
)


# Where install() hooks every session, those created before it included: wrap this method at class level (wrapt:
# module, name) to call `guard_session(self, ...)` before each request; only when `untested_version()` is None.
# aiohttp reads the session's middlewares inside this method, after the wrapper has run.
SESSION_REQUEST_METHOD = ("aiohttp.client", "ClientSession._request")


def unsupported_version() -> str | None:
    """Why the guard cannot run on the imported aiohttp at all, not even on its public API, or None. It needs client
    middlewares (aiohttp 3.12) and ``Payload.as_bytes()`` to read a request's body (3.12.2): asked of aiohttp itself,
    not of its version number."""
    if hasattr(aiohttp, "ClientMiddlewareType") and hasattr(aiohttp.payload.Payload, "as_bytes"):
        return None
    return (
        f"the guard needs aiohttp's client middlewares and Payload.as_bytes() (aiohttp 3.12.2 or later), and this is "
        f"aiohttp {aiohttp.__version__} (pip install 'aiohttp>=3.12.4,<3.15')"
    )


def untested_version() -> str | None:
    """None when the imported aiohttp is a version in `TESTED_VERSIONS`; else why not, naming it
    (`unsupported_version()` first), and what the guard does without its hooks."""
    return _version_gate(
        ": the guard uses public API only: new connections are not probed and stream connections are not dropped "
        "after the final chunk (retries, the first-byte deadline and Connection: close on streams stay on)"
    )


def sessions_out_of_reach() -> str | None:
    """Why `install()` cannot add the guard to the imported aiohttp's sessions, or None. It reaches them through a
    private method (`SESSION_REQUEST_METHOD`), which only the tested versions are known to have."""
    return _version_gate(
        ", and install() reaches sessions through a private method "
        "(llama_guard.aiohttp.guard_session(session) guards one on aiohttp's public API)"
    )


def _version_gate(consequence: str) -> str | None:
    """None on a version in `TESTED_VERSIONS`; else `unsupported_version()`'s reason, or the version named and
    ``consequence``. Read from ``aiohttp.__version__`` at each call, so that a test can change it."""
    version = aiohttp.__version__
    if version in TESTED_VERSIONS:
        return None
    return unsupported_version() or (
        f"aiohttp {version} is not a version llama_guard was tested with ({_tested_range()}){consequence}"
    )


def _tested_range() -> str:
    """`TESTED_VERSIONS` in a few words: its lowest and highest release, and how many."""
    ordered = sorted(TESTED_VERSIONS, key=lambda version: tuple(int(part) for part in version.split(".")))
    return f"{ordered[0]} to {ordered[-1]}, {len(ordered)} releases"


def check_version(warnings: WarnOnce) -> str | None:
    """`untested_version()`, logged once per process (``warnings``: the process's) for each untested version."""
    return warnings.warn_if(untested_version())


# -- new connections ---------------------------------------------------------------------------------------------


class ConnectionHooks:
    """What the guard does around a connector's creation of a new connection (see `hook_new_connections`)."""

    def connecting(self, request: aiohttp.ClientRequest, timeout: aiohttp.ClientTimeout) -> Awaitable[Any]:
        """Before the connection is opened (may wait for its turn); what it returns is handed to `finished`."""
        raise NotImplementedError

    def connected(self, request: aiohttp.ClientRequest, transport: Any, token: Any) -> Awaitable[None]:
        """The connection is open (the token of `connecting`); raising fails the connect (and closes the
        connection)."""
        raise NotImplementedError

    def finished(self, request: aiohttp.ClientRequest, token: Any) -> None:
        """The connect ended, however (the token of `connecting`)."""
        raise NotImplementedError


class _CreateConnection:
    """A connector's ``_create_connection`` with the guard's hooks around it (an instance attribute)."""

    __slots__ = ("create", "hooks")

    def __init__(self, create: Callable[..., Awaitable[Any]], hooks: ConnectionHooks) -> None:
        self.create = create
        self.hooks = hooks

    async def __call__(self, req: aiohttp.ClientRequest, traces: Any, timeout: Any) -> Any:
        token = await self.hooks.connecting(req, timeout)
        try:
            protocol = await self.create(req, traces, timeout)
            try:
                await self.hooks.connected(req, protocol.transport, token)
            except BaseException:
                protocol.close()
                raise
        finally:
            self.hooks.finished(req, token)
        return protocol


def unhookable_connector(connector: aiohttp.BaseConnector | None) -> str | None:
    """Why `hook_new_connections` cannot reach ``connector``'s new connections, whatever the aiohttp version: it is
    not an `aiohttp.TCPConnector` (an `aiohttp.UnixConnector`, a connector of the caller's own), or there is none;
    None when it can."""
    if connector is None:
        return "the session has no connector"
    if isinstance(connector, aiohttp.TCPConnector):
        return None
    return f"the session's connector is a {type(connector).__name__}, not an aiohttp.TCPConnector"


def hook_new_connections(connector: aiohttp.BaseConnector, hooks: ConnectionHooks, warnings: WarnOnce) -> str | None:
    """Run ``hooks`` around every new connection ``connector`` creates; None if done, else why not (untested
    aiohttp, said once through ``warnings``, or `unhookable_connector`)."""
    untested = check_version(warnings)
    if untested is not None:
        return untested
    unhookable = unhookable_connector(connector)
    if unhookable is not None:
        return unhookable
    create = connector._create_connection
    if isinstance(create, _CreateConnection):
        create.hooks = hooks
    else:
        connector._create_connection = _CreateConnection(create, hooks)  # type: ignore[method-assign]
    if not isinstance(connector._get, _GetPooled):
        connector._get = _GetPooled(connector, connector._get)  # type: ignore[method-assign]
    return None


def unhook_new_connections(connector: aiohttp.BaseConnector) -> None:
    for name in ("_create_connection", "_get"):
        if isinstance(connector.__dict__.get(name), (_CreateConnection, _GetPooled)):
            del connector.__dict__[name]


class _GetPooled:
    """A connector's ``_get`` (hand out an idle pooled connection) that first discards idle connections whose
    socket is readable: at end of file (the server closed it: llama-server after a stream or on a restart) or
    holding stray bytes. aiohttp learns of a close only when its event loop next reads the socket, so a request
    sent right after would be written to a dead connection; httpcore's pool makes the same check."""

    __slots__ = ("connector", "get")

    def __init__(self, connector: aiohttp.BaseConnector, get: Callable[..., Awaitable[Any]]) -> None:
        self.connector = connector
        self.get = get

    async def __call__(self, key: Any, traces: Any) -> Any:
        conns = self.connector._conns.get(key)
        while conns:
            protocol = conns[0][0]  # the one aiohttp hands out next
            transport = protocol.transport
            sock = transport.get_extra_info("socket") if transport is not None else None
            if sock is None or not readable_now(sock):
                break
            conns.popleft()
            protocol.close()
        if conns is not None and not conns:
            del self.connector._conns[key]
        return await self.get(key, traces)


# -- responses and sessions --------------------------------------------------------------------------------------


def drop_after_response(response: aiohttp.ClientResponse) -> bool:
    """Have the connection of ``response`` closed instead of pooled once its body is read; False when that cannot
    be done (an untested aiohttp).

    A body that had arrived whole by the time the headers were parsed has released its connection to the pool
    already, inside ``response.start()``, with no await since: it is idle there, and closing it now is safe (the
    pool discards a closed connection)."""
    if untested_version() is not None:
        return False
    protocol = response._protocol
    if protocol is None:
        return False
    if response.connection is not None:
        protocol.force_close()
    else:
        protocol.close()
    return True


def fail_body_on_connection_loss(response: aiohttp.ClientResponse) -> None:
    """Make a read of ``response``'s body fail, rather than wait forever, if its connection is lost first.

    aiohttp 3.14 drops a chunked body whose framing turns bad after the headers were handed out (a chunk size that
    is not hex): it closes the connection but never fails the body, and a reader waits forever (its sock_read
    timeout is dropped too). Only for a response whose connection is not reused (a llama stream), so that callbacks
    do not pile up on a long-lived connection."""
    if untested_version() is not None:
        return
    protocol = response._protocol
    closed = protocol.closed if protocol is not None else None
    if closed is None:
        return
    content = response.content

    def on_closed(future: Any) -> None:
        if not future.cancelled():
            future.exception()  # retrieved: asyncio would log an unretrieved one
        if not content.is_eof() and content.exception() is None:
            content.set_exception(
                aiohttp.ClientPayloadError("Response payload is not completed: the connection was closed")
            )

    closed.add_done_callback(on_closed)


def disable_connection_retry(session: aiohttp.ClientSession) -> bool | None:
    """Turn off aiohttp's own resend of an idempotent request after a dead pooled connection: the guard's
    middleware retries by its own rules (a resend outside it would repeat what the guard gave up on). Returns the
    setting it had (for `restore_connection_retry`), or None where the guard cannot reach it."""
    if untested_version() is not None:
        return None
    had = bool(session._retry_connection)
    session._retry_connection = False
    return had


def restore_connection_retry(session: aiohttp.ClientSession, had: bool) -> None:
    """Put back the setting `disable_connection_retry` found (the guard taken off a session)."""
    if untested_version() is None:
        session._retry_connection = had


def session_of(request: aiohttp.ClientRequest) -> aiohttp.ClientSession | None:
    """The session that sends ``request`` (None on an aiohttp version where the request does not say)."""
    session: aiohttp.ClientSession | None = getattr(request, "_session", None)
    return session


def session_middlewares(session: aiohttp.ClientSession) -> Sequence[Any]:
    middlewares: Sequence[Any] = session._middlewares
    return middlewares


def set_session_middlewares(session: aiohttp.ClientSession, middlewares: Sequence[Any]) -> None:
    session._middlewares = tuple(middlewares)
