"""`AsyncGuardTransport`, the guard as an httpx async transport: the httpx driver of the shared core.

This file is the source of truth: ``scripts/unasync.py`` generates ``sync_transport.py`` from it, and CI checks
that the generated file is current. It does httpx's I/O only: every decision is the core's (``_core/guard.py``
plans a request, ``_core/request_machine.py`` decides its attempts), and the loop over them is the shared one
(``_drive/async_drive.py``), fed by `_AsyncAttempts`.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import httpx

from .._core import connection_machine as connection
from .._core.attempt_context import CURRENT_PLAN
from .._core.guard import Guard, GuardAttributes, RequestPlan
from .._core.llama_server import CLIENT_KEEPALIVE, RETRIED_STATUSES
from .._core.log import logger
from .._core.origins import Origin, OriginRegistry
from .._core.policy import GuardPolicy
from .._core.process_state import ProcessState
from .._core.request_machine import (
    BEGIN,
    ERROR_BODY_READ,
    MAX_RETRIED_ERROR_BODY,
    Answered,
    Fail,
    Failed,
    RequestSignal,
    Send,
)
from .._core.result import EXTENSION, GuardResult
from .._core.stats import GuardStats
from .._core.wrapped_transports import mark_wrapped_by_a_guard
from .._drive.async_drive import advance_connection, drive_request
from .._runtime import PROCESS
from .async_connections import AsyncStreamIO, negotiated_http2, track_connections
from .attempts import AttemptBody, caller_error, judged_failure
from .internals import (
    bypassing_mounts,
    cap_keepalive_expiry,
    check_versions,
    close_headers,
    fix_pool_race,
    hookable_pool,
    http_versions,
    is_direct_pool,
    network_backend,
    request_parts,
    streaming_check,
    unix_socket_path,
)
from .sockets import shutdown_connection

__all__ = ["AsyncGuardTransport"]

# llama-server keeps an idle connection for 5 s (`Keep-Alive: timeout=5`): expire ours first, so that the pool
# never picks a connection at the moment the server closes it.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=CLIENT_KEEPALIVE)
# The stack's name in the counts per origin (stats.by_origin(), llama_guard.metrics): "httpx", or "httpx2" in the twin.
STACK = httpx.__name__


class AsyncGuardTransport(GuardAttributes, httpx.AsyncBaseTransport):
    """An httpx async transport that makes a pooled client safe against llama-server.

    Wraps ``transport`` (default: a new `httpx.AsyncHTTPTransport` whose keep-alive expiry is below
    llama-server's 5 s) and closes it when closed. Requests to llama-server origins get the guard's mechanisms
    (see `GuardPolicy`); all other requests pass through unchanged. Per-request options go in
    ``request.extensions["llama_guard"]`` (a dict of `GuardPolicy` fields); the guard's account comes back in
    ``response.extensions["llama_guard"]`` (a `GuardResult`). Counters are in ``stats``.
    """

    STACK = STACK  # the stack's name in the counts per origin
    # A first attempt lends the request its body as an `AttemptBody` (an iterator object): httpx's async body is an
    # async generator, which a write failing half way leaves suspended for trio's finalizer to warn about. Under
    # asyncio too, where the iterator costs less than the generator (asyncio's first-iteration hook adds every async
    # generator to a WeakSet): lending only under trio added about 4,900 instructions per request (cachegrind). The
    # sync flavour does not lend (a sync generator is simply closed): about 3,500 instructions per request.
    _LENDS_BODY = True

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: GuardPolicy | None = None,
        stats: GuardStats | None = None,
        origins: OriginRegistry | None = None,
        process: ProcessState | None = None,
    ) -> None:
        """``stats``: a `GuardStats` to count into (shared by several transports), else a new one. ``origins``: the
        registry of llama-server origins to share with other transports (what `install()` passes); else the
        policy's. ``process``: what the guards of the process share (the probe deadlines learnt, the connection
        strategies...); the process's own unless given (tests)."""
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError(
                "transport must be an httpx.AsyncBaseTransport (for a sync client use GuardTransport); "
                f"got {type(transport).__name__}"
            )
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport(limits=DEFAULT_LIMITS)
        unix_socket = unix_socket_path(self._transport) is not None
        process = process or PROCESS
        guard = Guard.made(STACK, policy=policy, stats=stats, origins=origins, process=process, unix_socket=unix_socket)
        self._guard = guard
        process = self._guard.process
        # install() must not guard this transport's requests a second time.
        mark_wrapped_by_a_guard(self._transport)
        # New connections are probed, and attempts followed, by hooks on the httpcore pool (internals.py), on the
        # library versions the guard was tested with; otherwise, or when the pool is out of reach (a wrapper
        # around a transport), through httpcore's public trace extension.
        untested = check_versions(process.warnings)
        pool = hookable_pool(self._transport) if untested is None else None
        if pool is not None:
            fix_pool_race(self._transport)  # httpcore 1.x can close a connection another request is using
            cap_keepalive_expiry(self._transport)  # wrapped transports often expire at llama-server's own 5 s
            track_connections(pool)
        else:
            self.stats.public_path = untested or "the wrapped transport's httpcore pool is out of reach"
        self._hooked = pool is not None
        # Spares replace dropped stream connections (GuardPolicy.prewarm): on a direct HTTP/1.1 pool that is hooked.
        self._spares = (
            network_backend(pool).spares if pool is not None and is_direct_pool(pool) and unix_socket is False else None
        )
        self._bypass_checked = False  # whether its client was looked at for transports that send round it
        # Whether HTTP/2 may carry a request (no Connection: close there).
        self._http1, self._http2 = http_versions(self._transport)
        self._is_streaming = streaming_check(untested is None)
        self._request_parts = request_parts(untested is None)
        self._close_headers = close_headers(untested is None)
        self._every_origin = self._guard.origins.every_origin  # read for every request: a plain attribute
        # On the trace path: whether the wrapped transport reports httpcore's trace events at all, learnt from
        # its first answer (None until then). One that does not (aiohttp below, a mock) cannot be probed through.
        self._reports_trace_events: bool | None = None

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """The wrapped transport."""
        return self._transport

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.policy!r} around {type(self._transport).__name__}>"

    async def __aenter__(self) -> AsyncGuardTransport:
        self._say_if_bypassed(sys._getframe(1))  # a client entering its transports: before any request
        await self._transport.__aenter__()
        return self

    async def aclose(self) -> None:
        self._say_if_bypassed(sys._getframe(1))
        self._guard.close()
        if self._spares is not None:
            await self._spares.aclose()
        await self._transport.aclose()

    def _say_if_bypassed(self, caller: FrameType) -> None:
        """If its client mounted transports of its own (``proxy=``, ``mounts=``), they send round the guard: said
        once per process, and in ``stats.bypassed``. Looked at once, when the client enters its transports
        (``with``), sends its first request through the guard, or closes them: the client is found among the
        ``caller`` frames (`bypassing_mounts`)."""
        if self._bypass_checked:
            return
        self._bypass_checked = True
        patterns = bypassing_mounts(self, caller)
        if not patterns:
            return
        self.stats.bypassed = (
            f"the client mounted its own transports for {', '.join(patterns)} (proxy= or mounts=), which send its "
            "requests round this guard"
        )
        self._guard.process.warnings.warning(
            f"{type(self).__name__} is bypassed: {self.stats.bypassed}. Guard the client with "
            "llama_guard.guard(client) (it wraps the mounted transports too), or mount the guard: "
            "mounts={'all://': GuardTransport(httpx.HTTPTransport(proxy=...))}"
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._bypass_checked:  # a client that never entered its transports (no ``with``): said now
            self._say_if_bypassed(sys._getframe(1))
        guard = self._guard
        origin = None
        if not self._every_origin:
            origin = Origin.of_url(request.url)
            if not guard.origins.is_llama(origin):
                return await self._pass_through(request, origin)
        scheme, host, port, body = self._request_parts(request)
        plan = guard.plan(
            request,
            scheme=scheme,
            host=host,
            port=port,
            origin=origin,
            overrides=request.extensions.get(EXTENSION),
            body=body,
            may_close=not self._http2 or (self._http1 and scheme == "http"),  # HTTP/2 forbids the header
            hooks_follow=self._hooked,
        )
        if plan.stream and (plan.close_connection or plan.drops_streams):
            # Its connection will not be reused: the replacement is opened now, while the stream is sent and read.
            self._prewarm(plan)
        if not plan.as_is:
            return await drive_request(plan.start(), _AsyncAttempts(self, plan), BEGIN)

        # The usual request: its first attempt goes out as the caller built it, with no machine unless something
        # needs one. Most requests are answered here: on a pooled connection (reuse), or on a new one with
        # Connection: close (headers lent to the request for the attempt: the caller's are never changed). A body
        # held in memory goes out as an `AttemptBody`, not httpx's generator, which a write failing half way would
        # leave suspended.
        caller_stream, caller_headers = request.stream, request.headers
        if self._LENDS_BODY and plan.body:
            request.stream = AttemptBody(plan.body, None)
        if plan.close_connection:
            request.headers = self._close_headers(request)
        token = CURRENT_PLAN.set(plan)  # for the hook on the pool's new connections (async_connections.py)
        try:
            response = await self._transport.handle_async_request(request)
        except Exception as exc:
            CURRENT_PLAN.reset(token)
            request.stream, request.headers = caller_stream, caller_headers
            attempts = _AsyncAttempts(self, plan)
            return await drive_request(plan.machine(), attempts, attempts.failed(exc))
        except BaseException:  # cancelled: counted
            CURRENT_PLAN.reset(token)
            request.stream, request.headers = caller_stream, caller_headers
            plan.interrupted()
            raise
        CURRENT_PLAN.reset(token)
        request.stream, request.headers = caller_stream, caller_headers
        if response.status_code in RETRIED_STATUSES:
            attempts = _AsyncAttempts(self, plan)
            return await drive_request(plan.machine(), attempts, attempts.answered(response))
        dropped = (
            plan.drops_streams
            and self._is_streaming(response.headers)
            and self._drop_after_stream(response, plan.stats)
        )
        response.extensions[EXTENSION] = plan.answered_at_once(dropped)
        return response

    def _learn_trace_support(self, plan: RequestPlan, saw_events: bool) -> None:
        """After an answer on the trace path: a wrapped transport that reported no trace event does not send
        through httpcore, so the guard cannot probe its new connections. Said once per transport, in the log and in
        ``stats.probing_off``; a later answer with trace events (a cache hit came first, say) takes it back. Nor
        can it time them: ``"auto"``, measuring, closes every connection from then on (a final choice)."""
        if saw_events:
            self._reports_trace_events = True
            self.stats.probing_off = None
            return
        unseen = f"{type(self._transport).__name__} does not send through httpcore (it reports no trace events)"
        if not plan.connection.final:
            self._guard.strategies.unmeasurable = f"{unseen}, so the guard cannot time its new connections"
        if self._reports_trace_events is False or not plan.policy.probe or plan.connection.strategy == "close":
            return
        self._reports_trace_events = False
        self.stats.probing_off = f"{unseen}, so the guard cannot probe its new connections"
        logger.warning(  # once per transport: each transport's wrapped transport is its own
            f"{self.stats.probing_off}: new connections to {plan.origin} are not probed, so a connection that "
            "llama-server before b11737 leaves unread is not caught (retries and stream handling still apply). "
            "Guard an httpx.HTTPTransport instead, or for an aiohttp-based transport (litellm's) use "
            "llama_guard.install() or llama_guard.aiohttp"
        )

    async def _pass_through(self, request: httpx.Request, origin: Origin) -> httpx.Response:
        guard = self._guard
        self.stats.add(passthrough=1)
        if CURRENT_PLAN.get() is None:
            response = await self._transport.handle_async_request(request)
        else:  # inside another guarded request's attempt (a nested client): its connections are not this one's
            token = CURRENT_PLAN.set(None)
            try:
                response = await self._transport.handle_async_request(request)
            finally:
                CURRENT_PLAN.reset(token)
        if (
            guard.origins.learns
            and guard.origins.learn(origin, response.headers)
            and guard.policy.stream_mode != "off"
            and self._is_streaming(response.headers)
        ):
            # The first response of an origin in "auto" mode: it just said it is llama-server, so its connection
            # dies after this stream too.
            self._drop_after_stream(response, self.stats.of_origin(STACK, origin))
        return response

    def _prewarm(self, plan: RequestPlan) -> None:
        """A stream's connection will not be reused: open its replacement ahead, where that pays
        (`GuardPolicy.prewarm`). Opened as the stream's request goes out, it has the stream's whole time (a round
        trip and the generation) to connect, do TLS and be probed before the pool's next connect wants it."""
        if self._spares is not None and self._http1 and not self._http2 and plan.prewarms:
            self._spares.open_one(plan, (plan.request.url.host, plan.origin.port))

    def _drop_after_stream(self, response: httpx.Response, stats: GuardStats) -> bool:
        """Have a llama-server stream's connection shut when the response closes, before httpcore would pool it."""
        if response.extensions.get("http_version", b"HTTP/1.1") != b"HTTP/1.1":
            # An HTTP/2 connection carries other requests' streams: dropping it would kill them. Whatever speaks
            # HTTP/2 to us is not llama-server (HTTP/1.1 only), and keeps its connection when a stream ends.
            return False
        network_stream = response.extensions.get("network_stream")
        if network_stream is None or not isinstance(response.stream, httpx.AsyncByteStream):
            return False
        response.stream = _AsyncDropAfterStream(response.stream, network_stream, stats)
        return True


class _AsyncAttempts:
    """The httpx I/O of one guarded request's attempts, for the shared drive loop (`AsyncAttemptIO`).

    Each attempt lends the caller's ``httpx.Request`` the attempt's body (and extensions, when the attempt needs its
    own, and headers with ``Connection: close`` when it carries that) instead of copying the request, and gives the
    caller's back, whatever the attempt's outcome (as the first attempt sent as it is does, in the transport).
    """

    __slots__ = (
        "_caller_extensions",
        "_caller_headers",
        "_caller_stream",
        "_error",
        "_plan",
        "_response",
        "_timeouts",
        "_transport",
    )

    def __init__(self, transport: AsyncGuardTransport, plan: RequestPlan) -> None:
        self._transport = transport
        self._plan = plan
        request = plan.request
        self._caller_extensions: dict[str, Any] = request.extensions
        self._caller_stream = request.stream
        self._caller_headers = request.headers
        self._response: httpx.Response | None = None
        self._error: Exception | None = None
        self._timeouts: dict[str, Any] | None = None  # the attempt's, while its first-byte deadline is armed

    async def send(self, send: Send) -> Answered | Failed:
        plan = self._plan
        request: httpx.Request = plan.request
        transport = self._transport
        # The usual way: the hooks on the pool (async_connections.py) see a new connection and report it to this
        # request, which the attempt's body names; an attempt on a pooled connection passes no hook at all. A
        # transport whose pool is out of reach is followed through httpcore's trace extension instead.
        trace = None if transport._hooked else _AsyncTracer(plan)
        extensions = self._extensions(send, trace)
        request.extensions = extensions
        body = request.stream = AttemptBody(plan.body, self._caller_stream)
        if send.close_connection:
            request.headers = transport._close_headers(request)
        token = CURRENT_PLAN.set(plan)
        try:
            response = await transport.transport.handle_async_request(request)
        except Exception as exc:
            return self.failed(exc)
        finally:
            CURRENT_PLAN.reset(token)
            request.extensions = self._caller_extensions
            request.stream = self._caller_stream
            request.headers = self._caller_headers
            if plan.body is None:  # a one-shot body: its iterator, which a failed write leaves suspended
                await body.aclose()
        if trace is not None and not transport._reports_trace_events:
            transport._learn_trace_support(plan, trace.saw_events)
        return self.answered(response)

    def _extensions(self, send: Send, trace: _AsyncTracer | None) -> dict[str, Any]:
        """The extensions an attempt goes out with: the caller's own object unless it needs the first-byte deadline
        or the guard's ``trace`` callback; never the guard's own options."""
        extensions = self._caller_extensions
        self._timeouts = None
        if trace is None and send.first_byte_deadline is None and EXTENSION not in extensions:
            return extensions
        extensions = dict(extensions)
        extensions.pop(EXTENSION, None)
        if trace is not None:
            extensions["trace"] = trace
        if send.first_byte_deadline is not None:
            # The deadline rides on httpcore's read timeout, looked up for the headers and again for the body (the
            # caller's own is put back in `answered`).
            timeouts = self._timeouts = dict(extensions.get("timeout", {}))
            timeouts["read"] = send.first_byte_deadline
            extensions["timeout"] = timeouts
        return extensions

    def failed(self, exc: Exception) -> Failed:
        event, self._error = judged_failure(self._plan, exc)
        return event

    def answered(self, response: httpx.Response) -> Answered:
        self._response = response
        timeouts = self._timeouts
        if timeouts is not None:  # the body is read under the caller's own read timeout
            caller: dict[str, Any] = self._caller_extensions.get("timeout", {})
            if "read" in caller:
                timeouts["read"] = caller["read"]
            else:
                del timeouts["read"]
        return Answered(response.status_code, response.headers, self._transport._is_streaming(response.headers))

    async def read_error_body(self) -> RequestSignal | Failed:
        response = self._response
        assert response is not None
        try:
            await response.aread()
        except Exception as exc:
            self._error = exc
            return Failed(None)  # judged as the 503/429 it was
        finally:
            await response.aclose()
        assert len(response.content) <= MAX_RETRIED_ERROR_BODY
        return ERROR_BODY_READ

    def drop_stream(self) -> bool:
        assert self._response is not None
        return self._transport._drop_after_stream(self._response, self._plan.stats)

    def respond(self, result: GuardResult) -> httpx.Response:
        response = self._response
        assert response is not None
        response.extensions[EXTENSION] = result
        return response

    def error(self, fail: Fail | None) -> BaseException:
        assert self._error is not None
        return caller_error(self._error, fail)


class _AsyncTracer:
    """For a wrapped transport whose pool the guard cannot reach: the ``trace`` extension of one attempt, which
    follows its progress, drives a new connection's machine (no admission: it cannot wait inside a trace event),
    and passes every event on to the caller's own trace callback."""

    __slots__ = ("_connection", "_io", "_machine", "_tracker", "_user_trace")

    def __init__(self, plan: RequestPlan) -> None:
        self._machine = plan.machine()
        self._tracker = self._machine.follow_trace()
        self._user_trace = plan.request.extensions.get("trace")
        self._connection: connection.ConnectionMachine | None = None
        self._io = AsyncStreamIO(plan.request, None)

    @property
    def saw_events(self) -> bool:
        return self._tracker.saw_events

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        self._tracker.observe(event)
        machine = self._machine
        if event == "connection.connect_tcp.started" and machine.plan.probing:
            url = machine.plan.request.url
            host, port = info.get("host"), info.get("port")
            self._connection = connection.ConnectionMachine(machine.plan)
            opening = connection.Opening(
                direct=(host, port) == (url.host, machine.plan.origin.port),
                proxy=f"{host}:{port}",
                tls_later=url.scheme == "https",
                admits=False,
            )
            await advance_connection(self._connection, opening, self._io)  # Open
        elif event == "connection.connect_tcp.complete" and self._connection is not None:
            stream = self._io.stream = info["return_value"]
            action = await advance_connection(
                self._connection, connection.Opened(socket=stream.get_extra_info("socket")), self._io
            )
            if action is connection.READY:
                self._connection = None
        elif event == "connection.start_tls.complete" and self._connection is not None:
            stream = self._io.stream = info["return_value"]
            done = connection.TlsDone(h2=negotiated_http2(stream), socket=stream.get_extra_info("socket"))
            pending, self._connection = self._connection, None
            await advance_connection(pending, done, self._io)
        if self._user_trace is not None:
            await self._user_trace(event, info)


class _AsyncDropAfterStream(httpx.AsyncByteStream):
    """A llama-server stream whose connection is shut down when the response closes, before httpcore would put
    it back in the pool: llama-server closes it right after the final chunk, whatever its headers said."""

    def __init__(self, stream: httpx.AsyncByteStream, network_stream: Any, stats: GuardStats) -> None:
        self._stream = stream
        self._network_stream = network_stream
        self._stats = stats

    def __aiter__(self) -> Any:
        # The inner stream's own iterator: no generator of ours that could be left suspended (and warned about by
        # trio's finalizer) when the caller stops reading half way.
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            if shutdown_connection(self._network_stream):
                self._stats.add(stream_connections_closed=1, stream_connections_dropped=1)
                self._network_stream = None
        finally:
            await self._stream.aclose()
