"""llama-server's ``--parallel`` slots: a FIFO of inference capacity.

A completion needs a free slot.  Until it gets one, llama-server defers the
task and the HTTP thread just waits -- no status, no headers -- while it polls
whether the client went away (then the task is cancelled, not run).  Waiters
are served first-come first-served, as the server's deferred-task queue does.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from ._responses import SlotView

__all__ = ["SlotPool"]

#: How often a waiting request checks that its client is still connected.
PEER_POLL_INTERVAL = 0.05


class SlotPool:
    def __init__(self, parallel: int, stop_event: threading.Event) -> None:
        self._cond = threading.Condition()
        self._stop_event = stop_event
        self._free: collections.deque[int] = collections.deque(range(parallel))
        self._waiters: collections.deque[object] = collections.deque()
        self._views = [SlotView(i, -1, False, 0, -1) for i in range(parallel)]
        self._next_task = 0

    def acquire(self, peer_closed: Callable[[], bool], n_tokens: int) -> tuple[int, int] | None:
        """Block for a slot: ``(slot_id, task_id)``, or None if cancelled.

        Cancelled means the client disconnected or the emulator is stopping.
        """
        ticket = object()
        with self._cond:
            self._waiters.append(ticket)
            try:
                while not (self._free and self._waiters[0] is ticket):
                    if self._stop_event.is_set():
                        return None
                    self._cond.wait(PEER_POLL_INTERVAL)
                    if self._free and self._waiters[0] is ticket:
                        break
                    # Checked outside the happy path only: a select() per poll.
                    if peer_closed():
                        return None
                slot_id = self._free.popleft()
                task_id = self._next_task
                self._next_task += 1
                self._views[slot_id] = SlotView(slot_id, task_id, True, 0, n_tokens)
                return slot_id, task_id
            finally:
                self._waiters.remove(ticket)
                self._cond.notify_all()

    def progress(self, slot_id: int, n_decoded: int) -> None:
        with self._cond:
            view = self._views[slot_id]
            remaining = max(view.n_remain - 1, 0) if view.n_remain >= 0 else -1
            self._views[slot_id] = SlotView(slot_id, view.id_task, True, n_decoded, remaining)

    def release(self, slot_id: int) -> None:
        with self._cond:
            self._views[slot_id] = SlotView(slot_id, -1, False, 0, -1)
            self._free.append(slot_id)
            self._cond.notify_all()

    def wake_all(self) -> None:
        """Let waiters notice that the emulator is stopping."""
        with self._cond:
            self._cond.notify_all()

    def views(self) -> list[SlotView]:
        with self._cond:
            return list(self._views)

    def busy(self) -> int:
        with self._cond:
            return sum(1 for view in self._views if view.is_processing)

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiters)
