"""A loopback TCP relay that holds the server's FIN until the client writes again: the stream defect, every time.

llama-server b11434 closes a streamed response's connection right after the final chunk although it announced
keep-alive. A pooled client loses its next request only if it writes it before that FIN arrives: a window of
microseconds on loopback, so plain httpx loses such a request now and then on a quiet machine, and rarely on a
busy one (a busy client notices the FIN first). Controls cannot rest on that.

After a FIN the server can send nothing more on that connection, so no request written to it can be answered.
This relay forwards every byte at once both ways, but when the server closes, it keeps the client's side open
(the FIN is "still in flight") until the client writes: it then forwards those bytes to the closed server, and
closes the client's side without an answer, which is what the client gets from the real server when its write
wins the race. The relay decides only when the client learns of the close, never what the server sends; counts
(:attr:`FinHoldingRelay.stats`) say how often the server closed and how many writes landed on a closed
connection. A client that never writes again gets the FIN after ``hold`` seconds.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class RelayStats:
    connections: int = 0
    #: Connections the server closed while the client's side was open (the FIN the relay held).
    server_closes: int = 0
    #: Connections on which the client wrote a request the server closed without answering (written after its
    #: close, or before the close reached the relay): each such request is lost.
    writes_after_close: int = 0
    #: Held closes passed on because the client wrote nothing for ``hold`` seconds.
    closes_released: int = 0


class FinHoldingRelay:
    """``with FinHoldingRelay(server.address) as relay:`` then point a client at ``relay.url``."""

    def __init__(self, upstream: tuple[str, int], *, hold: float = 5.0) -> None:
        self.upstream = upstream
        self.hold = hold
        self.stats = RelayStats()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="fin-hold-accept", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.address[1]}"

    def __enter__(self) -> FinHoldingRelay:
        self._acceptor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stopping.set()
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()
        stuck = [t.name for t in self._threads if t.is_alive()] + (["accept"] if self._acceptor.is_alive() else [])
        if stuck:
            raise RuntimeError(f"relay threads did not stop: {stuck}")

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._count("connections")
            thread = threading.Thread(target=self._pump, args=(client,), name="fin-hold-pump", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _pump(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ)
        selector.register(server, selectors.EVENT_READ)
        server_closed_at: float | None = None
        client_wrote_last = False  # the client's bytes came after the server's last ones: a request is pending
        try:
            while not self._stopping.is_set():
                if server_closed_at is not None and time.monotonic() - server_closed_at >= self.hold:
                    self._count("closes_released")
                    return
                # The server's side first: a close that came with the client's next request counts as before it.
                events = sorted(selector.select(timeout=0.1), key=lambda event: event[0].fileobj is not server)
                for key, _ in events:
                    sock = key.fileobj
                    try:
                        data = sock.recv(65536)  # type: ignore[union-attr]
                    except OSError:  # a reset: a close, as far as the client is concerned
                        data = b""
                    if sock is server:
                        if data:
                            client_wrote_last = False
                            client.sendall(data)
                            continue
                        self._count("server_closes")
                        if client_wrote_last:  # the request reached a server that was closing: no answer
                            self._count("writes_after_close")
                            return
                        server_closed_at = time.monotonic()
                        selector.unregister(server)
                        continue
                    if not data:  # the client closed: nothing more to relay
                        return
                    if server_closed_at is None:
                        client_wrote_last = True
                        try:
                            server.sendall(data)
                        except OSError:
                            # The server closed with a reset that arrived after the select: a close all the same
                            # (counted, or the counts would hang on the race), and this request is lost.
                            self._count("server_closes")
                            self._count("writes_after_close")
                            return
                        continue
                    # Written to a connection the server has closed: it reaches the server (which resets), and
                    # nothing can come back after the server's FIN; the client learns of the close now.
                    self._count("writes_after_close")
                    with contextlib.suppress(OSError):
                        server.sendall(data)
                    return
        except OSError:
            return
        finally:
            selector.close()
            server.close()
            _close_gracefully(client)


def _close_gracefully(sock: socket.socket, *, drain_for: float = 1.0) -> None:
    """Close with a FIN, never a reset: whether a request ends as "disconnected" or "connection reset" must not
    depend on timing. Closing a socket that still has unread bytes (a request body that arrived after its headers)
    sends a reset, so the relay says FIN first, then reads what the client still sends until it closes too."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(drain_for)
        deadline = time.monotonic() + drain_for
        while time.monotonic() < deadline and sock.recv(65536):
            pass
    except OSError:
        pass
    finally:
        sock.close()
