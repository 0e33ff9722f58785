"""Dropping a connection from under httpcore's pool without breaking the pool."""

from __future__ import annotations

import array
import contextlib
import select
import socket
from typing import Any

try:
    import fcntl
    import termios
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["answer_waiting", "finish_writing", "shutdown_connection"]


def shutdown_connection(network_stream: Any) -> bool:
    """Shut down both directions of a response's connection; True if there was a socket to shut down.

    Shutting the socket down, rather than closing the network stream, leaves httpcore's bookkeeping intact on
    every backend: the connection goes back to the pool, where httpcore finds its socket readable (at EOF) and
    discards it instead of handing it out. Closing the stream itself breaks httpcore's pool under trio.
    """
    if network_stream is None:
        return False
    sock = network_stream.get_extra_info("socket")
    if sock is None:
        return False
    # The peer may have been faster (already disconnected): the pool sees that too.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    return True


def answer_waiting(network_stream: Any) -> bool | None:
    """Whether a connection nobody reads has received bytes: True if some wait to be read, False if the peer closed
    or reset it (or there is no socket to look at), None if nothing came yet. Looks without reading, blocking or
    making a socket object, on the descriptor itself: every backend leaves unread bytes in the kernel once its own
    read ended."""
    sock = network_stream.get_extra_info("socket")
    fileno = sock.fileno() if sock is not None else -1
    if fileno < 0:
        return False
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fileno, select.POLLIN)
            if not poller.poll(0):
                return None
        elif not select.select([fileno], [], [], 0)[0]:
            return None
        if fcntl is None:  # readable, and no way to count the bytes (Windows): take it for the end
            return False
        waiting = array.array("i", [0])
        fcntl.ioctl(fileno, termios.FIONREAD, waiting, True)
        return waiting[0] > 0  # readable with nothing to read: the peer closed
    except OSError:
        return False


def finish_writing(network_stream: Any) -> None:
    """Send FIN on a connection, leaving it open for reading: a server that reads it later answers what was sent
    and then sees the end, and closes its side instead of keeping a thread on an idle keep-alive connection."""
    sock = network_stream.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
