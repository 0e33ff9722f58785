"""Which guard each aiohttp session has, and what adding one does to the session (`adopt`): its connector's new
connections probed, aiohttp's own resend turned off, and whatever cannot be done said; `release` undoes it.
`guarded_session` and `guard_session` adopt a session when they guard it; a `GuardMiddleware` put in a session by
hand adopts it at its first request there (it would otherwise probe nothing, and say nothing)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import aiohttp

from .connector import GuardConnector, ProbingHooks
from .internals import (
    check_version,
    disable_connection_retry,
    hook_new_connections,
    restore_connection_retry,
    unhook_new_connections,
    unhookable_connector,
    untested_version,
)

if TYPE_CHECKING:
    from .middleware import GuardMiddleware

__all__ = ["adopt", "guard_of", "release"]

_GUARDS: weakref.WeakKeyDictionary[aiohttp.ClientSession, GuardMiddleware] = weakref.WeakKeyDictionary()
# aiohttp's own resend as each guarded session had it, put back when the guard is taken off (`unguard_session`).
_RESEND: weakref.WeakKeyDictionary[aiohttp.ClientSession, bool] = weakref.WeakKeyDictionary()


def guard_of(session: aiohttp.ClientSession) -> GuardMiddleware | None:
    """The guard of a session made by `guarded_session`, guarded by `guard_session`, or that a `GuardMiddleware`
    put in by hand has served a request of; else None."""
    return _GUARDS.get(session)


def adopt(session: aiohttp.ClientSession, guard: GuardMiddleware, *, own_resend_off: bool = True) -> None:
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
    had = disable_connection_retry(session) if own_resend_off else None
    if had is not None:
        _RESEND[session] = had
    elif own_resend_off and public is None:
        public = "aiohttp's own resend of idempotent requests stays on"
    if public is not None:
        guard.stats.public_path = public
        if untested_version() is None:  # else the version gate has said it once
            warnings.warning(f"llama_guard on an aiohttp session: {public}")


def release(session: aiohttp.ClientSession) -> GuardMiddleware | None:
    """Undo `adopt`: the session's guard forgotten (returned, for the caller to take its middleware off), its
    connector unhooked and aiohttp's own resend as it was (without it, a plain session's streams lose requests).
    None if the session had no guard."""
    guard = _GUARDS.pop(session, None)
    if guard is None:
        return None
    if session.connector is not None and not isinstance(session.connector, GuardConnector):
        unhook_new_connections(session.connector)
    had = _RESEND.pop(session, None)
    if had is not None:
        restore_connection_retry(session, had)
    return guard
