"""Blocking socket I/O that ``stop()`` can always interrupt.

Every wait on a client socket also watches the emulator's wake-up socket,
which ``stop()`` makes readable for good; blocked ``sendall`` calls are
unblocked by ``stop()`` shutting the socket down.  So "never answer" and
"stall for ever" faults really last until ``stop()`` and no longer.

Closing copies cpp-httplib: ``shutdown(SHUT_RDWR)`` then ``close()``.  If the
client already sent bytes the server never read (a request pipelined after a
stream, or one that waited in the pool), the kernel answers the close with
an RST instead of a FIN -- the real server behaves the same way.
"""

from __future__ import annotations

import array
import contextlib
import socket
import struct
import threading
import time

from .._readiness import readable_now, ready

try:  # POSIX: the exact size of the kernel's receive queue
    import fcntl
    import termios

    _FIONREAD: int | None = termios.FIONREAD
except ImportError:  # pragma: no cover - Windows
    _FIONREAD = None

__all__ = ["PeerGone", "Stopping", "Wire", "pending_bytes", "reset_socket"]

RECV_SIZE = 16384


class Stopping(Exception):
    """The emulator is stopping; unwind this connection."""


class PeerGone(Exception):
    """The client closed or reset the connection."""


def pending_bytes(sock: socket.socket) -> int:
    """Bytes waiting unread in the kernel receive queue (``FIONREAD``).

    Where FIONREAD is missing, 1 means "something is readable".
    """
    try:
        if _FIONREAD is not None:
            buf = array.array("i", [0])
            fcntl.ioctl(sock.fileno(), _FIONREAD, buf, True)
            return int(buf[0])
        return 1 if readable_now(sock) else 0
    except (OSError, ValueError):  # closed meanwhile
        return 0


def reset_socket(sock: socket.socket) -> None:
    """Close with SO_LINGER 0, so the kernel sends RST instead of FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class Wire:
    """One accepted connection as the handler thread sees it."""

    def __init__(
        self,
        sock: socket.socket,
        wake: socket.socket,
        stop_event: threading.Event,
        read_timeout: float,
        *,
        close_lock: threading.RLock | None = None,
    ) -> None:
        self.sock = sock
        self._close_lock = close_lock if close_lock is not None else threading.RLock()
        self._wake = wake
        self._stop_event = stop_event
        self._read_timeout = read_timeout
        self.closed = False
        self.bytes_sent = 0
        self.requests_read = 0  # request heads read on this connection (``_handler``)
        self.stalled = False  # the stall_burst gate held it before a thread took it (``_emulator``)

    # -- reading --------------------------------------------------------------

    def wait_readable(self, timeout: float) -> bool:
        """True when the client sent something (or EOF); False on timeout."""
        if self._stop_event.is_set():
            raise Stopping
        try:
            readable = ready([self.sock, self._wake], timeout)
        except (OSError, ValueError) as exc:
            raise PeerGone from exc
        if self._wake in readable or self._stop_event.is_set():
            raise Stopping
        return bool(readable)

    def recv(self) -> bytes:
        """Some bytes, or ``b""`` on EOF; PeerGone on timeout or reset."""
        if not self.wait_readable(self._read_timeout):
            raise PeerGone("read timeout")
        try:
            return self.sock.recv(RECV_SIZE)
        except OSError as exc:
            raise PeerGone from exc

    def peer_closed(self) -> bool:
        """cpp-httplib's ``is_socket_alive`` negated: EOF or error pending."""
        if self.closed:
            return True
        try:
            if not readable_now(self.sock):
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- writing --------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._stop_event.is_set():
            raise Stopping
        try:
            self.sock.sendall(data)
        except OSError as exc:
            if self._stop_event.is_set():
                raise Stopping from exc
            raise PeerGone from exc
        self.bytes_sent += len(data)

    # -- waiting and closing ----------------------------------------------------

    def sleep(self, seconds: float) -> None:
        """Sleep, but raise Stopping as soon as the emulator stops."""
        if seconds > 0 and self._stop_event.wait(seconds):
            raise Stopping
        if self._stop_event.is_set():
            raise Stopping

    def hold(self, seconds: float | None) -> None:
        """Keep the connection open, silent, for ``seconds`` (None: until stop).

        Whatever the client sends meanwhile stays unread, like a hung server.
        """
        if seconds is None:
            self._stop_event.wait()
            raise Stopping
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if self._stop_event.wait(remaining):
                raise Stopping

    def reset(self) -> None:
        with self._close_lock:
            if not self.closed:
                self.closed = True
                reset_socket(self.sock)

    def close(self) -> None:
        with self._close_lock:
            if not self.closed:
                self.closed = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                self.sock.close()

    def interrupt(self) -> None:
        """From another thread: unblock any recv/send by shutting down."""
        with self._close_lock:
            if not self.closed:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
