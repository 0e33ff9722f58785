"""Connection-level hooks: a wrapper of an httpcore pool's network backend, which sees every new connection.

This file is the source of truth: ``scripts/unasync.py`` generates ``sync_connections.py`` from it (and the httpx2
twins), and CI checks that they are current.

The guard must probe each new connection before httpcore writes a request to it, and must know, when an attempt
fails, whether it failed connecting (nothing sent) or on a connection (maybe sent). Both are per connection, not per
request. The pool's network backend, wrapped (`track_connections`), sees each connect; it learns which guarded
request the connect is for from `CURRENT_PLAN`, which the transport sets around each attempt: httpcore connects
lazily, inside the request that will be the connection's first, in that request's own thread or task. It drives the
new connection's machine (`ConnectionMachine`, through the shared loop) with this stream's I/O (`AsyncStreamIO`).

A request on a pooled connection passes no hook: it pays nothing here. The connections and the streams httpcore reads
and writes are its own, unchanged (an https connection is wrapped only until its TLS handshake).
"""

from __future__ import annotations

import functools
from typing import Any

import httpcore
import httpx

from .._core import connection_machine as connection
from .._core.attempt_context import CURRENT_PLAN
from .._core.guard import RequestPlan
from .._drive.async_drive import advance_connection
from .exceptions import ProbeError, ProbeTimeout
from .internals import network_backend, pool_speaks_http1, set_instance_method, set_network_backend

__all__ = ["AsyncGuardedBackend", "AsyncStreamIO", "negotiated_http2", "track_connections"]


def track_connections(pool: Any) -> None:
    """Put the guard's hook on ``pool`` (once): on its network backend, checked again at each new connection (someone
    may replace the pool's backend after the guard wrapped it). ``pool``: from `internals.hookable_pool`."""
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
    """The pool's ``create_connection``: the backend a new connection is given is the guard's."""

    __slots__ = ("_create", "_pool")

    def __init__(self, pool: Any, create: Any) -> None:
        self._pool = pool
        self._create = create

    def __call__(self, origin: Any) -> Any:
        # Checked here, once per connection, rather than for every request.
        _wrap_backend(self._pool)
        return self._create(origin)


class AsyncGuardedBackend(httpcore.AsyncNetworkBackend):
    """Opens connections through the wrapped backend; drives those opened by a guarded attempt."""

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
        plan = CURRENT_PLAN.get()
        if plan is None:
            return await connect()
        if not plan.needs_connection_machine:
            return await _noted(plan, connect)
        url = plan.request.url
        # Through a proxy (forwarding, CONNECT, SOCKS) the connection is the proxy's, not the origin's.
        direct = host == url.host and port == plan.origin.port
        opening = connection.Opening(
            direct=direct, proxy=f"{host}:{port}", http1=self._http1, tls_later=url.scheme == "https"
        )
        return await self._connect(plan, connect, timeout, opening)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        connect = functools.partial(
            self._backend.connect_unix_socket, path, timeout=timeout, socket_options=socket_options
        )
        plan = CURRENT_PLAN.get()
        if plan is None:
            return await connect()
        if not plan.needs_connection_machine:
            return await _noted(plan, connect)
        # httpx sends every request of a uds transport, proxies included, straight to the socket: kicks go there too.
        opening = connection.Opening(http1=self._http1, tls_later=plan.request.url.scheme == "https", kick_path=path)
        return await self._connect(plan, connect, timeout, opening)

    async def _connect(
        self, plan: RequestPlan, connect: Any, timeout: float | None, opening: connection.Opening
    ) -> httpcore.AsyncNetworkStream:
        """A guarded attempt's new connection: its machine admits it, ``connect`` opens it, the machine probes it
        (after the TLS handshake for https, which httpcore does when this returns)."""
        machine = connection.ConnectionMachine(plan.machine())
        io = AsyncStreamIO(plan.request, timeout)
        await advance_connection(machine, opening, io)  # Open, once its turn came
        try:
            stream: httpcore.AsyncNetworkStream = await connect()
        except BaseException:
            machine.next(connection.OPEN_FAILED)
            raise
        io.stream = stream
        if opening.tls_later:
            await advance_connection(machine, connection.Opened(), io)  # AwaitTls
            return _AsyncAfterTls(stream, machine, io)
        await advance_connection(machine, connection.Opened(socket=stream.get_extra_info("socket")), io)
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


async def _noted(plan: RequestPlan, connect: Any) -> httpcore.AsyncNetworkStream:
    """A new connection that needs no machine (the close strategy: nothing to probe, nothing to measure): only
    noted, for the retry decision if the attempt fails."""
    plan.opening()
    stream: httpcore.AsyncNetworkStream = await connect()
    plan.opened()  # a TLS handshake that fails after this is a connect error: nothing was sent either way
    return stream


class _AsyncAfterTls(httpcore.AsyncNetworkStream):
    """A new https connection of a guarded attempt, whose machine goes on once httpcore has done its TLS handshake;
    the TLS stream that `start_tls` returns is httpcore's own, not wrapped."""

    def __init__(
        self, stream: httpcore.AsyncNetworkStream, machine: connection.ConnectionMachine, io: AsyncStreamIO
    ) -> None:
        self._stream = stream
        self._machine = machine
        self._io = io

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            stream = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        except BaseException:
            self._machine.next(connection.OPEN_FAILED)
            raise
        self._io.stream = stream
        done = connection.TlsDone(h2=negotiated_http2(stream), socket=stream.get_extra_info("socket"))
        await advance_connection(self._machine, done, self._io)
        return stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def negotiated_http2(stream: Any) -> bool:
    """The TLS handshake of ``stream`` chose HTTP/2 (ALPN ``h2``): not llama-server, which speaks HTTP/1.1 only."""
    ssl_object = stream.get_extra_info("ssl_object")
    return ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2"


class AsyncStreamIO:
    """The probe's I/O on an httpcore network stream (`AsyncConnectionIO`): ``stream`` is None until it is open."""

    __slots__ = ("_request", "connect_timeout", "stream")

    def __init__(self, request: httpx.Request, connect_timeout: float | None) -> None:
        self._request = request
        self.connect_timeout = connect_timeout
        self.stream: httpcore.AsyncNetworkStream | None = None

    async def write(self, data: bytes, timeout: float) -> connection.ConnectionSignal | connection.Broken:
        assert self.stream is not None
        try:
            await self.stream.write(data, timeout=timeout)
        except httpcore.TimeoutException:
            return connection.TIMED_OUT
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            return connection.Broken(exc)
        return connection.WRITTEN

    async def read(self, timeout: float) -> connection.Received | connection.ConnectionSignal | connection.Broken:
        assert self.stream is not None
        try:
            return connection.Received(await self.stream.read(connection.READ_SIZE, timeout=timeout))
        except httpcore.TimeoutException:
            return connection.TIMED_OUT
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            return connection.Broken(exc)

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()

    def error(self, abort: connection.Abort) -> BaseException:
        """The connect fails: with the guard's probe errors (httpx's classes: httpcore lets them through), or
        httpcore's ConnectTimeout for a turn that did not come (httpx maps it to its own)."""
        if abort.reason == "connect timeout":
            return httpcore.ConnectTimeout(abort.message)
        cls = ProbeTimeout if abort.reason == "probe timeout" else ProbeError
        return cls(abort.message, request=self._request)
