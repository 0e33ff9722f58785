"""`guard(client)`: protect an httpx, httpx2 or requests client that already exists, keeping every other setting it
has."""

from __future__ import annotations

import sys
from typing import Any, TypeVar

import httpx

from .._core.policy import GuardPolicy
from .._core.stats import GuardStats
from .._httpx import internals as httpx_internals
from .._httpx.async_transport import AsyncGuardTransport
from .._httpx.sync_transport import GuardTransport

__all__ = ["guard"]

ClientT = TypeVar("ClientT")


def guard(client: ClientT, *, policy: GuardPolicy | None = None) -> ClientT:
    """Wrap ``client``'s transport and every mounted transport in the guard, in place; returns ``client``.

    Takes an `httpx.Client` or `httpx.AsyncClient`, or their httpx2 twins (with ``llama-guard[httpx2]``), or a
    `requests.Session` (with ``llama-guard[requests]``: its ``HTTPAdapter`` s are guarded in place, see
    ``llama_guard.requests.guard_session``). Base
    URL, headers, auth, timeouts, limits, proxies and event hooks stay as they were: only the transports are
    wrapped. A transport that is already guarded is left as it is, or re-wrapped when a different ``policy`` is
    given. The transports it wraps count into one `GuardStats`: ``llama_guard.stats_of(client)``. httpx offers no
    public way to replace a client's transports, so this sets the client's ``_transport`` and ``_mounts``. On an
    httpx (or httpcore) llama_guard was not tested with it works as `GuardTransport` and `install()` do there: one
    warning naming the version, and the guard on httpcore's public API; it refuses (RuntimeError) only a client
    whose ``_transport`` and ``_mounts`` are not the transport and dict of transports it would replace.
    """
    if _is_requests_session(client):
        # Imported only for a requests session, so that llama_guard never needs requests otherwise.
        from .._requests.adapter import guard_session

        return guard_session(client, policy=policy)  # type: ignore[arg-type, return-value]
    guard_class, internals = _guard_class_for(client)
    untested = internals.untested_client_version()
    problem = internals.client_layout_problem(client) if untested is not None else None
    if problem is not None:
        raise RuntimeError(
            f"guard(client) replaces the client's private attributes _transport and _mounts, and {untested}, where "
            f"{problem}; build the client with transport=llama_guard.GuardTransport() (or AsyncGuardTransport) "
            "instead, or call llama_guard.install()"
        )

    shared: list[GuardStats] = []  # one account for the client: made with its first guard

    def wrap(transport: Any) -> Any:
        if isinstance(transport, guard_class):
            if policy is None or policy == transport.policy:
                if not shared:
                    shared.append(transport.stats)
                return transport
            transport = transport.transport
        if not shared:
            shared.append(GuardStats())
        return guard_class(transport, policy=policy, stats=shared[0])

    internals.replace_client_transports(client, wrap)
    return client


def _is_requests_session(client: object) -> bool:
    """A `requests.Session` (or a subclass of one), without importing requests where nothing uses it."""
    requests = sys.modules.get("requests")
    return requests is not None and isinstance(client, requests.Session)


def _guard_class_for(client: object) -> tuple[type[Any], Any]:
    """The guard class for ``client``'s kind and library, and that library's internals module."""
    if isinstance(client, httpx.AsyncClient):
        return AsyncGuardTransport, httpx_internals
    if isinstance(client, httpx.Client):
        return GuardTransport, httpx_internals
    if type(client).__module__.partition(".")[0] == "httpx2":
        # Imported only for an httpx2 client, so that llama_guard never needs httpx2 otherwise.
        import httpx2

        from .._httpx2 import internals as httpx2_internals
        from .._httpx2.async_transport import AsyncGuardTransport as AsyncGuardTransport2
        from .._httpx2.sync_transport import GuardTransport as GuardTransport2

        if isinstance(client, httpx2.AsyncClient):
            return AsyncGuardTransport2, httpx2_internals
        if isinstance(client, httpx2.Client):
            return GuardTransport2, httpx2_internals
    raise TypeError(
        "guard() takes an httpx.Client or httpx.AsyncClient (or their httpx2 twins) or a requests.Session; "
        f"got {type(client).__name__}"
    )
