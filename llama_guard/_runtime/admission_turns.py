"""A waiter's turn: how a connection waiting for admission (`OriginProbes`) is woken when its turn may have come.

The queue of an origin is shared by every transport of the process, so the connection that frees the turn may run
in another thread or event loop than the waiter. Each waiter therefore makes its own turn (`probes.Turn`) in
its own context (a thread's `threading.Event`, an asyncio loop's or a trio run's event) and the releaser calls
``wake()``, which
is thread-safe: it sets the event directly, or through the waiter's loop (``call_soon_threadsafe``, trio's
``run_sync_soon``). A wake-up is a hint that the turn may have come: the waiter checks, clears and waits again
(the wait itself is the drive loop's, ``_drive/async_drive.py``). No HTTP library here; trio only if the waiter runs
in trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["AsyncTurn", "ThreadTurn"]


class ThreadTurn:
    """A waiter in a thread (sync transports)."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout: float | None) -> bool:
        """True when woken, False when ``timeout`` seconds passed first."""
        return self._event.wait(timeout)


class AsyncTurn:
    """A waiter in an asyncio or trio task; made in that task (it remembers its loop)."""

    __slots__ = ("_event", "_schedule", "_trio")

    def __init__(self) -> None:
        self._trio = _in_trio()
        self._event: Any
        self._schedule: Callable[[Callable[[], None]], object]
        if self._trio:
            import trio

            self._event = trio.Event()
            self._schedule = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            self._event = asyncio.Event()
            self._schedule = asyncio.get_running_loop().call_soon_threadsafe

    def wake(self) -> None:
        # The waiter's loop sets its event (events of either library are not thread-safe); a loop that has ended
        # has no waiter left to wake.
        with contextlib.suppress(RuntimeError):  # asyncio: loop closed; trio: RunFinishedError is a RuntimeError
            self._schedule(self._set)

    def _set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._trio:
            if self._event.is_set():
                import trio

                self._event = trio.Event()  # trio's events cannot be cleared; _set sets the current one
        else:
            self._event.clear()

    async def wait(self, timeout: float | None) -> bool:
        """True when woken, False when ``timeout`` seconds passed first."""
        if self._trio:
            import trio

            with trio.move_on_after(float("inf") if timeout is None else timeout):
                await self._event.wait()
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)
        return bool(self._event.is_set())


def _in_trio() -> bool:
    trio = sys.modules.get("trio")  # a trio task has imported trio
    in_task: bool = trio is not None and trio.lowlevel.in_trio_task()
    return in_task
