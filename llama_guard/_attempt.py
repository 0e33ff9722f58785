"""The attempt in progress in this thread or task, for the connection-level hooks to report to.

The guard follows each attempt (how far it got: connected, writing, waiting for headers) and probes new
connections from inside httpcore's pool, through a wrapper of the pool's network backend (``_async_network.py``).
That wrapper is per pool and shared by every request; it learns which attempt it is serving from this context
variable, which the transport sets around the one call that runs an attempt. A context variable is per thread
(sync clients) and per task (asyncio, trio), as an attempt is, and costs next to nothing to set and read: far less
than httpcore's per-request ``trace`` extension, which the guard used before (ten callbacks a request).
"""

from __future__ import annotations

import contextvars
from typing import Any

from ._decisions import ProgressTracker

__all__ = ["CURRENT_ATTEMPT", "Attempt"]


class Attempt(ProgressTracker):
    """One attempt of a guarded request: its progress, as the connection hooks report it, and what they need.

    ``run``: the request's `RequestRun`. ``prober``: the transport's probe coroutine (or function) when new
    connections must be probed, else None.
    """

    __slots__ = ("prober", "run")

    def __init__(self, run: Any, prober: Any) -> None:
        super().__init__(hooked=True)
        self.run = run
        self.prober = prober


CURRENT_ATTEMPT: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar("llama_guard_attempt", default=None)
