"""`install()` for aiohttp: every `aiohttp.ClientSession` gets the guard at its first request while installed.

aiohttp has no transport class to wrap as httpx has: a session's requests all go through one private method,
named in ``llama_guard/_aiohttp/internals.py`` (``SESSION_REQUEST_METHOD``, wrapped only on the aiohttp versions
listed there). `install()` wraps that method; the wrapper hands the session, before its request starts, to
`guard_session()` of ``llama_guard.aiohttp``, which adds a `GuardMiddleware` for the installation's origins and
probes the session's new connections (aiohttp's own resend stays on: other origins are left as they were).
Sessions created before `install()` are covered at their next request, and so are sessions that other libraries
build and keep to themselves (litellm's ``LiteLLMAiohttpTransport``, its ``hosted_vllm/`` route). Requests to
other origins pass the middleware untouched. `uninstall()` takes the guard off every session it added it to.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import Any

from .._core.origins import OriginRegistry
from .._core.policy import GuardPolicy
from .._core.stats import GuardStats

__all__ = ["InstalledSessions", "session_request_method"]


def session_request_method() -> tuple[type, str] | str:
    """The session class and the name of the method to wrap; or, on an aiohttp version the guard was not tested with
    (or cannot run on), why `install()` leaves aiohttp's sessions alone."""
    from .._aiohttp.internals import SESSION_REQUEST_METHOD, sessions_out_of_reach  # imports aiohttp: once in use

    why = sessions_out_of_reach()
    if why is not None:
        return why
    module_name, qualified_name = SESSION_REQUEST_METHOD
    class_name, _, method = qualified_name.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name), method


class InstalledSessions:
    """The sessions one installation guarded, so that it can take the guard off them again."""

    def __init__(self, policy: GuardPolicy, stats: GuardStats, origins: OriginRegistry) -> None:
        self._policy = policy
        self._stats = stats
        self._origins = origins
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()  # every session handed over, guarded or not
        self._guarded: weakref.WeakSet[Any] = weakref.WeakSet()  # those this installation added the guard to
        self._lock = threading.Lock()

    def adopt(self, session: Any) -> None:
        """Add the guard to ``session`` unless this installation has seen it already or it has its own guard."""
        if session in self._seen:
            return
        from .._aiohttp.session import guard_of, guard_session  # imported once aiohttp is in use

        with self._lock:
            if session in self._seen:
                return
            self._seen.add(session)
            if guard_of(session) is not None:
                return  # guarded explicitly (guarded_session, guard_session): never twice
            # None on an aiohttp version the guard was not tested with; guard_session() has warned.
            if guard_session(session, policy=self._policy, stats=self._stats, origins=self._origins) is not None:
                self._guarded.add(session)

    def release(self) -> None:
        """Take the guard off every session this installation guarded."""
        with self._lock:
            guarded = list(self._guarded)
            if guarded:
                # Only a guarded session means aiohttp is installed: the default install has no aiohttp to import.
                from .._aiohttp.session import unguard_session

                for session in guarded:
                    unguard_session(session)
            self._guarded = weakref.WeakSet()
            self._seen = weakref.WeakSet()
