"""`DualGuardTransport`: one guard object for a sync and an async client built from the same settings.

Some frameworks build both of their clients from one dict of keyword arguments (haystack's ``http_client_kwargs``
goes to ``httpx.Client(**kwargs)`` and to ``httpx.AsyncClient(**kwargs)``), so the ``transport`` in it must serve
``handle_request`` and ``handle_async_request`` alike. This one holds a `GuardTransport` and an
`AsyncGuardTransport` that share their settings, their counters and their llama-server origins.
"""

from __future__ import annotations

import httpx

from .._core.origins import OriginRegistry
from .._core.policy import GuardPolicy
from .._core.stats import GuardStats
from .async_transport import AsyncGuardTransport
from .sync_transport import GuardTransport

__all__ = ["DualGuardTransport"]


class DualGuardTransport(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """The guard as a transport that both an `httpx.Client` and an `httpx.AsyncClient` can use.

    ``transport`` / ``async_transport``: the sync and async transports to wrap (default: new pools, as for
    `GuardTransport` and `AsyncGuardTransport`). Sync requests go through ``sync_guard``, async ones through
    ``async_guard``; ``stats`` counts both. ``close()`` closes the sync side and ``aclose()`` the async side, as
    each client closes its own transport.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: GuardPolicy | None = None,
        stats: GuardStats | None = None,
    ) -> None:
        if policy is not None and not isinstance(policy, GuardPolicy):
            raise TypeError(f"policy must be a llama_guard.GuardPolicy or None; got {type(policy).__name__}")
        self.stats = stats if stats is not None else GuardStats()
        origins = OriginRegistry((policy or GuardPolicy()).origins)
        self.sync_guard = GuardTransport(transport, policy=policy, stats=self.stats, origins=origins)
        self.async_guard = AsyncGuardTransport(async_transport, policy=policy, stats=self.stats, origins=origins)

    @property
    def policy(self) -> GuardPolicy:
        return self.sync_guard.policy

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.policy!r} around {type(self.sync_guard.transport).__name__} and "
            f"{type(self.async_guard.transport).__name__}>"
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.sync_guard.handle_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.async_guard.handle_async_request(request)

    def close(self) -> None:
        self.sync_guard.close()

    async def aclose(self) -> None:
        await self.async_guard.aclose()
