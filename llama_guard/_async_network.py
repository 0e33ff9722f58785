"""Connection-level hooks: a wrapper of an httpcore pool's network backend, which sees every new connection.

This file is the source of truth: ``scripts/unasync.py`` generates ``_sync_network.py`` from it (and the httpx2
twins), and CI checks that they are current.

The guard must probe each new connection before httpcore writes a request to it, and must know, when an attempt
fails, whether it failed connecting (nothing sent) or on a connection (maybe sent). Both are per connection, not per
request: the backend wrapper probes each connection it opens for a guarded attempt and reports the connect to the
attempt's request (`CURRENT_ATTEMPT`, set by the transport). Requests on pooled connections pay nothing here, and the
streams httpcore reads and writes are its own, unwrapped (an https connection only until its TLS handshake).
"""

from __future__ import annotations

from typing import Any

import httpcore

from ._attempt import CURRENT_ATTEMPT

__all__ = ["AsyncGuardedBackend", "track_connections"]


def track_connections(pool: Any) -> bool:
    """Put the guard's hooks on ``pool``'s network backend (once); False if ``pool`` is not an httpcore pool."""
    backend = getattr(pool, "_network_backend", None)
    if backend is None:
        return False
    if not isinstance(backend, AsyncGuardedBackend):
        pool._network_backend = AsyncGuardedBackend(backend)
    return True


class AsyncGuardedBackend(httpcore.AsyncNetworkBackend):
    """Opens connections through the wrapped backend; probes those opened by a guarded attempt."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        run = CURRENT_ATTEMPT.get()
        if run is not None:
            run.connecting()
        stream = await self._backend.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        if run is None:
            return stream
        # Probe only a connection to the origin itself: through an HTTP proxy the connection is the proxy's.
        if run.probing and host == run.request.url.host and port == run.origin.port:
            if run.request.url.scheme == "https":
                return _AsyncProbeAfterTls(stream, run)  # the probe must wait for the TLS handshake
            await run.guard._probe(stream, run)  # closes the stream and raises if the probe fails
        run.connected()
        return stream

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        run = CURRENT_ATTEMPT.get()
        if run is not None:
            run.connecting()
        stream = await self._backend.connect_unix_socket(path, timeout=timeout, socket_options=socket_options)
        if run is not None:
            run.connected()
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _AsyncProbeAfterTls(httpcore.AsyncNetworkStream):
    """A new https connection to probe once httpcore has done its TLS handshake; the TLS stream that
    `start_tls` returns is httpcore's own, not wrapped."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, run: Any) -> None:
        self._stream = stream
        self._run = run

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        await self._run.guard._probe(stream, self._run)  # skips HTTP/2 connections (ALPN "h2")
        self._run.connected()
        return stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)
