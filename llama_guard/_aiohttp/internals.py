"""Every access the guard makes to private attributes of aiohttp, behind one version gate.

The guard hooks a connector's ``_create_connection`` (where a new connection is made, before its first request is
written: the probe goes there), marks a llama stream's connection to be closed on release
(``ResponseHandler.force_close()`` on ``response.connection.protocol``), and, for a session it guards, turns off
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

from .._core.log import logger

__all__ = [
    "TESTED_VERSIONS",
    "check_version",
    "disable_connection_retry",
    "drop_after_response",
    "hook_new_connections",
    "session_middlewares",
    "set_session_middlewares",
    "unhook_new_connections",
    "untested_version",
]

# The versions whose private attributes used here were read and run against (the guard's aiohttp tests).
TESTED_VERSIONS: frozenset[str] = frozenset({"3.12.15", "3.13.5", "3.14.5"})

_WARNED: set[str] = set()


def untested_version() -> str | None:
    """None when the imported aiohttp is a version in `TESTED_VERSIONS`; else why not, naming it.

    Read from ``aiohttp.__version__`` at each call, so that a test can change it."""
    version = aiohttp.__version__
    if version in TESTED_VERSIONS:
        return None
    return (
        f"aiohttp {version} is not a version llama_guard was tested with ({', '.join(sorted(TESTED_VERSIONS))}): "
        "the guard uses public API only: new connections are not probed and stream connections are not dropped "
        "after the final chunk (retries, the first-byte deadline and Connection: close on streams stay on)"
    )


def check_version() -> str | None:
    """`untested_version()`, logged once per process for each untested version."""
    reason = untested_version()
    if reason is not None and reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("%s", reason)
    return reason


# -- new connections ---------------------------------------------------------------------------------------------


class ConnectionHooks:
    """What the guard does around a connector's creation of a new connection (see `hook_new_connections`)."""

    def connecting(self, request: aiohttp.ClientRequest) -> None:
        raise NotImplementedError

    def connected(self, request: aiohttp.ClientRequest, transport: Any) -> Awaitable[None]:
        raise NotImplementedError


class _CreateConnection:
    """A connector's ``_create_connection`` with the guard's hooks around it (an instance attribute)."""

    __slots__ = ("create", "hooks")

    def __init__(self, create: Callable[..., Awaitable[Any]], hooks: ConnectionHooks) -> None:
        self.create = create
        self.hooks = hooks

    async def __call__(self, req: aiohttp.ClientRequest, traces: Any, timeout: Any) -> Any:
        self.hooks.connecting(req)
        protocol = await self.create(req, traces, timeout)
        try:
            await self.hooks.connected(req, protocol.transport)
        except BaseException:
            protocol.close()
            raise
        return protocol


def hook_new_connections(connector: aiohttp.BaseConnector, hooks: ConnectionHooks) -> str | None:
    """Run ``hooks`` around every new connection ``connector`` creates; None if done, else why not (untested
    aiohttp, or a connector that is not a `aiohttp.TCPConnector`)."""
    untested = check_version()
    if untested is not None:
        return untested
    if not isinstance(connector, aiohttp.TCPConnector):
        return f"the session's connector is a {type(connector).__name__}, not an aiohttp.TCPConnector: not probed"
    create = connector._create_connection
    if isinstance(create, _CreateConnection):
        create.hooks = hooks
    else:
        connector._create_connection = _CreateConnection(create, hooks)  # type: ignore[method-assign]
    return None


def unhook_new_connections(connector: aiohttp.BaseConnector) -> None:
    if isinstance(connector.__dict__.get("_create_connection"), _CreateConnection):
        del connector.__dict__["_create_connection"]


# -- responses and sessions --------------------------------------------------------------------------------------


def drop_after_response(response: aiohttp.ClientResponse) -> bool:
    """Have the connection of ``response`` closed, instead of pooled, once its body is read; False when that
    cannot be done (untested aiohttp, or no connection: the body is read already)."""
    if untested_version() is not None:
        return False
    connection = response.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is None:
        return False
    protocol.force_close()
    return True


def disable_connection_retry(session: aiohttp.ClientSession) -> bool:
    """Turn off aiohttp's own resend of an idempotent request after a dead pooled connection: the guard's
    middleware retries by its own rules (a resend outside it would repeat what the guard gave up on)."""
    if untested_version() is not None:
        return False
    session._retry_connection = False
    return True


def session_middlewares(session: aiohttp.ClientSession) -> Sequence[Any]:
    middlewares: Sequence[Any] = session._middlewares
    return middlewares


def set_session_middlewares(session: aiohttp.ClientSession, middlewares: Sequence[Any]) -> None:
    session._middlewares = tuple(middlewares)
