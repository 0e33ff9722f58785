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

Spare connections (`AsyncSpares`, `GuardPolicy.prewarm`): llama-server closes a stream's connection after its final
chunk, so under the keep-alive strategy every stream costs its pool a new connection, a connect (and TLS) and the
probe's round trip paid by the next request that needs one: across a network, two or three round trips of that
request's own time. The guard opens the replacement as the stream's request goes out, so that it has the stream's
whole time to get ready: connected, TLS'd as the pool's own connections are, and probed through its own machine, it
waits (at most `SPARE_IDLE`, below llama-server's keep-alive) for the pool's next connect to that origin, which takes it
instead of connecting. Never on loopback or a Unix socket (a new connection costs nothing there), through a proxy,
or on an HTTP/2 pool.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import httpcore
import httpx

from .._core import connection_machine as connection
from .._core.attempt_context import CURRENT_PLAN
from .._core.guard import RequestPlan
from .._core.llama_server import CLIENT_KEEPALIVE
from .._core.log import logger
from .._drive.async_drive import advance_connection
from .._runtime.admission_turns import AsyncTurn
from .._runtime.spawn import spawn_task
from .exceptions import ProbeError, ProbeTimeout
from .internals import network_backend, pool_speaks_http1, set_instance_method, set_network_backend

__all__ = [
    "MAX_SPARES",
    "SPARE_IDLE",
    "AsyncGuardedBackend",
    "AsyncSpares",
    "AsyncStreamIO",
    "negotiated_http2",
    "track_connections",
]

#: An origin of a pool, as its connects name it.
Key = tuple[str, int]


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
        self.spares = AsyncSpares(backend)  # connections opened ahead for dropped streams (GuardPolicy.prewarm)

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
        https = url.scheme == "https"
        spare = await self.spares.take((host, port), timeout) if direct else None
        if spare is not None:  # opened and probed ahead: the request's connection is up, and read by the server
            plan.opened(read=True)
            plan.stats.add(spares_used=1)
            return _AsyncTlsDone(spare) if https else spare
        opening = connection.Opening(direct=direct, proxy=f"{host}:{port}", http1=self._http1, tls_later=https)
        return await self._connect(plan, connect, timeout, opening, key=(host, port))

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
        self,
        plan: RequestPlan,
        connect: Any,
        timeout: float | None,
        opening: connection.Opening,
        key: Key | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """A guarded attempt's new connection: its machine admits it, ``connect`` opens it, the machine probes it
        (after the TLS handshake for https, which httpcore does when this returns)."""
        machine = connection.ConnectionMachine(plan)
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
            return _AsyncAfterTls(stream, machine, io, self.spares, key)
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


class _AsyncDelegatingStream(httpcore.AsyncNetworkStream):
    """A network stream that passes reads, writes and closes to ``self._stream``; subclasses say what `start_tls`
    does."""

    _stream: httpcore.AsyncNetworkStream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _AsyncAfterTls(_AsyncDelegatingStream):
    """A new https connection of a guarded attempt, whose machine goes on once httpcore has done its TLS handshake;
    the TLS stream that `start_tls` returns is httpcore's own, not wrapped."""

    def __init__(
        self,
        stream: httpcore.AsyncNetworkStream,
        machine: connection.ConnectionMachine,
        io: AsyncStreamIO,
        spares: AsyncSpares,
        key: Key | None,
    ) -> None:
        self._stream = stream
        self._machine = machine
        self._io = io
        self._spares = spares  # told how the pool does TLS, for the spares of its origin
        self._key = key

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            stream = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        except BaseException:
            self._machine.next(connection.OPEN_FAILED)
            raise
        if self._key is not None:
            self._spares.remember_tls(self._key, ssl_context, server_hostname)
        self._io.stream = stream
        done = connection.TlsDone(h2=negotiated_http2(stream), socket=stream.get_extra_info("socket"))
        await advance_connection(self._machine, done, self._io)
        return stream


class _AsyncTlsDone(_AsyncDelegatingStream):
    """A spare https connection, TLS'd ahead: the handshake httpcore asks for is the one done already."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        return self._stream


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


# A spare waits this long for the pool at most: the probe's answer proved the server reads it, and the server closes
# an idle connection at 5 s (the guard's own pool expires its idle ones at the same 4 s).
SPARE_IDLE = CLIENT_KEEPALIVE
# Spares per origin, ready or being opened: enough for the streams of a pool in flight at once.
MAX_SPARES = 4
# A spare's connect, TLS and probe, each, when the stream's request set no connect timeout.
SPARE_TIMEOUT = 5.0


class AsyncSpares:
    """The spare connections of one pool's network backend (``backend``: the one it wraps), per origin."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._ready: dict[Key, list[tuple[float, httpcore.AsyncNetworkStream]]] = {}
        self._opening: dict[Key, int] = {}
        self._waiting: dict[Key, list[AsyncTurn]] = {}  # connects waiting for a spare being opened
        self._closed = False  # the pool's transport closed: a spare opened after is closed at once
        # How the pool's own connections to each origin did TLS (its ssl context and server name), seen at their
        # handshake: a spare does the same, or is not opened.
        self._tls: dict[Key, tuple[Any, str | None]] = {}

    def remember_tls(self, key: Key, ssl_context: Any, server_hostname: str | None) -> None:
        self._tls[key] = (ssl_context, server_hostname)

    async def take(self, key: Key, timeout: float | None) -> httpcore.AsyncNetworkStream | None:
        """A spare for ``key`` that has waited less than `SPARE_IDLE` (older ones are closed); one being opened is
        waited for (it is further on than a new connect would be, within the connect's ``timeout``); else None."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.monotonic()
            taken, turn = None, None
            with self._lock:
                stale = self._take_stale(now)  # every origin's: any connect of the pool sweeps
                ready = self._ready.get(key)
                if ready:
                    taken = ready.pop(0)[1]
                    if not ready:
                        del self._ready[key]
                if taken is None and self._opening.get(key, 0) and (end is None or now < end):
                    turn = AsyncTurn()
                    self._waiting.setdefault(key, []).append(turn)
            for stream in stale:
                await stream.aclose()
            if turn is None:
                return taken
            await turn.wait(None if end is None else max(end - now, 0.0))  # woken when a spare is done

    def open_one(self, plan: RequestPlan, key: Key) -> None:
        """Open and probe a spare for ``key`` in the background (for ``plan``'s stream, whose connection is being
        dropped), unless the origin has `MAX_SPARES` already."""
        https = plan.request.url.scheme == "https"
        if https and key not in self._tls:
            return  # the pool's TLS settings are not known yet: its next connection shows them
        with self._lock:
            if len(self._ready.get(key, ())) + self._opening.get(key, 0) >= MAX_SPARES:
                return
            self._opening[key] = self._opening.get(key, 0) + 1
        spawn_task(lambda: self._open(plan, key, https))

    async def _open(self, plan: RequestPlan, key: Key, https: bool) -> None:
        timeouts: dict[str, float | None] = plan.request.extensions.get("timeout", {})
        timeout = timeouts.get("connect") or SPARE_TIMEOUT
        machine = connection.ConnectionMachine(plan.for_spare())  # its own: the stream's request is answered
        io = AsyncStreamIO(plan.request, timeout)
        spare = None
        try:
            await advance_connection(machine, connection.Opening(), io)  # its turn, when the origin admits so
            stream = await self._backend.connect_tcp(key[0], key[1], timeout=timeout)
            io.stream = stream
            if https:
                ssl_context, server_hostname = self._tls[key]
                stream = io.stream = await stream.start_tls(ssl_context, server_hostname, timeout)
            opened = connection.Opened(h2=negotiated_http2(stream), socket=stream.get_extra_info("socket"))
            await advance_connection(machine, opened, io)  # probed: raises (and closes it) if the probe fails
            spare = stream
        except Exception as exc:  # a spare that cannot be opened or fails its probe is simply not there
            if not machine.done:
                machine.next(connection.OPEN_FAILED)
            await io.close()
            plan.stats.add(spares_failed=1)
            logger.debug("spare connection to %s not kept: %s", plan.origin, exc)
        finally:
            with self._lock:
                self._opening[key] -= 1
                if not self._opening[key]:
                    del self._opening[key]
                kept = spare is not None and not self._closed
                if spare is not None and kept:
                    self._ready.setdefault(key, []).append((time.monotonic(), spare))
                waiting = self._waiting.pop(key, [])
                stale = self._take_stale(time.monotonic())
            for turn in waiting:
                turn.wake()
            for stream in stale:
                await stream.aclose()
        if spare is not None and not kept:
            await spare.aclose()
        elif spare is not None:
            plan.stats.add(spares_opened=1)

    def _take_stale(self, now: float) -> list[httpcore.AsyncNetworkStream]:
        """Take out the spares of every origin that waited `SPARE_IDLE` (for the caller to close), at each connect
        and each spare opened: a client of many origins would otherwise keep a descriptor for each origin it no
        longer asks. A pool gone quiet keeps its spares until then or its close, as httpcore keeps its idle
        connections. Under the lock."""
        stale: list[httpcore.AsyncNetworkStream] = []
        for key, ready in list(self._ready.items()):
            fresh = [(made, stream) for made, stream in ready if now - made < SPARE_IDLE]
            stale.extend(stream for made, stream in ready if now - made >= SPARE_IDLE)
            if fresh:
                self._ready[key] = fresh
            else:
                del self._ready[key]
        return stale

    async def aclose(self) -> None:
        """Close every spare (the pool's transport closes)."""
        with self._lock:
            self._closed = True
            spares = [stream for ready in self._ready.values() for _, stream in ready]
            self._ready.clear()
        for stream in spares:
            await stream.aclose()
