"""Open a burst of TCP connections the way that triggers cpp-httplib's pool bug (before b11737), deterministically:
what doctor, the demo, the tests and the benchmarks share (re-exported by `llama_guard.testing`, whose
`burst_transport()` hands the sockets to httpx clients). Sockets only: no HTTP library.

    sockets = open_burst("127.0.0.1", port, 32)
"""

from __future__ import annotations

import os
import socket
import time

from ._readiness import ready

__all__ = ["MAX_BURST", "open_burst"]

#: The most connections one burst opens (doctor's --burst and the demo's --clients refuse more).
MAX_BURST = 4096


def open_burst(host: str, port: int, count: int, *, timeout: float = 5.0) -> list[socket.socket]:
    """Open ``count`` TCP connections at once (every connect started before any completes), before any of them
    sends a byte: the burst in which llama-server's accept loop queues them faster than its pool threads wake.

    Blocking connects one after another are slower, and on an idle machine rarely trigger the bug."""
    if not 1 <= count <= MAX_BURST:
        raise ValueError(f"count must be from 1 to {MAX_BURST}; got {count!r}")
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect_ex((host, port))
        pending = list(sockets)
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(pending)} of {count} connections to {host}:{port} did not complete")
            for sock in ready(pending, remaining, write=True):
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise ConnectionError(error, f"connect to {host}:{port} failed: {os.strerror(error)}")
                pending.remove(sock)
        for sock in sockets:
            sock.setblocking(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
