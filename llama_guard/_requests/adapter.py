"""`GuardAdapter`, the guard as a requests transport adapter, and `guard_session` for a session that exists.

The adapter is requests' own ``HTTPAdapter`` whose urllib3 pools are hooked by a `PoolGuard` (``pool_guard.py``):
the guard works inside urllib3's ``urlopen``, where it sees each attempt's connection, and requests turns what
urllib3 answers or raises into its response and exceptions as usual. The adapter's own part is the last step: an
error the guard gave up on becomes the requests class requests would raise, as the guard's (`ProbeTimeout`,
``Guarded<requests.ConnectionError>``...), so ``except requests.ConnectionError`` keeps working.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import requests
import requests.adapters

from .._core.guard import GuardAttributes
from .._core.origins import OriginRegistry
from .._core.policy import GuardPolicy
from .._core.request_options import request_options
from .._core.result import GuardResult
from .._core.stats import GuardStats
from .._runtime import PROCESS
from .exceptions import guarded_requests_error
from .internals import wrap_new_pool
from .pool_guard import PoolGuard, result_of_urllib3

__all__ = ["GUARD_ATTRIBUTE", "GuardAdapter", "guard_of", "guard_session", "request_options", "result_of"]

# The stack's name in the counts per origin (stats.by_origin(), llama_guard.metrics).
STACK = "requests"
# Where an adapter guarded in place (`guard_session`) keeps its guard.
GUARD_ATTRIBUTE = "_llama_guard"


def _new_guard(policy: object, stats: object, origins: object) -> PoolGuard:
    return PoolGuard.made(STACK, policy=policy, stats=stats, origins=origins, process=PROCESS, explicit=True)


class GuardAdapter(GuardAttributes, requests.adapters.HTTPAdapter):
    """A requests transport adapter that makes a session safe against llama-server (see `GuardPolicy`).

    Takes `requests.adapters.HTTPAdapter`'s arguments (``pool_connections``, ``pool_maxsize``, ``max_retries``,
    ``pool_block``) and the guard's. Mount it for ``http://`` and ``https://``, or let `guard(session)` do it.
    Requests to llama-server origins get the guard's mechanisms; others pass through unchanged. The guard's
    account of each response: `result_of(response)`; counters in ``stats``.

    ``max_retries`` (urllib3's ``Retry``) still governs requests to other origins; for a llama-server origin the
    guard's attempts replace its retries (each attempt is sent once by urllib3, redirects aside), so a request goes
    out at most ``max_attempts`` times, never the product of both.
    """

    _guard: PoolGuard

    def __init__(
        self,
        pool_connections: int = requests.adapters.DEFAULT_POOLSIZE,
        pool_maxsize: int = requests.adapters.DEFAULT_POOLSIZE,
        max_retries: Any = requests.adapters.DEFAULT_RETRIES,
        pool_block: bool = requests.adapters.DEFAULT_POOLBLOCK,
        *,
        policy: GuardPolicy | None = None,
        stats: GuardStats | None = None,
        origins: OriginRegistry | None = None,
    ) -> None:
        """``stats``: a `GuardStats` to count into (shared with other guards), else a new one. ``origins``: a
        registry of llama-server origins shared with other guards (what `install()` passes); else the policy's."""
        self._guard = _new_guard(policy, stats, origins)
        super().__init__(pool_connections, pool_maxsize, max_retries, pool_block)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False, **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        hook_manager(self.poolmanager, self._guard)

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        hook_manager(manager, self._guard)
        return manager

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        try:
            return super().send(request, *args, **kwargs)
        except requests.RequestException as exc:
            raise_guarded(exc)
            raise

    def close(self) -> None:
        super().close()
        self._guard.close()

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        state["_llama_guard_policy"] = self.policy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A new guard, with its own counters: a guard's state (locks, watched sockets) does not pickle.
        self._guard = _new_guard(state.pop("_llama_guard_policy", None), None, None)
        super().__setstate__(state)


def raise_guarded(exc: requests.RequestException) -> None:
    """Raise requests' error as the guard's when what urllib3 raised under it was the guard's; else return."""
    guarded = guarded_requests_error(exc)
    if guarded is not exc:
        raise guarded from exc.__cause__


def hook_manager(manager: Any, guard: PoolGuard) -> None:
    """Put ``guard`` on every pool a urllib3 ``PoolManager`` (or ``ProxyManager``) has and makes."""
    wrap_new_pool(manager, _new_pool, guard)
    pools = manager.pools
    for key in list(pools.keys()):  # a RecentlyUsedContainer: keys() copies under its lock
        with contextlib.suppress(KeyError):
            guard.hook(pools[key])


def _new_pool(manager: Any, new_pool: Any, guard: PoolGuard, *args: Any, **kwargs: Any) -> Any:  # see hook_manager
    pool = new_pool(manager, *args, **kwargs)
    guard.hook(pool)
    return pool


def guard_of(session: requests.Session) -> GuardStats | None:
    """The counters of the guard `guard_session` put on ``session`` (or of its mounted `GuardAdapter`s, when they
    share one), or None for a session without a guard. ValueError when its adapters count apart."""
    found: list[GuardStats] = []
    for adapter in session.adapters.values():
        guard = _adapter_guard(adapter)
        if guard is not None and not any(guard.stats is seen for seen in found):
            found.append(guard.stats)
    if len(found) > 1:
        raise ValueError(
            f"this session has {len(found)} guard adapters with counters of their own: read each adapter's stats, "
            "or guard the session with llama_guard.guard(session), whose adapters share one GuardStats"
        )
    return found[0] if found else None


def _adapter_guard(adapter: Any) -> PoolGuard | None:
    if isinstance(adapter, GuardAdapter):
        return adapter._guard
    guard = adapter.__dict__.get(GUARD_ATTRIBUTE) if hasattr(adapter, "__dict__") else None
    return guard if isinstance(guard, PoolGuard) else None


def guard_session(session: requests.Session, *, policy: GuardPolicy | None = None) -> requests.Session:
    """Put the guard on every `requests.adapters.HTTPAdapter` mounted on ``session``, in place; returns it.

    The adapters keep their settings (pool sizes, ``max_retries``, subclass behaviour): their urllib3 pools are
    hooked, and their errors become the guard's when it gave up. The adapters share one `GuardStats`. An adapter
    that is guarded already keeps its guard, unless a different ``policy`` is given. Adapters of other kinds
    (not ``HTTPAdapter``) are left alone.
    """
    if not isinstance(session, requests.Session):
        raise TypeError(f"guard_session() takes a requests.Session; got {type(session).__name__}")
    if policy is not None and not isinstance(policy, GuardPolicy):
        raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
    shared: list[PoolGuard] = []
    for adapter in session.adapters.values():
        if not isinstance(adapter, requests.adapters.HTTPAdapter):
            continue
        current = _adapter_guard(adapter)
        if current is not None and (policy is None or policy == current.policy):
            if not shared:
                shared.append(current)
            if current is shared[0]:
                continue
        if not shared:
            shared.append(_new_guard(policy if policy is not None else GuardPolicy(), None, None))
        _attach(adapter, shared[0])
    return session


def _attach(adapter: requests.adapters.HTTPAdapter, guard: PoolGuard) -> None:
    """Guard an adapter in place: its pool managers' pools, its future proxy managers, and its errors."""
    previous = _adapter_guard(adapter)
    if previous is not None:
        previous.unhook_all()
    if isinstance(adapter, GuardAdapter):
        adapter._guard = guard
    else:
        adapter.__dict__[GUARD_ATTRIBUTE] = guard
        cls = type(adapter)
        adapter.proxy_manager_for = functools.partial(_proxy_manager_for, adapter, cls.proxy_manager_for)  # type: ignore[method-assign]
        adapter.send = functools.partial(_send, adapter, cls.send)  # type: ignore[method-assign]
        # Pickled (a session sent to another process, deep-copied), it stays guarded: HTTPAdapter pickles its
        # settings only, and its copy would be a plain adapter, silently.
        adapter.__reduce_ex__ = functools.partial(_reduce_guarded, adapter)  # type: ignore[method-assign]
    hook_manager(adapter.poolmanager, guard)
    for manager in adapter.proxy_manager.values():
        hook_manager(manager, guard)


class _PickledGuard:
    """A guard as the adapters it guards pickle it: its policy. Unpickled once per pickle (pickle's memo), so the
    adapters of one session share one new guard again (new counters: a guard's state does not pickle)."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self._guard: PoolGuard | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"policy": self.policy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.policy = state["policy"]
        self._guard = None

    def guard(self) -> PoolGuard:
        if self._guard is None:
            self._guard = _new_guard(self.policy, None, None)
        return self._guard


# One `_PickledGuard` per guard, so that its adapters pickle it as one object.
_PICKLED: weakref.WeakKeyDictionary[PoolGuard, _PickledGuard] = weakref.WeakKeyDictionary()


def _reduce_guarded(adapter: requests.adapters.HTTPAdapter, protocol: int) -> tuple[Any, ...]:
    guard = _adapter_guard(adapter)
    assert guard is not None  # `_attach` put it there, and nothing takes it off
    pickled = _PICKLED.get(guard)
    if pickled is None:
        pickled = _PICKLED[guard] = _PickledGuard(guard.policy)
    return (_guarded_adapter, (type(adapter), adapter.__getstate__(), pickled))


def _guarded_adapter(cls: type[requests.adapters.HTTPAdapter], state: dict[str, Any], pickled: _PickledGuard) -> Any:
    adapter = cls.__new__(cls)
    adapter.__setstate__(state)
    _attach(adapter, pickled.guard())
    return adapter


def _proxy_manager_for(adapter: Any, original: Any, proxy: str, **kwargs: Any) -> Any:
    manager = original(adapter, proxy, **kwargs)
    guard = _adapter_guard(adapter)
    if guard is not None:
        hook_manager(manager, guard)
    return manager


def _send(adapter: Any, original: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return original(adapter, request, *args, **kwargs)
    except requests.RequestException as exc:
        raise_guarded(exc)
        raise


def result_of(response: Any) -> GuardResult | None:
    """What the guard did for the request of ``response`` (a `requests.Response` or a urllib3 response): a
    `GuardResult`, or None for a request it passed by."""
    if isinstance(response, requests.Response):
        return result_of_urllib3(response.raw)
    return result_of_urllib3(response)
