"""Sessions with the guard: `guarded_session()` makes one; `guard_session()` adds the guard to one that exists
(what `install()` does with a session created before it), `unguard_session()` takes it off again."""

from __future__ import annotations

import weakref
from typing import Any

import aiohttp

from .._core.origins import OriginRegistry
from .._core.policy import GuardPolicy
from .._core.stats import GuardStats
from .._runtime import PROCESS
from .connector import GuardConnector, ProbingHooks
from .internals import (
    check_version,
    disable_connection_retry,
    hook_new_connections,
    session_middlewares,
    set_session_middlewares,
    unhook_new_connections,
    unhookable_connector,
    untested_version,
)
from .middleware import GuardMiddleware

__all__ = ["guard_of", "guard_session", "guarded_session", "unguard_session"]

_GUARDS: weakref.WeakKeyDictionary[aiohttp.ClientSession, GuardMiddleware] = weakref.WeakKeyDictionary()


def guarded_session(
    base_url: Any = None,
    *,
    policy: GuardPolicy | None = None,
    stats: GuardStats | None = None,
    middlewares: tuple[Any, ...] = (),
    **session_kwargs: Any,
) -> aiohttp.ClientSession:
    """An `aiohttp.ClientSession` guarded against llama-server: a `GuardConnector` (unless ``connector=`` gives
    one) and a `GuardMiddleware` ahead of ``middlewares``. Every other argument goes to `aiohttp.ClientSession`.
    The guard's counters: ``guard_of(session).stats`` (or pass ``stats=``)."""
    guard = GuardMiddleware(policy=policy, stats=stats)
    connector = session_kwargs.pop("connector", None)
    if connector is None:
        connector = GuardConnector()
    session = aiohttp.ClientSession(base_url, connector=connector, middlewares=(guard, *middlewares), **session_kwargs)
    _adopt(session, guard)
    return session


def guard_session(
    session: aiohttp.ClientSession,
    *,
    policy: GuardPolicy | None = None,
    stats: GuardStats | None = None,
    origins: OriginRegistry | None = None,
) -> GuardMiddleware | None:
    """Add the guard to an existing session, in place: its middleware first, its connector's new connections
    probed. Returns the session's guard (the one it has already, if it is guarded), or None when the session
    cannot be changed (an aiohttp version the guard was not tested with: one warning says so)."""
    guard = _GUARDS.get(session)
    if guard is not None:
        return guard
    untested = check_version(PROCESS.warnings)
    if untested is not None:
        return None
    guard = GuardMiddleware(policy=policy, stats=stats, origins=origins)
    set_session_middlewares(session, (guard, *session_middlewares(session)))
    # aiohttp's own resend stays on when some origins are not the guard's: their requests are left as they were.
    _adopt(session, guard, own_resend_off=guard.origins.every_origin)
    return guard


def unguard_session(session: aiohttp.ClientSession) -> bool:
    """Take the guard off a session guarded by `guard_session` or `guarded_session`; False if it had none."""
    guard = _GUARDS.pop(session, None)
    if guard is None:
        return False
    if check_version(PROCESS.warnings) is None:
        set_session_middlewares(session, [m for m in session_middlewares(session) if m is not guard])
    if session.connector is not None and not isinstance(session.connector, GuardConnector):
        unhook_new_connections(session.connector)
    return True


def guard_of(session: aiohttp.ClientSession) -> GuardMiddleware | None:
    """The guard of a session made by `guarded_session` or guarded by `guard_session`; else None."""
    return _GUARDS.get(session)


def _adopt(session: aiohttp.ClientSession, guard: GuardMiddleware, *, own_resend_off: bool = True) -> None:
    """The guard's part of a guarded session: its connector probes, and aiohttp's own one-time resend of an
    idempotent request is off (the guard's rules decide; aiohttp would resend what the guard gave up on).

    Where the guard cannot see the connector's new connections it says so apart from why: ``stats.public_path``
    for an aiohttp version it was not tested with (public API only: no probe, no drop after a stream), and
    ``stats.probing_off``, at the first request that would probe, for a connector that is not an
    `aiohttp.TCPConnector` (an `aiohttp.UnixConnector`: ``"auto"`` closes every connection there, as on httpx's
    ``uds=``, and nothing needs a probe)."""
    _GUARDS[session] = guard
    connector = session.connector
    warnings = guard.process.warnings
    # Why the guard is on aiohttp's public API only (GuardConnector.probing_off: the same, worked out when it was made).
    public = connector.probing_off if isinstance(connector, GuardConnector) else check_version(warnings)
    unhookable = unhookable_connector(connector)
    if unhookable is not None:
        guard.connections_unseen(
            f"{unhookable}, so the guard cannot see its new connections",
            unix_socket=isinstance(connector, aiohttp.UnixConnector),
            unprobed=None if public is not None else f"{unhookable}, so the guard cannot probe its new connections",
        )
    elif public is not None:
        guard.connections_unseen(
            f"aiohttp {aiohttp.__version__} is not a version llama_guard was tested with, so the guard cannot see "
            "the session's new connections",
            unix_socket=False,
            unprobed=None,
        )
    elif connector is not None and not isinstance(connector, GuardConnector):
        hook_new_connections(connector, ProbingHooks(), warnings)
    if own_resend_off and not disable_connection_retry(session) and public is None:
        public = "aiohttp's own resend of idempotent requests stays on"
    if public is not None:
        guard.stats.public_path = public
        if untested_version() is None:  # else the version gate has said it once
            warnings.warning(f"llama_guard on an aiohttp session: {public}")
