"""Sessions with the guard: `guarded_session()` makes one; `guard_session()` adds the guard to one that exists
(what `install()` does with a session created before it), `unguard_session()` takes it off again."""

from __future__ import annotations

from typing import Any

import aiohttp

from .._core.origins import OriginRegistry
from .._core.policy import GuardPolicy
from .._core.stats import GuardStats
from .._runtime import PROCESS
from .adoption import adopt, guard_of, release
from .connector import GuardConnector
from .internals import check_version, session_middlewares, set_session_middlewares
from .middleware import GuardMiddleware

__all__ = ["guard_of", "guard_session", "guarded_session", "unguard_session"]


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
    adopt(session, guard)
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
    guard = guard_of(session)
    if guard is not None:
        return guard
    untested = check_version(PROCESS.warnings)
    if untested is not None:
        return None
    guard = GuardMiddleware(policy=policy, stats=stats, origins=origins)
    set_session_middlewares(session, (guard, *session_middlewares(session)))
    # aiohttp's own resend stays on when some origins are not the guard's: their requests are left as they were.
    adopt(session, guard, own_resend_off=guard.origins.every_origin)
    return guard


def unguard_session(session: aiohttp.ClientSession) -> bool:
    """Take the guard off a session guarded by `guard_session` or `guarded_session`; False if it had none."""
    guard = release(session)
    if guard is None:
        return False
    if check_version(PROCESS.warnings) is None:
        set_session_middlewares(session, [m for m in session_middlewares(session) if m is not guard])
    return True
