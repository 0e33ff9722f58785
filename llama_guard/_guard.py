"""`guard(client)`: protect an httpx client that already exists, keeping every other setting it has."""

from __future__ import annotations

from typing import TypeVar

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
        client._transport = _wrap_async(client._transport, policy)
        client._mounts = {
            pattern: None if transport is None else _wrap_async(transport, policy)
            for pattern, transport in client._mounts.items()
        }
        return client
    if isinstance(client, httpx.Client):
        client._transport = _wrap_sync(client._transport, policy)
        client._mounts = {
            pattern: None if transport is None else _wrap_sync(transport, policy)
            for pattern, transport in client._mounts.items()
        }
        return client
    raise TypeError(f"guard() takes an httpx.Client or httpx.AsyncClient; got {type(client).__name__}")


def _wrap_sync(transport: httpx.BaseTransport, policy: GuardPolicy | None) -> httpx.BaseTransport:
    if isinstance(transport, GuardTransport):
        if policy is None or policy == transport.policy:
            return transport
        transport = transport.transport
    return GuardTransport(transport, policy=policy)


def _wrap_async(transport: httpx.AsyncBaseTransport, policy: GuardPolicy | None) -> httpx.AsyncBaseTransport:
    if isinstance(transport, AsyncGuardTransport):
        if policy is None or policy == transport.policy:
            return transport
        transport = transport.transport
    return AsyncGuardTransport(transport, policy=policy)
