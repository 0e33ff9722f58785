"""Dropping a connection from under httpcore's pool without breaking the pool."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

__all__ = ["shutdown_connection"]


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
