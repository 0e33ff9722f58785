"""Reproduce the burst that triggers cpp-httplib's pool bug, deterministically, with any httpx client.

What triggers the bug, measured against llama-server b11434: the connections must be accepted in one burst
before their first requests arrive (a pool re-opening all its connections at once). Clients that connect as their
requests start rarely do; so `open_burst()` (``llama_guard/_burst.py``, which doctor shares) opens the
connections back to back first, and `burst_transport()` hands one of them to each client as its "new connection"
through httpcore's network backend interface. Everything after that, probes included, is the client's real code
on a real socket.

    sockets = open_burst("127.0.0.1", port, 32)
    clients = [httpx.Client(transport=burst_transport([s])) for s in sockets]
"""

from __future__ import annotations

import contextlib
import functools
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import anyio
import httpcore
import httpx

from .._burst import open_burst
from .._readiness import readable_now
from ._backends import WrappingBackend

__all__ = ["AsyncPreopenedBackend", "PreopenedBackend", "async_burst_transport", "burst_transport", "open_burst"]


class _Handout:
    """Pre-opened sockets, each handed out once; thread-safe."""

    def __init__(self, sockets: Iterable[socket.socket]) -> None:
        self._sockets = list(sockets)
        self._lock = threading.Lock()

    def take(self) -> socket.socket | None:
        with self._lock:
            return self._sockets.pop(0) if self._sockets else None

    def close_unused(self) -> None:
        while (sock := self.take()) is not None:
            sock.close()


@contextlib.contextmanager
def _as_httpcore_errors(timeout_error: type[Exception], error: type[Exception]) -> Iterator[None]:
    """A socket's errors as httpcore's: a timeout as ``timeout_error``, any other OSError as ``error``."""
    try:
        yield
    except TimeoutError as exc:  # anyio's fail_after raises it with no message; the socket's says "timed out"
        raise timeout_error(str(exc) or "timed out") from exc
    except OSError as exc:
        raise error(str(exc)) from exc


class _SyncSocketStream(httpcore.NetworkStream):
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._sock.settimeout(timeout)
        with _as_httpcore_errors(httpcore.ReadTimeout, httpcore.ReadError):
            return self._sock.recv(max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._sock.settimeout(timeout)
        with _as_httpcore_errors(httpcore.WriteTimeout, httpcore.WriteError):
            self._sock.sendall(buffer)

    def close(self) -> None:
        self._sock.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        """TLS on the pre-opened connection (an ``https://`` origin): the handshake runs at the first request."""
        self._sock.settimeout(timeout)
        try:
            tls = ssl_context.wrap_socket(self._sock, server_hostname=server_hostname)
        except TimeoutError as exc:
            self._sock.close()
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:  # ssl.SSLError included
            self._sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        return _SyncSocketStream(tls)

    def get_extra_info(self, info: str) -> Any:
        return _extra_info(self._sock, info)


class _AsyncSocketStream(httpcore.AsyncNetworkStream):
    """A non-blocking socket driven by anyio, so it works under asyncio and trio alike."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _as_httpcore_errors(httpcore.ReadTimeout, httpcore.ReadError), anyio.fail_after(timeout):
            while True:
                try:
                    return self._sock.recv(max_bytes)
                except BlockingIOError:
                    await anyio.wait_readable(self._sock)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        with _as_httpcore_errors(httpcore.WriteTimeout, httpcore.WriteError), anyio.fail_after(timeout):
            while view:
                try:
                    view = view[self._sock.send(view) :]
                except BlockingIOError:
                    await anyio.wait_writable(self._sock)

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            anyio.notify_closing(self._sock)
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        return _extra_info(self._sock, info)


def _extra_info(sock: socket.socket, info: str) -> Any:
    if info == "socket":
        return sock
    if info == "ssl_object":
        return sock if isinstance(sock, ssl.SSLSocket) else None
    if info == "is_readable":
        if sock.fileno() < 0:
            return True
        return readable_now(sock)
    if info == "client_addr":
        return sock.getsockname()
    if info == "server_addr":
        return sock.getpeername()
    return None


class PreopenedBackend(WrappingBackend):
    """Hands out pre-opened sockets as new connections, then connects for real."""

    def __init__(self, sockets: Iterable[socket.socket]) -> None:
        super().__init__()
        self._handout = _Handout(sockets)

    def _open(self, connect: Callable[[], httpcore.NetworkStream]) -> httpcore.NetworkStream:
        sock = self._handout.take()
        return connect() if sock is None else _SyncSocketStream(sock)

    def close_unused(self) -> None:
        self._handout.close_unused()


class AsyncPreopenedBackend(httpcore.AsyncNetworkBackend):
    """The async twin of `PreopenedBackend` (asyncio and trio)."""

    def __init__(self, sockets: Iterable[socket.socket]) -> None:
        self._handout = _Handout(sockets)
        self._fallback = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        sock = self._handout.take()
        if sock is None:  # httpcore's arguments (timeout, local_address, socket_options) passed on as they came
            return await self._fallback.connect_tcp(host, port, *args, **kwargs)
        return _AsyncSocketStream(sock)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    def close_unused(self) -> None:
        self._handout.close_unused()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # One context for every burst transport: httpx builds (and loads certificates into) a new one per transport
    # otherwise, which costs 32 clients seconds of CPU before their first request.
    return ssl.create_default_context()


def burst_transport(
    sockets: Iterable[socket.socket], *, limits: httpx.Limits | None = None, verify: ssl.SSLContext | None = None
) -> httpx.HTTPTransport:
    """An `httpx.HTTPTransport` whose first new connections are the given pre-opened sockets (TCP: for an
    ``https://`` origin the TLS handshake runs on them at the first request, checked with ``verify``)."""
    transport = httpx.HTTPTransport(limits=limits or httpx.Limits(), verify=verify or _tls_context())
    # httpx takes no network backend argument; its pool does. Test tooling, so the private attribute is fine.
    transport._pool._network_backend = PreopenedBackend(sockets)
    return transport


def async_burst_transport(
    sockets: Iterable[socket.socket], *, limits: httpx.Limits | None = None
) -> httpx.AsyncHTTPTransport:
    """An `httpx.AsyncHTTPTransport` whose first new connections are the given pre-opened sockets."""
    transport = httpx.AsyncHTTPTransport(limits=limits or httpx.Limits(), verify=_tls_context())
    transport._pool._network_backend = AsyncPreopenedBackend(sockets)
    return transport
