"""`GuardConnector` and its hooks: every new connection to llama-server is proven read before a request is written
to it.

The hooks run around the connector's creation of a connection (``internals.hook_new_connections``): for a
connection opened by a guarded attempt (`plan_of`, set by the middleware), they drive the new connection's machine
(``_core/connection_machine.py``, through the shared loop) with this transport's I/O (`_TransportIO`): the admission
before aiohttp connects, then ``GET /health`` written on the new transport and its answer read, with the protocol
aiohttp gave the connection set aside (``transport.set_protocol``, public asyncio API) so that aiohttp never sees the
exchange. A probe that fails closes the connection and raises `ProbeTimeout`/`ProbeError` from the connect: nothing
of the request was written, and the middleware retries it on a fresh connection.

A connection whose probe was given up is watched a while for a late answer (``_runtime/late_answers.py``): by the
connector, which ends the watches when it closes (a `GuardConnector`), or until the watch ends.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeAlias

import aiohttp
import anyio

from .._core import connection_machine as connection
from .._core.guard import RequestPlan
from .._core.llama_server import CLIENT_KEEPALIVE
from .._core.probes import GivenUpWatches
from .._core.process_state import ProcessState
from .._drive.async_drive import advance_connection
from .._runtime import PROCESS
from .attempts import ATTEMPT_DEADLINE, plan_of
from .exceptions import ProbeError, ProbeTimeout, probe_error
from .internals import ConnectionHooks, hook_new_connections

__all__ = ["GuardConnector", "ProbingHooks"]


class GuardConnector(aiohttp.TCPConnector):
    """An `aiohttp.TCPConnector` whose new connections to llama-server are probed (``GET /health``) before the
    first request is written to them, when that request goes through the guard's middleware (`GuardMiddleware`;
    `guarded_session()` wires both). Takes every `aiohttp.TCPConnector` argument; ``keepalive_timeout`` defaults
    to 4 s, below llama-server's 5 s.

    ``probing_off``: None when new connections are probed; else why not (an aiohttp version the guard was not
    tested with), also in the guard's ``stats.public_path``.
    """

    def __init__(
        self,
        *,
        keepalive_timeout: float | object = CLIENT_KEEPALIVE,
        process: ProcessState | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(keepalive_timeout=keepalive_timeout, **kwargs)  # type: ignore[arg-type]
        self._hooks = ProbingHooks()
        self.probing_off = hook_new_connections(self, self._hooks, (process or PROCESS).warnings)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        self._hooks.given_up.end_all()  # connections watched for a late answer
        return super().close(*args, **kwargs)


class ProbingHooks(ConnectionHooks):
    """The guard's work on a connector's new connections (one instance per connector)."""

    def __init__(self) -> None:
        # Connections whose probe was given up, watched a while for a late answer: ended when a `GuardConnector`
        # closes; on another connector (a session the guard was added to), when the watch ends.
        self.given_up = GivenUpWatches()

    async def connecting(self, request: aiohttp.ClientRequest, timeout: aiohttp.ClientTimeout) -> _Token:
        plan = plan_of(request)
        if plan is None:
            return None  # a request the guard passes through, or another session's inside a guarded attempt
        if not plan.needs_connection_machine:  # the close strategy: nothing to probe or measure, only noted
            plan.opening()
            return plan
        machine = connection.ConnectionMachine(plan, watches=self.given_up)
        io = _TransportIO(request, timeout)
        proxy = request.proxy
        opening = connection.Opening(
            direct=proxy is None,
            proxy=None if proxy is None else f"{proxy.host}:{proxy.port}",
            kick_host=request.url.host or plan.origin.host,
        )
        await advance_connection(machine, opening, io)  # Open, once its turn came
        return machine, io

    async def connected(
        self,
        request: aiohttp.ClientRequest,
        transport: Any,
        token: _Token,
    ) -> None:
        if token is None:
            return
        if isinstance(token, RequestPlan):
            token.opened()
            return
        machine, io = token
        io.transport = transport
        await advance_connection(machine, connection.Opened(socket=transport.get_extra_info("socket")), io)
        io.give_back()
        scope, deadline = ATTEMPT_DEADLINE.get(), machine.plan.policy.first_byte_timeout
        if scope is not None and deadline is not None:
            # The first-byte deadline starts now, as httpx's read timeout starts once the request is written.
            scope.deadline = anyio.current_time() + deadline

    def finished(self, request: aiohttp.ClientRequest, token: _Token) -> None:
        if isinstance(token, tuple) and not token[0].done:  # the connect failed, or was cancelled
            token[0].next(connection.OPEN_FAILED)  # its turn, if it had one, goes to the next connection


# What `ProbingHooks.connecting` hands to `connected` and `finished`: nothing (a request the guard passes by), the
# plan of an attempt whose new connection is only noted, or the connection's machine and its I/O.
_Token: TypeAlias = "RequestPlan | tuple[connection.ConnectionMachine, _TransportIO] | None"


class _TransportIO:
    """The probe's I/O on a new asyncio transport (`AsyncConnectionIO`): while the probe runs, aiohttp's protocol is
    set aside and what arrives waits in a `_ProbeReader`."""

    __slots__ = ("_protocol", "_reader", "_request", "connect_timeout", "transport")

    def __init__(self, request: aiohttp.ClientRequest, timeout: aiohttp.ClientTimeout) -> None:
        self._request = request
        # aiohttp's connect timer covers the whole connect, this wait included (it then raises its own
        # ConnectionTimeoutError); the smaller of connect and sock_connect bounds the wait for a turn too.
        bounds = [t for t in (timeout.connect, timeout.sock_connect) if t is not None]
        self.connect_timeout = min(bounds) if bounds else None
        self.transport: Any = None
        self._protocol: Any = None
        self._reader: _ProbeReader | None = None

    def _probe_reader(self) -> _ProbeReader:
        reader = self._reader
        if reader is None:
            reader = self._reader = _ProbeReader()
            self._protocol = self.transport.get_protocol()
            self.transport.set_protocol(reader)
        return reader

    async def write(self, data: bytes, timeout: float) -> connection.ConnectionSignal | connection.Broken:
        self._probe_reader()
        self.transport.write(data)  # buffered by asyncio: the read after it waits for the answer
        return connection.WRITTEN

    async def read(self, timeout: float) -> connection.Received | connection.ConnectionSignal | connection.Broken:
        return await self._probe_reader().next_event(timeout)

    def give_back(self) -> None:
        """The probe passed (or none ran): aiohttp's protocol takes the connection back."""
        if self._reader is not None:
            self.transport.set_protocol(self._protocol)
            self._reader = None

    async def close(self) -> None:
        """Close a connection that failed its probe; aiohttp's protocol gets the close, as for any lost one."""
        if self.transport is not None:
            self.give_back()
            self.transport.abort()

    def error(self, abort: connection.Abort) -> BaseException:
        if abort.reason == "connect timeout":
            return aiohttp.ConnectionTimeoutError(abort.message)
        cls = ProbeTimeout if abort.reason == "probe timeout" else ProbeError
        return probe_error(cls, self._request, abort.message)


class _ProbeReader(asyncio.Protocol):
    """The new connection's protocol while the probe runs: what arrives waits for `next_event`."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._closed = False
        self._error: Exception | None = None
        self._arrived: asyncio.Future[None] | None = None

    async def next_event(self, timeout: float) -> connection.Received | connection.ConnectionSignal | connection.Broken:
        """What arrived (waiting up to ``timeout`` seconds for something): bytes, the end, an error, or nothing."""
        if not (self._data or self._closed):
            self._arrived = asyncio.get_running_loop().create_future()
            await asyncio.wait((self._arrived,), timeout=timeout)
            self._arrived = None
        if self._data:
            data, self._data = bytes(self._data), bytearray()
            return connection.Received(data)
        if self._error is not None:
            return connection.Broken(self._error)
        return connection.Received(b"") if self._closed else connection.TIMED_OUT

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._data += data
        self._wake()

    def eof_received(self) -> bool:
        self._closed = True
        self._wake()
        return True  # keep the transport open: the machine decides, and close() closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._error = exc
        self._wake()
