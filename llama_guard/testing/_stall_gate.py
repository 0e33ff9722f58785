"""``stall_burst``: cpp-httplib's pool stall (defect 2) made deterministic.

On the real server (and with the timing-faithful ``pool_bug``) which connections of a burst stall depends on how
fast the pool's threads wake up: on a quiet machine often none, on a busy one most of them.  The gate decides by
position instead, as if the threads never woke in time:

* a *burst* begins with a connection accepted while no connection of the previous burst is open; the
  ``http_threads`` base threads are then idle (and any dynamic thread gone);
* a connection is served at once by an idle thread if there is one: the first ``http_threads`` of a burst, and
  later ones that find the thread of a closed connection idle;
* otherwise, among the first ``stall_burst`` connections of the burst, it is *stalled*: queued, its first request
  left unread in the kernel's receive queue, as if the notified threads had not woken yet;
* a stalled connection is served when a served connection closes (its thread, now free, takes the oldest waiting
  job: first in, first out) or when the test calls ``release_stalled()``;
* connections accepted after the ``stall_burst``-th are served at once (cpp-httplib spawns a dynamic thread when
  it sees no idle one), so a client's reconnect is served on its first try; or, with ``oldest_first``, as
  cpp-httplib's FIFO queue does: the spawned thread serves the oldest stalled connection, and the newcomer is
  stalled in its place (a closed replacement's stalled predecessor is what that thread then finds).

So a burst of ``stall_burst`` new connections stalls exactly ``stall_burst - http_threads`` of them, and a
client that replaces its few connections one at a time (a closed one's thread serves the next) never stalls.

The gate only decides; the emulator owns the sockets, the locks and the counters.
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

__all__ = ["StallGate"]

_Job = TypeVar("_Job")


class StallGate(Generic[_Job]):
    """Which connections of a burst wait; not thread-safe (the emulator calls it under its connection lock)."""

    def __init__(self, *, served_first: int, burst: int, oldest_first: bool = False) -> None:
        if not 0 < served_first < burst:
            raise ValueError(f"need 0 < served_first < burst; got {served_first} and {burst}")
        self._served_first = served_first
        self._burst = burst
        self._oldest_first = oldest_first
        self._open = 0  # connections admitted and not finished (stalled ones included)
        self._position = 0  # accept order within the current burst
        self._idle = served_first  # threads with nothing to do
        self._stalled: collections.deque[_Job] = collections.deque()

    def admit(self, job: _Job) -> tuple[_Job | None, bool]:
        """A connection was accepted: (the job a thread serves now, if any: ``job`` itself, or with ``oldest_first``
        the oldest stalled one; did it begin a burst?). A stalled job is kept until released."""
        began = self._open == 0
        if began:
            self._position = 0
            self._idle = self._served_first
        self._open += 1
        self._position += 1
        if self._idle > 0:
            self._idle -= 1
            return job, began
        if self._position <= self._burst:
            self._stalled.append(job)
            return None, began
        if self._oldest_first and self._stalled:  # the dynamic thread takes the front of the queue
            self._stalled.append(job)
            return self._stalled.popleft(), began
        return job, began  # a dynamic thread

    def finished(self) -> _Job | None:
        """An admitted connection's life ended: the oldest stalled job, which its freed thread takes, if any."""
        self._open -= 1
        if self._stalled:
            return self._stalled.popleft()
        self._idle += 1
        return None

    def release(self, count: int | None) -> list[_Job]:
        """Let go of the ``count`` oldest stalled jobs (all for None)."""
        take = len(self._stalled) if count is None else min(count, len(self._stalled))
        return [self._stalled.popleft() for _ in range(take)]

    def stalled(self) -> list[_Job]:
        return list(self._stalled)
