"""Connection-level hooks: a wrapper of an httpcore pool's network backend, which sees every new connection.

This file is the source of truth: ``scripts/unasync.py`` generates ``sync_connections.py`` from it (and the httpx2
twins), and CI checks that they are current.

The guard must probe each new connection before httpcore writes a request to it, and must know, when an attempt
fails, whether it failed connecting (nothing sent) or on a connection (maybe sent). Both are per connection, not per
request. Two hooks, put on one pool instance by `track_connections`:

- the pool's ``create_connection`` marks each new connection, which httpcore connects lazily inside its first
  request; for that one call, `CURRENT_ATTEMPT` names the guarded request, taken from the attempt body the
  request carries (`AttemptBody`);
- the pool's network backend, wrapped, sees the connect: it probes the new connection and reports the connect to
  that request.

A request on a pooled connection passes neither hook: it pays nothing here. The streams httpcore reads and writes
are its own, unwrapped (an https connection only until its TLS handshake).
"""

from __future__ import annotations

import functools
from typing import Any

import httpcore

from .._core.attempt_context import CURRENT_ATTEMPT, GuardedRequest
from .._core.origin_probes import Admission
from .._core.turns import AsyncTurn
from .attempts import AttemptBody
from .internals import (
    network_backend,
    pool_speaks_http1,
    remove_instance_method,
    set_instance_method,
    set_network_backend,
)

__all__ = ["AsyncGuardedBackend", "track_connections"]


def track_connections(pool: Any) -> None:
    """Put the guard's hooks on ``pool`` (once): on its network backend and on the connections it creates.
    ``pool``: from `internals.hookable_pool`."""
    _wrap_backend(pool)
    create = pool.create_connection
    if not isinstance(create, _AsyncCreateConnection):
        set_instance_method(pool, "create_connection", _AsyncCreateConnection(pool, create))


def _wrap_backend(pool: Any) -> None:
    """Wrap the pool's network backend in the guard's, unless it is wrapped already."""
    backend = network_backend(pool)
    if not isinstance(backend, AsyncGuardedBackend):
        set_network_backend(pool, AsyncGuardedBackend(backend, http1=pool_speaks_http1(pool)))


class _AsyncCreateConnection:
    """The pool's ``create_connection``, giving each new connection a hook on its first request."""

    __slots__ = ("_create", "_pool")

    def __init__(self, pool: Any, create: Any) -> None:
        self._pool = pool
        self._create = create

    def __call__(self, origin: Any) -> Any:
        # Someone may have replaced the pool's backend after the guard wrapped it: wrap the new one before the
        # connection is given it. Checked here, once per connection, rather than for every request.
        _wrap_backend(self._pool)
        connection = self._create(origin)
        # A connection class without an instance __dict__ is not one of httpcore's: it is left alone.
        set_instance_method(connection, "handle_async_request", _AsyncFirstRequest(connection))
        return connection


class _AsyncFirstRequest:
    """A new connection's ``handle_async_request`` for its first request, inside which httpcore connects.

    It tells the backend wrapper which guarded request that is (`CURRENT_ATTEMPT`): the one whose attempt body
    (`AttemptBody`) the request carries, or none for a request the guard passed through. Then it is gone: later
    requests on the connection call httpcore's own method, and pay nothing.
    """

    __slots__ = ("_connection",)

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    async def __call__(self, request: httpcore.Request) -> httpcore.Response:
        connection = self._connection
        # Two threads may race here for a new HTTP/2 connection (only one connects): the second finds it gone.
        remove_instance_method(connection, "handle_async_request")
        body = request.stream
        token = CURRENT_ATTEMPT.set(body.guarded_run() if isinstance(body, AttemptBody) else None)
        try:
            response: httpcore.Response = await type(connection).handle_async_request(connection, request)
        finally:
            CURRENT_ATTEMPT.reset(token)
        return response


class AsyncGuardedBackend(httpcore.AsyncNetworkBackend):
    """Opens connections through the wrapped backend; probes those opened by a guarded attempt."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend, *, http1: bool = True) -> None:
        """``http1``: the pool speaks HTTP/1.1 (not HTTP/2 only), so the probe's HTTP/1.1 bytes fit its connections."""
        self._backend = backend
        self._http1 = http1

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        connect = functools.partial(
            self._backend.connect_tcp,
            host,
            port,
            timeout=timeout,
            local_address=local_address,
            socket_options=socket_options,
        )
        run = CURRENT_ATTEMPT.get()
        if run is None:
            return await connect()
        # Probe only a connection to the origin itself: through a proxy the connection is the proxy's.
        direct = host == run.request.url.host and port == run.origin.port
        if not direct and run.probing:
            run.probing_off(
                f"they go through a proxy at {host}:{port} (HTTP, CONNECT or SOCKS), whose connections are not "
                "llama-server's"
            )
        return await self._connect(run, connect, timeout, direct=direct)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        connect = functools.partial(
            self._backend.connect_unix_socket, path, timeout=timeout, socket_options=socket_options
        )
        run = CURRENT_ATTEMPT.get()
        if run is None:
            return await connect()
        # httpx sends every request of a uds transport, proxies included, straight to the socket.
        return await self._connect(run, connect, timeout, direct=True)

    async def _connect(
        self, run: GuardedRequest, connect: Any, timeout: float | None, *, direct: bool
    ) -> httpcore.AsyncNetworkStream:
        """A guarded attempt's new connection: opened by ``connect``, timed, and probed when ``direct`` (to the
        origin itself) and the request probes, unless the pool speaks HTTP/2 only (h2c with prior knowledge)."""
        run.connecting()
        if direct and run.probing and not self._http1:
            run.probing_off("the pool speaks HTTP/2 only (h2c with prior knowledge, http1=False), unlike llama-server")
        probing = direct and run.probing and self._http1
        https = run.request.url.scheme == "https"
        # Opened and probed in turn when the origin asks for it (connect_admission); not an https connection, whose
        # probe comes after httpcore's TLS handshake, outside this call.
        admission = await _admission(run, timeout) if probing and not https else None
        try:
            stream: httpcore.AsyncNetworkStream = await connect()
            if https:
                # The probe, and what the connection cost, wait for the TLS handshake.
                return _AsyncAfterTls(stream, run, probing=probing)
            run.connection_ready()
            if probing:
                await run.probe(stream)  # raises if the probe fails (the stream is then the probe's to close)
        finally:
            if admission is not None:
                admission.leave()
        run.connected()
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


async def _admission(run: GuardedRequest, timeout: float | None) -> Admission[AsyncTurn] | None:
    """This connection's place in its origin's queue, once its turn has come (`Admission`), or None when the origin
    lets connections open freely now. The wait is part of the connect: the caller's connect ``timeout`` bounds it."""
    # Woken by the connection ahead once it is probed (or gives its place up), in whatever thread or event loop that
    # runs: the turn is made here, in the waiter's own, and woken thread-safely (_core/turns.py).
    admission = Admission.of(run, AsyncTurn)
    if admission is not None and admission.waits:
        admitted = await admission.turn.wait_until(admission.admitted, timeout, abandoned=admission.leave)
        if not admission.waited(admitted):
            raise httpcore.ConnectTimeout(admission.timeout_message(timeout))
    return admission


class _AsyncAfterTls(httpcore.AsyncNetworkStream):
    """A new https connection of a guarded attempt, to time and (``probing``) probe once httpcore has done its TLS
    handshake; the TLS stream that `start_tls` returns is httpcore's own, not wrapped."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, run: GuardedRequest, *, probing: bool) -> None:
        self._stream = stream
        self._run = run
        self._probing = probing

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        self._run.connection_ready()
        if self._probing:
            await self._run.probe(stream)  # skips HTTP/2 connections (ALPN "h2")
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
