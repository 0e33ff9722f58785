"""Work started in the background, from a thread or a task: the spare connections the httpx driver opens ahead.

A task of its own in the caller's event loop (asyncio's ``create_task``, kept referenced until it ends; trio's
system task, trio having no task outside a nursery otherwise), or a daemon thread for a sync caller. The work must
catch its own errors: an error that escaped a trio system task would end the trio run.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["spawn_task", "spawn_thread"]

_RUNNING: set[asyncio.Task[Any]] = set()  # asyncio keeps only weak references to its tasks


def spawn_task(work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work()`` as a task of its own in the running event loop (asyncio or trio)."""
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_task():
        trio.lowlevel.spawn_system_task(work)
        return
    task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work())  # type: ignore[arg-type]
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)


def spawn_thread(work: Callable[[], None]) -> None:
    """Run ``work()`` in a daemon thread of its own."""
    threading.Thread(target=work, name="llama_guard-spare", daemon=True).start()
