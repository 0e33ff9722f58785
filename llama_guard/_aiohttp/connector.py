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
import functools
import time
from typing import Any

import aiohttp

from .._core.late_answers import GivenUpWatches, WatchedConnection
from .._core.origin_probes import PROBE_SLICE, OriginProbes
from .._core.origins import Origin
from .._core.probe import ProbeAnswer, ProbeExchange, ProbeProtocolError
from .._core.turns import AsyncTurn
from .attempts import AiohttpRequest, current_run
from .exceptions import ProbeError, ProbeTimeout, probe_error
from .internals import ConnectionHooks, hook_new_connections

__all__ = ["KEEPALIVE_TIMEOUT", "GuardConnector", "ProbingHooks"]

# llama-server keeps an idle connection for 5 s (`Keep-Alive: timeout=5`), aiohttp 15 s: a pooled connection the
# server has closed would be handed out. Expire ours a second before the server's.
KEEPALIVE_TIMEOUT = 4.0


_KICK_CONNECT_TIMEOUT = 1.0


async def _kick(run: AiohttpRequest) -> None:
    """Open one TCP connection to the origin and close it at once (`GuardPolicy.probe_kick`): accepting it makes
    llama-server's pool spawn a thread (before b11737), which serves the oldest unread connection first. Nothing is
    written: the server reads the end of the connection and closes its side."""
    host = run.aiohttp_request.url.host or run.origin.host
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, run.origin.port), _KICK_CONNECT_TIMEOUT)
    except (OSError, asyncio.TimeoutError) as exc:
        run.probe_kicked(exc)
    else:
        writer.close()
        run.probe_kicked()


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
    ) -> tuple[OriginProbes, int] | None:
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

    def finished(self, request: aiohttp.ClientRequest, token: tuple[OriginProbes, int] | None) -> None:
        if token is not None:
            probes, ticket = token
            probes.leave(ticket)  # wakes the next connection waiting for its turn

    def _probes(self, run: AiohttpRequest, request: aiohttp.ClientRequest) -> bool:
        # Probe only a connection to the origin itself: through a proxy the connection is the proxy's.
        if request.proxy is not None and run.probing:
            run.probing_off(f"they go through a proxy at {request.proxy.host}:{request.proxy.port}")
            return False
        return run.probing and run.origin not in self.unprobeable

    async def _probe(self, transport: asyncio.Transport, run: AiohttpRequest) -> None:
        request = run.aiohttp_request
        exchange = ProbeExchange(run.host_header)
        run.probe_started()
        deadline = run.next_probe_deadline()
        protocol = transport.get_protocol()
        reader = _ProbeReader(exchange)
        transport.set_protocol(reader)
        started = time.monotonic()
        try:
            transport.write(exchange.request_bytes())
            while not reader.answered.done():
                elapsed = time.monotonic() - started
                remaining = deadline - elapsed
                if remaining <= 0:
                    raise asyncio.TimeoutError
                kick_now, remaining = run.probe_wait(elapsed, remaining)
                if kick_now:
                    await _kick(run)
                    continue
                await asyncio.wait((reader.answered,), timeout=min(remaining, PROBE_SLICE))
                if not reader.answered.done():
                    # While probes wait, given-up ones are watched; the deadline in force may change meanwhile
                    # (other probes of the origin are answered).
                    run.origin_probes.check_given_up()
                    deadline = run.next_probe_deadline()
            answer = reader.answered.result()
            if reader.extra:
                raise ProbeProtocolError(f"{len(reader.extra)} bytes after the answer to GET /health")
        except asyncio.TimeoutError as exc:
            reader.abandon()
            watched = WatchedConnection.of(transport.get_extra_info("socket"))
            self.given_up.add(run.probe_given_up(time.monotonic() - started, watched))
            _discard(transport, protocol)
            raise probe_error(
                ProbeTimeout,
                request,
                f"new connection to {run.origin} did not answer GET /health within {deadline:.3g} s: the server is "
                "not reading it (llama-server before b11737 under a burst of connections); reconnecting",
            ) from exc
        except (OSError, ProbeProtocolError) as exc:
            _discard(transport, protocol)
            run.probe_failed(time.monotonic() - started)
            raise probe_error(
                ProbeError, request, f"the probe of a new connection to {run.origin} failed: {exc}"
            ) from exc
        except BaseException:
            _discard(transport, protocol)
            run.probe_abandoned()
            raise
        transport.set_protocol(protocol)
        run.probe_answered(time.monotonic() - started)
        if not answer.keep_alive:
            self._closed_after_probe(transport, protocol, run, answer)

    def _closed_after_probe(
        self, transport: asyncio.Transport, protocol: Any, run: AiohttpRequest, answer: ProbeAnswer
    ) -> None:
        _discard(transport, protocol)
        if run.probe_closed(answer.status):
            self.unprobeable.add(run.origin)
        raise probe_error(
            ProbeError, run.aiohttp_request, f"{run.origin} answered GET /health with {answer.status} and closed"
        )


async def _admission(run: AiohttpRequest, timeout: aiohttp.ClientTimeout) -> tuple[OriginProbes, int] | None:
    """Wait for this connection's turn to be opened, if its origin admits them one at a time now; the token for
    `ProbingHooks.finished`, or None. Bounded by the caller's connect timeout: aiohttp's ``connect`` timer covers the
    whole connect, this wait included (it then raises its own ConnectionTimeoutError); the smaller of ``connect``
    and ``sock_connect`` bounds it here too, with a message that names the admission."""
    probes = run.origin_probes
    if not probes.admission_needed(run.policy):
        return None
    # Woken by the connection ahead once it is probed (or gives its place up), in whatever thread or event loop
    # that runs: the turn is made here, in the waiter's own loop, and woken thread-safely (_core/turns.py).
    turn = AsyncTurn()
    ticket = probes.take_ticket(turn)
    if probes.admit(ticket):
        return probes, ticket
    bounds = [t for t in (timeout.connect, timeout.sock_connect) if t is not None]
    bound = min(bounds) if bounds else None
    started = time.monotonic()
    try:
        if not await turn.wait_until(functools.partial(probes.admit, ticket), bound):
            raise aiohttp.ConnectionTimeoutError(
                f"waited {bound:g} s (the connect timeout) for the other new connections to {probes.origin} to be "
                "probed first (connect_admission)"
            )
    except BaseException:  # timed out or cancelled while waiting: give the place up
        probes.leave(ticket)
        raise
    run.stats.record_admission_wait(time.monotonic() - started)
    return probes, ticket


def _discard(transport: asyncio.Transport, protocol: Any) -> None:
    """Close a connection that failed its probe; aiohttp's protocol gets the close, as for any lost connection."""
    transport.set_protocol(protocol)
    transport.abort()


class _ProbeReader(asyncio.Protocol):
    """The new connection's protocol while the probe runs: feeds what arrives to the exchange."""

    def __init__(self, exchange: ProbeExchange) -> None:
        self.exchange = exchange
        self.answered: asyncio.Future[ProbeAnswer] = asyncio.get_running_loop().create_future()
        self.extra = b""

    def abandon(self) -> None:
        self.answered.cancel()

    def _feed(self, data: bytes) -> None:
        if self.answered.done():
            self.extra += data
            return
        try:
            answer = self.exchange.feed(data)
        except ProbeProtocolError as exc:
            self.answered.set_exception(exc)
            return
        if answer is not None:
            self.answered.set_result(answer)

    def data_received(self, data: bytes) -> None:
        self._feed(data)

    def eof_received(self) -> bool:
        if not self.answered.done():
            self._feed(b"")
        return True  # keep the transport open: the answer decides (its keep-alive), and _discard closes

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answered.done():
            self.answered.set_exception(
                exc or ProbeProtocolError("the server closed the connection before answering GET /health")
            )
