"""`guard(client)`: protect an httpx or httpx2 client that already exists, keeping every other setting it has."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx

from .._core.policy import GuardPolicy
from .._httpx.async_transport import AsyncGuardTransport
from .._httpx.sync_transport import GuardTransport

__all__ = ["guard"]

ClientT = TypeVar("ClientT")


def guard(client: ClientT, *, policy: GuardPolicy | None = None) -> ClientT:
    """Wrap ``client``'s transport and every mounted transport in the guard, in place; returns ``client``.

    Takes an `httpx.Client` or `httpx.AsyncClient`, or their httpx2 twins (with ``llama-guard[httpx2]``). Base
    URL, headers, auth, timeouts, limits, proxies and event hooks stay as they were: only the transports are
    wrapped. A transport that is already guarded is left as it is, or re-wrapped when a different ``policy`` is
    given. httpx offers no public way to replace a client's transports, so this sets the client's ``_transport``
    and ``_mounts`` (stable across httpx 0.2x and httpx2).
    """
    guard_class = _guard_class_for(client)

    def wrap(transport: Any) -> Any:
        if isinstance(transport, guard_class):
            if policy is None or policy == transport.policy:
                return transport
            transport = transport.transport
        return guard_class(transport, policy=policy)

    target: Any = client
    target._transport = wrap(target._transport)
    target._mounts = {pattern: None if t is None else wrap(t) for pattern, t in target._mounts.items()}
    return client


def _guard_class_for(client: object) -> type[Any]:
    if isinstance(client, httpx.AsyncClient):
        return AsyncGuardTransport
    if isinstance(client, httpx.Client):
        return GuardTransport
    if type(client).__module__.partition(".")[0] == "httpx2":
        # Imported only for an httpx2 client, so that llama_guard never needs httpx2 otherwise.
        import httpx2

        from ..httpx2 import AsyncGuardTransport as AsyncGuardTransport2
        from ..httpx2 import GuardTransport as GuardTransport2

        if isinstance(client, httpx2.AsyncClient):
            return AsyncGuardTransport2
        if isinstance(client, httpx2.Client):
            return GuardTransport2
    raise TypeError(
        f"guard() takes an httpx.Client or httpx.AsyncClient (or their httpx2 twins); got {type(client).__name__}"
    )
