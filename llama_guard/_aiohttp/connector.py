"""`GuardConnector` and the probe: every new connection to llama-server is proven read before a request is
written to it.

The hooks run around the connector's creation of a connection (``internals.hook_new_connections``): for a
connection opened by a guarded attempt (`CURRENT_ATTEMPT`, set by the middleware), they report the connect to that
request, then write ``GET /health`` on the new transport and wait for the answer, with the protocol aiohttp gave
the connection set aside (``transport.set_protocol``, public asyncio API) so that aiohttp never sees the exchange.
A probe that fails closes the connection and raises `ProbeTimeout`/`ProbeError` from the connect: nothing of the
request was written, and the middleware retries it on a fresh connection with the stall schedule.

As in the httpx flavour, the deadline in force, the admission of new connections and the watch for late answers
are the origin's (`_core/origin_probes.py`): a connection whose probe was given up is closed here, and a duplicate
of its socket, half closed, is watched a while for a late answer (`_core/late_answers.py`).
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

import aiohttp

from .._core import probe_machine
from .._core.late_answers import GivenUpWatches
from .._core.llama_server import CLIENT_KEEPALIVE
from .._core.origin_probes import Admission
from .._core.origins import Origin
from .._core.turns import AsyncTurn
from .attempts import AiohttpRequest, current_run
from .exceptions import ProbeError, ProbeTimeout, probe_error
from .internals import ConnectionHooks, hook_new_connections

__all__ = ["KEEPALIVE_TIMEOUT", "GuardConnector", "ProbingHooks"]

# aiohttp keeps an idle connection 15 s, past llama-server's 5 s: a connection the server closed would be handed out.
KEEPALIVE_TIMEOUT = CLIENT_KEEPALIVE


async def _kick(kick: probe_machine.Kick) -> BaseException | None:
    """Open one TCP connection and close it at once, writing nothing (`probe_machine.Kick`); the failure if any."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(kick.host, kick.port), kick.timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        return exc
    writer.close()
    return None


class GuardConnector(aiohttp.TCPConnector):
    """An `aiohttp.TCPConnector` whose new connections to llama-server are probed (``GET /health``) before the
    first request is written to them, when that request goes through the guard's middleware (`GuardMiddleware`;
    `guarded_session()` wires both). Takes every `aiohttp.TCPConnector` argument; ``keepalive_timeout`` defaults
    to 4 s, below llama-server's 5 s.

    ``probing_off``: None when new connections are probed; else why not (an aiohttp version the guard was not
    tested with), also in the guard's ``stats.public_path``.
    """

    def __init__(self, *, keepalive_timeout: float | object = KEEPALIVE_TIMEOUT, **kwargs: Any) -> None:
        super().__init__(keepalive_timeout=keepalive_timeout, **kwargs)  # type: ignore[arg-type]
        self._hooks = ProbingHooks()
        self.probing_off = hook_new_connections(self, self._hooks)

    def close(self, *args: Any, **kwargs: Any) -> Any:
        self._hooks.given_up.end_all()  # connections watched for a late answer
        return super().close(*args, **kwargs)


class ProbingHooks(ConnectionHooks):
    """The guard's work on a connector's new connections (one instance per connector)."""

    def __init__(self) -> None:
        # Origins whose server closed the connection after answering a probe: probing them cannot work.
        self.unprobeable: set[Origin] = set()
        # Connections whose probe was given up, watched a while for a late answer (_core/late_answers.py): ended
        # when a `GuardConnector` closes; on another connector (a session the guard was added to), when the watch
        # ends.
        self.given_up = GivenUpWatches()

    async def connecting(
        self, request: aiohttp.ClientRequest, timeout: aiohttp.ClientTimeout
    ) -> Admission[AsyncTurn] | None:
        run = current_run(request)
        if run is None:
            return None
        run.connecting()
        if not self._probes(run, request):
            return None
        return await _admission(run, timeout)

    async def connected(self, request: aiohttp.ClientRequest, transport: Any) -> None:
        run = current_run(request)
        if run is None:
            return  # a request the guard passes through, or another session's inside a guarded attempt
        run.connection_ready()
        if self._probes(run, request):
            await self._probe(transport, run)
        run.connected()

    def finished(self, request: aiohttp.ClientRequest, admission: Admission[AsyncTurn] | None) -> None:
        if admission is not None:
            admission.leave()  # wakes the next connection waiting for its turn

    def _probes(self, run: AiohttpRequest, request: aiohttp.ClientRequest) -> bool:
        # Probe only a connection to the origin itself: through a proxy the connection is the proxy's.
        if request.proxy is not None and run.probing:
            run.probing_off(f"they go through a proxy at {request.proxy.host}:{request.proxy.port}")
            return False
        return run.probing and run.origin not in self.unprobeable

    async def _probe(self, transport: asyncio.Transport, run: AiohttpRequest) -> None:
        """The I/O of a `ProbeMachine` on a new connection, whose aiohttp protocol is set aside meanwhile."""
        protocol = transport.get_protocol()
        reader = _ProbeReader()
        transport.set_protocol(reader)
        host = run.aiohttp_request.url.host or run.origin.host
        machine = probe_machine.ProbeMachine(run, socket=transport.get_extra_info("socket"), kick_host=host)
        action = machine.next(probe_machine.Start())
        while not isinstance(action, probe_machine.Usable):
            if isinstance(action, probe_machine.Abort):
                _discard(transport, protocol)
                self._aborted(action, run)
            event: probe_machine.ProbeEvent
            try:
                if isinstance(action, probe_machine.Write):
                    transport.write(action.data)  # buffered by asyncio: the read below waits for the answer
                    event = probe_machine.Written()
                elif isinstance(action, probe_machine.Read):
                    event = await reader.next_event(action.timeout)
                else:
                    event = probe_machine.Kicked(await _kick(action))
            except BaseException:
                if machine.state is not probe_machine.ProbeState.DONE:
                    machine.next(probe_machine.Cancelled())
                _discard(transport, protocol)
                raise
            action = machine.next(event)
        transport.set_protocol(protocol)

    def _aborted(self, abort: probe_machine.Abort, run: AiohttpRequest) -> NoReturn:
        """A probe failed (its connection discarded): keep its late-answer watch, and fail the connect."""
        if abort.watch is not None:
            self.given_up.add(abort.watch)
        if abort.unprobeable:
            self.unprobeable.add(run.origin)
        raise probe_error(ProbeTimeout if abort.timed_out else ProbeError, run.aiohttp_request, abort.message)


async def _admission(run: AiohttpRequest, timeout: aiohttp.ClientTimeout) -> Admission[AsyncTurn] | None:
    """This connection's place in its origin's queue, once its turn has come (`Admission`), or None. aiohttp's
    ``connect`` timer covers the whole connect, this wait included (it then raises its own ConnectionTimeoutError);
    the smaller of ``connect`` and ``sock_connect`` bounds it here too, with a message that names the admission."""
    admission = Admission.of(run, AsyncTurn)  # woken thread-safely, from any loop (_core/turns.py)
    if admission is not None and admission.waits:
        bounds = [t for t in (timeout.connect, timeout.sock_connect) if t is not None]
        bound = min(bounds) if bounds else None
        admitted = await admission.turn.wait_until(admission.admitted, bound, abandoned=admission.leave)
        if not admission.waited(admitted):
            raise aiohttp.ConnectionTimeoutError(admission.timeout_message(bound))
    return admission


def _discard(transport: asyncio.Transport, protocol: Any) -> None:
    """Close a connection that failed its probe; aiohttp's protocol gets the close, as for any lost connection."""
    transport.set_protocol(protocol)
    transport.abort()


class _ProbeReader(asyncio.Protocol):
    """The new connection's protocol while the probe runs: what arrives waits for `next_event`."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._closed = False
        self._error: Exception | None = None
        self._arrived: asyncio.Future[None] | None = None

    async def next_event(self, timeout: float) -> probe_machine.ProbeEvent:
        """What arrived (waiting up to ``timeout`` seconds for something): bytes, the end, an error, or nothing."""
        if not (self._data or self._closed):
            self._arrived = asyncio.get_running_loop().create_future()
            await asyncio.wait((self._arrived,), timeout=timeout)
            self._arrived = None
        if self._data:
            data, self._data = bytes(self._data), bytearray()
            return probe_machine.Received(data)
        if self._error is not None:
            return probe_machine.Broken(self._error)
        return probe_machine.Received(b"") if self._closed else probe_machine.TimedOut()

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._data += data
        self._wake()

    def eof_received(self) -> bool:
        self._closed = True
        self._wake()
        return True  # keep the transport open: the machine decides, and _discard closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._error = exc
        self._wake()
