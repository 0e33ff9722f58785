"""`install()` for requests and urllib3: every urllib3 connection pool of the process, at its first request to a
guarded origin.

requests sends through urllib3 (``HTTPAdapter.send`` calls a pool's ``urlopen``), so one wrapper covers both:
`install()` wraps, with wrapt, ``urllib3.connectionpool.HTTPConnectionPool.urlopen`` (the https pool inherits it),
whatever imported urllib3 and whenever: sessions made before and after, the module-level ``requests.post`` (a new
session each call), urllib3's ``PoolManager`` and pools used directly. For a llama-server origin the wrapper hands
the call to the installation's `PoolGuard` (``llama_guard/_requests/pool_guard.py``), which hooks that pool (its
connections' class: the probe of new ones, the expiry of idle ones); any other origin's call goes to urllib3's own
method with the same arguments. A pool an explicit guard hooked (`GuardAdapter`, `guard(session)`) is left to it.
``HTTPAdapter.send`` is wrapped too, so that an error the guard gave up on reaches the caller as the guard's requests
class. `uninstall()` takes both wrappers off and puts every hooked pool back.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import wrapt

from .._core.origins import OriginRegistry
from .._core.policy import GuardPolicy
from .._core.stats import GuardStats

__all__ = ["MODULES", "InstalledPools", "patch_if_imported", "unpatch", "unsupported_urllib3"]

# The modules whose import patches them (post-import hooks): urllib3's pools, requests' adapter.
MODULES = ("urllib3", "requests")
# The stack's name in the counts per origin: install() sees urllib3's pools, whoever calls them.
STACK = "urllib3"

_handles: dict[str, tuple[type, str, Any]] = {}  # module -> (class, method, wrapper)


class InstalledPools:
    """The installation's guard of urllib3 pools, made at the first guarded request (importing
    ``llama_guard._requests`` imports urllib3, which an installation must not do by itself)."""

    def __init__(self, policy: GuardPolicy, stats: GuardStats, origins: OriginRegistry) -> None:
        self._policy = policy
        self._stats = stats
        self._origins = origins
        self._guard: Any = None
        self._released = False
        self._lock = threading.Lock()

    def guard(self) -> Any:
        """The `PoolGuard`; None once released."""
        guard = self._guard
        if guard is None:
            with self._lock:
                if self._released:
                    return None
                if self._guard is None:
                    from .._requests.pool_guard import PoolGuard
                    from .._runtime import PROCESS

                    origins, stats, policy = self._origins, self._stats, self._policy
                    self._guard = PoolGuard.made(
                        STACK, policy=policy, stats=stats, origins=origins, explicit=False, process=PROCESS
                    )
                guard = self._guard
        return guard

    def release(self) -> None:
        """Put back every pool this installation hooked."""
        with self._lock:
            self._released = True
            guard, self._guard = self._guard, None
        if guard is not None:
            guard.unhook_all()
            guard.close()


def patch_if_imported(current: Any) -> None:
    """Wrap urllib3's ``urlopen`` and requests' ``HTTPAdapter.send`` if those modules are imported (and not
    wrapped yet). ``current``: the active installation, whose ``urllib3_pools`` serve the wrappers."""
    if current is None:
        return
    urllib3 = sys.modules.get("urllib3")
    why = None if urllib3 is None else unsupported_urllib3(urllib3)
    if why is not None:
        current.leave_unguarded(STACK, "requests and urllib3", why)
        return
    if "urllib3" not in _handles and urllib3 is not None:
        from urllib3.connectionpool import HTTPConnectionPool

        _handles["urllib3"] = (
            HTTPConnectionPool,
            "urlopen",
            wrapt.wrap_function_wrapper(HTTPConnectionPool, "urlopen", _urlopen_wrapper),
        )
    if "requests" not in _handles and sys.modules.get("requests") is not None:
        adapters = sys.modules.get("requests.adapters")
        if adapters is None:  # requests' __init__ is still running: its adapters come with it
            return
        _handles["requests"] = (
            adapters.HTTPAdapter,
            "send",
            wrapt.wrap_function_wrapper(adapters.HTTPAdapter, "send", _send_wrapper),
        )


def unsupported_urllib3(urllib3: Any) -> str | None:
    """Why the guard cannot drive this urllib3 (it needs 2.x: its pools' ``urlopen``, connection classes and
    responses), or None."""
    version = str(getattr(urllib3, "__version__", "0"))
    if version.partition(".")[0] == "2":
        return None
    return f"the guard needs urllib3 2.x and this is urllib3 {version} (pip install 'urllib3>=2,<3')"


def unpatch() -> None:
    for module, (cls, method, handle) in list(_handles.items()):
        try:
            wrapt.unwrap_object(cls, method, handle, missing_ok=True)
        except wrapt.WrapperNotOutermostError:
            # Another library wrapped the method after us: ours stays in the chain, inert while nothing is installed.
            continue
        del _handles[module]


def _installed_guard() -> Any:
    from .patching import installation

    current = installation()
    return None if current is None else current.urllib3_pools.guard()


def _urlopen_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if instance is None:
        return wrapped(*args, **kwargs)
    from .._core.attempt_context import CURRENT_PLAN
    from .._requests.attempts import CallView
    from .._requests.pool_guard import pool_guard_of

    current = CURRENT_PLAN.get()
    if current is not None and isinstance(current.request, CallView):  # a guard's attempt, or a redirect in one
        return wrapped(*args, **kwargs)
    owner = pool_guard_of(instance)
    if owner is not None and owner.explicit:  # GuardAdapter's or guard(session)'s pool
        return wrapped(*args, **kwargs)
    guard = _installed_guard()
    if guard is None:
        return wrapped(*args, **kwargs)
    return guard.urlopen(instance, wrapped, *args, **kwargs)


def _send_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import requests

    try:
        return wrapped(*args, **kwargs)
    except requests.RequestException as exc:
        from .._requests.adapter import raise_guarded

        raise_guarded(exc)
        raise
