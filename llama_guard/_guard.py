"""`guard(client)`: protect an httpx client that already exists, keeping every other setting it has."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx

from ._async_transport import AsyncGuardTransport
from ._policy import GuardPolicy
from ._sync_transport import GuardTransport

__all__ = ["guard"]

ClientT = TypeVar("ClientT", httpx.Client, httpx.AsyncClient)


def guard(client: ClientT, *, policy: GuardPolicy | None = None) -> ClientT:
    """Wrap ``client``'s transport and every mounted transport in the guard, in place; returns ``client``.

    Base URL, headers, auth, timeouts, limits, proxies and event hooks stay as they were: only the transports
    are wrapped. A transport that is already guarded is left as it is, or re-wrapped when a different ``policy``
    is given. httpx offers no public way to replace a client's transports, so this sets the client's
    ``_transport`` and ``_mounts`` (stable across httpx 0.2x).
    """
    if isinstance(client, httpx.AsyncClient):
        guard_class: type[Any] = AsyncGuardTransport
    elif isinstance(client, httpx.Client):
        guard_class = GuardTransport
    else:
        raise TypeError(f"guard() takes an httpx.Client or httpx.AsyncClient; got {type(client).__name__}")

    def wrap(transport: Any) -> Any:
        if isinstance(transport, guard_class):
            if policy is None or policy == transport.policy:
                return transport
            transport = transport.transport
        return guard_class(transport, policy=policy)

    client._transport = wrap(client._transport)
    client._mounts = {pattern: None if t is None else wrap(t) for pattern, t in client._mounts.items()}
    return client
