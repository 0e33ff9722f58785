"""The guarded request whose attempt is in progress in this thread or task, for the connection hooks to serve.

The guard follows each attempt (did it open a new connection, did that connect and its probe succeed) and probes
new connections from inside httpcore's pool, through a wrapper of the pool's network backend
(``_async_network.py``). That wrapper is per pool and shared by every request; it learns which request it is
serving from this context variable, which the transport sets around the one call that runs an attempt. A context
variable is per thread (sync clients) and per task (asyncio, trio), as an attempt is, and costs next to nothing to
set and read: far less than httpcore's per-request ``trace`` extension, which the guard used before (ten callbacks
a request). The value is the request's `RequestRun`, which keeps the progress of its current attempt; nothing is
built for an attempt that finds a pooled connection.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

from ._origins import Origin

__all__ = ["CURRENT_ATTEMPT", "GuardedRequest"]


class GuardedRequest(Protocol):
    """What the connection hooks use of a `RequestRun` (of the httpx or the httpx2 flavour)."""

    @property
    def request(self) -> Any: ...  # the httpx (or httpx2) request
    @property
    def origin(self) -> Origin: ...
    @property
    def guard(self) -> Any: ...  # the transport, whose ``_probe`` probes a new connection
    @property
    def probing(self) -> bool: ...
    def connecting(self) -> None: ...
    def connected(self) -> None: ...


CURRENT_ATTEMPT: contextvars.ContextVar[GuardedRequest | None] = contextvars.ContextVar(
    "llama_guard_attempt", default=None
)
