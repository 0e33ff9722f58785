"""Which sockets are ready to read or write, whatever their descriptor numbers.

``select.select`` refuses descriptors from 1024 on (FD_SETSIZE: ``ValueError: filedescriptor out of range``), which
a busy process reaches: a proxy's open connections, a burst of hundreds. poll(2) has no such limit and is used
wherever the platform has it (as httpcore's ``is_socket_readable`` does); select is the fallback (Windows).
"""

from __future__ import annotations

import math
import select
import socket
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["readable_now", "ready"]

SocketT = TypeVar("SocketT", bound=socket.socket)

_POLL = getattr(select, "poll", None)


def ready(sockets: Sequence[SocketT], timeout: float | None, *, write: bool = False) -> list[SocketT]:
    """Those of ``sockets`` ready to read (``write``: to write) within ``timeout`` seconds (None: no limit; 0: now),
    in the order given; empty when none is by then."""
    if _POLL is None:
        readable, writable, _ = select.select([] if write else sockets, sockets if write else [], [], timeout)
        return writable if write else readable
    poller = _POLL()
    by_descriptor: dict[int, SocketT] = {}
    for sock in sockets:
        descriptor = sock.fileno()
        if descriptor < 0:  # closed: ready, as select would have raised for it
            return [sock]
        by_descriptor[descriptor] = sock
        poller.register(descriptor, select.POLLOUT if write else select.POLLIN | select.POLLPRI)
    # Milliseconds rounded up: a short wait must not become none (a caller looping to its deadline would spin).
    events = poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
    # An error, a hang-up or a closed descriptor counts as ready too: the caller's read or SO_ERROR says which.
    happened = {descriptor for descriptor, _ in events}
    return [sock for descriptor, sock in by_descriptor.items() if descriptor in happened]


def readable_now(sock: socket.socket) -> bool:
    """``sock`` has bytes, an end of stream or an error to read at once."""
    return bool(ready([sock], 0))
