"""Connections whose probe was given up, kept open a while to see whether the answer still comes: the sockets and
the thread of the late-answer watch (the decisions are `_core.probes`'s).

A late answer is a false alarm (the server was reading the connection, only slowly) and must raise the learnt probe
deadline (`_core.probes`). To see it, the guard keeps the connection: it sends FIN on it (a server that reads it
later answers, sees the end and closes its side instead of holding a thread on an idle keep-alive connection) and
duplicates its descriptor (`WatchedConnection`), which this module owns from then on. The adapter closes its own
stream at once, as for any failed connection, whatever the HTTP stack; the duplicate keeps the TCP connection open,
and is looked at without reading and closed here, in whatever thread: when its watch settles, when the watch ends
(`EXPIRY`, even if nothing else looks again), or when the transport that gave it up closes (`GivenUpWatches`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._core.log import logger

__all__ = ["Expiry", "WatchedConnection"]


class WatchedConnection:
    """A duplicate of a given-up connection's socket: `peek` looks for an answer without reading, `close` ends it.
    Thread-safe: the expiry thread and a transport's own thread may both reach it.

    Without a socket (the connection was closed already, or the transport has none) it reads as closed; ``unseen``
    then says why a late answer could not be seen, when one might have come (None for a closed connection)."""

    __slots__ = ("_lock", "_sock", "unseen")

    def __init__(self, sock: socket.socket | None, unseen: str | None = None) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.unseen = unseen

    @classmethod
    def of(cls, raw_socket: Any) -> WatchedConnection:
        """Send FIN on ``raw_socket`` (a `socket.socket` or a backend's wrapper of one: asyncio's, trio's) and
        duplicate it."""
        if raw_socket is None:
            return cls(None, "the transport's network stream has no socket")
        try:
            fileno = raw_socket.fileno()
            if fileno < 0:
                return cls(None)  # closed: the connection is gone, no answer can come
            duplicate = socket.fromfd(fileno, raw_socket.family, raw_socket.type)
        except (OSError, AttributeError, ValueError) as error:
            return cls(None, f"its socket could not be duplicated ({type(error).__name__}: {error})")
        with contextlib.suppress(OSError):
            duplicate.shutdown(socket.SHUT_WR)
        duplicate.setblocking(False)
        return cls(duplicate)

    def peek(self) -> bool | None:
        """True if bytes wait to be read, False if the peer closed or reset the connection (or it was closed here),
        None if nothing came yet."""
        with self._lock:
            if self._sock is None:
                return False
            try:
                return bool(self._sock.recv(1, socket.MSG_PEEK))  # b"": the peer closed
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:  # reset
                return False

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class Expiry:
    """Calls made at a given time by one daemon thread, started when needed and gone when nothing is due: the last
    look at each origin's given-up connections when their watch ends."""

    def __init__(self, name: str = "llama_guard-late-answers") -> None:
        self._name = name
        self._condition = threading.Condition()
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._running = False

    def at(self, when: float, call: Callable[[], None]) -> None:
        """Call ``call`` (once) at ``when`` (`time.monotonic`), or soon after."""
        with self._condition:
            heapq.heappush(self._due, (when, next(self._order), call))
            if self._running:
                self._condition.notify()
                return
            self._running = True
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def pending(self) -> int:
        with self._condition:
            return len(self._due)

    def _run(self) -> None:
        while True:
            with self._condition:
                while True:
                    if not self._due:
                        self._running = False
                        return
                    wait = self._due[0][0] - time.monotonic()
                    if wait <= 0:
                        call = heapq.heappop(self._due)[2]
                        break
                    self._condition.wait(wait)
            try:
                call()
            except Exception:  # a bug must not end the thread: the next watches would then never close
                logger.debug("the late-answer watch failed", exc_info=True)
