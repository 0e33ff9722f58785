"""The guarded request whose attempt is opening a connection in this thread or task, for the connection hooks.

The guard follows each attempt (did it open a new connection, did that connect and its probe succeed) and probes
new connections from inside httpcore's pool, through a wrapper of the pool's network backend
(``_httpx/async_connections.py``). That wrapper is per pool and shared by every request; it learns which request it is
serving from this context variable, which the one-time hook of a new connection sets around that connection's
first request (inside which httpcore connects). A context variable is per thread (sync clients) and per task
(asyncio, trio), as an attempt is. Requests on pooled connections never set it: they cost nothing here. The value
is the request's `RequestRun` (built then if the request had none yet, see `FirstAttempt`), which keeps the
progress of its current attempt."""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

from .origin_probes import OriginProbes
from .origins import Origin
from .policy import GuardPolicy
from .stats import GuardStats

__all__ = ["CURRENT_ATTEMPT", "GuardedRequest"]


class GuardedRequest(Protocol):
    """What the connection hooks use of a `RequestRun` (of the httpx or the httpx2 flavour)."""

    @property
    def request(self) -> Any: ...  # the httpx (or httpx2) request
    @property
    def origin(self) -> Origin: ...
    @property
    def probing(self) -> bool: ...
    @property
    def origin_probes(self) -> OriginProbes: ...
    @property
    def policy(self) -> GuardPolicy: ...
    @property
    def stats(self) -> GuardStats: ...
    def probe(self, stream: Any) -> Any: ...  # probes a new connection; a coroutine for async transports
    def connecting(self) -> None: ...
    def probing_off(self, why: str) -> None: ...
    def connection_ready(self) -> None: ...
    def connected(self) -> None: ...


CURRENT_ATTEMPT: contextvars.ContextVar[GuardedRequest | None] = contextvars.ContextVar(
    "llama_guard_attempt", default=None
)
